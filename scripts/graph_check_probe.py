"""The whole-graph check's baseline against Inductor's own compilation, in one process.

A model's inference call (its loss included, grad off) or, with ``--train``, its training
step, is compiled by the comfuse backend, whose whole-graph check is made to keep both of its
forms (the graph with fused regions and Inductor's compilation of the graph without them);
then, after ``torch._dynamo.reset()``, by Inductor alone. The three are checked against each
other, timed side by side (rounds of back-to-back calls or steps, host time included) and
profiled kernel by kernel; the kernels whose time differs most between the check's baseline
and Inductor's own code, and between the fused form and the baseline, are printed last.

    python scripts/graph_check_probe.py --model llama8b --out OUT_DIR [--planner] [--train]

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
        if graph_check.training_call(args):
            calls = {"fused": graph_check._step(fused, args), "inductor": graph_check._step(plain, args)}
        else:
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
    parser.add_argument("--train", action="store_true", help="the training step (forward and backward) is probed")
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
    model = model.to("cuda", torch.bfloat16).train(a.train)
    kwargs = inputs(batch, seq)
    captured = _capture_checks()
    mode = torch.enable_grad() if a.train else torch.no_grad()
    run = (lambda fn: models.step(fn, model, kwargs).float()) if a.train else \
        (lambda fn: models.loss_of(fn(**kwargs)).float())
    with mode:
        want = run(model)
        comfuse_run = torch.compile(model, backend="comfuse")
        got = run(comfuse_run)
    if not captured:
        raise SystemExit(f"the backend ran no whole-graph check on this model's {'training' if a.train else 'inference'} "
                         "graph")
    check = max(captured, key=lambda c: sum(t.numel() for t in c["args"] if isinstance(t, torch.Tensor)))
    torch._dynamo.reset()
    fused, plain, args = check["fused"], check["plain"], check["args"]
    with mode:
        inductor_run = torch.compile(model, backend="inductor")
        got_inductor = run(inductor_run)
        if a.train:  # the two forms' gradients into the graph's inputs, as one vector each
            calls = {"check fused": graph_check._step(fused, args), "check baseline": graph_check._step(plain, args),
                     "inductor": lambda: models.step(inductor_run, model, kwargs)}
            outs = {n: torch.cat([g.float().flatten() for g in calls[n]() if g is not None]) for n in
                    ("check fused", "check baseline")}
        else:
            calls = {"check fused": lambda: fused(*args), "check baseline": lambda: plain(*args),
                     "inductor": lambda: inductor_run(**kwargs)}
            outs = {"check fused": _first_tensor(fused(*args)), "check baseline": _first_tensor(plain(*args))}
    errors = {"comfuse loss": float((got - want).abs() / want.abs()),
              "inductor loss": float((got_inductor - want).abs() / want.abs()),
              f"check fused vs baseline ({'gradients' if a.train else 'first output'})":
                  models.rel(outs["check fused"].float(), outs["check baseline"].float())}
    with mode:
        times = models.time_side_by_side(calls, a.rounds)
        kernels = {name: kernel_times(call) for name, call in calls.items()}
    tables = {}
    what = "step" if a.train else "call"
    for name, (gpu_ms, rows) in kernels.items():
        tables[name] = {k: ms for ms, _, k in rows}
        lines = [f"# {a.model}, {name}: {gpu_ms:.3f} ms of GPU time a {what}", "", "| ms | launches | kernel |",
                 "|---|---|---|"] + [f"| {ms:.4f} | {n} | {k[:140]} |" for ms, n, k in rows]
        (out / f"{a.model}-{what}-{name.replace(' ', '-')}.md").write_text("\n".join(lines) + "\n")
    diffs = {"baseline_minus_inductor": _diff(tables["check baseline"], tables["inductor"]),
             "fused_minus_baseline": _diff(tables["check fused"], tables["check baseline"])}
    result = {"model": a.model, "layers": layers, "train": a.train, "errors": errors, "times_ms": times,
              "check": graph_check.GRAPH_CHECKS[-1] if graph_check.GRAPH_CHECKS else None,
              "check_again_rounds_ms": check["again"],
              "gpu_ms": {n: kernels[n][0] for n in kernels},
              **{k: [[round(d, 4), name] for d, name in v[:25]] for k, v in diffs.items()}}
    (out / f"{a.model}-{what}-probe.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(errors))
    print(f"| {a.model} | ms a {what} (median [range]) | GPU ms a {what} |")
    print("|---|---|---|")
    for n in calls:
        print(f"| {n} | {times[n]} | {kernels[n][0]:.3f} |")
    print("the check:", result["check"])
    for i, again in enumerate(check["again"]):
        print(f"its timing again ({i + 1}), ms a call in each round:",
              {n: [round(t, 3) for t in ts] for n, ts in again.items()})
    for title, rows in diffs.items():
        print(f"kernels, {title.replace('_', ' ')} (ms a {what}):")
        for d, k in rows[:12]:
            print(f"  {d:+.4f}  {k[:110]}")


def _diff(mine: dict, theirs: dict) -> list:
    """[(ms in ``mine`` minus ms in ``theirs``, kernel)], the largest differences first."""
    return sorted(((mine.get(k, 0.0) - theirs.get(k, 0.0), k) for k in set(mine) | set(theirs)),
                  key=lambda d: -abs(d[0]))


if __name__ == "__main__":
    main()
