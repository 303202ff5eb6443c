"""The GEMM mainloop alone against cuBLAS: issue 3's first target (>= 0.95x torch.mm, bf16).

Builds the region ``relu(a @ b)`` (the cheapest epilogue, so the kernel is the mainloop and
one store), then every (mainloop, tile, warps, stages) variant of its plan; checks each
against torch before timing it; times torch.mm (cuBLAS) and torch.relu(torch.mm) in the
same run. Also comfuse's persistent tile plan (``persistent``: one program per SM, tile and
K loops fused) and a hand-written persistent TMA kernel with a TMA store (the probe that
showed the persistent grid winning, ninth session). Last, cuBLAS and the three fastest variants are timed again
after 2 s of heating in three interleaved rounds (the H200 here is power-capped: its clock
falls by a quarter within a second of load, so whatever runs first runs faster). Writes a
JSON log to $OUT (or --out) and prints a table last.

    [GRAPH=1] python scripts/mainloop_bench.py [--shapes 8192x8192x8192,...] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402
from comfuse import settings  # noqa: E402
from comfuse.bench.env import environment  # noqa: E402
from comfuse.bench.timing import graphed, measure, measure_rounds  # noqa: E402
from comfuse.runtime import kernel as kernel_mod  # noqa: E402

SHAPES = "8192x8192x8192,8192x4096x4096,8192x1024x1024"
TILES = [  # block_m, block_n, block_k, warps, stages
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
    (128, 256, 128, 8, 2), (256, 128, 128, 8, 2),  # K = 1024: half the steps per tile
]
PERSISTENT_TILES = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4)]


@triton.jit
def persistent_mm(a_desc, b_desc, c_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
                  FLATTEN: tl.constexpr, STAGES: tl.constexpr):
    """C = A @ B on a persistent grid: program p takes tiles p, p + PROGRAMS, ... in grouped
    order; TMA loads and a TMA store of the bf16 tile."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=FLATTEN):
        first_m = (tile // group) * GROUP_M
        group_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % group_m
        pid_n = (tile % group) // group_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            a = a_desc.load([pid_m * BLOCK_M, k0])
            b = b_desc.load([k0, pid_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16))


def persistent_variant(a, b, out, bm, bn, bk, warps, stages, flatten):
    """A launcher of ``persistent_mm`` writing a @ b into ``out``."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    M, K = a.shape
    N = b.shape[1]
    programs = min(torch.cuda.get_device_properties(a.device).multi_processor_count,
                   triton.cdiv(M, bm) * triton.cdiv(N, bn))
    ad = TensorDescriptor.from_tensor(a, [bm, bk])
    bd = TensorDescriptor.from_tensor(b, [bk, bn])
    cd = TensorDescriptor.from_tensor(out, [bm, bn])
    return lambda: persistent_mm[(programs,)](ad, bd, cd, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                              PROGRAMS=programs, FLATTEN=flatten, STAGES=stages,
                                              num_warps=warps, num_stages=stages)


def timed(fn):
    """``measure(fn)``; with GRAPH=1 of its CUDA-graph replay (at 8192x1024x1024 a ~30 us
    kernel is otherwise timed together with its Python launch)."""
    return measure(graphed(fn, warmup_calls=1)) if os.environ.get("GRAPH") == "1" else measure(fn)


def planned(a, b):
    """The plan comfuse makes for relu(a @ b), with autotuning off."""
    with settings.override(autotune="0"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = comfuse.explain(lambda x, y: torch.relu(x @ y), (a, b))
    (region,) = report.regions
    if not region.fused:
        raise SystemExit(f"relu(a @ b) is not fused: {region.reason}")
    return region.planned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/comfuse-out"))
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        M, N, K = (int(s) for s in shape.split("x"))
        torch.manual_seed(0)
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        ref = torch.relu(torch.mm(a, b))
        cublas = timed(lambda: torch.mm(a, b))
        cublas_relu = timed(lambda: torch.relu(torch.mm(a, b)))
        flops = 2 * M * N * K
        row = {"shape": [M, N, K], "cublas_ms": cublas.as_dict(), "cublas_relu_ms": cublas_relu.as_dict(),
               "variants": []}
        base = planned(a, b)
        out = torch.empty(1, M, N, device="cuda", dtype=torch.bfloat16)
        runs = {}  # name -> checked callable, for the interleaved rounds
        variants = [(f"{mainloop} {bm}x{bn}x{bk} w{warps} s{stages}", mainloop, (bm, bn, bk, warps, stages))
                    for mainloop in ("pointer", "tma") for bm, bn, bk, warps, stages in TILES]
        variants += [(f"tma persistent {bm}x{bn}x{bk} w{warps} s{stages}", "tma-persistent",
                      (bm, bn, bk, warps, stages)) for bm, bn, bk, warps, stages in PERSISTENT_TILES]
        variants += [(f"probe persistent{' flattened' if flat else ''} {bm}x{bn}x{bk} w{warps} s{stages}",
                      "probe", (bm, bn, bk, warps, stages, flat))
                     for bm, bn, bk, warps, stages in PERSISTENT_TILES for flat in (False, True)]
        for name, mainloop, tile in variants:
            v = {"name": name}
            try:
                if mainloop == "probe":
                    run = persistent_variant(a, b, out[0], *tile)
                else:
                    bm, bn, bk, warps, stages = tile
                    plan = dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                               num_stages=stages, mainloop=mainloop.split("-")[0],
                                               persistent=mainloop.endswith("persistent"))
                    kernel = kernel_mod.build(plan)
                    run = lambda kernel=kernel: kernel.launch(a.unsqueeze(0), b.unsqueeze(0), [], [out])  # noqa: E731
                out.zero_()
                run()
                got = out[0].float() if mainloop != "probe" else torch.relu(out[0].float())
                err = (got - ref.float()).abs().max().item()
                scale = ref.float().abs().max().item()
                if not err <= 2e-2 * scale:
                    v.update(status="wrong", err=err)
                else:
                    t = timed(run)
                    runs[name] = run
                    v.update(status="ok", err=err, **t.as_dict(),
                             tflops=flops / t.median_ms / 1e9, vs_cublas=cublas.median_ms / t.median_ms)
            except Exception as e:  # one variant failing must not stop the sweep
                v.update(status="failed", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            row["variants"].append(v)
            print(f"{shape:18s} {name:40s} {v.get('median_ms', float('nan')):8.4f} ms  "
                  f"{v.get('vs_cublas', 0):.3f}x cuBLAS  {v['status']}", flush=True)
        best = sorted((v for v in row["variants"] if v["status"] == "ok"), key=lambda v: v["median_ms"])[:3]
        calls = {"cuBLAS mm": lambda: torch.mm(a, b)}
        calls.update({v["name"]: runs[v["name"]] for v in best})
        if os.environ.get("GRAPH") == "1":
            calls = {k: graphed(f, warmup_calls=1) for k, f in calls.items()}
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:  # heat: the clock the rounds see is the sustained one
            calls["cuBLAS mm"]()
            torch.cuda.synchronize()
        rounds = measure_rounds(calls, 3)
        row["rounds"] = {k: r.as_dict() for k, r in rounds.items()}
        for k, r in rounds.items():
            print(f"{shape:18s} rounds: {k:40s} {r.median_ms:8.4f} ms  "
                  f"{rounds['cuBLAS mm'].median_ms / r.median_ms:.3f}x cuBLAS  "
                  f"[{min(r.round_medians_ms):.4f}..{max(r.round_medians_ms):.4f}]", flush=True)
        rows.append(row)
    (out_dir / "mainloop.json").write_text(json.dumps({"meta": environment("cuda"), "timing": "cuda-graph replays" if os.environ.get("GRAPH") == "1"
                                else "python launches", "rows": rows}, indent=1))
    print("\n| shape | cuBLAS mm ms | mm+relu ms | best comfuse variant | ms | x cuBLAS |"
          " interleaved rounds (sustained): cuBLAS ms, best three x cuBLAS |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        ok = [v for v in row["variants"] if v["status"] == "ok"]
        best = min(ok, key=lambda v: v["median_ms"]) if ok else {"name": "none", "median_ms": float("nan"),
                                                                    "vs_cublas": 0}
        r = row.get("rounds", {})
        mm = r.get("cuBLAS mm", {}).get("median_ms", float("nan"))
        rounds = ", ".join(f"{k} {mm / v['median_ms']:.3f}x" for k, v in r.items() if k != "cuBLAS mm")
        print(f"| {'x'.join(map(str, row['shape']))} | {row['cublas_ms']['median_ms']:.4f} | "
              f"{row['cublas_relu_ms']['median_ms']:.4f} | {best['name']} | {best['median_ms']:.4f} | "
              f"{best['vs_cublas']:.3f} | {mm:.4f}: {rounds} |")


if __name__ == "__main__":
    main()
