"""Autotuning: time the candidate plans of a region against its unfused ops, keep the fastest.

On the first call of a region on a GPU every candidate plan is built, run once and
checked against the unfused ops' result (a plan that disagrees or fails scores inf),
then timed; the unfused ops are timed too; those within 10 % of the fastest are timed
again in interleaved rounds (``final_rounds``) and the fastest of them wins: a fused region
is never kept when running its ops separately is faster. Decisions are written to
``COMFUSE_CACHE_DIR/tuning/<key>.json``, the key hashing the region's structure, its
sizes, the GPU, and the torch, triton and code generator versions.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

from .. import settings as settings_mod
from ..errors import FallbackWarning, KernelMismatch
from ..ir import rows_independent, structural_text
from . import cache, workers
from .check import compare, tolerance
from .timing import graphed, heat, measure, measure_rounds

log = logging.getLogger("comfuse.tuning")

UNFUSED = "unfused"
# A split region (a loss or statistic over a vocabulary-wide row) stays fused even when its
# unfused ops are faster if they would materialise an fp32 [M, N] intermediate at least this
# large: avoiding that tensor is the point of the schedule.
MEMORY_FIRST_BYTES = 1 << 30
# Contenders whose first time is within this factor of the fastest are timed again in
# interleaved rounds before the choice: the H200 is power-capped (its clock falls by a quarter
# within a second of load), so the first contender timed runs on a cooler GPU, and the same
# kernel's first time and its round median were seen to differ by 13 %.
FINALIST_MARGIN = 1.10
FINAL_ROUNDS = 3
FINALISTS = 4  # at most this many of them, the fastest first
# The unfused ops join the rounds wherever a fused plan leads, however far behind their first
# time was: the first pass times them right after the heating and each plan later, after its
# first call's check, at other moments of a power-capped clock. SwiGLU's two products at the
# 8B widths were kept on first times of 2.545 against 3.012 ms and ran 2.834 against 2.789 ms
# inside the model (H200, 2026-12-07, bench/results/2026-12-07-h200-models-suite/; whether
# the rounds catch that is not yet measured).
# a fused plan is kept only where it is at least this much faster than the unfused ops: the
# same 8B down projection (8192 x 4096 x 14336) timed 0.978 and 0.999 of its ops' time in two
# graphs of one run (H200, 2026-12-06), and a region's call adds host time that the ops'
# Inductor code does not
KEEP_MARGIN = 0.98
# each timing of a candidate within about this much GPU time (at least timing.LEAST_REPS runs):
# the 8B LM head's 9 candidates of 13 ms took 14 s to time at 20 runs and more each
TUNE_BUDGET_MS = 100
# the unfused ops run back to back for this long before the first timing: the H200 idles at
# 345 MHz while candidates compile (the same plan of the same region was timed 0.1659 and
# 0.3255 ms in two runs that timed Python launches right after compiling)
HEAT_MS = 100
# compile the candidates' kernels in worker processes (``workers.py``) rather than only in
# this process's threads
COMPILE_IN_WORKERS = True
# the Inductor forms of a region's unfused ops autotuning compiles and times, each by the name
# a decision stores and the torch.compile mode it is compiled in: neither wins everywhere
# (GEMM + LayerNorm: the default's 0.0420 ms against max-autotune's 0.0524; the multi-stage
# epilogue: max-autotune's 0.0541 against 0.0598), so a region is never slower than either
INDUCTOR_FORMS = {"inductor": None, "inductor-max-autotune": "max-autotune-no-cudagraphs"}


def _best_candidate(times: dict, rejected: dict) -> str:
    """For the log where the unfused ops were chosen: the fastest candidate, or why none ran."""
    ran = {n: t for n, t in times.items() if n != UNFUSED and math.isfinite(t)}
    best = min(ran, key=ran.get) if ran else None
    return (f"; fastest candidate {best} {ran[best]:.4f} ms" if best else
            f"; no candidate ran: {next(iter(rejected.values()))}" if rejected else "")


def final_rounds(times: dict, call) -> dict:
    """Time again, in ``FINAL_ROUNDS`` interleaved rounds with a rotating order, the
    contenders whose first time in ``times`` is within ``FINALIST_MARGIN`` of the fastest,
    and the unfused ops wherever a fused plan is the fastest;
    ``call(name)`` gives each one's callable (built only for those; one that raises is left
    out). Return name -> median of their round medians (empty when fewer than two are that
    close). A contender failing a round keeps its first time. When it is not empty the choice
    is among these (``fastest``): the others lost the first pass by more than the margin, and
    their first times, taken on a cooler GPU, are not comparable with the rounds'."""
    best = min(times.values(), default=math.inf)
    near = sorted((n for n, t in times.items() if math.isfinite(t) and t <= best * FINALIST_MARGIN), key=times.get)
    near = near[:FINALISTS]
    if UNFUSED not in near and math.isfinite(times.get(UNFUSED, math.inf)):
        near.append(UNFUSED)
    if len(near) < 2:
        return {}
    close = {}
    for name in near:
        try:
            close[name] = call(name)
        except Exception as e:  # (a graph capture, say): it keeps its first time
            log.info("autotuning: %s not timed again (%s)", name, type(e).__name__)
    if len(close) < 2:
        return {}
    rounds = measure_rounds(close, FINAL_ROUNDS, "cuda", warmup_ms=5, rep_ms=25, budget_ms=TUNE_BUDGET_MS,
                            on_error=lambda n, e: log.info("autotuning: a timing round of %s failed: %s", n, e))
    return {n: r.median_ms for n, r in rounds.items()}


