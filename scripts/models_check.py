"""Whole Hugging Face models through ``torch.compile(backend="comfuse")`` against Inductor, on a GPU.

For each model (built from a config, random weights, bf16, labels given where the model takes
them so the loss is part of the graph): eager's loss and gradients as the reference; then each
form compiled afresh: the first call's seconds (forward and backward), the loss and all
gradients as one vector against eager's, the forward (with loss, grad off) and the training
step in ms (median of rounds of back-to-back calls, host time included; tokens a second
and the step's peak GPU memory beside), and a profile of one
forward and one step: every kernel's GPU time, and the host time of each launch (the
profiler's CPU record of an Inductor kernel launch, of a comfuse kernel Inductor launches,
and of a ``comfuse::region`` operator call). For comfuse, the regions of every graph Inductor
lowered, with each fused region's autotuned time against its unfused ops' (standalone, on
random inputs), summed per graph: what the region should save inside the model. The compiled
forms stay cached side by side, and at the end their forward and step are timed again in
interleaved rounds (the order rotating), so a drift of the GPU's clocks over the run falls on
every form alike (not with a reduce-overhead form, whose CUDA graphs' pools would count in
the others' peaks: each form is then compiled after a reset, as before).

Forms: ``inductor`` (default mode); ``comfuse`` (the backend's defaults: regions autotuned,
the fused graph kept only where it beats Inductor's in the whole-graph check); ``forced``
(regions that won their autotuning kept, no whole-graph check); ``forced-op`` (the same with
every region through the ``comfuse::region`` operator, none launched by Inductor). Each may
name torch.compile's mode after ``@``: ``inductor@max-autotune-no-cudagraphs``,
``inductor@reduce-overhead``, ``comfuse@reduce-overhead``. Models: gpt2, llama, llama8b (a
Llama-3-8B-shaped block: 4096 / 14336, 32 / 8 heads, vocabulary 128256), qwen2, bert, t5, vit.

``--modes`` instead runs every model at a small size through the backend in ``default``,
``reduce-overhead`` and ``max-autotune-no-cudagraphs`` and through ``comfuse.compile``, with two
batch and sequence sizes (the second a recompile), each step's loss and gradients against
eager's; ``--forced`` turns autotuning and the whole-graph check off there, so every region
the planner fuses runs fused.

``--first-calls`` times the first training step and the first inference call of each model in a
new process with empty caches (comfuse's, Inductor's and Triton's, per backend), then again in
another new process with the caches the first left: the cold and the warm first calls users
meet, through Inductor alone and through the backend (default mode). On a CPU (``--small``)
the models run in float32 and a fused region runs through the interpreter.

One JSON line per run goes to ``$OUT/models_check.jsonl`` (kernel tables to
``$OUT/profiles/``), the table to ``$OUT/results.md`` and, last, to stdout.

    python scripts/models_check.py [--models gpt2,llama,bert] [--layers 2] [--rounds 5]
        [--forms inductor,comfuse,forced,forced-op]
    python scripts/models_check.py --modes [default,comfuse.compile] [--forced] [--models gpt2,llama,bert,qwen2,vit,t5]
    python scripts/models_check.py --first-calls [inductor,comfuse] [--small] [--models ...]
    python scripts/models_check.py --report models_check.jsonl   # the tables again
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402,F401  (registers the backend)
from comfuse import inductor_pass, settings  # noqa: E402
from comfuse.bench import models as bench_models  # noqa: E402
from comfuse.bench.kernels import profile, regions_by_graph  # noqa: E402
from comfuse.bench.models import error_line, grads, loss_of, peak_gib, rel, step  # noqa: E402,F401

MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: --first-calls at small sizes only)


def build(name: str, layers: int, small: bool = False):
    """(model, batch, seq, inputs(batch, seq) -> kwargs) at the size users run, or small."""
    return bench_models.build(name, layers, small, DEVICE)


def time_ms(call, rounds: int) -> tuple:
    return bench_models.time_ms(call, rounds, "cuda")


def configure(form: str):
    """(the settings a form runs under, its torch.compile arguments). A form is ``inductor``,
    ``comfuse``, ``forced`` or ``forced-op``, optionally ``@mode`` (torch.compile's mode, e.g.
    ``inductor@max-autotune-no-cudagraphs``, ``comfuse@reduce-overhead``)."""
    base, _, mode = form.partition("@")
    if base not in ("inductor", "comfuse", "forced", "forced-op") or (mode and mode not in MODES + ("max-autotune",)):
        raise ValueError(f"unknown form {form!r}")
    inductor_pass.LAUNCH_FROM_INDUCTOR = base != "forced-op"
    over = settings.override(graph_check="0") if base.startswith("forced") else settings.override()
    return over, {"backend": "inductor" if base == "inductor" else "comfuse", **({"mode": mode} if mode else {})}


def interleaves(forms) -> bool:
    """Whether the forms are timed again side by side at the end: forms that keep CUDA graphs
    hold their memory pools, which would count in every later form's peak."""
    return len(forms) > 1 and not any("reduce-overhead" in f or f.endswith("@max-autotune") for f in forms)


