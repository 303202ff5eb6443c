"""``comfuse bench``: run the candidates of every case, check them, time them.

For each case the harness computes the float64 reference once, then for each
candidate: builds it (recording compile time), runs it once and checks the result
against the reference (a wrong result is reported with its error and not timed),
then times it (median and IQR of at least 20 repetitions, L2 flushed between
them). Results are written to ``results.json`` after every case, so a long run can
be resumed (``--resume``) after an interruption.
"""
from __future__ import annotations

import json
import statistics
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import torch

import comfuse

from .. import settings
from ..planner import SCHEDULES
from ..planner.gluon import GLUON_SCHEDULES
from ..runtime import tuning
from ..runtime.check import compare, tolerance
from ..runtime.timing import graphed, measure, measure_rounds
from . import workloads
from .env import ceilings, environment

BASELINES = ("eager", "inductor", "inductor-max-autotune")
# torch.compile's CUDA-graph mode, for Inductor alone and with comfuse's regions: asked for by
# name (--candidates), not run by default; under --graph they are n/a (every candidate is a
# graph replay there already)
GRAPH_MODE_CANDIDATES = ("inductor-reduce-overhead", "comfuse-backend-reduce-overhead")
DEFAULT_CANDIDATES = ("comfuse", "comfuse-graph", "comfuse-backend") + tuple(f"comfuse[{s}]" for s in SCHEDULES) + \
    BASELINES + ("gemm", "epilogue", "sdpa", "tensorrt")
# the warp-specialised Gluon schedules forced (sm_90 GPUs), run when named
GLUON_CANDIDATES = tuple(f"comfuse[{s}]" for s in GLUON_SCHEDULES)
ALL_CANDIDATES = DEFAULT_CANDIDATES + GRAPH_MODE_CANDIDATES + GLUON_CANDIDATES
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _as_tuple(x):
    return x if isinstance(x, (tuple, list)) else (x,)


def _double(args):
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def _check(outs, refs) -> tuple[bool, float, str]:
    worst, detail = 0.0, ""
    for o, r in zip(_as_tuple(outs), _as_tuple(refs)):
        c = compare(o, r, tolerance(o.dtype), floor=1.0)
        worst = max(worst, c.error)
        if not c.ok:
            return False, c.error, str(c)
    return True, worst, detail


def _tensorrt_reason() -> str:
    for module in ("torch_tensorrt", "tensorrt"):
        try:
            __import__(module)
            return ""
        except Exception:
            continue
    return "neither torch_tensorrt nor tensorrt imports in this environment"


def _compile_torch(fn, mode):
    return torch.compile(fn, mode=mode, dynamic=False)


def _graphed(fn, args):
    """comfuse's call captured in a CUDA graph after its first (autotuning) calls: replaying
    it shows what the kernels cost without Python's launch overhead. A diagnostic column,
    never a speedup claim (the baselines are not graphed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = comfuse.compile(fn, args)
        return graphed(lambda: compiled(*args))


def _candidate(name: str, prog: workloads.Program) -> tuple[Callable | None, dict]:
    """(callable, info) for a candidate; callable None with info['status'] when it can't run."""
    fn, args = prog.fn, prog.args
    info: dict = {}
    if name == "eager":
        return (lambda: fn(*args)), info
    if name in ("inductor", "inductor-max-autotune"):
        compiled = _compile_torch(fn, None if name == "inductor" else "max-autotune-no-cudagraphs")
        return (lambda: compiled(*args)), info
    if name == "comfuse-backend":  # torch.compile(backend="comfuse"): comfuse + Inductor
        compiled = torch.compile(fn, backend="comfuse", dynamic=False)
        return (lambda: compiled(*args)), info
    if name in GRAPH_MODE_CANDIDATES:  # torch.compile(..., mode="reduce-overhead"): Inductor's CUDA graphs
        backend = "comfuse" if name.startswith("comfuse") else "inductor"
        compiled = torch.compile(fn, backend=backend, mode="reduce-overhead", dynamic=False)

        def replay():
            torch.compiler.cudagraph_mark_step_begin()  # (the last call's outputs may be overwritten)
            return compiled(*args)
        return replay, info
    if name == "comfuse-graph":  # diagnostic: GPU time of comfuse's launches, Python excluded
        if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            info.update(status="n/a", reason="CUDA graphs need a GPU")
            return None, info
        return _graphed(fn, args), info
    if name.startswith("comfuse"):
        schedule = name[len("comfuse["):-1] if "[" in name else ""
        with settings.override(schedule=schedule), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = comfuse.compile(fn, args)
        regions = compiled.report.regions
        if schedule and not any(r.fused for r in regions):
            info["status"] = "infeasible"
            info["reason"] = "; ".join(r.reason for r in regions if r.reason)[:300]
            return None, info
        info["report"] = compiled.report  # summarised after the first call (autotuning runs then)
        return (lambda: compiled(*args)), info
    if name == "gemm":
        return prog.gemm, info
    if name == "epilogue":
        if prog.epilogue is None:
            info.update(status="n/a", reason="no separable epilogue")
            return None, info
        ep = _compile_torch(prog.epilogue, None)
        ep_args = prog.epilogue_args
        return (lambda: ep(*ep_args)), info
    if name == "sdpa":
        if prog.sdpa is None:
            info.update(status="n/a", reason="SDPA does not compute this program")
            return None, info
        return prog.sdpa, info
    if name == "tensorrt":
        reason = _tensorrt_reason()
        info.update(status="unavailable" if reason else "not run",
                    reason=reason or "TensorRT imports, but comfuse has no TensorRT path yet")
        return None, info
    raise ValueError(f"unknown candidate {name!r}")


