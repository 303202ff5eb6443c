"""Where a model's first training step and first inference call spend their time, and how
fast the process launches afterwards.

    python scripts/first_call_phases.py gpt2 comfuse          # or inductor; LAYERS=2 for fewer
    COMFUSE_AUTOTUNE=0 python scripts/first_call_phases.py gpt2 comfuse   # settings as usual

In a fresh process: the model of the models suite (``comfuse.bench.models.build``, bf16 on a
GPU), one eager step (the reference), then its first step and first inference call through
``torch.compile(backend=FORM)``. Each function named in ``PHASES`` is timed wherever it is
called (inclusive wall seconds and calls; a recursive call counts once), so the table shows
how the first calls divide into Dynamo, AOTAutograd, Inductor's lowering, comfuse's pass,
its tuning and its whole-graph check. The host time of one small in-place aten op
(``models.launch_host_us``) is read at the start, after the first calls, and after ten timed
steps, with the process's thread count and Python object count beside it. One JSON line to
stdout and to ``$OUT/phases-MODEL-FORM.json``, a table last.
"""
import functools
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from comfuse.bench import models  # noqa: E402

# (module, qualified name) of each function timed; a name missing in this torch is skipped
PHASES = [
    ("torch._dynamo.convert_frame", "_compile"),
    ("torch._functorch.aot_autograd", "aot_module_simplified"),
    ("torch._inductor.compile_fx", "compile_fx"),
    ("torch._inductor.compile_fx", "_compile_fx_inner"),
    ("torch._inductor.compile_fx", "fx_codegen_and_compile"),
    ("torch._inductor.graph", "GraphLowering.codegen"),
    ("torch._inductor.graph", "GraphLowering.compile_to_module"),
    ("torch._inductor.async_compile", "AsyncCompile.wait"),
    ("torch._inductor.select_algorithm", "AlgorithmSelectorCache.__call__"),
    ("comfuse.backend", "comfuse_backend"),
    ("comfuse.backend", "_dense_masks"),
    ("comfuse.backend", "_compile_with_regions"),
    ("comfuse.backend", "_inductor"),
    ("comfuse.inductor_pass", "RegionPass.__call__"),
    ("comfuse.inductor_pass", "lower"),
    ("comfuse.pipeline", "compile_graph"),
    ("comfuse.inductor_pass", "tune_on_random_inputs"),
    ("comfuse.runtime.tuning", "compile_ahead"),
    ("comfuse.runtime.tuning", "decide"),
    ("comfuse.graph_check", "GraphChoice._choose"),
    ("comfuse.graph_check", "GraphChoice._steps_may_differ"),
    ("comfuse.graph_check", "BackwardChoice._choose"),
    ("comfuse.graph_check", "_time_graphs"),
]
SPENT: dict = {}  # label -> [seconds, calls]
CALLS: list = []  # (label, began s, seconds) of every outermost call, in the order they ended
BEGAN = time.perf_counter()


def _timed(label, fn):
    depth = threading.local()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        outer = not getattr(depth, "n", 0)
        depth.n = getattr(depth, "n", 0) + 1
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            depth.n -= 1
            if outer:
                entry = SPENT.setdefault(label, [0.0, 0])
                entry[0] += time.perf_counter() - began
                entry[1] += 1
                CALLS.append((label, round(began - BEGAN, 2), round(time.perf_counter() - began, 2)))
    return wrapper


