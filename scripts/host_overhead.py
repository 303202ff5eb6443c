"""How much of a fused call is Python? (2026-11-30: the autotuner, timing launches, measured
RMSNorm's cooperative plans at 0.13-0.28 ms; the same kernels replayed from a CUDA graph run
in 0.042-0.06 ms.)

For each workload (``--workloads``, RMSNorm by default) at 8192x1024x1024 (bf16) and each
candidate plan of the schedule (``--schedule``, cooperative by default), prints:
the GPU time (CUDA-graph replay), the host time of one launch through ``run_kernel`` (300
launches without synchronising, divided), and the time with both (``measure``). Then a
cProfile of 300 launches of one pointer plan and one TMA plan (top entries by own time), and
the host time of a whole ``comfuse.compile`` call and of a ``torch.compile`` call.

    python scripts/host_overhead.py            # on the GPU machine; writes $OUT/host_overhead.txt
    python scripts/host_overhead.py --workloads rmsnorm,softmax --schedule ws_stages
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402
from comfuse import settings  # noqa: E402
from comfuse.bench.timing import graphed, measure  # noqa: E402
from comfuse.bench.workloads import SUITE  # noqa: E402
from comfuse.planner import candidates  # noqa: E402
from comfuse.runtime import kernel as kernel_mod  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from coop_anatomy import region_of  # noqa: E402

CALLS = 300


def host_us(fn) -> float:
    """Microseconds of host time per call: CALLS calls queued without synchronising."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / CALLS * 1e6


def profile(fn, out) -> None:
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(CALLS):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    out.write(s.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="rmsnorm", help="suite workloads, comma-separated")
    ap.add_argument("--schedule", default="cooperative", help="the candidate plans' schedule")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "/tmp/comfuse-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "host_overhead.txt", "w")
    rows = []
    for name in args.workloads.split(","):
        w = SUITE[name]
        inputs = w.inputs(8192, 1024, 1024, dtype=torch.bfloat16, device="cuda")
        region, ext = region_of(w.fn, inputs)
        a, b = ext[region.operands[0]], ext[region.operands[1]]
        profiled = set()
        for plan in candidates(region.region, target="cuda"):
            if plan.schedule != args.schedule:
                continue
            kernel = kernel_mod.build(plan)
            region.run_kernel(ext, a, b, kernel, check=True)
            call = lambda k=kernel, region=region, ext=ext, a=a, b=b: region.run_kernel(ext, a, b, k)  # noqa: E731
            gpu = measure(graphed(call, warmup_calls=1)).median_ms * 1e3
            both = measure(call).median_ms * 1e3
            rows.append((f"{name}: " + plan.describe().split("; ", 2)[-1], gpu, host_us(call), both))
            print(f"{rows[-1][0]:70s} gpu {gpu:6.1f} us  host {rows[-1][2]:6.1f} us  launch-timed {both:6.1f} us",
                  flush=True)
            if plan.mainloop not in profiled:
                profiled.add(plan.mainloop)
                log.write(f"\n## cProfile, {CALLS} launches: {rows[-1][0]}\n")
                profile(call, log)
    with settings.override(autotune="0"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = comfuse.compile(w.fn, inputs)
        fused(*inputs)
        whole = host_us(lambda: fused(*inputs))
        log.write("\n## cProfile, whole comfuse.compile call\n")
        profile(lambda: fused(*inputs), log)
    ind = torch.compile(w.fn, dynamic=False)
    ind(*inputs)
    ind_host = host_us(lambda: ind(*inputs))
    log.close()
    print(f"\nwhole comfuse.compile call (autotune off): host {whole:.1f} us; torch.compile call: host {ind_host:.1f} us")
    print("\n| plan | GPU us (graph) | host us per launch | launch-timed us |")
    print("|---|---|---|---|")
    for name, gpu, host, both in rows:
        print(f"| {name} | {gpu:.1f} | {host:.1f} | {both:.1f} |")


if __name__ == "__main__":
    main()