def run(name: str, layers: int, rounds: int, out, forms, out_dir: Path) -> list:
    torch.manual_seed(0)
    model, batch, seq, inputs = build(name, layers)
    model = model.to("cuda", torch.bfloat16)
    kwargs = inputs(batch, seq)
    ref_loss = step(model, model, kwargs).float()
    ref_grads = grads(model)
    rows, calls = [], {}
    side_by_side = interleaves(forms)
    torch._dynamo.reset()
    if side_by_side and hasattr(torch._dynamo.config, "recompile_limit"):  # (each form's graphs stay cached)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(forms))
    for form in forms:
        if not side_by_side:
            torch._dynamo.reset()
        inductor_pass.REPORTS.clear()
        # (the blocks the forms before cached return to the GPU: on an 80 GB GPU the 8B block's
        # process held 76.7 GiB when comfuse tuned its head, whose candidates then failed to
        # allocate, 2026-12-06)
        torch.cuda.empty_cache()
        row = {"model": name, "layers": layers, "batch": batch, "seq": seq, "form": form}
        try:
            over, compile_args = configure(form)
            with over:
                cm = torch.compile(model, **compile_args)
                t0 = time.perf_counter()
                loss = step(cm, model, kwargs).float()
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - t0, 1)
                row["loss_rel_err"] = float((loss.detach() - ref_loss).abs() / ref_loss.abs())
                row["grads_rel_err"] = rel(grads(model), ref_grads)
                with torch.no_grad():
                    cm(**kwargs)  # (the inference graph compiles here)
                    row["forward_ms"] = time_ms(lambda: cm(**kwargs), rounds)
                    row["forward_profile"] = profile(f"{name}-{form}-forward", lambda: cm(**kwargs), out_dir)
                row["step_ms"] = time_ms(lambda: step(cm, model, kwargs), rounds)
                row["step_peak_gib"] = peak_gib(lambda: step(cm, model, kwargs))
                row["step_profile"] = profile(f"{name}-{form}-step", lambda: step(cm, model, kwargs), out_dir)
                if compile_args["backend"] != "inductor":
                    row["regions"] = regions_by_graph()
                    row["graph_checks"] = [{k: v for k, v in c.items() if isinstance(v, (int, float, str, bool))}
                                           for c in comfuse.backend.GRAPH_CHECKS]
                calls[form] = cm
        except Exception as e:  # reported, not hidden
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), file=out, flush=True)
        print(json.dumps({k: row.get(k) for k in ("model", "form", "first_call_s", "forward_ms", "step_ms", "error")}),
              flush=True)
        rows.append(row)
    if side_by_side and len(calls) > 1:
        rows.append(side_by_side_times(name, calls, model, kwargs, rounds))
        print(json.dumps(rows[-1]), file=out, flush=True)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def side_by_side_times(name: str, compiled: dict, model, kwargs, rounds: int) -> dict:
    """The compiled forms' forward and training step timed again in interleaved rounds (the
    order rotating each round), so that a drift of the GPU's clocks over the run (heat,
    power) falls on every form alike rather than on the one timed last."""
    with torch.no_grad():
        forward = bench_models.time_side_by_side({f: (lambda cm=cm: cm(**kwargs)) for f, cm in compiled.items()},
                                                 rounds)
    steps = bench_models.time_side_by_side({f: (lambda cm=cm: step(cm, model, kwargs)) for f, cm in compiled.items()},
                                           rounds)
    return {"model": name, "side_by_side": {f: {"forward_ms": forward[f], "step_ms": steps[f]} for f in compiled}}


