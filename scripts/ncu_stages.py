"""One launch of the generated Gluon kernel (ws_stages), forced, for Nsight Compute (issue 3).

Compiles one workload in one form (a ``stages_trace.py`` variant), checks it against float64,
warms it up, then runs ``--calls`` calls between ``cudaProfilerStart`` and ``cudaProfilerStop``,
so that ``ncu --profile-from-start off`` sees only the fused kernel:

    ncu --clock-control none --profile-from-start off --launch-count 1 --set full \\
        --export $OUT/ln python scripts/ncu_stages.py --workload ln_postnorm --shape 8192x1024x1024 --variant 8
    ncu --import $OUT/ln.ncu-rep --page details                      # sections
    ncu --import $OUT/ln.ncu-rep --page source --print-source sass --csv > $OUT/ln-sass.csv

The SASS page's per-instruction warp-stall samples say where the epilogue partition waits.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402
from comfuse.bench.workloads import SUITE  # noqa: E402
from comfuse.runtime import kernel as kernel_mod, stages_kernel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stages_trace import variant_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="ln_postnorm")
    ap.add_argument("--shape", default="8192x1024x1024", help="MxKxN")
    ap.add_argument("--variant", default="8", help="a stages_trace.py variant (its FORM), e.g. 8 or 8rkh96")
    ap.add_argument("--calls", type=int, default=1)
    args = ap.parse_args()
    wl = SUITE[args.workload]
    M, K, N = (int(v) for v in args.shape.split("x"))
    xs = wl.inputs(M, K, N, dtype=torch.bfloat16, device="cuda")
    label, overrides, grid_fn = variant_of(args.variant)
    stages_kernel.StagesKernel.grid_options = grid_fn
    kernel_mod._kernels.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        with comfuse.settings.override(schedule="ws_stages", **overrides):
            made = comfuse.compile(wl.fn, xs)
        compiled = comfuse.settings.pinned(made, autotune="0", schedule="ws_stages", strict=True, **overrides)
        out = compiled(*xs)
    (r,) = made.report.regions
    if not (r.fused and r.schedule == "ws_stages"):
        raise SystemExit(f"{args.workload} {args.shape} {args.variant}: not ws_stages ({r.reason})")
    ref = wl.fn(*[t.double() if t.is_floating_point() else t for t in xs])
    err = ((out.double() - ref).norm() / ref.norm()).item()
    print(f"{args.workload} {args.shape} [{label}]: rel err {err:.2e}", flush=True)
    if err > 2e-2:
        raise SystemExit("WRONG: not profiled")
    for _ in range(5):
        compiled(*xs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(args.calls):
        compiled(*xs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
