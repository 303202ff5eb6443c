"""Host time of a fused region's launch from Inductor's wrapper against an Inductor kernel's.

One graph: a GEMM + residual + LayerNorm region (8192 x 1024 x 1024, bf16, launched by
Inductor's wrapper) beside a pointwise op Inductor compiles itself, compiled through the
backend with autotuning and the whole-graph check off. The profiler's CPU time of each
launch over 50 calls; one JSON line: the median and least microseconds per kind, the
regions, and the result's error against float64.

    python scripts/launch_host.py                 # Inductor's default launcher for user kernels
    LH_CFG=1 python scripts/launch_host.py        # static_launch_user_defined_triton_kernels set
"""
import json
import os
import statistics

import torch
import torch.nn.functional as F

import comfuse  # noqa: F401  (registers the backend)
from comfuse import inductor_pass, settings
from comfuse.runtime.timing import profiled

if os.environ.get("LH_CFG") == "1":
    torch._inductor.config.static_launch_user_defined_triton_kernels = True
M, K, N = 8192, 1024, 1024
torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
x, w, r = (torch.randn(M, K, device=dev, dtype=dt), torch.randn(K, N, device=dev, dtype=dt) / 32,
           torch.randn(M, N, device=dev, dtype=dt))
g, b, z = torch.rand(N, device=dev, dtype=dt), torch.rand(N, device=dev, dtype=dt), torch.randn(M, N, device=dev, dtype=dt)


def f(x, w, r, g, b, z):
    return F.layer_norm(x @ w + r, (N,), g, b), (z * 2).relu()


want = [t.double() for t in f(*(t.double() for t in (x, w, r, g, b, z)))]
with settings.override(autotune="0", graph_check="0"):
    cf = torch.compile(f, backend="comfuse")
    got = cf(x, w, r, g, b, z)
err = max(float((a.double() - e).abs().max() / e.abs().max()) for a, e in zip(got, want))
kinds = {}
prof = profiled(lambda: cf(x, w, r, g, b, z), "CPU", 50)
for e in prof.events():
    n = e.name
    k = "region op" if n == "comfuse::region" else "comfuse kernel" if n.startswith("comfuse_") else \
        "inductor kernel" if n.startswith("triton_") else ""
    if k:
        kinds.setdefault(k, []).append(e.cpu_time_total)
rep = [(x.fused, x.launch, x.schedule) for rr in inductor_pass.REPORTS for x in rr.regions]
print(json.dumps({"cfg": os.environ.get("LH_CFG"), "threads": torch._inductor.config.compile_threads,
                  "static_env": os.environ.get("TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"),
                  "max_rel_err": err, "regions": rep,
                  "host_us": {k: [len(v), round(statistics.median(v), 1), round(min(v), 1)] for k, v in kinds.items()}}))
