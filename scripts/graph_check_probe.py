"""The whole-graph check's baseline against Inductor's own compilation, in one process.

A model's inference call (its loss included, grad off) is compiled by the comfuse backend,
whose whole-graph check is made to keep both of its forms (the graph with fused regions and
Inductor's compilation of the graph without them); then, after ``torch._dynamo.reset()``, by
Inductor alone. The three are checked against each other, timed side by side (rounds of
back-to-back calls, host time included) and profiled kernel by kernel; the kernels whose
time differs most between the check's baseline and Inductor's own code are printed last.

    python scripts/graph_check_probe.py --model llama8b --out OUT_DIR [--planner]

``--planner``: the planner's own plans, untuned, with the check forced on, so that regions
are fused and checked whatever autotuning would have kept (a run where tuning kept every
region's ops has no check to probe).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from comfuse import graph_check  # noqa: E402
from comfuse.bench import models  # noqa: E402
from comfuse.bench.kernels import kernel_times  # noqa: E402


def _capture_checks() -> list:
    """Each whole-graph check, as it decides: its two forms and the arguments it times them on."""
    captured = []
    decide = graph_check.GraphChoice.decide

    def keeping(self, args):
        fused, plain = self.fused, self.plain
        captured.append({"fused": fused, "plain": plain, "args": list(args)})
        chosen = decide(self, args)
        # the check's own timing once more, twice, right after it: does the first one differ?
        calls = {"fused": lambda: fused(*args), "inductor": lambda: plain(*args)}
        device = next(t for t in args if isinstance(t, torch.Tensor)).device
        captured[-1]["again"] = [graph_check.time_rounds(calls, device, 3) for _ in range(2)]
        return chosen
    graph_check.GraphChoice.decide = keeping
    return captured


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    for o in out:
        if isinstance(o, torch.Tensor) and o.numel() > 1:
            return o
    raise ValueError("no tensor output")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama8b", choices=models.MODELS)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="out/graph-check-probe")
    parser.add_argument("--planner", action="store_true", help="the planner's plans, untuned; the check forced on")
    a = parser.parse_args(argv)
    if a.planner:
        from comfuse import settings
        with settings.override(autotune="0", graph_check="1"):
            return _probe(a)
    return _probe(a)


def _probe(a) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import comfuse  # noqa: F401  (registers the backend)
    torch.manual_seed(0)
    layers = a.layers or models.DEPTH.get(a.model, 2)
    model, batch, seq, inputs = models.build(a.model, layers)
    model = model.to("cuda", torch.bfloat16)
    kwargs = inputs(batch, seq)
    captured = _capture_checks()
    with torch.no_grad():
        want = models.loss_of(model(**kwargs)).float()
        comfuse_run = torch.compile(model, backend="comfuse")
        got = models.loss_of(comfuse_run(**kwargs)).float()
    if not captured:
        raise SystemExit("the backend ran no whole-graph check on this model's inference graph")
    check = max(captured, key=lambda c: sum(t.numel() for t in c["args"] if isinstance(t, torch.Tensor)))
    torch._dynamo.reset()
    with torch.no_grad():
        inductor_run = torch.compile(model, backend="inductor")
        got_inductor = models.loss_of(inductor_run(**kwargs)).float()
        fused, plain, args = check["fused"], check["plain"], check["args"]
        outs = {"check fused": _first_tensor(fused(*args)), "check baseline": _first_tensor(plain(*args))}
    errors = {"comfuse loss": float((got - want).abs() / want.abs()),
              "inductor loss": float((got_inductor - want).abs() / want.abs()),
              "check fused vs baseline (first output)": models.rel(outs["check fused"].float(),
                                                                   outs["check baseline"].float())}
    calls = {"check fused": lambda: fused(*args), "check baseline": lambda: plain(*args),
             "inductor": lambda: inductor_run(**kwargs)}
    with torch.no_grad():
        times = models.time_side_by_side(calls, a.rounds)
        kernels = {name: kernel_times(call) for name, call in calls.items()}
    tables = {}
    for name, (gpu_ms, rows) in kernels.items():
        tables[name] = {k: ms for ms, _, k in rows}
        lines = [f"# {a.model}, {name}: {gpu_ms:.3f} ms of GPU time a call", "", "| ms | launches | kernel |",
                 "|---|---|---|"] + [f"| {ms:.4f} | {n} | {k[:140]} |" for ms, n, k in rows]
        (out / f"{a.model}-{name.replace(' ', '-')}.md").write_text("\n".join(lines) + "\n")
    base, own = tables["check baseline"], tables["inductor"]
    diff = sorted(((base.get(k, 0.0) - own.get(k, 0.0), k) for k in set(base) | set(own)), key=lambda d: -abs(d[0]))
    result = {"model": a.model, "layers": layers, "errors": errors, "times_ms": times,
              "check": graph_check.GRAPH_CHECKS[-1] if graph_check.GRAPH_CHECKS else None,
              "check_again_rounds_ms": check["again"],
              "gpu_ms": {n: kernels[n][0] for n in kernels},
              "baseline_minus_inductor": [[round(d, 4), k] for d, k in diff[:25]]}
    (out / f"{a.model}-probe.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(errors))
    print(f"| {a.model} | ms a call (median [range]) | GPU ms a call |")
    print("|---|---|---|")
    for n in calls:
        print(f"| {n} | {times[n]} | {kernels[n][0]:.3f} |")
    print("the check:", result["check"])
    for i, again in enumerate(check["again"]):
        print(f"its timing again ({i + 1}), ms a call in each round:",
              {n: [round(t, 3) for t in ts] for n, ts in again.items()})
    print("kernels, check baseline minus Inductor's own (ms a call):")
    for d, k in diff[:12]:
        print(f"  {d:+.4f}  {k[:110]}")


if __name__ == "__main__":
    main()
