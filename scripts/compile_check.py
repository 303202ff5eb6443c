"""How long a region's candidate kernels take to compile, one by one, in threads, and in
threads with compile workers (``comfuse/runtime/workers.py``), each form in a fresh process
with an empty Triton cache: as the first region of a process meets it (for the workers,
their start-up included) and as a later region does (another shape's candidates compiled
first, in the same form).

    python scripts/compile_check.py [--shape 8192x768x768] [--threads 8] [--out DIR]

The region is a LayerNorm of ``x @ W + b + r`` (BERT's attention output at the shape given);
its candidates are those autotuning times inside the backend's pass (the plans Inductor's
wrapper launches). On a GPU the compilations target it; without one, sm_90 (the H200's),
through a stand-in driver. The kernels are compiled by Triton's JIT as a first launch would
(``warmup`` with contiguous tensors' sizes), not launched. Prints a table; ``--out`` also
writes it as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMS = ("serial", "threads", "workers")


def candidates(shape: tuple):
    import warnings

    import torch
    import torch.nn.functional as F

    from comfuse import settings
    from comfuse.frontend.capture import capture
    from comfuse.frontend.regions import find_regions
    from comfuse.kernel_node import launchable
    from comfuse.planner import candidates as plans_of
    M, N, K = shape

    def layer(x, w, b, r, g, beta):
        return F.layer_norm(x @ w + b + r, (N,), g, beta)
    bf = torch.bfloat16
    args = (torch.randn(M, K, dtype=bf), torch.randn(K, N, dtype=bf), torch.randn(N, dtype=bf),
            torch.randn(M, N, dtype=bf), torch.randn(N, dtype=bf), torch.randn(N, dtype=bf))
    with settings.override(autotune="0"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (found,) = find_regions(capture(layer, args))
    return launchable(plans_of(found.region, target="cuda"), found.region)


def one_form(form: str, shape: tuple, threads: int, before: tuple | None = None) -> dict:
    """Compile the candidates in ``form`` in this process; seconds and counts. ``before``: a
    shape whose candidates are compiled first, untimed, in the same form (a later region's
    case: the compiler's modules loaded, the workers started and warm)."""
    import torch
    from triton.runtime.driver import driver

    from comfuse.runtime import aot, tuning, workers
    from comfuse.runtime.compile_worker import TargetDriver
    if torch.cuda.is_available():
        target = driver.active.get_current_target()
    else:
        from triton.backends.compiler import GPUTarget
        target = GPUTarget("cuda", 90, 32)
        driver.set_active(TargetDriver(target))
    pool = workers.start(target, threads) if form == "workers" else None

    def compile_all(jobs) -> dict:
        def compile_one(i):
            fn, args, options = jobs[i]
            fn.warmup(*args, grid=(1,), **options)
        if pool is None and form == "serial":
            for i in range(len(jobs)):
                compile_one(i)
            return {}
        with workers.compiling_in(pool) if pool is not None else contextlib.nullcontext():
            return tuning.in_threads(compile_one, len(jobs), threads)
    if before:
        compile_all([aot.warmup_arguments(p) for p in candidates(before)])
    began = time.perf_counter()
    jobs = [aot.warmup_arguments(p) for p in candidates(shape)]
    generated = time.perf_counter() - began
    began = time.perf_counter()
    failed = compile_all(jobs)
    seconds = time.perf_counter() - began
    return {"form": form, "plans": len(jobs), "threads": 1 if form == "serial" else threads,
            "generate_s": round(generated, 2), "compile_s": round(seconds, 2),
            "failed": [f"{type(e).__name__}: {str(e)[:120]}" for e in failed.values()],
            "target": f"{target.backend} sm_{target.arch}", "cpus": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x768x768", help="M x N x K")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--before", default="8192x1024x1024",
                        help="for the 'later region' rows: a shape whose candidates are compiled first, untimed")
    parser.add_argument("--out", default="")
    parser.add_argument("--form", default="", help=argparse.SUPPRESS)  # (one form, in this process)
    parser.add_argument("--later", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    shape = tuple(int(v) for v in opts.shape.split("x"))
    if opts.form:
        before = tuple(int(v) for v in opts.before.split("x")) if opts.later else None
        print(json.dumps(dict(one_form(opts.form, shape, opts.threads, before), later=opts.later)))
        return
    rows = []
    for form in opts.forms.split(","):
        for later in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(Path(tmp) / "triton"),
                           COMFUSE_CACHE_DIR=str(Path(tmp) / "comfuse"))
                env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
                proc = subprocess.run([sys.executable, __file__, "--form", form, "--shape", opts.shape, "--threads",
                                       str(opts.threads), "--before", opts.before] + (["--later"] if later else []),
                                      capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    raise SystemExit(f"{form}: {proc.stderr[-2000:]}")
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        (Path(opts.out) / "compile_check.json").write_text(json.dumps(rows, indent=1))
    print(f"\nLayerNorm region {opts.shape}, {rows[0]['plans']} launchable candidates, {rows[0]['target']}, "
          f"{rows[0]['cpus']} CPUs; a later region: another shape's candidates compiled first ({opts.before})")
    print("| form | threads | first region: compile s | a later region: compile s |")
    print("|---|---|---|---|")
    for first, later in zip(rows[::2], rows[1::2]):
        print(f"| {first['form']} | {first['threads']} | {first['compile_s']:.2f} | {later['compile_s']:.2f} |")


if __name__ == "__main__":
    main()
