"""Host time of one fused region's call inside a compiled model, without its kernel.

On the H200 (tenth session) three fused regions added ~290 us of host time to a BERT
layer's call. This measures comfuse's share on any machine: a small post-norm block
(Linear -> + residual -> LayerNorm, one fused region) compiled with ``backend="comfuse"``
(autotuning and the graph check off, the region fused) and with Inductor alone; then every
comfuse kernel launch is replaced by a no-op (its outputs stay allocated, unwritten), so
what remains is Python and dispatch: torch's custom-op path and comfuse's own (argument
views, settings, output checks). Prints microseconds per call for both, the difference,
a bare torch custom op's dispatch for scale, and the top of a cProfile of the comfuse calls.

    python scripts/region_host_cost.py [--calls 3000] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402,F401  (registers the backend)
from comfuse import backend  # noqa: E402


def post_norm(d: int = 32, h: int = 48):
    """Linear -> + residual -> LayerNorm as a function of (x, r) over its own modules."""
    lin, norm = torch.nn.Linear(d, h), torch.nn.LayerNorm(h)
    return lin, norm, lambda x, r: norm(lin(x) + r)


@torch.library.custom_op("comfuse_probe::ident", mutates_args=())
def _ident(rid: int, tensors: list[torch.Tensor], scalars: list[int]) -> list[torch.Tensor]:
    return [tensors[0].clone()]


@_ident.register_fake
def _ident_fake(rid, tensors, scalars):
    return [torch.empty_like(tensors[0])]


_ident.register_autograd(lambda ctx, grads: (None, [grads[0]], None), setup_context=lambda ctx, inputs, output: None)


def per_call_us(fn, calls: int, sync) -> float:
    for _ in range(100):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.manual_seed(0)
    lin, norm, model = post_norm()
    lin.to(dev), norm.to(dev)
    x, r = torch.randn(2, 5, 32, device=dev), torch.randn(2, 5, 48, device=dev)
    warnings.simplefilter("ignore")
    with torch.no_grad():
        torch._dynamo.reset()
        fused = torch.compile(model, backend="comfuse", options={"autotune": "0", "graph_check": "0"})
        fused(x, r)
        stubbed = 0
        for module, _, _ in list(backend._REGISTRY.values()):
            kernel = getattr(module, "kernel", None)
            if kernel is not None:
                kernel.launch = lambda *a, **k: None
                stubbed += 1
        assert stubbed, "no fused region was built"
        plain = torch.compile(model)
        plain(x, r)
        t_plain = per_call_us(lambda: plain(x, r), args.calls, sync)
        t_fused = per_call_us(lambda: fused(x, r), args.calls, sync)
        t_op = per_call_us(lambda: torch.ops.comfuse_probe.ident.default(1, [x], []), args.calls, sync)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fused(x, r)
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(out.getvalue())
    print(f"| device | Inductor alone us/call | with one comfuse region (kernel stubbed) | difference | a bare custom op |")
    print("|---|---|---|---|---|")
    print(f"| {dev} | {t_plain:.1f} | {t_fused:.1f} | {t_fused - t_plain:.1f} | {t_op:.1f} |")


if __name__ == "__main__":
    main()
