"""Host time of a comfuse.compile call whose region runs the generated kernel (ws_stages),
without a GPU: the region's plan is replaced by its ws_stages plan and the kernel's bound
launch by a no-op, so what is timed is comfuse's Python from the call to the launcher (the
argument views, the layout key, the TMA descriptors), not Triton's launcher or the kernel.

On the H200's host a ws_stages launch took 50-260 us (nineteenth session, host_overhead.py),
more than the 33-50 us its kernel runs at 8192x1024x1024; this is the part of that we own,
measured where it can be changed and re-measured on any machine.

    TRITON_INTERPRET=1 python scripts/stages_host_cost.py [--workloads ln_postnorm,rmsnorm,softmax] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402
from comfuse import settings  # noqa: E402
from comfuse.bench.workloads import SUITE  # noqa: E402
from comfuse.planner import plan as plan_for  # noqa: E402
from comfuse.runtime.stages_kernel import StagesKernel  # noqa: E402


def stubbed_call(name: str):
    """(the compiled function, its arguments) with its one region on a stubbed ws_stages kernel."""
    wl = SUITE[name]
    args = wl.inputs(256, 64, 1024, dtype=torch.bfloat16, device="cpu")
    compiled = comfuse.compile(wl.fn, args)
    compiled(*args)
    (region,) = compiled.fused_regions()
    with settings.override(schedule="ws_stages"):
        region.plan = plan_for(region.region, target="cuda")
    kernel = region.kernel = StagesKernel(region.plan, None, None)

    def bind(tensors):  # what StagesKernel.bind keeps, with a no-op for the compiled launcher
        full = kernel.arguments(tensors, torch.empty(8), torch.zeros(2, dtype=torch.int64))
        fresh = kernel.fresh(tensors)
        return (lambda *a: None), [None] * fresh + full[fresh:], fresh, kernel.descriptor_fields(full, len(tensors))
    kernel.bind = bind
    return compiled, args


def per_call_us(fn, calls: int) -> float:
    """The best of 5 rounds of ``calls`` calls, microseconds a call."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="ln_postnorm,rmsnorm,softmax")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="also print the top of a cProfile of each")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    with settings.override(autotune="0", validate="0"):
        for name in args.workloads.split(","):
            compiled, inputs = stubbed_call(name)
            rows.append((name, per_call_us(lambda: compiled(*inputs), args.calls)))
            if args.profile:
                prof = cProfile.Profile()
                prof.runcall(lambda: [compiled(*inputs) for _ in range(args.calls)])
                pstats.Stats(prof).sort_stats("tottime").print_stats(16)
    print("| workload | host us a call (kernel launch stubbed) |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
