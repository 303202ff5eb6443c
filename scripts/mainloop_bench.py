"""The GEMM mainloop alone against cuBLAS: issue 3's first target (>= 0.95x torch.mm, bf16).

Builds the region ``relu(a @ b)`` (the cheapest epilogue, so the kernel is the mainloop and
one store), then every (mainloop, tile, warps, stages) variant of its plan; checks each
against torch before timing it; times torch.mm (cuBLAS) and torch.relu(torch.mm) in the
same run. Writes a JSON log to $OUT (or --out) and prints a table last.

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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402
from comfuse import settings  # noqa: E402
from comfuse.bench.env import environment  # noqa: E402
from comfuse.bench.timing import graphed, measure  # noqa: E402
from comfuse.runtime import kernel as kernel_mod  # noqa: E402

SHAPES = "8192x8192x8192,8192x4096x4096,8192x1024x1024"
TILES = [  # block_m, block_n, block_k, warps, stages
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
    (128, 256, 128, 8, 2), (256, 128, 128, 8, 2),  # K = 1024: half the steps per tile
]


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
        for mainloop in ("pointer", "tma"):
            for bm, bn, bk, warps, stages in TILES:
                plan = dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                           num_stages=stages, mainloop=mainloop)
                name = f"{mainloop} {bm}x{bn}x{bk} w{warps} s{stages}"
                v = {"name": name}
                try:
                    kernel = kernel_mod.build(plan)
                    run = lambda: kernel.launch(a.unsqueeze(0), b.unsqueeze(0), [], [out])  # noqa: E731
                    run()
                    err = (out[0].float() - ref.float()).abs().max().item()
                    scale = ref.float().abs().max().item()
                    if not err <= 2e-2 * scale:
                        v.update(status="wrong", err=err)
                    else:
                        t = timed(run)
                        v.update(status="ok", err=err, **t.as_dict(),
                                 tflops=flops / t.median_ms / 1e9, vs_cublas=cublas.median_ms / t.median_ms)
                except Exception as e:  # one variant failing must not stop the sweep
                    v.update(status="failed", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                row["variants"].append(v)
                print(f"{shape:18s} {name:32s} {v.get('median_ms', float('nan')):8.4f} ms  "
                      f"{v.get('vs_cublas', 0):.3f}x cuBLAS  {v['status']}", flush=True)
        rows.append(row)
    (out_dir / "mainloop.json").write_text(json.dumps({"meta": environment("cuda"), "timing": "cuda-graph replays" if os.environ.get("GRAPH") == "1"
                                else "python launches", "rows": rows}, indent=1))
    print("\n| shape | cuBLAS mm ms | mm+relu ms | best comfuse variant | ms | x cuBLAS |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        ok = [v for v in row["variants"] if v["status"] == "ok"]
        best = min(ok, key=lambda v: v["median_ms"]) if ok else {"name": "none", "median_ms": float("nan"),
                                                                    "vs_cublas": 0}
        print(f"| {'x'.join(map(str, row['shape']))} | {row['cublas_ms']['median_ms']:.4f} | "
              f"{row['cublas_relu_ms']['median_ms']:.4f} | {best['name']} | {best['median_ms']:.4f} | "
              f"{best['vs_cublas']:.3f} |")


if __name__ == "__main__":
    main()
