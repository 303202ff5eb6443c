"""What ptxas makes of every candidate plan, on a CPU: registers, spills, shared memory,
tensor-core instructions, for the paper workloads at their H200 shapes (no GPU needed).

    TRITON_INTERPRET=0 python scripts/sm90_report.py [--only ln_postnorm,rmsnorm]

A fused kernel that spills its accumulator to local memory, or falls back from wgmma to
mma.sync, cannot reach the GEMM's speed; this table says which candidates do, before any
device time is spent. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402
from comfuse import settings  # noqa: E402
from comfuse.bench import workloads  # noqa: E402
from comfuse.planner import candidates, plan as make_plan  # noqa: E402
from comfuse.codegen.gluon import strip  # noqa: E402
from comfuse.runtime import aot, stages_kernel, strip_kernel  # noqa: E402
from comfuse.runtime.build import kernel_name  # noqa: E402


def compiled(p) -> dict:
    """ptxas's view of one plan's kernel for sm_90: registers, stack, shared bytes, MMAs."""
    gluon = p.schedule in ("ws_stages", "ws_strip")
    if p.schedule == "ws_stages":  # a Gluon kernel generated from the region's stages
        k = stages_kernel.compile_sm90(p, kernel_name(p))
    elif p.schedule == "ws_strip":  # the hand-written Gluon template
        sz = p.region.sizes
        k = strip.compile_sm90(strip_kernel.config(p), M=sz.M, N=sz.N, K=sz.K)
    if gluon:
        ptx = k.asm.get("ptx", "")
        info = {"asm": dict(k.asm), "shared_bytes": k.metadata.shared,
                "wgmma": ptx.count("wgmma.mma_async"), "mma": ptx.count("mma.sync")}
    else:
        info = aot.compile_for_gpu(p)
    return dict(info, **aot.resources(info["asm"]["cubin"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated workloads (default: the paper suite)")
    args = ap.parse_args()
    only = {s for s in args.only.split(",") if s}
    print("| workload | shape | plan | regs | stack (spill) bytes | shared bytes | wgmma | mma.sync |")
    print("|---|---|---|---|---|---|---|---|")
    for suite, name, shape in workloads.cases("paper", True):
        if only and name not in only:
            continue
        prog = workloads.build((suite, name, shape), torch.bfloat16, "cpu")  # planned for "cuda" below
        with settings.override(autotune="0"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = comfuse.explain(prog.fn, prog.args)
        for r in report.regions:
            if r.found is None:
                continue
            first = make_plan(r.found, target="cuda")
            if not hasattr(first, "schedule"):
                print(f"| {name} | {'x'.join(map(str, prog.shape))} | not fused: {first.reason[:80]} | | | | | |")
                continue
            for p in candidates(r.found, target="cuda"):
                try:
                    info = compiled(p)
                    print(f"| {name} | {'x'.join(map(str, prog.shape))} | {p.schedule} {p.mainloop} "
                          f"{p.block_m}x{p.block_n}x{p.block_k} w{p.num_warps} s{p.num_stages}"
                          f"{' prefetch' if getattr(p.form, 'prefetch', False) else ''}"
                          f"{' persistent' if getattr(p.form, 'persistent', False) else ''}"
                          f"{', ' + p.form.describe() if p.schedule == 'ws_stages' else ''} | "
                          f"{info.get('reg', '?')} | {info.get('stack', '?')} | {info['shared_bytes']} | "
                          f"{info['wgmma']} | {info['mma']} |", flush=True)
                except Exception as e:  # report and go on
                    print(f"| {name} | {'x'.join(map(str, prog.shape))} | {p.schedule}: failed "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:80]} | | | | | |", flush=True)


if __name__ == "__main__":
    main()