def fastest(times: dict, finalists: dict | None = None) -> str:
    """The name with the least time: among ``finalists`` (``final_rounds``'s result) when
    there are any, else among all of ``times``."""
    pool = finalists or times
    return min(pool, key=pool.get)


def intermediate_text(region) -> str:
    s = region.sizes
    return f"unfused, an fp32 [{s.B * s.M}, {s.N}] intermediate of {s.B * s.M * s.N * 4 / 2**30:.1f} GiB"


def saves_memory(region) -> bool:
    """Whether fusing ``region`` avoids a large tensor: per-row outputs only, where its
    unfused ops would hold an fp32 [M, N] intermediate of MEMORY_FIRST_BYTES or more (a loss
    over a vocabulary)."""
    s = region.sizes
    return s.B * s.M * s.N * 4 >= MEMORY_FIRST_BYTES and not any("N" in o.axes for o in region.outputs)


def memory_first(region, decision: dict) -> str:
    """The fastest correct fused plan when the region must stay fused to save memory
    (``saves_memory``), else ''."""
    if not saves_memory(region):
        return ""  # small, or the outputs are [M, N] anyway: nothing to save
    fused = {n: t for n, t in decision["times_ms"].items() if n != UNFUSED and t < math.inf}
    return min(fused, key=fused.get) if fused else ""


def reusable(decision: dict | None, names: list) -> bool:
    """Whether a stored decision answers for these candidates: it timed every one of them
    and chose one of them or the unfused ops. (A region planned with autotuning off and
    tuned on a later call has only the planner's plan as a candidate: its decision must not
    stand for a region that has them all; on the H200 such a leftover kept linear + CE on a
    4.6 ms plan where a 4.0 ms one was a candidate, 2026-11-30.)"""
    if decision is None:
        return False
    timed = decision.get("times_ms", {})
    return set(names) <= set(timed) and (decision["choice"] == UNFUSED or decision["choice"] in names)


def enabled(device: torch.device, settings=None) -> bool:
    """Whether a region autotunes on ``device`` (COMFUSE_AUTOTUNE; ``settings``: the caller's,
    when it has them: asked on every fused call until a choice is made)."""
    mode = (settings or settings_mod.get()).autotune
    return mode == "1" or (mode == "auto" and device.type == "cuda")  # (the interpreter's times mean nothing)


