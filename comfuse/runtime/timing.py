"""Timing: medians and interquartile ranges of many timed repetitions.

On CUDA, ``triton.testing.do_bench`` times each repetition with CUDA events and
zeroes a 256 MB buffer before each one, so no repetition finds its inputs warm in
the 60 MB L2. On the CPU (smoke runs through the interpreter) a wall clock is used.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Callable, Sequence

MIN_REPS = 20
# with a time budget (autotuning's: ``budget_ms``), a slow function is timed at least this many
# times rather than MIN_REPS: an LM head of 13 ms took 37 runs (0.5 s) a timing
LEAST_REPS = 5


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
            min_reps: int = MIN_REPS, budget_ms: float | None = None) -> Timing:
    """Time ``fn``: warm up, then at least ``min_reps`` repetitions; with ``budget_ms``, a
    function too slow for ``min_reps`` of it within the budget is timed as many times as fit
    (at least LEAST_REPS): its run-to-run spread is small against its time."""
    return summarize(_times(fn, device, warmup_ms, rep_ms, min_reps, budget_ms))


def _times(fn: Callable, device: str = "cuda", warmup_ms: float = 25, rep_ms: float = 100,
           min_reps: int = MIN_REPS, budget_ms: float | None = None) -> list:
    """The repetitions' times in ms (see ``measure``)."""
    if device == "cuda":
        from triton.testing import do_bench
        times = list(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))
        if len(times) < min_reps:  # slow functions: ask for enough repetitions explicitly
            per = max(statistics.median(times), 1e-3)
            if budget_ms is not None:
                want = max(LEAST_REPS, min(min_reps, int(budget_ms / per)))
                return times + _event_times(fn, want - len(times))
            times = do_bench(fn, warmup=warmup_ms, rep=per * min_reps * 1.2, return_mode="all")
        return list(times)
    fn()
    times = []
    for _ in range(min_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _event_times(fn: Callable, reps: int) -> list:
    """``reps`` more timings of ``fn`` (ms), each with CUDA events and after zeroing 256 MB as
    ``do_bench`` does (no repetition finds its inputs in L2), without its estimate first."""
    import torch
    if reps <= 0:
        return []
    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def heat(fn: Callable, ms: float) -> None:
    """Run ``fn`` back to back for about ``ms`` milliseconds of GPU time (its one-call time
    measured first), so that what is timed next finds the GPU at its working clock."""
    import torch
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    per_call = max((time.perf_counter() - began) * 1e3, 1e-3)
    for _ in range(min(int(ms / per_call), 10_000)):
        fn()
    torch.cuda.synchronize()


@contextlib.contextmanager
def own_cublas_workspaces():
    """cuBLAS's workspaces dropped before and after the block, as Inductor's CUDA-graph trees
    do around a recording. cuBLAS keeps one workspace (32 MiB on an H100 / H200) per handle
    and stream for the life of the process, and each capture warms up on a side stream of
    its own (a new one from the pool each time). Models whose regions were autotuned by graph
    replays held, at their training step's peak, 3 to 10 times 32 MiB more than under
    Inductor alone (0.09-0.31 GiB, H200, 2026-12-05), running Inductor's graph. Dropped
    before, the capture allocates its workspace in its graph's pool, which the graph keeps;
    dropped after, no later launch outside the graph writes into that one. Launches after
    the block allocate theirs again."""
    import torch
    torch._C._cuda_clearCublasWorkspaces()
    try:
        yield
    finally:
        torch._C._cuda_clearCublasWorkspaces()


def graphed(fn: Callable, warmup_calls: int = 3) -> Callable:
    """A callable that replays one call of ``fn`` captured in a CUDA graph (after
    ``warmup_calls`` calls on a side stream, so compilation and autotuning stay out of it),
    returning that call's result: timing it gives the GPU's time without Python's launch
    path (for ~30 us kernels the two differ by up to 2x; see bench/results)."""
    import torch
    with own_cublas_workspaces():
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


@dataclasses.dataclass(frozen=True)
class Rounds:
    """A callable timed in several rounds interleaved with others': the median of the rounds'
    medians, the rounds' medians, and the quartiles of all repetitions pooled."""
    median_ms: float
    round_medians_ms: tuple
    pooled: Timing

    def as_dict(self) -> dict:
        return {**self.pooled.as_dict(), "median_ms": self.median_ms,
                "round_medians_ms": list(self.round_medians_ms),
                "rounds_min_ms": min(self.round_medians_ms), "rounds_max_ms": max(self.round_medians_ms)}


def measure_rounds(calls: dict, rounds: int = 3, device: str = "cuda", on_error=None, **kw) -> dict:
    """Time every callable of ``calls`` (name -> callable) in ``rounds`` interleaved rounds
    (A B C, B C A, C A B, ...: each round starts one later, so no callable always runs first
    on a GPU still cool from the last pause). A GPU whose clock follows its power draw (the
    H200 here falls from 1980 to ~1500 MHz within a second of a long GEMM) then treats them
    alike. Returns name -> Rounds for the callables that ran; a round that raises is
    reported to ``on_error(name, exc)`` and left out."""
    names = list(calls)
    medians = {n: [] for n in names}
    pooled = {n: [] for n in names}
    for r in range(rounds if names else 0):
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            try:
                times = _times(calls[n], device, **kw)
            except Exception as e:  # keep the rounds that ran
                if on_error is None:
                    raise
                on_error(n, e)
                continue
            medians[n].append(statistics.median(times))
            pooled[n].extend(times)
    return {n: Rounds(statistics.median(medians[n]), tuple(medians[n]), summarize(pooled[n]))
            for n in names if medians[n]}


def profiled(fn: Callable, activity: str, calls: int = 5):
    """The torch profiler's record of ``calls`` calls of ``fn`` (after one untimed call), for
    ``activity`` "CPU" or "CUDA"."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_times(fn: Callable, calls: int = 5) -> tuple[float, list]:
    """(GPU ms per call, [(ms per call, launches per call, kernel name)], slowest first): every
    kernel ``calls`` calls of ``fn`` launch, from the profiler (CUDA)."""
    prof = profiled(fn, "CUDA", calls)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count]
    rows = sorted(((e.device_time_total / calls / 1e3, e.count // calls, e.key) for e in events), reverse=True)
    return sum(r[0] for r in rows), rows


def graph_rounds(forms: dict, rounds: int = 3, reps: int = 20, heat: int = 50) -> dict:
    """name -> the medians (ms per call) of ``rounds`` interleaved rounds: each callable of
    ``forms`` is captured ``reps`` times in one CUDA graph; the first graph is replayed ``heat``
    times first (the H200 here is power-capped: whatever runs first runs cooler); each round
    times 10 replays of every graph, starting one later than the last round."""
    import torch
    graphs = {}
    for name, fn in forms.items():
        with own_cublas_workspaces():
            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(reps):
                    fn()
        graphs[name] = g
    names = list(graphs)
    times = {n: [] for n in names}
    torch.cuda.synchronize()
    for _ in range(heat if names else 0):
        graphs[names[0]].replay()
    for rnd in range(rounds if names else 0):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            per = []
            for _ in range(10):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graphs[name].replay()
                end.record()
                end.synchronize()
                per.append(start.elapsed_time(end) / reps)
            times[name].append(statistics.median(per))
    return times


def ratio_rows(label: str, times: dict, base: str) -> list:
    """(label, name, median, min, max, median / base's median) per name of ``graph_rounds``."""
    ref = statistics.median(times[base])
    return [(label, n, statistics.median(t), min(t), max(t), statistics.median(t) / ref) for n, t in times.items()]


def print_ratio_table(rows: list, base: str = "cuBLAS GEMM") -> None:
    print(f"\n| shape (MxNxK) | form | median ms | rounds min..max | / {base} |")
    print("|---|---|---|---|---|")
    for s, name, med, lo, hi, ratio in rows:
        print(f"| {s} | {name} | {med:.4f} | {lo:.4f}..{hi:.4f} | {ratio:.3f} |")
