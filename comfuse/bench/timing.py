"""Timing: medians and interquartile ranges of many timed repetitions.

On CUDA, ``triton.testing.do_bench`` times each repetition with CUDA events and
zeroes a 256 MB buffer before each one, so no repetition finds its inputs warm in
the 60 MB L2. On the CPU (smoke runs through the interpreter) a wall clock is used.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

MIN_REPS = 20


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    q1_ms: float
    q3_ms: float
    reps: int

    @property
    def iqr_ms(self) -> float:
        return self.q3_ms - self.q1_ms

    def as_dict(self) -> dict:
        return {"median_ms": self.median_ms, "q1_ms": self.q1_ms, "q3_ms": self.q3_ms,
                "iqr_ms": self.iqr_ms, "reps": self.reps}


def summarize(times_ms: Sequence[float]) -> Timing:
    """Median and quartiles (inclusive method) of repetition times."""
    times = sorted(float(t) for t in times_ms)
    if not times:
        raise ValueError("no repetitions to summarise")
    if len(times) == 1:
        return Timing(times[0], times[0], times[0], 1)
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return Timing(statistics.median(times), q1, q3, len(times))


def measure(fn: Callable, device: str = "cuda", warmup_ms: float = 25, rep_ms: float = 100,
            min_reps: int = MIN_REPS) -> Timing:
    """Time ``fn``: warm up, then at least ``min_reps`` repetitions."""
    if device == "cuda":
        from triton.testing import do_bench
        times = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
        if len(times) < min_reps:  # slow functions: ask for enough repetitions explicitly
            per = max(statistics.median(times), 1e-3)
            times = do_bench(fn, warmup=warmup_ms, rep=per * min_reps * 1.2, return_mode="all")
        return summarize(times)
    fn()
    times = []
    for _ in range(min_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return summarize(times)


def graphed(fn: Callable, warmup_calls: int = 3) -> Callable:
    """A callable that replays one call of ``fn`` captured in a CUDA graph (after
    ``warmup_calls`` calls on a side stream, so compilation and autotuning stay out of it),
    returning that call's result: timing it gives the GPU's time without Python's launch
    path (for ~30 us kernels the two differ by up to 2x; see bench/results)."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out
    return replay

