"""Where the backend's graph check spends its time on the GPU: the test scenario of
tests/test_gpu.py (a Linear -> GELU -> + residual -> LayerNorm block, 4096x1024 bf16, one
region forced fused) with the timing profiled by cProfile. Prints the check's record and the
top functions by cumulative time."""
import cProfile
import pstats
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import comfuse
from comfuse import backend


def main(grad: bool) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 1024).to("cuda", torch.bfloat16)
    norm = torch.nn.LayerNorm(1024).to("cuda", torch.bfloat16)

    def block(x, r):
        return norm(F.gelu(lin(x)) + r)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    r = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    prof = cProfile.Profile()
    timed = backend._time_graphs

    def profiled(calls, device):
        prof.enable()
        try:
            return timed(calls, device)
        finally:
            prof.disable()
    backend._time_graphs = profiled
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        cm = torch.compile(block, backend="comfuse", dynamic=False, options={"autotune": "0", "graph_check": "1"})
        cm(x, r)
        for i in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cm(x, r)
            torch.cuda.synchronize()
            print(f"call {i + 2} after the choice: {(time.perf_counter() - t0) * 1e3:.3f} ms")
    backend._time_graphs = timed
    print("grad", grad, backend.GRAPH_CHECKS[-1])
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main(grad="--grad" in sys.argv)