def modes(name: str, mode: str, out, forced: bool = False, sizes: int = 2, backend: str = "comfuse") -> dict:
    """The small model through the backend in ``mode`` (or through ``comfuse.compile``, mode
    ``comfuse.compile``) at two sizes (the second a recompile), each training step's loss and
    gradients against eager's. ``forced``: autotuning off and no whole-graph check, so every
    region the planner fuses runs fused with the planner's plan (what the check is of).
    ``sizes``: how many of the two sizes to run (1: the first only). ``backend``: "inductor"
    runs Inductor alone in ``mode`` instead (its first calls beside comfuse's)."""
    torch.manual_seed(0)
    model, batch, seq, inputs = build(name, 1, small=True)
    model = model.to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    inductor_pass.REPORTS.clear()
    row = {"model": name, "mode": mode, "forced": forced, "backend": backend, "sizes": []}
    over = settings.override(autotune="0", graph_check="0") if forced else settings.override()
    shapes = (((2, 128), (3, 96)) if name != "vit" else ((2, 64), (3, 96)))[:sizes]
    try:
        with over:
            if mode == "comfuse.compile":  # (positional inputs: the model's keyword arguments in order)
                keys = sorted(inputs(*shapes[0]))
                entry = lambda *values: model(**dict(zip(keys, values)))  # noqa: E731
                compiled = comfuse.compile(entry, tuple(inputs(*shapes[0])[k] for k in keys))
                cm = lambda **kw: compiled(*(kw[k] for k in keys))  # noqa: E731
            elif backend == "inductor":
                cm = torch.compile(model, mode=mode)
            else:
                cm = torch.compile(model, backend="comfuse", mode=mode)
            for b, s in shapes:
                kwargs = inputs(b, s)
                t0 = time.perf_counter()
                loss = step(cm, model, kwargs).float()
                seconds = round(time.perf_counter() - t0, 1)
                got = grads(model)
                want = step(model, model, kwargs).float()
                row["sizes"].append({"batch": b, "seq": s, "first_call_s": seconds,
                                     "loss_rel_err": float((loss - want).abs() / want.abs()),
                                     "grads_rel_err": rel(got, grads(model))})
            if backend != "inductor":
                row["regions"] = regions_by_graph()
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(row), file=out, flush=True)
    print(json.dumps(row), flush=True)
    return row


