"""Is a back-to-back workload's call bound by the GPU or by Python? (2026-11-30: the bench
timed comfuse's target-attention call at 0.147-0.18 ms on a machine where its autotuner had
timed the same kernel at 0.080 ms, and Inductor's default code 1.4x slower than the run
before: the host's speed varies between machines.)

For each of the b2b workloads and each of comfuse, torch.compile (default) and
torch.compile max-autotune-no-cudagraphs, prints: the GPU time (CUDA-graph replay of one
call), the host time of one call (300 calls without synchronising, divided), and the time
measured as the bench measures it (CUDA events around each call). A call is host-bound
when the host time exceeds the GPU time. Every contender is checked against eager first.

    python scripts/call_overhead.py [target_attention,dlrm_bottom_mlp]   # on the GPU machine
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402
from comfuse.bench.timing import graphed, measure  # noqa: E402
from comfuse.bench.workloads import b2b_program  # noqa: E402


def host_us(fn, calls: int = 300) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    names = (sys.argv[1] if len(sys.argv) > 1 else "target_attention,dlrm_bottom_mlp").split(",")
    rows = []
    for name in names:
        prog = b2b_program(name, torch.bfloat16, "cuda")
        expect = prog.fn(*prog.args)
        contenders = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            contenders["comfuse"] = comfuse.compile(prog.fn, prog.args)
            contenders["torch.compile"] = torch.compile(prog.fn, dynamic=False)
            contenders["max-autotune"] = torch.compile(prog.fn, mode="max-autotune-no-cudagraphs", dynamic=False)
            for label, fn in contenders.items():
                out = fn(*prog.args)
                err = float((out.float() - expect.float()).norm() / expect.float().norm())
                if not err < 2e-2:
                    print(f"{name} {label}: WRONG (rel. error {err:.2e}), not timed")
                    continue
                call = lambda fn=fn: fn(*prog.args)  # noqa: E731
                gpu = measure(graphed(call), "cuda").median_ms * 1e3
                rows.append((name, label, gpu, host_us(call), measure(call, "cuda").median_ms * 1e3))
    print("| workload | contender | GPU us (graph replay) | host us per call | measured us | bound by |")
    print("|---|---|---|---|---|---|")
    for name, label, gpu, host, measured in rows:
        print(f"| {name} | {label} | {gpu:.1f} | {host:.1f} | {measured:.1f} | "
              f"{'host' if host > gpu else 'GPU'} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "call_overhead.txt").write_text("\n".join(map(str, rows)) + "\n")


if __name__ == "__main__":
    main()