def validating(device: torch.device, regions) -> bool:
    """Whether a region (a chain: its regions) is compared with its own ops on its first
    call (COMFUSE_VALIDATE): not where those ops would hold a memory-first intermediate."""
    mode = settings_mod.get().validate
    if mode == "0" or (mode == "auto" and device.type != "cuda"):
        return False
    return all(r.sizes.B * r.sizes.M * r.sizes.N * 4 < MEMORY_FIRST_BYTES for r in regions)


def check_first_call(outs, run_unfused, tol: float, where: str, turn_off, exact=None) -> tuple:
    """A fused result against the region's own ops on the same inputs (COMFUSE_VALIDATE), as
    autotuning compares its candidates (``exact``: see ``_disagreement``): ``outs`` when they
    agree, else the ops' outputs, after ``turn_off(reason)`` (COMFUSE_STRICT=1:
    KernelMismatch instead)."""
    refs = tuple(run_unfused())
    bad = _disagreement(outs, refs, tol, exact)
    if not bad:
        return outs
    reason = f"the fused kernel disagrees with its own ops on its first call ({bad})"
    if settings_mod.get().strict:
        raise KernelMismatch(f"{where}: {reason}")
    turn_off(reason)
    return refs


def key(region, device: torch.device) -> str:
    """The decision's cache key: the region, its sizes, the GPU, the versions, and every
    setting that changes the candidates or how they are timed."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-interpreter"
    s = region.sizes
    st = settings_mod.get()
    chosen = ",".join(f"{name}={getattr(st, name)!r}" for name in settings_mod.KEYED)
    return cache.digest(structural_text(region), f"{s.B},{s.M},{s.N},{s.K}", gpu, torch.__version__,
                        triton.__version__, cache.CODEGEN_VERSION, chosen)


def plan_fields(plan) -> dict:
    """A plan's choices as plain values (its schedule, tiles, warps, stages, its schedule
    record's fields), as a stored decision lists them beside each candidate's time."""
    out = {}
    for name, value in plan.key_fields():
        if isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif isinstance(value, tuple) and isinstance(name, str) and value and isinstance(value[0], tuple):
            out.update({f"{name}.{k}": v for k, v in value if isinstance(v, (bool, int, float, str))})
    return out


def _path(k: str):
    return settings_mod.get().cache_dir / "tuning" / f"{k}.json"


def load(k: str) -> dict | None:
    path = _path(k)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a damaged entry is re-measured, never trusted


def store(k: str, decision: dict) -> None:
    cache.atomic_write(_path(k), json.dumps(decision, indent=1))


EXACT_LIMIT_BYTES = 1 << 31  # a float64 [B, M, N] beyond this gets no second opinion (a vocabulary-wide
# loss would hold several 8 GiB intermediates): the ops' judgment stands


EXACT_OUTPUT_LIMIT_BYTES = 1 << 32  # the whole float64 outputs of an evaluation a slice of rows at a time
# (GPT-2's [8192, 50257] logits: 3.3 GB; the comparison holds a few more of their size)
EXACT_SLICE_BYTES = 1 << 29  # one [B, rows, N] float64 intermediate of such a slice


def exact_fits(regions) -> None:
    """Raise when a float64 evaluation of ``regions`` would be too large to hold."""
    for r in regions:
        s = r.sizes
        if s.B * s.M * s.N * 8 > EXACT_LIMIT_BYTES:
            raise MemoryError(f"a float64 [{s.B}, {s.M}, {s.N}] exceeds {EXACT_LIMIT_BYTES >> 30} GiB")


def exact_rows(region) -> int:
    """How many rows of ``region`` a float64 evaluation takes at a time: all of them where
    they fit (``exact_fits``); else, where its rows are independent (an LM head's loss over
    GPT-2's vocabulary) and its float64 outputs fit EXACT_OUTPUT_LIMIT_BYTES, a slice whose
    intermediates are EXACT_SLICE_BYTES each; else raises MemoryError."""
    s = region.sizes
    if s.B * s.M * s.N * 8 <= EXACT_LIMIT_BYTES:
        return s.M
    outputs = sum(s.B * s.M * (s.N if "N" in o.axes else 1) * 8 for o in region.outputs)
    if not rows_independent(region) or outputs > EXACT_OUTPUT_LIMIT_BYTES:
        exact_fits([region])  # (raises, saying why)
    return max(1, EXACT_SLICE_BYTES // (s.B * s.N * 8))


def _disagreement(outs, refs, tol: float | None, exact=None) -> str:
    """'' when every output matches the unfused result, else what differs.

    The unfused ops round too: where a result is ill-conditioned (LayerNorm of rows with a
    large offset, rounded to bf16 before the statistics), they and a correct kernel can
    differ by more than the dtype's tolerance. ``exact()``, when given, returns the float64
    outputs (the IR's reference interpreter); an output that disagrees with the ops is then
    accepted if it is within tolerance of the exact one, or no further from it than twice
    the ops' own error (norm-wise): a kernel at least about as accurate as the ops."""
    exact_refs = None
    for k, (o, r) in enumerate(zip(outs, refs)):
        t = tolerance(o.dtype) if tol is None else tol
        result = compare(o, r, t, floor=1.0)
        if result.ok:
            continue
        if exact is not None and t > 0 and o.dtype.is_floating_point:
            if exact_refs is None:
                try:
                    exact_refs = exact()
                except Exception as e:  # no second opinion: the ops' judgment stands
                    log.info("no float64 reference (%s: %s)", type(e).__name__, e)
                    return f"output {k}: {result}"
            x = exact_refs[k].to(device=r.device)
            allowance = (r.double() - x).abs().nan_to_num(0.0, 0.0, 0.0) * (2.0 / t)
            closer = compare(o, x, t, scale=allowance, floor=1.0)
            if closer.ok:
                log.info("output %d differs from the unfused ops (%s) but not from float64 (%s)", k, result, closer)
                continue
            return f"output {k}: {result}; against float64: {closer}"
        return f"output {k}: {result}"
    return ""


def _on_gpu(ext) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in ext)


def _inductor(unfused, ext, form: str):
    """``unfused`` compiled by Inductor in ``form``'s mode, run once."""
    from torch._inductor.compile_fx import compile_fx
    mode = INDUCTOR_FORMS[form]
    patches = dict(torch._inductor.list_mode_options(mode) if mode else {})
    # the backend tunes inside Inductor's compilation, whose config patches stay in force:
    # without these the nested compilation would run comfuse's pass on the region's own ops,
    # which tunes them again, and so on until Python's recursion limit (and would capture
    # them in CUDA graphs, which the timing does itself where it wants them)
    patches.update(post_grad_custom_pre_pass=None, post_grad_custom_post_pass=None)
    patches["triton.cudagraphs"] = False
    # outside any compilation in progress (the backend tunes while Dynamo compiles):
    # this graph's guards and sizes are its own
    with torch._guards.tracing(None):
        compiled = compile_fx(copy.deepcopy(unfused), list(ext), config_patches=patches)
        compiled(*ext)
    return compiled


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


_inside: list = []  # the Inductor forms of the compilations the backend is tuning inside


@contextlib.contextmanager
def inside_inductor():
    """Tuning inside Inductor's compilation of a graph (the backend's pass): a region's
    unfused ops are compiled only in that compilation's form, the code they would run as
    if left to Inductor (a GEMM's max-autotune alone took 15 s on the H200)."""
    config = torch._inductor.config
    _inside.append("inductor-max-autotune" if config.max_autotune or config.max_autotune_gemm else "inductor")
    try:
        yield
    finally:
        _inside.pop()


def separate(unfused, ext, on_cpu: bool = False, form: str | None = None, forms=None) -> tuple:
    """The region's own ops as the best separate execution comfuse can offer, and which form
    it is: on a GPU, the fastest of the ops run one by one ("ops") and their Inductor
    compilations in ``forms`` (by default INDUCTOR_FORMS: Inductor's default mode and
    max-autotune-no-cudagraphs). Inside the backend's pass it is the surrounding
    compilation's form alone, untimed: ops left unfused there go back into Inductor's graph,
    so that code is what they would run, never the ops one by one. ``form``, a stored
    decision's, is taken without measuring again. Falls back to the ops themselves when
    Inductor cannot compile them."""
    gpu = _on_gpu(ext)
    only = forms is None and bool(_inside)
    if forms is None:
        forms = (_inside[-1],) if _inside else tuple(INDUCTOR_FORMS)
    if form == "ops" or not (gpu or on_cpu):
        return unfused, "ops"
    forms = (form,) if form in INDUCTOR_FORMS else forms
    built = {}
    for name in forms:
        try:
            built[name] = _inductor(unfused, ext, name)
        except Exception as e:  # the plain ops still run
            warnings.warn(f"comfuse: Inductor ({name}) could not compile a region's unfused ops "
                          f"({_why(e)}); timing them as they are", FallbackWarning, stacklevel=2)
    if not built:
        return unfused, "ops"
    if not gpu or form is not None or only:  # (on the CPU, for tests: compiled, not timed)
        name = next(iter(built))
        return built[name], name
    # Inductor's code is not always the faster (DLRM's GEMM chain: eager won), nor is
    # max-autotune's (LayerNorm after a GEMM, H200 2026-11-30: 0.0524 ms vs the default's 0.0420)
    calls = {name: (lambda c=c: c(*ext)) for name, c in built.items()}
    calls["ops"] = lambda: unfused(*ext)
    times = {name: measure(call, "cuda", warmup_ms=5, rep_ms=25, budget_ms=TUNE_BUDGET_MS).median_ms
             for name, call in calls.items()}
    again = final_rounds(times, calls.__getitem__)
    times.update(again)
    name = fastest(times, again)
    log.info("autotuning: unfused forms %s; kept %s",
             ", ".join(f"{n} {t:.4f} ms" for n, t in times.items()), name)
    return (unfused if name == "ops" else built[name]), name


def in_threads(fn, count: int, workers: int) -> dict:
    """``fn(i)`` for i in range(count), at most ``workers`` at a time; returns {i: the
    exception} of those that raised (the caller meets it again when it runs ``fn(i)``)."""
    def quietly(i):
        try:
            fn(i)
        except Exception as e:
            return i, e
        return i, None
    with ThreadPoolExecutor(max(workers, 1), thread_name_prefix="comfuse-compile") as pool:
        return {i: e for i, e in pool.map(quietly, range(count)) if e is not None}


def compile_ahead(run_fused, count: int, device: torch.device) -> None:
    """On a GPU, the candidates' first calls, which generate and compile their kernels (1-3 s
    each on the H200's host; Triton releases the GIL in its compiler passes and ptxas runs in
    a process of its own), in parallel threads: the timed pass that follows only launches.
    Each thread launches on the device's current stream, so the GPU still runs one candidate
    at a time (a strip kernel's programs wait for one another and must all be resident).
    Where ``COMPILE_IN_WORKERS``, the compilations those calls start run in worker processes
    (``workers.py``), which hold no lock of this process's Python."""
    threads = min(count, os.cpu_count() or 1, 16)
    if device.type != "cuda" or threads < 2 or not torch.cuda.is_available():
        return
    stream = torch.cuda.current_stream(device)

    def first_call(i):
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
            run_fused(i)
    start = time.perf_counter()
    pool = start_workers(device)
    with workers.compiling_in(pool) if pool is not None else contextlib.nullcontext():
        failed = in_threads(first_call, count, threads)
    torch.cuda.synchronize(device)
    log.info("autotuning: %d candidates compiled in %.1f s by %d threads%s%s", count - len(failed),
             time.perf_counter() - start, threads, " and compile workers" if pool is not None else "",
             f"; {len(failed)} failed (first: {_why(next(iter(failed.values())))})" if failed else "")


def start_workers(device: torch.device):
    """The process's compile workers for ``device``'s GPU (started now if they are not yet:
    their start-up, a Python with torch and Triton, overlaps what comes before the first
    compilation), or None where they are not used."""
    # as many as Inductor's own compile workers (TORCHINDUCTOR_COMPILE_THREADS: 1 turns both off)
    count = min(workers.MAX_WORKERS, getattr(torch._inductor.config, "compile_threads", None) or os.cpu_count() or 1)
    if not COMPILE_IN_WORKERS or count < 2 or device.type != "cuda" or not torch.cuda.is_available():
        return None
    from triton.runtime.driver import driver
    with torch.cuda.device(device):
        target = driver.active.get_current_target()
    return workers.start(target, count)


def decide(names: list, run_fused, run_unfused, device: torch.device, tol: float | None = None,
           exact=None) -> dict:
    """Time ``run_unfused()`` and ``run_fused(i)`` for each candidate; return the decision:
    {"choice": name or "unfused", "times_ms": {name: median or inf},
    "rejected": {name: why}} (a candidate that disagrees with the unfused result beyond
    ``tol``, by default the outputs' dtype tolerance, and with the float64 ``exact()`` when
    given (see ``_disagreement``), or fails)."""
    timing = settings_mod.get().tune_timing
    if device.type != "cuda":
        timing = "launch"

    def timed(fn) -> float:
        run = graphed(fn, warmup_calls=1) if timing == "graph" else fn
        return measure(run, device.type, warmup_ms=5, rep_ms=25, budget_ms=TUNE_BUDGET_MS).median_ms
    start = time.perf_counter()
    log.info("autotuning: %d candidate plan(s) and the unfused ops, timed by %s", len(names),
             "CUDA-graph replays" if timing == "graph" else "launches")
    reference = run_unfused()
    # every candidate compiled before anything is timed: seconds of compiling leave the GPU
    # idle and its clock low, which would favour whatever was timed before them
    compile_ahead(run_fused, len(names), device)
    if device.type == "cuda":
        heat(run_unfused, HEAT_MS)
    note = ""
    try:
        times = {UNFUSED: timed(run_unfused)}
    except Exception as e:  # e.g. the unfused ops cannot be captured: time every launch instead
        note = f"graph capture of the unfused ops failed ({type(e).__name__}); timed launches"
        timing = "launch"
        times = {UNFUSED: timed(run_unfused)}
    rejected = {}
    exact_once = functools.cache(exact) if exact is not None else None  # (computed once, if ever)
    for i, name in enumerate(names):
        began = time.perf_counter()
        try:
            outs = run_fused(i)
            bad = _disagreement(outs, reference, tol, exact_once)
            if bad:
                times[name], rejected[name] = math.inf, bad
                continue
            called = time.perf_counter()
            times[name] = timed(lambda: run_fused(i))
            log.debug("  %s: first call and check %.2f s, timing %.2f s", name, called - began,
                      time.perf_counter() - called)
        except Exception as e:
            times[name] = math.inf
            rejected[name] = _why(e)
    first_pass, again = {}, {}
    if device.type == "cuda":
        def call(name):
            fn = run_unfused if name == UNFUSED else functools.partial(run_fused, names.index(name))
            return graphed(fn, warmup_calls=1) if timing == "graph" else fn
        again = final_rounds(times, call)
        first_pass = {n: times[n] for n in again}
        times.update(again)
    for name in names:
        log.debug("  %s: %s", name, f"{times[name]:.4f} ms" if name not in rejected else rejected[name])
    choice = fastest(times, again)
    pool = again or times  # (times taken alike: the rounds', where the unfused ops were among them)
    if choice != UNFUSED and UNFUSED in pool and not pool[choice] <= pool[UNFUSED] * KEEP_MARGIN:
        log.info("autotuning: %s (%.4f ms) is within %.0f %% of the unfused ops (%.4f ms): not kept", choice,
                 pool[choice], (1 - KEEP_MARGIN) * 100, pool[UNFUSED])
        choice = UNFUSED
    log.info("autotuning: chose %s (%.4f ms; unfused %.4f ms%s) in %.1f s", choice, times[choice],
             times[UNFUSED], _best_candidate(times, rejected) if choice == UNFUSED else "",
             time.perf_counter() - start)
    decision = {"choice": choice, "times_ms": times, "rejected": rejected, "timing": timing}
    if first_pass:  # the finalists' first times; times_ms holds their rounds' medians
        decision["first_pass_ms"] = first_pass
    if note:
        decision["timing_note"] = note
    return decision