def first_call_child(name: str, layers: int, backend: str, small: bool) -> None:
    """In a process of its own: the model's first training step (from ``torch.compile``) and
    first inference call through ``backend`` ("inductor" or "comfuse", default mode), in
    seconds, as one JSON line."""
    torch.manual_seed(0)
    model, batch, seq, inputs = build(name, layers, small=small)
    model = model.to(DEVICE, torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    if small:
        batch, seq = 2, (64 if name == "vit" else 128)
    kwargs = inputs(batch, seq)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    logging.getLogger("comfuse.models_check").info("first call: the model is built, torch.compile starts")
    t0 = time.perf_counter()  # (torch.compile's own imports included: Inductor's differ from the backend's)
    cm = torch.compile(model, backend=backend)
    loss = step(cm, model, kwargs).float()
    sync()
    t1 = time.perf_counter()
    with torch.no_grad():
        cm(**kwargs)
    sync()
    t2 = time.perf_counter()
    want = step(model, model, kwargs).float()
    print(json.dumps({"step_s": round(t1 - t0, 1), "forward_s": round(t2 - t1, 1),
                      "loss_rel_err": float((loss - want).abs() / want.abs())}), flush=True)


def first_calls(name: str, layers: int, backends: list, out, out_dir: Path, small: bool) -> list:
    """For each of ``backends``, the model's first calls (``first_call_child``) in a new process
    with empty caches (cold: comfuse's, Inductor's and Triton's, of that backend's own), then in
    another new process with the caches the first left (warm)."""
    import shutil
    import subprocess
    rows = []
    for backend in backends:
        caches = out_dir / "caches" / f"{name}-{backend}"
        shutil.rmtree(caches, ignore_errors=True)
        env = dict(os.environ, COMFUSE_CACHE_DIR=str(caches / "comfuse"),
                   TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"))
        row = {"model": name, "layers": layers, "backend": backend, "small": small}
        for run in ("cold", "warm"):
            args = [sys.executable, __file__, "--first-call-child", name, "--layers", str(layers),
                    "--backend", backend, "--log", "info"] + (["--small"] if small else [])
            t0 = time.perf_counter()
            done = subprocess.run(args, env=env, capture_output=True, text=True)
            # (its log, comfuse's progress with ms since the process started, says where a first call went)
            (out_dir / f"first-call-{name}-{backend}-{run}.log").write_text(done.stderr)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                row[run] = {"error": error_line(done.stderr)}
            else:
                row[run] = {**json.loads(lines[-1]), "process_s": round(time.perf_counter() - t0, 1)}
        if (caches / "comfuse" / "tuning").is_dir():  # (autotuning's decisions: each candidate's plan and time)
            shutil.copytree(caches / "comfuse" / "tuning", out_dir / "decisions" / f"{name}-{backend}", dirs_exist_ok=True)
        if (caches / "comfuse" / "measured").is_dir():  # (this GPU's record by class of plan)
            shutil.copytree(caches / "comfuse" / "measured", out_dir / "decisions" / f"{name}-{backend}-measured", dirs_exist_ok=True)
        shutil.rmtree(caches, ignore_errors=True)
        print(json.dumps(row), file=out, flush=True)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", nargs="?", const="default,reduce-overhead,comfuse.compile,max-autotune-no-cudagraphs", default="",
                    help="small models in these modes (default: the three, and comfuse.compile; the slowest last) at two sizes")
    ap.add_argument("--forced", action="store_true",
                    help="with --modes: autotuning off and no whole-graph check (every region fused)")
    ap.add_argument("--sizes", type=int, default=2, choices=(1, 2),
                    help="with --modes: run the first size only (1) or both (2)")
    ap.add_argument("--backend", default="comfuse", choices=("comfuse", "inductor"),
                    help="with --modes: Inductor alone instead of the backend (run it in a process of its own, "
                         "with a TORCHINDUCTOR_CACHE_DIR of its own, for first calls that share no cache)")
    ap.add_argument("--first-calls", nargs="?", const="inductor,comfuse", default="",
                    help="first calls cold and warm, each in a new process, through these backends (default both)")
    ap.add_argument("--small", action="store_true", help="with --first-calls: the models' small sizes")
    ap.add_argument("--first-call-child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--report", default="", help="only write the tables of this JSONL file to stdout")
    ap.add_argument("--forms", default="inductor,comfuse,forced,forced-op")
    ap.add_argument("--threads-only", action="store_true",
                    help="compile autotuning's candidates in threads only, without comfuse's compile workers "
                         "(to measure what the workers save)")
    ap.add_argument("--log", nargs="?", const="info", default="", choices=("info", "debug"),
                    help="comfuse's progress on stderr (debug: each candidate's times too), with ms since the start")
    args = ap.parse_args()
    if args.log:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(relativeCreated)9.0f ms %(name)s: %(message)s"))
        logging.getLogger("comfuse").addHandler(handler)
        logging.getLogger("comfuse").setLevel(logging.DEBUG if args.log == "debug" else logging.INFO)
    if args.threads_only:
        from comfuse.runtime import tuning
        tuning.COMPILE_IN_WORKERS = False
    if args.report:
        print(markdown([json.loads(line) for line in open(args.report) if line.strip()]), end="")
        return
    if args.first_call_child:
        first_call_child(args.first_call_child, args.layers, args.backend, args.small)
        return
    out_dir = Path(os.environ.get("OUT", "/tmp/comfuse-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(out_dir / "models_check.jsonl", "a") as out:
        if args.first_calls:
            rows += [r for name in args.models.split(",")
                     for r in first_calls(name, args.layers, args.first_calls.split(","), out, out_dir, args.small)]
        elif args.modes:  # (each mode over every model before the next mode: the slowest last)
            rows += [modes(name, mode, out, args.forced, args.sizes, args.backend) for mode in args.modes.split(",")
                     for name in args.models.split(",")]
        else:
            for name in args.models.split(","):
                rows += run(name, args.layers, args.rounds, out, args.forms.split(","), out_dir)
    table = markdown(rows)
    (out_dir / "results.md").write_text(table)
    print(table)


def markdown(rows: list) -> str:
    """The rows as tables (what ``--report`` writes again from a JSONL file)."""
    fmt = lambda t: f"{t[0]:.3f} [{t[1]:.3f}..{t[2]:.3f}]" if t else "-"  # noqa: E731
    timed = [r for r in rows if "form" in r]
    lines = []
    if timed:
        lines += ["| model | form | first call s | forward ms [range] | step ms [range] | step tokens/s | "
                  "step peak GiB | loss rel err | grads rel err | host us a launch (forward) | "
                  "regions: fused/found, by Inductor, saved alone ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in timed:
            host = r.get("forward_profile", {}).get("host_us", {})
            hosts = "; ".join(f"{k}: {n} x {us}" for k, (n, us) in host.items())
            regions = "; ".join(f"{g['graph']}: {g['fused']}/{g['found']}, {g['by_inductor']}, {g['saved_alone_ms']}"
                                for g in r.get("regions", []))
            tokens = f"{r['batch'] * r['seq'] / r['step_ms'][0] * 1e3:,.0f}" if r.get("step_ms") and "batch" in r \
                else "-"
            lines.append(f"| {r['model']} | {r['form']} | {r.get('first_call_s', '-')} | {fmt(r.get('forward_ms'))} | "
                         f"{fmt(r.get('step_ms'))} | {tokens} | {r.get('step_peak_gib', '-')} | "
                         f"{r.get('loss_rel_err', float('nan')):.2e} | "
                         f"{r.get('grads_rel_err', float('nan')):.2e} | {hosts} | {r.get('error') or regions} |")
    paired = [r for r in rows if "side_by_side" in r]
    if paired:
        lines += ["", "Side by side (the compiled forms timed again at the end, rounds interleaved):", "",
                  "| model | form | forward ms [range] | step ms [range] |", "|---|---|---|---|"]
        for r in paired:
            for form, t in r["side_by_side"].items():
                lines.append(f"| {r['model']} | {form} | {fmt(t['forward_ms'])} | {fmt(t['step_ms'])} |")
    started = [r for r in rows if "cold" in r]
    if started:
        lines += ["", "| model | backend | cold: first step s, first inference call s | warm (a new process): "
                  "first step s, first inference call s |", "|---|---|---|---|"]
        for r in started:
            cells = [c.get("error") or f"{c['step_s']}, {c['forward_s']}" for c in (r["cold"], r["warm"])]
            lines.append(f"| {r['model']} | {r['backend']} | {cells[0]} | {cells[1]} |")
    moded = [r for r in rows if "mode" in r]
    if moded:
        lines += ["", "| model | mode | batch x seq: first call s, loss rel err, grads rel err | regions fused/found |",
                  "|---|---|---|---|"]
        for r in moded:
            sizes = "; ".join(f"{s['batch']}x{s['seq']}: {s.get('first_call_s', '-')} s, {s['loss_rel_err']:.1e}, "
                              f"{s['grads_rel_err']:.1e}" for s in r["sizes"])
            regions = "; ".join(f"{g['graph']}: {g['fused']}/{g['found']}" for g in r.get("regions", []))
            mode = r["mode"] + (", forced" if r.get("forced") else "") + \
                (", Inductor alone" if r.get("backend") == "inductor" else "")
            error = " ".join(r["error"].split()) if r.get("error") else ""
            lines.append(f"| {r['model']} | {mode} | {error or sizes} | {regions} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
