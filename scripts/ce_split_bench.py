"""Linear + cross-entropy's split schedule against the GEMM alone (issue 3: <= 1.05x).

The third session found the split kernel's tiles 1.25x slower than the same tiles as a plain
GEMM even with the epilogue removed. Candidate causes: the order in which programs take
(row block, slice) pairs (slice fastest), and the per-tile ``noinline`` function (each
tile's mainloop restarts inside its own call). This script times, as CUDA-graph replays in
one run: cuBLAS ``torch.mm`` alone; comfuse's plain GEMM kernel (``relu(x @ w)``, same tile);
torch.compile of the loss; comfuse's split plan as planned; and variants of it: tiles per
slice (1 = one tile per program), slice-fastest vs grouped order (measured 2026-11-30; grouped is
now the default), the tile's work inlined or a function of its own, tile shapes.
Every variant's per-row losses are checked against float64 PyTorch before it is timed; all
are then timed after 2 s of heating in interleaved rounds (``--rounds``), since the H200 here
slows its clock by a quarter within a second of load (power cap; scripts/power_check.py).

    python scripts/ce_split_bench.py [--shape 8192x4096x32768]   # on the GPU machine
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import comfuse  # noqa: E402
from comfuse import settings  # noqa: E402
from comfuse.bench.timing import graphed, kernel_times, measure_rounds  # noqa: E402
from comfuse.bench.workloads import linear_cross_entropy  # noqa: E402
from comfuse.runtime import kernel as kernel_mod  # noqa: E402
from mainloop_bench import planned  # noqa: E402

# bm, bn, bk, warps, stages; 128x128 at 4 warps and 3 stages fits two programs per SM (98 KB
# of shared memory and 255 registers each), so one's epilogue can run beside the other's mainloop
TILES = [(128, 256, 64, 8, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 3)]


def region_and_args(fn, args):
    """The compiled function's one fused region and the arguments its forward receives."""
    with settings.override(autotune="0", validate="0"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = comfuse.compile(fn, args)
        compiled(*args)
    region = next(m for spec in compiled._specs.values() for m in spec.gm.modules()
                  if m.__class__.__name__ == "FusedRegion")
    seen, forward = [], region.forward
    region.forward = lambda *ext: seen.append(ext) or forward(*ext)
    compiled(*args)
    region.forward = forward
    return region, seen[-1]


def split_variant(base, N: int, bm=128, bn=256, bk=64, warps=8, stages=3, per=4, inline=True, flatten=False):
    """The split plan ``base`` with a TMA mainloop at another tile, ``per`` tiles a slice, in
    grouped order (the defaults: the autotuner's pick at 8192x4096x32768, 2026-11-30)."""
    tiles = -(-N // bn)
    return dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                               mainloop="tma", tiles_n=tiles, chunks=-(-tiles // per), tiles_per_chunk=per,
                               grouped=True, inline_tile=inline, flatten=flatten)


def kernel_table(label, fn, calls: int = 5) -> None:
    """Every GPU kernel one call launches, with its mean time over ``calls`` calls (profiler)."""
    total, rows = kernel_times(fn, calls)
    print(f"\n{label}: kernels per call ({total:.4f} ms of GPU time)", flush=True)
    for ms, count, key in rows:
        print(f"  {ms:8.4f} ms  x{count}  {key[:110]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8192x4096x32768")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/comfuse-out"))
    ap.add_argument("--before", default=str(Path(__file__).resolve().parents[1] / "bench" / "results"
                                              / "h200-2026-11-30-session8" / "before"),
                    help="folder of ce_split_before.py: the split kernel of an older codegen, timed beside")
    ap.add_argument("--quick", action="store_true", help="the GEMM, torch.compile and comfuse.compile only")
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("CE_SPLIT_ROUNDS", "3")),
                    help="interleaved timing rounds (env CE_SPLIT_ROUNDS)")
    args = ap.parse_args()
    M, K, N = (int(s) for s in args.shape.split("x"))
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5)
    t = torch.randint(0, N, (M,), device="cuda")
    ref = F.cross_entropy(x.double() @ w.double(), t, reduction="none")
    rows = []

    calls = {}  # name -> graph replay, timed at the end in interleaved rounds

    def add(name, fn, check=None):
        row = {"name": name}
        rows.append(row)
        try:
            if check is not None:
                got = check()
                err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
                row["err"] = err
                if not err < 2e-2:
                    row["status"] = "wrong"
                    print(f"{name:56s} WRONG {err:.3g}", flush=True)
                    return
            calls[name] = graphed(fn, warmup_calls=1)
            row["status"] = "ok"
        except Exception as e:  # one variant failing must not stop the sweep
            row.update(status="failed", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        print(f"{name:56s} {row['status']} {row.get('reason', '')}", flush=True)

    add("cuBLAS mm alone", lambda: torch.mm(x, w))
    compiled = torch.compile(linear_cross_entropy, dynamic=False)
    add("torch.compile (loss, mean)", lambda: compiled(x, w, t))
    relu = planned(x, w)  # comfuse's plan for relu(x @ w): the mainloop and one store
    gemm_out = torch.empty(1, M, N, device="cuda", dtype=torch.bfloat16)
    for bm, bn, bk, warps, stages in TILES[:1] if args.quick else TILES:
        plain = kernel_mod.build(dataclasses.replace(relu, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                                     num_stages=stages, mainloop="tma"))
        add(f"comfuse plain GEMM tma {bm}x{bn}x{bk} w{warps} s{stages}",
            lambda k=plain, out=gemm_out: k.launch(x.unsqueeze(0), w.unsqueeze(0), [], [out]))

    region, ext = region_and_args(lambda a, b, c: F.cross_entropy((a @ b).float(), c, reduction="none"), (x, w, t))
    a, b = ext[region.operands[0]], ext[region.operands[1]]
    base = region.plan
    print("planned:", base.describe(), flush=True)
    variants = {"as planned": base}
    for bm, bn, bk, warps, stages in () if args.quick else TILES:
        for per in sorted({base.tiles_per_chunk, 1, 4}):
            for inline in (False, True):
                v = split_variant(base, N, bm, bn, bk, warps, stages, per, inline)
                variants[f"split {bm}x{bn}x{bk} w{warps} s{stages} {per}/slice{' inlined' if inline else ''}"] = v
    for name, plan in variants.items():
        try:
            kern = kernel_mod.build(plan)
        except Exception as e:
            rows.append({"name": name, "status": "failed", "reason": f"{type(e).__name__}: {e}"[:200]})
            print(f"{name:56s} build failed: {e}"[:300], flush=True)
            continue
        run = lambda k=kern: region.run_kernel(ext, a, b, k)  # noqa: E731
        add(name, run, check=lambda r=run: r()[0].reshape(-1))
    # the user-facing call: comfuse.compile with autotuning (its choice among the split plans
    # and the unfused ops), the mean loss as the workload defines it
    from comfuse.runtime import tuning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = comfuse.compile(linear_cross_entropy, (x, w, t))
        fused(x, w, t)
    print(fused.report, flush=True)
    tuned = next(m for spec in fused._specs.values() for m in spec.gm.modules()
                 if m.__class__.__name__ == "FusedRegion")
    decision = tuning.load(tuning.key(tuned.region, x.device)) or {}
    names = {kernel_mod.kernel_name(p): p for p in tuned.alternatives}
    for name, ms in sorted(decision.get("times_ms", {}).items(), key=lambda kv: kv[1]):
        p = names.get(name)
        what = (f"{p.mainloop} {p.block_m}x{p.block_n}x{p.block_k} w{p.num_warps} s{p.num_stages} "
                f"{p.tiles_per_chunk}/slice" if p is not None else name)
        print(f"  autotuner: {what:40s} {ms:.4f} ms {decision.get('rejected', {}).get(name, '')[:150]}", flush=True)
    add("comfuse.compile (loss, mean; autotuned)", lambda: fused(x, w, t))
    chosen = next((p for p in tuned.alternatives if kernel_mod.kernel_name(p) == decision.get("choice")), None)
    if chosen is not None:  # the chosen kernel alone, so the call's other work shows as the difference
        kern = kernel_mod.build(chosen)
        run = lambda k=kern: region.run_kernel(ext, a, b, k)  # noqa: E731
        add("the autotuned split kernel alone", run, check=lambda r=run: r()[0].reshape(-1))
    # A/B against an older code generator: the same plan (TMA 128x256x64, 8 warps, 3 stages,
    # 4 tiles a slice, grouped, inlined), its kernels loaded from a saved source file,
    # generated at vocabulary 32768 (the combine's constants; they are set to this N)
    saved = Path(args.before) / "ce_split_before.py"
    if saved.exists():
        before = Path(args.out) / f"ce_split_before_{N}.py"
        before.parent.mkdir(parents=True, exist_ok=True)
        before.write_text(re.sub(r"\b32768\b", str(N), saved.read_text()))
        now = kernel_mod.build(split_variant(base, N))
        spec = importlib.util.spec_from_file_location("ce_split_before", before)
        old_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old_module)
        old = dataclasses.replace(now, fn=old_module.ce_split_before, combine=old_module.ce_split_before_combine,
                                  _scratch={}, _resident={}, _bound={})
        fused_loops = kernel_mod.build(split_variant(base, N, flatten=True))
        for label, k in (("split 4/slice, this codegen", now), ("split 4/slice, this codegen, loops fused", fused_loops),
                         (f"split 4/slice, codegen of {saved.parent.parent.name}", old)):
            run = lambda k=k: region.run_kernel(ext, a, b, k)  # noqa: E731
            add(label, run, check=lambda r=run: r()[0].reshape(-1))
    kernel_table("comfuse.compile", lambda: fused(x, w, t))
    kernel_table("torch.compile", lambda: compiled(x, w, t))
    # The H200 here is power-capped: within ~1 s of a long GEMM its clock falls from 1980 to
    # ~1500 MHz. Heat it first, then time every variant in interleaved rounds (each round
    # starting one variant later), so that none is timed on a cooler GPU than another.
    heat = calls["cuBLAS mm alone"]
    end = time.perf_counter() + 2.0
    while time.perf_counter() < end:
        for _ in range(10):
            heat()
        torch.cuda.synchronize()
    timed = measure_rounds(calls, args.rounds, on_error=lambda name, e: print(f"{name}: a round failed: {e}"))
    for row in rows:
        if row["name"] in timed:
            row.update(timed[row["name"]].as_dict())
            print(f"{row['name']:56s} {row['median_ms']:8.4f} ms (rounds {row['rounds_min_ms']:.4f}.."
                  f"{row['rounds_max_ms']:.4f})", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ce_split.json").write_text(json.dumps({"shape": [M, K, N], "rows": rows}, indent=1))
    mm = next(r["median_ms"] for r in rows if r["name"] == "cuBLAS mm alone")
    print(f"\n| linear + CE {M}x{K}x{N} (bf16, graph replays, {args.rounds} interleaved rounds after 2 s of "
          "heating) | median of round medians, ms | [range of round medians] | [q1..q3 pooled] | x cuBLAS mm |")
    print("|---|---|---|---|---|")
    for r in sorted((r for r in rows if "median_ms" in r), key=lambda r: r["median_ms"]):
        print(f"| {r['name']} | {r['median_ms']:.4f} | {r['rounds_min_ms']:.4f}..{r['rounds_max_ms']:.4f} | "
              f"{r['q1_ms']:.4f}..{r['q3_ms']:.4f} | {r['median_ms'] / mm:.3f} |")


if __name__ == "__main__":
    main()
