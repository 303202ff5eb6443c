"""The host time of a fused region's call through the ``comfuse::region`` operator, its kernel
launch left out (replaced by a no-op): what comfuse's Python and the dispatcher add per call.
Also, for the parts: ``settings.get()``, and one dispatch of an operator of the region's schema
defined through ``torch.library.Library`` against one defined through ``torch.library.custom_op``.
Runs on a CPU (a row-in-CTA region, LayerNorm after a 64 x 32 x 48 GEMM); medians of 7 rounds
of 20000 calls, in microseconds. And a settled region's replayed call as Inductor's code makes
it (``region_op.call``): five 64 x 64 tensors in, three outputs allocated, two launches (no-ops).

    python scripts/region_call_cost.py
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402
from comfuse import settings  # noqa: E402
from comfuse import region_op  # noqa: E402
from comfuse.runtime.launch import layout_key  # noqa: E402
from comfuse.runtime.replay import Replay  # noqa: E402


def per_call_us(fn, calls: int = 20000, rounds: int = 7) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def replayed_call():
    """A region call that replays: five tensors, three outputs, two launches that do nothing."""
    class Region(torch.nn.Module):
        pinned = ()
    tensors = [torch.randn(64, 64) for _ in range(5)]
    outputs = ((64 * 64, (64, 64), (64, 1), 0, torch.float32, torch.device("cpu")),) * 3
    launch = (lambda *args: None, (None, None, None, 1, 2, 3, 4), ((0, 0, None), (1, 1, None), (2, 5, None)))
    module = Region()
    module.__dict__["_replay"] = Replay((torch.backends.cuda.matmul.allow_tf32, layout_key(tensors)), outputs,
                                        (launch, launch), settings.get(()))
    i = region_op.register(module, [True] * 5)
    return lambda: region_op.call(i, tensors, [])


def main() -> None:
    warnings.simplefilter("ignore")
    lib = torch.library.Library("region_call_cost", "FRAGMENT")
    lib.define("by_library(int region_id, Tensor[] tensors, int[] scalars) -> Tensor[]")
    lib.impl("by_library", lambda i, tensors, scalars: [tensors[0]], "CompositeExplicitAutograd")

    @torch.library.custom_op("region_call_cost::by_custom_op", mutates_args=())
    def by_custom_op(region_id: int, tensors: list[torch.Tensor], scalars: list[int]) -> list[torch.Tensor]:
        return [tensors[0].clone()]

    x, w, g = torch.randn(64, 32), torch.randn(32, 48), torch.randn(48)
    with settings.override(check=False):
        compiled = comfuse.compile(lambda x, w, g: torch.nn.functional.layer_norm(x @ w, (48,), g), (x, w, g))
        (region,) = compiled.fused_regions()
        region.kernel.launch = lambda *args, **kwargs: None
        region_id = region_op.register(region, [True, True, True])
        rows = {
            "settings.get()": per_call_us(settings.get),
            "dispatch, torch.library.Library": per_call_us(
                lambda: torch.ops.region_call_cost.by_library(0, [x, w, g], [])),
            "dispatch, torch.library.custom_op": per_call_us(
                lambda: torch.ops.region_call_cost.by_custom_op(0, [x, w, g], [])),
            "region module's forward (launch left out)": per_call_us(lambda: region.forward(x, w, g)),
            "comfuse::region call (launch left out)": per_call_us(
                lambda: torch.ops.comfuse.region(region_id, [x, w, g], [])),
            "a replayed region call from Inductor's code (launches left out)": per_call_us(replayed_call()),
        }
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}")
    print("| what | us a call |")
    print("|---|---|")
    for what, us in rows.items():
        print(f"| {what} | {us:.1f} |")


if __name__ == "__main__":
    main()
