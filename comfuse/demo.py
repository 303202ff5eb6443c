"""``comfuse demo``: compile the built-in suite, show each plan, run it, check it, and end
with a verdict. On a CPU the kernels run through Triton's interpreter at small shapes; on a
GPU they run at a real shape and are timed against eager PyTorch."""
from __future__ import annotations

import sys
import time
import warnings

import torch

from . import compile as comfuse_compile
from .bench.workloads import SUITE
from .runtime.check import compare

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _reference(fn, args):
    return _as_tuple(fn(*[a.double() if a.is_floating_point() else a for a in args]))


def _time_ms(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def run(device: str = "auto", dtype: str = "bf16", only=None, out=None) -> int:
    out = out or sys.stdout
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dt = DTYPES[dtype]
    names = [n for n in SUITE if not only or n in only]
    unknown = set(only or ()) - set(SUITE)
    if unknown:
        print(f"unknown workloads: {sorted(unknown)}; choose from {sorted(SUITE)}", file=out)
        return 2
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=out)
        return 2
    mode = "Triton interpreter, small shapes" if device == "cpu" else f"{torch.cuda.get_device_name()}"
    print(f"comfuse demo on {device} ({mode}), dtype {dtype}\n", file=out)
    rows = []
    for name in names:
        wl = SUITE[name]
        shape = wl.cpu_shape if device == "cpu" else next(
            (s for s in wl.gpu_shapes if s[2] <= 2048), wl.gpu_shapes[0])
        args = wl.inputs(*shape, dtype=dt, device=device)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fused_fn = comfuse_compile(wl.fn, args)
            outs = _as_tuple(fused_fn(*args))
        compile_s = time.perf_counter() - t0
        report = fused_fn.report
        print(f"== {name} {list(shape)} ==", file=out)
        for r in report.regions:
            print("  " + r.summary(), file=out)
            if r.plan:
                print("    plan: " + r.plan, file=out)
        refs = _reference(wl.fn, args)
        eager = _as_tuple(wl.fn(*args))
        checks = [compare(o, r) for o, r in zip(outs, refs)]
        vs_eager = max(compare(o, e).error for o, e in zip(outs, eager))
        row = dict(name=name, shape=shape, fused=sum(r.fused for r in report.regions),
                   regions=len(report.regions), ok=all(c.ok for c in checks),
                   err=max(c.error for c in checks), vs_eager=vs_eager, compile_s=compile_s,
                   stages=max((r.stages for r in report.fused), default=0),
                   schedule=",".join(r.schedule for r in report.fused) or "-")
        for c in checks:
            print(f"  check vs float64 reference: {c}", file=out)
        if device == "cuda":
            row["eager_ms"] = _time_ms(lambda: wl.fn(*args))
            row["comfuse_ms"] = _time_ms(lambda: fused_fn(*args))
        rows.append(row)
        print(file=out)
    _table(rows, device, out)
    bad = [r["name"] for r in rows if not r["ok"]]
    unfused = [r["name"] for r in rows if r["fused"] < r["regions"]]
    if bad:
        print(f"\nverdict: FAIL: wrong results in {', '.join(bad)}", file=out)
        return 1
    fused_note = f"; not fused: {', '.join(unfused)}" if unfused else ""
    print(f"\nverdict: PASS: {len(rows)}/{len(rows)} workloads match the float64 reference "
          f"within tolerance, {len(rows) - len(unfused)} fused{fused_note}", file=out)
    return 0


def _table(rows, device, out) -> None:
    head = ["workload", "M,K,N", "fused", "stages", "schedule", "err vs f64", "err vs eager"]
    if device == "cuda":
        head += ["eager ms", "comfuse ms", "speedup"]
    lines = [head]
    for r in rows:
        line = [r["name"], ",".join(map(str, r["shape"])), f"{r['fused']}/{r['regions']}",
                str(r["stages"]), r["schedule"], f"{r['err']:.1e}", f"{r['vs_eager']:.1e}"]
        if device == "cuda":
            line += [f"{r['eager_ms']:.3f}", f"{r['comfuse_ms']:.3f}",
                     f"{r['eager_ms'] / r['comfuse_ms']:.2f}x"]
        lines.append(line)
    widths = [max(len(l[i]) for l in lines) for i in range(len(head))]
    for k, l in enumerate(lines):
        print("  ".join(c.ljust(w) for c, w in zip(l, widths)), file=out)
        if k == 0:
            print("  ".join("-" * w for w in widths), file=out)