def instrument() -> list:
    """Wrap each function of PHASES wherever a loaded module holds it (a module that imported
    it by name holds its own reference): the labels wrapped."""
    import importlib
    done = []
    for module_name, qualname in PHASES:
        try:
            module = importlib.import_module(module_name)
        except Exception:
            continue
        owner, _, attr = qualname.rpartition(".")
        holder = getattr(module, owner, None) if owner else module
        original = getattr(holder, attr, None) if holder is not None else None
        if original is None:
            continue
        label = f"{module_name.split('.')[-1]}.{qualname}"
        wrapped = _timed(label, original)
        setattr(holder, attr, wrapped)
        if not owner:  # (functions imported by name elsewhere)
            for other in list(sys.modules.values()):
                name = getattr(other, "__name__", "") or ""
                if not name.startswith(("torch", "comfuse")):
                    continue
                for key, value in list(vars(other).items()):
                    if value is original:
                        setattr(other, key, wrapped)
        done.append(label)
    return done


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (a CPU: a dry run of the script, small model)


def process_state() -> dict:
    return {"aten_us": models.launch_host_us(DEVICE), "threads": threading.active_count(),
            "gc_objects": len(gc.get_objects())}


def main():
    name, form = sys.argv[1], sys.argv[2]
    layers = int(os.environ.get("LAYERS", models.DEPTH.get(name, 2)))
    import comfuse  # noqa: F401  (registers the backend)
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.select_algorithm  # noqa: F401
    wrapped = instrument()
    torch.manual_seed(0)
    small = DEVICE == "cpu"
    model, batch, seq, inputs = models.build(name, layers, small, DEVICE)
    model = model.to(DEVICE, torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    kwargs = inputs(*((2, 128) if small else (batch, seq)))
    want = models.step(model, model, kwargs).float()
    row = {"model": name, "form": form, "layers": layers, "settings": {k: v for k, v in os.environ.items()
                                                                        if k.startswith("COMFUSE_")},
           "state": {"start": process_state()}}
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    backend, _, mode = form.partition("@")
    run = torch.compile(model, backend=backend, **({"mode": mode} if mode else {}))
    began = time.perf_counter()
    loss = models.step(run, model, kwargs).detach().float()
    sync()
    row["first_step_s"] = round(time.perf_counter() - began, 2)
    row["loss_rel_err"] = float((loss - want).abs() / want.abs())
    step_phases = {k: [round(v[0], 2), v[1]] for k, v in SPENT.items()}
    began = time.perf_counter()
    with torch.no_grad():
        run(**kwargs)
    sync()
    row["first_forward_s"] = round(time.perf_counter() - began, 2)
    row["state"]["after first calls"] = process_state()
    # (a dry run on a CPU times one round: fused kernels run through Triton's interpreter there)
    row["step_ms"] = models.time_ms(lambda: models.step(run, model, kwargs), 3 if DEVICE == "cuda" else 1, DEVICE)
    row["state"]["after timed steps"] = process_state()
    row["phases_first_step"] = step_phases
    row["phases_both"] = {k: [round(v[0], 2), v[1]] for k, v in SPENT.items()}
    row["wrapped"] = wrapped
    row["calls"] = CALLS
    text = json.dumps(row)
    print(text)
    out = Path(os.environ.get("OUT", "/tmp"))
    (out / f"phases-{name}-{form.replace('@', '-')}.json").write_text(text + "\n")
    print(f"\n{name} {form}: first step {row['first_step_s']} s, first forward {row['first_forward_s']} s, "
          f"step {row['step_ms'][0]:.3f} ms, loss rel err {row['loss_rel_err']:.2e}")
    print("state: " + "; ".join(f"{k}: aten {v['aten_us']} us, {v['threads']} threads, {v['gc_objects']} objects"
                                for k, v in row["state"].items()))
    print(f"{'phase':55s} {'step s':>8s} {'calls':>6s} {'both s':>8s}")
    for label, (both, calls) in sorted(row["phases_both"].items(), key=lambda kv: -kv[1][0]):
        first = step_phases.get(label, [0.0, 0])
        print(f"{label:55s} {first[0]:8.2f} {first[1]:6d} {both:8.2f}")
    print("\ncalls (began s, seconds), in the order they ended:")
    for label, began, spent in CALLS:
        print(f"  {began:8.2f} {spent:7.2f}  {label}")


if __name__ == "__main__":
    main()
