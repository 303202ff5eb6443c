"""Does comfuse's work in a process make Inductor's launches in it slower?

One process: an Inductor-compiled pointwise function, a bare Triton kernel, an in-place aten
op and an Inductor-compiled GPT-2 (``LP_LAYERS`` layers, 8 x 1024, bf16) are built first;
their host time a call is measured at each stage: at the start, at the start once more (the
stages' drift, and what a first profiler run leaves behind), after 64 more Triton kernels
are loaded, after importing comfuse, after a copy of the model
trained two steps through the backend (autotuning, compile workers, whole-graph checks),
after ``gc.freeze()``, and after the compile workers stop. Wall time a call of the small
functions (back-to-back calls, the GPU idle: host-bound), the profiler's median host time of
each of GPT-2's Inductor launches in a training step, the step's wall time, and how the
loaded Inductor kernels launch (static or Triton launchers). After the copy's training: the
profiler's launch times of the copy's step, both models' steps timed in turn (wall, no
profiler), cProfile tables of five steps of each ($OUT/pyprofile-*.txt) and a profiler
timeline of two steps of each ($OUT/trace-*.json). One JSON line a
stage to stdout and $OUT/launch_probe.jsonl, then a table.

    python scripts/launch_probe.py            # LP_LAYERS=2 for a shorter run
    LP_DRY=1 LP_LAYERS=1 COMFUSE_AUTOTUNE=0 python scripts/launch_probe.py   # a dry run on a CPU
"""
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
LAYERS = int(os.environ.get("LP_LAYERS", "4"))
DRY = os.environ.get("LP_DRY") == "1"  # (a dry run of the script on a CPU: a small model, nothing timed that counts)
DEVICE = "cpu" if DRY else "cuda"
if DRY:
    torch.cuda.synchronize = lambda *a: None
OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _twice(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


@triton.jit
def _scaled(x_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * SCALE, mask=offs < n)


def per_call_us(fn, calls=3000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / calls * 1e6


def kernel_kinds() -> dict:
    """How the Inductor kernels loaded in this process launch: (compile result type, launcher
    name, its binary's type) -> count, over every generated module's CachingAutotuners."""
    from collections import Counter

    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    modules = PyCodeCache.modules
    modules = modules.values() if isinstance(modules, dict) else modules
    kinds = Counter()
    for module in list(modules):
        for value in list(vars(module).values()):
            if isinstance(value, CachingAutotuner):
                results = getattr(value, "compile_results", None) or [None]
                launcher = value.launchers[0] if value.launchers else None
                kinds[f"{type(results[0]).__name__} / {getattr(launcher, '__qualname__', None)} / "
                      f"{type(getattr(launcher, 'bin', None)).__name__} / {len(value.launchers)}"] += 1
    return dict(kinds)


def main():
    from comfuse.bench import models
    from comfuse.bench.kernels import host_us
    torch.manual_seed(0)
    small = torch.randn(1024, device=DEVICE)
    other = torch.zeros(1024, device=DEVICE)  # (what the 64 more kernels write)
    pointwise = torch.compile(lambda x: (x * 2 + 1).relu())
    model, batch, seq, inputs = models.build("gpt2", LAYERS, small=DRY, device=DEVICE)
    model = model.to(DEVICE, torch.float32 if DRY else torch.bfloat16)
    batch, seq = (2, 32) if DRY else (batch, seq)
    kwargs = inputs(batch, seq)
    inductor_model = torch.compile(model)

    def step(fn):
        def run():
            fn(**kwargs).loss.backward()
        return run
    ind_step = step(inductor_model)
    ind_step()
    model.zero_grad(set_to_none=True)
    rows = []

    gc_time = {"ms": 0.0, "collections": [0, 0, 0], "began": 0.0}

    def on_gc(phase, info):
        if phase == "start":
            gc_time["began"] = time.perf_counter()
        else:
            gc_time["ms"] += (time.perf_counter() - gc_time["began"]) * 1e3
            gc_time["collections"][info["generation"]] += 1
    gc.callbacks.append(on_gc)

    def step_ms(fn):
        wall = []
        for _ in range(3):
            torch.cuda.synchronize()
            began = time.perf_counter()
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            wall.append((time.perf_counter() - began) / 5 * 1e3)
        return statistics.median(wall)

    def stage(name):
        gc_time.update(ms=0.0, collections=[0, 0, 0])
        ind_ms = step_ms(ind_step)
        row = {"stage": name,
               "pointwise_us": round(per_call_us(lambda: pointwise(small)), 2),
               "triton_us": None if DRY else round(per_call_us(lambda: _twice[(1,)](small, 1024, BLOCK=1024)), 2),
               "aten_us": models.launch_host_us(DEVICE),
               "gpt2_step_ms": round(ind_ms, 3),
               "gc_ms_a_step": round(gc_time["ms"] / 15, 3), "gc_collections": list(gc_time["collections"]),
               "gpt2_launch_host_us": host_us(ind_step, 3),
               "threads": len(threading.enumerate()), "gc_objects": len(gc.get_objects()),
               "cuda_segments": None if DRY else torch.cuda.memory_stats().get("segment.all.current")}
        try:
            row["kernel_kinds"] = kernel_kinds()
        except Exception as e:
            row["kernel_kinds"] = f"{type(e).__name__}: {e}"
        print(json.dumps(row), flush=True)
        rows.append(row)

    stage("start")
    stage("start, once more")  # (drift, and what the first profiler run leaves behind)
    if not DRY:  # (do loaded modules slow a launch? 64 more Triton kernels, each launched once)
        for scale in range(3, 67):
            _scaled[(1,)](other, 1024, SCALE=scale, BLOCK=1024)
        torch.cuda.synchronize()
        stage("64 more Triton kernels loaded")
    import comfuse  # noqa: F401
    stage("comfuse imported")
    copy, _, _, _ = models.build("gpt2", LAYERS, small=DRY, device=DEVICE)
    copy = copy.to(DEVICE, torch.float32 if DRY else torch.bfloat16)
    copy.load_state_dict(model.state_dict())
    fused = torch.compile(copy, backend="comfuse")
    fused_step = step(fused)
    for _ in range(2):
        fused_step()
    stage("a copy trained through comfuse")
    rows[-1]["comfuse_step_launch_host_us"] = host_us(fused_step, 3)
    # the two models' steps in turn, in this process: wall ms (host time included, no profiler)
    rows[-1]["steps_in_turn_ms"] = [(round(step_ms(ind_step), 3), round(step_ms(fused_step), 3)) for _ in range(3)]
    print(json.dumps({k: rows[-1][k] for k in ("comfuse_step_launch_host_us", "steps_in_turn_ms")}), flush=True)
    for label, fn in (("inductor", ind_step), ("comfuse", fused_step)):
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        prof.disable()
        with open(os.path.join(OUT, f"pyprofile-{label}.txt"), "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(45)
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(60)
        if not DRY:  # (a timeline of two steps: where the GPU waits on the host)
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as trace:
                for _ in range(2):
                    fn()
                torch.cuda.synchronize()
            trace.export_chrome_trace(os.path.join(OUT, f"trace-{label}.json"))
    gc.collect()
    gc.freeze()
    stage("gc frozen")
    from comfuse.runtime import workers
    for w in workers._pool:
        w.stop()
    time.sleep(2)
    stage("compile workers stopped")
    with open(os.path.join(OUT, "launch_probe.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"\n{'stage':34} {'pointwise us':>12} {'triton us':>10} {'aten us':>8} {'step ms':>8} {'gc ms':>6}  launch host us")
    for r in rows:
        print(f"{r['stage']:34} {r['pointwise_us']:12} {str(r['triton_us']):>10} {r['aten_us']:8} {r['gpt2_step_ms']:8} "
              f"{r['gc_ms_a_step']:6}  {r['gpt2_launch_host_us']}")


if __name__ == "__main__":
    main()