_UNCHECKED = ("gemm", "epilogue")  # they compute something else than the program: floors


def run_case(prog: workloads.Program, candidates, device: str, progress, repeat: int = 1,
             graph: bool = False) -> dict:
    """Build, check and time every candidate. With ``repeat`` > 1 the candidates that pass
    are timed in ``repeat`` interleaved rounds (A B C, then B C A, ...), so that a drifting
    machine affects all of them alike; the reported median is the median of the rounds'
    medians, with the rounds' range beside it. With ``graph`` (CUDA only) each checked
    candidate is timed as CUDA-graph replays of one call (a candidate that cannot be
    captured is timed as calls, and says so)."""
    row = {"suite": prog.suite, "workload": prog.workload, "shape": list(prog.shape),
           "dtype": str(prog.dtype).replace("torch.", ""), "flops": prog.flops,
           "min_bytes": prog.min_bytes, "candidates": {}}
    ref = _as_tuple(prog.reference(*prog.args) if prog.reference else prog.fn(*_double(prog.args)))
    # Dynamo's caches emptied once a case: the graphs of earlier cases (the same workloads'
    # code) neither hold memory nor count against recompile limits, and every candidate of
    # this case keeps its graphs (each compiled its own: torch.compile and comfuse.compile
    # alike run through Dynamo), so the interleaved rounds below never recompile
    torch._dynamo.reset()
    ready = {}  # name -> callable, checked
    for name in candidates:
        t0 = time.perf_counter()
        if graph and device == "cuda" and name in GRAPH_MODE_CANDIDATES:
            row["candidates"][name] = info = {"status": "n/a", "reason": "--graph times every candidate as CUDA-graph "
                                              "replays already"}
            progress(f"    {name:24s} n/a: {info['reason']}")
            continue
        try:
            call, info = _candidate(name, prog)
            if call is None:
                row["candidates"][name] = info
                progress(f"    {name:24s} {info['status']}: {info.get('reason', '')}")
                continue
            out = call()
            if device == "cuda":
                torch.cuda.synchronize()
            info["compile_s"] = round(time.perf_counter() - t0, 2)
            if "report" in info:  # what comfuse finally runs, after autotuning
                regions = info.pop("report").regions
                fused = [r for r in regions if r.fused]
                info["fused"] = f"{len(fused)}/{len(regions)}"
                info["schedules"] = ",".join(sorted({r.schedule for r in fused}))
                info["plans"] = [r.plan for r in fused]
                if len(fused) < len(regions):
                    info["reason"] = "; ".join(r.reason for r in regions if r.reason)[:300]
            if name not in _UNCHECKED:
                ok, err, detail = _check(out, ref)
                info["err"] = err
                if not ok:
                    info.update(status="wrong", reason=detail)
                    row["candidates"][name] = info
                    progress(f"    {name:24s} WRONG: {detail}")
                    continue
            if graph and device == "cuda":
                try:
                    call = graphed(call, warmup_calls=1)
                    info["timed_as"] = "graph"
                except Exception as e:  # (a host sync inside, say): time the calls instead
                    info["timed_as"] = f"calls (graph capture failed: {type(e).__name__})"
            timing = measure(call, device)
            info.update(status="ok", **timing.as_dict())
            ready[name] = call
            progress(f"    {name:24s} {timing.median_ms:9.4f} ms  (IQR {timing.iqr_ms:.4f}, "
                     f"{timing.reps} reps, built in {info['compile_s']:.1f} s)")
        except Exception as e:  # a failing candidate must not stop the run
            info = {"status": "failed", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                    "traceback": traceback.format_exc()[-2000:]}
            progress(f"    {name:24s} FAILED: {info['reason']}")
        row["candidates"][name] = info
    if repeat > 1 and ready:
        more = measure_rounds(ready, repeat - 1, device, on_error=lambda name, e: progress(
            f"    {name:24s} a timing round failed: {type(e).__name__}"))
        for name in ready:
            medians = [row["candidates"][name]["median_ms"]]
            medians += list(more[name].round_medians_ms) if name in more else []
            info = row["candidates"][name]
            info.update(median_ms=statistics.median(medians), round_medians_ms=medians,
                        rounds_min_ms=min(medians), rounds_max_ms=max(medians))
            progress(f"    {name:24s} {info['median_ms']:9.4f} ms  median of {len(medians)} rounds "
                     f"({min(medians):.4f} .. {max(medians):.4f})")
    return row


