"""Where a model's time goes under comfuse's backend and under Inductor.

For each way of compiling a block (a Hugging Face model of the models suite), with grad off
and on (the models bench calls with grad on, so torch.compile builds training forwards), it
prints the time of a Python call (``measure``), the host time of one call (calls queued
without synchronising), the GPU time (CUDA-graph replay, where capture works) and the
kernels one call launches (profiler), each output checked against eager first.

Tuning decisions are read from ``$COMFUSE_CACHE_DIR/tuning`` when present (seed it from an
earlier run's ``tuning/`` folder with ``--seed DIR`` to skip the autotuning).

    python scripts/model_anatomy.py [--models bert_layer] [--seed DIR] [--grad off|on|both]
        [--forms eager,inductor,max-autotune,comfuse,comfuse-max-autotune]   # on the GPU machine
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402,F401  (registers the backend)
from comfuse import settings  # noqa: E402
from comfuse.bench.workloads import model_program  # noqa: E402
from comfuse.runtime.timing import graphed, kernel_times, measure  # noqa: E402


def host_us(fn, calls: int = 300) -> float:
    """Microseconds of host time per call: ``calls`` calls queued without synchronising."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert_layer")
    ap.add_argument("--grad", default="both", choices=["off", "on", "both"])
    ap.add_argument("--forms", default="eager,inductor,comfuse",
                    help="comma-separated: eager, inductor, max-autotune (max-autotune-no-cudagraphs), "
                         "comfuse, comfuse-max-autotune (the backend with Inductor's max-autotune-no-cudagraphs around the regions)")
    ap.add_argument("--seed", default="", help="a folder of tuning decisions (*.json) to start the cache with")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/comfuse-out"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "model_anatomy.txt", "w")

    def say(text: str = "") -> None:
        print(text, flush=True)
        log.write(text + "\n")
    if args.seed:
        dest = settings.get().cache_dir / "tuning"
        dest.mkdir(parents=True, exist_ok=True)
        for f in Path(args.seed).glob("*.json"):
            shutil.copy(f, dest / f.name)
        say(f"tuning decisions seeded from {args.seed} into {dest}")
    table = []
    from comfuse import backend
    grads = {"off": (False,), "on": (True,), "both": (False, True)}[args.grad]
    no_cg = "max-autotune-no-cudagraphs"
    makers = {"eager": lambda fn: fn,
              "inductor": lambda fn: torch.compile(fn, dynamic=False),
              "max-autotune": lambda fn: torch.compile(fn, dynamic=False, mode=no_cg),
              "comfuse": lambda fn: torch.compile(fn, backend="comfuse", dynamic=False),
              "comfuse-max-autotune": lambda fn: torch.compile(fn, backend="comfuse", dynamic=False, mode=no_cg)}
    labels = {"comfuse": "comfuse backend", "comfuse-max-autotune": "comfuse backend, max-autotune around"}
    forms = args.forms.split(",")
    unknown = set(forms) - set(makers)
    if unknown:
        ap.error(f"unknown forms {sorted(unknown)}; choose from {', '.join(makers)}")
    for name, grad in ((n, g) for n in args.models.split(",") for g in grads):
        prog = model_program(name, torch.bfloat16, "cuda")
        with torch.no_grad():
            ref = prog.fn(*prog.args).float()
        with torch.set_grad_enabled(grad):
            for label, make in ((labels.get(f, f), lambda f=f: makers[f](prog.fn)) for f in forms):
                label += ", grad on" if grad else ", no_grad"
                torch._dynamo.reset()
                checks = len(backend.GRAPH_CHECKS)
                fn = make()
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = fn(*prog.args)
                torch.cuda.synchronize()
                built = time.perf_counter() - t0
                err = ((got.detach().float() - ref).norm() / ref.norm()).item()
                call = lambda: fn(*prog.args)  # noqa: E731
                py = measure(call).median_ms
                host = host_us(call)
                try:
                    gpu = measure(graphed(call)).median_ms
                except Exception as e:  # (a capture that fails is reported, not fatal)
                    gpu, why = float("nan"), f"{type(e).__name__}: {e}"
                    say(f"{name} {label}: graph capture failed: {why[:200]}")
                busy, rows = kernel_times(call)
                table.append((name, label, py, host, gpu, busy, len(rows), err, built))
                for check in backend.GRAPH_CHECKS[checks:]:
                    say(f"{name} / {label}: whole-graph check {check}")
                say(f"\n{name} / {label}: call {py:.4f} ms, host {host:.1f} us, graph {gpu:.4f} ms, "
                    f"kernels {busy:.4f} ms, err {err:.2e}, first call {built:.1f} s")
                for ms, count, key in rows[:16]:
                    say(f"  {ms:8.4f} ms  x{count}  {key[:120]}")
    say("\n| model | compiled by | Python call ms | host us per call | graph replay ms | kernel time ms | kernels | rel. err | first call s |")
    say("|---|---|---|---|---|---|---|---|---|")
    for name, label, py, host, gpu, busy, n, err, built in table:
        say(f"| {name} | {label} | {py:.4f} | {host:.1f} | {gpu:.4f} | {busy:.4f} | {n} | {err:.1e} | {built:.1f} |")


if __name__ == "__main__":
    main()
