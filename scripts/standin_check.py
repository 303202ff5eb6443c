"""How Inductor compiles one model's training graph in each context the backend may compile
it in, against Inductor alone (Dynamo's context): the GEMMs each compilation calls, what
``pad_mm`` decided, the step's time and its slowest kernels. The backend's whole-graph check
compiles Inductor's form of a graph a second time to time it against the fused one; that
second compilation must be the one Inductor alone makes.

    python scripts/standin_check.py [--model bert] [--layers 2] [--small]

Writes ``standin_check.json`` and the generated code (``code-<form>-<i>.py``) under --out
($OUT or /tmp/standin_check); prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comfuse.bench import models  # noqa: E402
from comfuse.graph_check import _step, later_compilation  # noqa: E402

# Inductor alone; then the same graph compiled again at the first call: in a context with a
# fake mode and shape environment of its own, in none, and as the backend compiles it
FORMS = ("dynamo", "fresh", "none", "backend")


def _fresh():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    return torch._guards.tracing(torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv())))


def _gemm_calls(codes: list) -> list:
    calls = []
    for code in codes:
        for line in code.splitlines():
            if not line.strip().startswith("#") and re.search(r"extern_kernels\.\w+\(|constant_pad_nd", line):
                calls.append(line.strip()[:160])
    return calls


def _time_step(run, device) -> list:
    times = []
    for _ in range(3):
        run()
    for _ in range(10):
        if device.type != "cuda":
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return times


def _device_us(event) -> float:
    total = getattr(event, "device_time_total", None)
    return total if total is not None else event.cuda_time_total


def _top_kernels(run, n=8) -> list:
    if not torch.cuda.is_available():
        return []
    from torch.profiler import ProfilerActivity, profile
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -_device_us(e))
    return [(e.key[:110], round(_device_us(e) / 1e3, 3)) for e in rows[:n]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bert")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "standin_check"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.fx_passes import pad_mm
    from torch._inductor.graph import GraphLowering

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, batch, seq, inputs = models.build(args.model, args.layers, args.small, device.type)
    model = model.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    kwargs = inputs(batch, seq)
    form = ["dynamo"]
    codes = {f: [] for f in FORMS}
    pads = {f: [] for f in FORMS}

    def save(code):
        codes[form[0]].append(code)
    GraphLowering.save_output_code = staticmethod(save)
    for name in ("_should_pad", "should_pad_bench"):  # (whichever this torch has)
        if hasattr(pad_mm, name):
            real = getattr(pad_mm, name)

            def logged(*a, _real=real, **k):
                verdict = _real(*a, **k)
                mats = [tuple(t.shape) for t in a if isinstance(t, torch.Tensor)]
                pads[form[0]].append((str(mats), bool(verdict)))
                return verdict
            setattr(pad_mm, name, logged)
            break
    graphs = []

    def capture(gm, example_inputs):
        inputs = list(example_inputs)
        graphs.append((gm, inputs, later_compilation(lambda: compile_fx(gm, list(inputs)))))
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(model, backend=capture)
    results = {}
    run = lambda: models.step(compiled, model, kwargs)  # noqa: E731
    # as for a registered backend (comfuse's): Dynamo forgets its inputs' symbolic contexts
    # once its compilation ends, before the backend's check compiles Inductor's form again
    forget = {"invalidate_compile_context_weakrefs": True} \
        if hasattr(torch._dynamo.config, "invalidate_compile_context_weakrefs") else {}
    with torch._dynamo.config.patch(**forget):
        run()
    results["dynamo"] = {"ms": _time_step(run, device), "kernels": _top_kernels(run)}
    gm, example_inputs, later = max(graphs, key=lambda g: len(g[0].graph.nodes))
    contexts = {"fresh": _fresh, "none": lambda: torch._guards.tracing(None)}
    for name in FORMS[1:]:
        form[0] = name
        try:
            if name == "backend":
                fn = later()
            else:
                with contexts[name]():
                    fn = compile_fx(gm, list(example_inputs))
            step = _step(fn, example_inputs)
            step()
            results[name] = {"ms": _time_step(step, device), "kernels": _top_kernels(step)}
        except Exception as e:  # (a context that cannot compile it is a finding too)
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    for name in FORMS:
        for i, code in enumerate(codes[name]):
            (out / f"code-{name}-{i}.py").write_text(code)
        results.setdefault(name, {}).update(gemms=_gemm_calls(codes[name]), pad_mm=pads[name])
    info = {"model": args.model, "layers": args.layers, "small": args.small, "torch": torch.__version__,
            "shape_padding": inductor_config.shape_padding,
            "comprehensive_padding": inductor_config.comprehensive_padding, "forms": results}
    (out / "standin_check.json").write_text(json.dumps(info, indent=1))
    for name in FORMS:
        r = results[name]
        print(f"\n== {name}: " + (r["error"] if "error" in r else
                                   f"step {statistics.median(r['ms']):.3f} ms [{min(r['ms']):.3f}..{max(r['ms']):.3f}]"))
        vocab = model.config.vocab_size
        for line in r.get("gemms", []):  # (the ones on the vocabulary, padded or not, and any padding)
            if "pad" in line or any(vocab <= int(n) < vocab + 128 for n in re.findall(r"\d+", line)):
                print("   ", line)
        print("    pad_mm:", r.get("pad_mm"))
        for k, t in r.get("kernels", []):
            print(f"    {t:8.3f} ms  {k}")


if __name__ == "__main__":
    main()