def _tune_timing(graph: bool, device: str) -> str:
    """How comfuse's autotuning times its candidates in a run: as the run times them (graph
    replays with ``graph`` on a GPU), unless COMFUSE_TUNE_TIMING names a way."""
    if graph and device == "cuda" and not settings.chosen("tune_timing"):
        return "graph"
    return settings.get().tune_timing


def run(suite: str = "all", quick: bool = False, out_dir: str | Path = "bench/results/latest",
        device: str = "auto", dtype: str = "bf16", candidates=None, resume: bool = False,
        progress=print, repeat: int = 1, only=None, graph: bool = False, shapes=None,
        sweep: bool = True) -> dict:
    """Build, check and time the suite's cases into ``out_dir``/results.json (``shapes``: for
    the paper suite, these (M, K, N) for each workload instead of its own; ``sweep=False``: each
    workload's own shapes without the paper suite's extra sweep). With ``graph``
    comfuse's autotuning also times its candidates as CUDA-graph replays (COMFUSE_TUNE_TIMING=
    graph), unless COMFUSE_TUNE_TIMING says otherwise: a choice made on launches, Python's host
    time included, is not the fastest kernel for a graph's replay (H200, 2026-12-01: at
    8192x1024x1024 a ws_stages launch took 50-260 us of host time for 33-50 us on the GPU, so
    launch timing kept the unfused ops where the graph-timed RMSNorm kernel ran 1.09x faster)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and suite not in ("paper", "blocks"):
        raise SystemExit("comfuse bench --device cpu runs only --suite paper or blocks (small shapes "
                         "through Triton's interpreter, a smoke test of the harness, not a measurement)")
    candidates = tuple(candidates or DEFAULT_CANDIDATES)
    unknown = set(candidates) - set(ALL_CANDIDATES)
    if unknown:
        raise SystemExit(f"unknown candidates {sorted(unknown)}; choose from {', '.join(ALL_CANDIDATES)}")
    todo = workloads.cases(suite, quick, sweep)
    if only:  # a subset of the suite's workloads
        unknown = set(only) - {name for _, name, _ in todo}
        if unknown:
            raise SystemExit(f"no workload {sorted(unknown)} in suite {suite!r}; it has "
                             f"{', '.join(sorted({name for _, name, _ in todo}))}")
        todo = [c for c in todo if c[1] in only]
    if shapes:
        if suite != "paper":
            raise SystemExit("--shapes applies to --suite paper (GEMM + epilogue workloads)")
        names = list(dict.fromkeys(name for _, name, _ in todo))
        todo = [("paper", name, tuple(shape)) for name in names for shape in shapes]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if resume and path.exists() else None
    if results is None:
        progress("measuring the machine's ceilings ...")
        results = {"meta": environment(device), "ceilings": ceilings(device), "cases": []}
        results["meta"].update(suite=suite, quick=quick, dtype=dtype, candidates=list(candidates),
                               repeat=repeat, graph=graph, workloads=list(only or []),
                               shapes=[list(x) for x in shapes or []], sweep=sweep,
                               unfused_forms=list(tuning.INDUCTOR_FORMS))
    tune_timing = _tune_timing(graph, device)
    results["meta"]["tune_timing"] = tune_timing
    done = {(c["workload"], tuple(c["shape"])) for c in results["cases"]}
    start = time.perf_counter()
    for i, case in enumerate(todo, 1):
        prog = workloads.build(case, DTYPES[dtype], device, cpu_scale=device == "cpu" and not shapes)
        if (prog.workload, tuple(prog.shape)) in done:
            progress(f"[{i}/{len(todo)}] {prog.label}: already measured (resume)")
            continue
        progress(f"[{i}/{len(todo)}] {prog.label} ({time.perf_counter() - start:.0f} s so far)")
        with settings.override(tune_timing=tune_timing):
            results["cases"].append(run_case(prog, candidates, device, progress, repeat, graph))
        path.write_text(json.dumps(results, indent=1))
        del prog
        if device == "cuda":
            torch.cuda.empty_cache()
    return results
