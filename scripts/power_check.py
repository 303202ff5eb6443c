"""How much a long GEMM's time depends on how long the GPU has been busy (H200 power limit).

Seen 2026-11-30: under the profiler, five back-to-back calls of torch.compile's linear + CE
ran its cuBLAS GEMM in 2.74 ms, while do_bench's graph replays of ``torch.mm`` alone took
3.16 ms. If sustained load lowers the clocks, a ratio "x cuBLAS" depends on when and how
long each side ran. This script times each kernel in two states, with CUDA events:

- *rested*: after 2 s idle, three single calls;
- *sustained*: after 3 s of back-to-back calls, the median of the next ten;

while ``nvidia-smi`` samples SM clock, power and temperature every 100 ms (``$OUT/smi.csv``).

Also, per ``--mainloop`` shape, cuBLAS against comfuse's plain GEMM (``relu(a @ b)``, TMA
128x256x64, 8 warps, 3 stages), the issue's mainloop target.

    python scripts/power_check.py [--shape 8192x4096x32768] [--mainloop 8192x8192x8192,...]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import comfuse  # noqa: E402
from comfuse.bench.workloads import linear_cross_entropy  # noqa: E402
from comfuse.runtime import kernel as kernel_mod  # noqa: E402

TILE = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, mainloop="tma")


def plain_gemm(a, b):
    """comfuse's kernel for relu(a @ b) at TILE, checked against torch, as a callable."""
    from mainloop_bench import planned
    kern = kernel_mod.build(dataclasses.replace(planned(a, b), **TILE))
    out = torch.empty(1, a.shape[0], b.shape[1], device="cuda", dtype=a.dtype)
    run = lambda: kern.launch(a.unsqueeze(0), b.unsqueeze(0), [], [out])  # noqa: E731
    run()
    torch.testing.assert_close(out[0], torch.relu(a @ b), atol=2e-2, rtol=2e-2)
    return run


def event_times(fn, calls: int) -> list:
    out = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def states(fn) -> dict:
    time.sleep(2.0)
    rested = event_times(fn, 3)
    end = time.perf_counter() + 3.0
    while time.perf_counter() < end:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    sustained = event_times(fn, 10)
    return {"rested": rested, "sustained": statistics.median(sustained)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8192x4096x32768")
    ap.add_argument("--mainloop", default="", help="comma-separated MxKxN shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/comfuse-out"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    M, K, N = (int(s) for s in args.shape.split("x"))
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    t = torch.randint(0, N, (M,), device="cuda")
    ref = linear_cross_entropy(x.double(), w.double(), t)
    inductor = torch.compile(linear_cross_entropy, dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = comfuse.compile(linear_cross_entropy, (x, w, t))
    for name, f in (("torch.compile", inductor), ("comfuse.compile", fused)):
        err = abs(f(x, w, t).double() - ref).item() / abs(ref).item()
        assert err < 1e-2, f"{name}: loss off by {err:.3g} (relative)"
    from ce_split_bench import region_and_args, split_variant
    region, ext = region_and_args(lambda a, b, c: torch.nn.functional.cross_entropy(
        (a @ b).float(), c, reduction="none"), (x, w, t))
    split = kernel_mod.build(split_variant(region.plan, N))  # TILE, 4 tiles a slice
    got = region.run_kernel(ext, ext[region.operands[0]], ext[region.operands[1]], split)[0].reshape(-1)
    want = torch.nn.functional.cross_entropy(x.double() @ w.double(), t, reduction="none")
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-2, "split kernel is wrong"
    groups = [{"cuBLAS mm": lambda: torch.mm(x, w), "comfuse plain GEMM": plain_gemm(x, w),
               "split kernel alone": lambda: region.run_kernel(ext, ext[region.operands[0]],
                                                               ext[region.operands[1]], split),
               "torch.compile loss": lambda: inductor(x, w, t), "comfuse.compile loss": lambda: fused(x, w, t)}]
    for shape in filter(None, args.mainloop.split(",")):
        m, k, n = (int(v) for v in shape.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        groups.append({f"cuBLAS mm {shape}": lambda a=a, b=b: torch.mm(a, b),
                       f"comfuse plain GEMM {shape}": plain_gemm(a, b)})
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader", "-lms", "100"], stdout=open(out / "smi.csv", "w"))
    rows = []
    try:
        for kernels, rnd in ((k, r) for k in groups for r in range(2)):
            # two rounds per group, order reversed in the second, so drift shows
            for name in (list(kernels) if rnd == 0 else list(kernels)[::-1]):
                r = states(kernels[name])
                rows.append((rnd, name, r))
                print(f"round {rnd} {name:22s} rested {' '.join(f'{v:.3f}' for v in r['rested'])} ms, "
                      f"sustained {r['sustained']:.3f} ms  [{time.strftime('%H:%M:%S')}]", flush=True)
    finally:
        smi.terminate()
    print(f"\n| bf16 (CE at {M}x{K}x{N}) | round | rested ms (3 calls) | sustained ms (median of 10) |")
    print("|---|---|---|---|")
    for rnd, name, r in rows:
        print(f"| {name} | {rnd} | {' / '.join(f'{v:.3f}' for v in r['rested'])} | {r['sustained']:.3f} |")


if __name__ == "__main__":
    main()
