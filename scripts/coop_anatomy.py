"""Where does a cooperative-strip kernel's time go? (issue 3: every fused epilogue plan lost to
cuBLAS + Inductor on the H200, 1.4x to 2.2x slower, 2026-11-30.)

For each paper workload at 8192x1024x1024 (bf16) and each of its cooperative candidate plans
this times, in one run:

- ``as is``: the kernel comfuse generates (checked against float64 first);
- ``inline``: the strip (split: tile) function inlined into the persistent loop;
- ``overlapped``: the plan with ``overlap`` (each strip's first exchange waited for behind
  the next strip's mainloop; COMFUSE_OVERLAP), checked against float64 first;
- ``mainloop only``: the strip function cut after its mainloop (timing only);
- ``no wait``: the same kernel with the arrival counter and the spin-wait removed (each tile
  combines whatever partials are in the workspace: wrong results, timing only), which
  prices the wait itself;
- ``relu``: the same tile, warps, stages and mainloop on ``relu(x @ w)`` (independent
  tiles, one store), which prices the GEMM at that tile shape;
- for linear + cross-entropy (8192x4096x32768), the split plans: as is and ``relu``;
- cuBLAS ``x @ w`` alone and the region's ops compiled by Inductor.

Knobs: GRAPH=1 times CUDA-graph replays (the GPU's time, no Python); ONLY=rmsnorm,...
picks workloads; FORMS="as is,no wait" picks forms. Writes $OUT/coop_anatomy.json and prints
a table last.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402
from comfuse import settings  # noqa: E402
from comfuse.bench.timing import graphed, measure  # noqa: E402
from comfuse.bench.workloads import SUITE  # noqa: E402
from comfuse.planner import candidates  # noqa: E402
from comfuse.runtime import cache, compiled  # noqa: E402
from comfuse.runtime import kernel as kernel_mod  # noqa: E402

WORKLOADS = (("rmsnorm", (8192, 1024, 1024)), ("softmax", (8192, 1024, 1024)),
             ("ln_postnorm", (8192, 1024, 1024)), ("linear_ce", (8192, 4096, 32768)))


def region_of(fn, inputs):
    """The FusedRegion comfuse builds for ``fn`` (autotuning off) and its arguments."""
    seen = {}
    original = compiled.FusedRegion.forward

    def spy(self, *ext):
        seen.setdefault("call", (self, ext))
        return original(self, *ext)
    compiled.FusedRegion.forward = spy
    try:
        with settings.override(autotune="0"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            comfuse.compile(fn, inputs)(*inputs)
    finally:
        compiled.FusedRegion.forward = original
    return seen["call"]


def without_wait(kernel: kernel_mod.Kernel) -> kernel_mod.Kernel:
    return variant(kernel, "_nowait", kernel.source.text.replace("strip_barrier(counter_ptr + slot, TILES_N)",
                                                                 "tl.debug_barrier()"))


def variant(kernel: kernel_mod.Kernel, suffix: str, text: str) -> kernel_mod.Kernel:
    name = kernel.source.name + suffix
    text = text.replace(kernel.source.name, name)
    module = cache.load_source(name, text)
    return kernel_mod.Kernel(kernel.plan, dataclasses.replace(kernel.source, name=name, text=text),
                             getattr(module, name), kernel.phases, getattr(module, f"{name}_combine", None))


def mainloop_only(kernel: kernel_mod.Kernel) -> kernel_mod.Kernel:
    """The strip (or split tile) function cut after its mainloop: one per-row sum of the
    accumulator goes to the workspace, so the GEMM is not optimised away."""
    text = kernel.source.text
    marker = ("    # ---- stage 0" if kernel.plan.schedule == "cooperative"
              else "    # ---- the slice's statistics so far")
    start = text.index(marker)
    end = text.index("\n\n\n@triton.jit", start)
    keep = "    tl.store(ws_ptr + offs_m, tl.sum(acc, axis=1), mask=mask_m)  # timing only\n"
    return variant(kernel, "_mainloop", text[:start] + keep + text[end:])


def inline(kernel: kernel_mod.Kernel) -> kernel_mod.Kernel:
    return variant(kernel, "_inline", kernel.source.text.replace("@triton.jit(noinline=True)", "@triton.jit"))


def timed(fn, device: str):
    """``measure(fn)``; with GRAPH=1 of its CUDA-graph replay (the GPU's time, not Python's:
    TMA plans build their descriptors per call)."""
    if device != "cuda" or os.environ.get("GRAPH") != "1":
        return measure(fn, device=device)
    return measure(graphed(fn, warmup_calls=1))


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/comfuse-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    smoke = os.environ.get("SMOKE") == "1"  # CPU check of the script itself (interpreter)
    device = "cpu" if smoke else "cuda"
    rows = []
    relu_cache = {}
    only = {w for w in os.environ.get("ONLY", "").split(",") if w}
    forms_wanted = {f for f in os.environ.get("FORMS", "").split(",") if f}
    for wname, (M, K, N) in WORKLOADS:
        if only and wname not in only:
            continue
        if smoke:
            M, K, N = 96, 64, 96
        w = SUITE[wname]
        inputs = w.inputs(M, K, N, dtype=torch.float32 if smoke else torch.bfloat16, device=device)
        x, wt = inputs[0], inputs[1]
        region, ext = region_of(w.fn, inputs)
        a, b = ext[region.operands[0]], ext[region.operands[1]]
        gemm = timed(lambda: x @ wt, device)
        inductor = timed(lambda: w.fn(*inputs), device) if smoke else timed(
            lambda f=torch.compile(w.fn, dynamic=False): f(*inputs), device)
        rows.append({"workload": wname, "variant": "cuBLAS x @ w", **gemm.as_dict()})
        rows.append({"workload": wname, "variant": "torch.compile (whole function)", **inductor.as_dict()})
        print(f"{wname}: cuBLAS {gemm.median_ms:.4f} ms, torch.compile {inductor.median_ms:.4f} ms", flush=True)
        relu_region, relu_ext = region_of(lambda p, q: torch.relu(p @ q), (x, wt))
        for plan in candidates(region.region, target="interpreter" if smoke else "cuda"):
            if plan.schedule not in ("cooperative", "split") or (wname == "linear_ce" and plan.schedule != "split"):
                continue
            kernel = kernel_mod.build(plan)
            label = plan.describe().split("; ", 2)[-1]
            try:
                region.run_kernel(ext, a, b, kernel, check=True)
            except Exception as e:
                rows.append({"workload": wname, "variant": f"as is: {label}", "status": f"{type(e).__name__}: {e}"[:300]})
                continue
            forms = [("as is", kernel), ("inline", inline(kernel)), ("mainloop only", mainloop_only(kernel))]
            if plan.schedule == "cooperative" and not plan.prefetch:
                forms.append(("overlapped", kernel_mod.build(dataclasses.replace(plan, overlap=True))))
            if plan.schedule == "cooperative":
                forms.append(("no wait", without_wait(kernel)))
            for what, k in forms:
                if forms_wanted and what not in forms_wanted:
                    continue
                if what in ("inline", "overlapped") and not smoke:  # (the interpreter runs phase kernels)
                    region.run_kernel(ext, a, b, k, check=True)
                t = timed(lambda: region.run_kernel(ext, a, b, k), device)
                rows.append({"workload": wname, "variant": f"{what}: {label}", **t.as_dict(),
                             "x_gemm": t.median_ms / gemm.median_ms})
                print(f"  {what:8s} {label:60s} {t.median_ms:.4f} ms", flush=True)
            shape = (plan.mainloop, plan.block_m, plan.block_n, plan.block_k, plan.num_warps, plan.num_stages)
            if shape not in relu_cache:
                rplan = dataclasses.replace(relu_region.plan, mainloop=plan.mainloop, block_m=plan.block_m,
                                            block_n=plan.block_n, block_k=plan.block_k,
                                            num_warps=plan.num_warps, num_stages=plan.num_stages)
                rk = kernel_mod.build(rplan)
                ra, rb = relu_ext[relu_region.operands[0]], relu_ext[relu_region.operands[1]]
                relu_region.run_kernel(relu_ext, ra, rb, rk, check=True)
                relu_cache[shape] = timed(lambda: relu_region.run_kernel(relu_ext, ra, rb, rk), device)
            t = relu_cache[shape]
            rows.append({"workload": wname, "variant": f"relu tile: {label}", **t.as_dict(),
                         "x_gemm": t.median_ms / gemm.median_ms})
            print(f"  relu     {label:60s} {t.median_ms:.4f} ms", flush=True)
    (out_dir / "coop_anatomy.json").write_text(json.dumps(rows, indent=1))
    print("\n| workload | variant | median ms | x cuBLAS GEMM |")
    print("|---|---|---|---|")
    for r in rows:
        ms = f"{r['median_ms']:.4f}" if "median_ms" in r else r.get("status", "")
        print(f"| {r['workload']} | {r['variant']} | {ms} | {r.get('x_gemm', float('nan')):.2f} |")


if __name__ == "__main__":
    main()
