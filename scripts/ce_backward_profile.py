"""Where a linear + cross-entropy training step under comfuse spends its time: one step
profiled (torch.profiler, CPU and CUDA), the top GPU kernels and the wall time printed.

    COMFUSE_AUTOTUNE=0 python scripts/ce_backward_profile.py [--vocab 32768]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: F401  (registers the backend)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    M, K, V = args.tokens, args.hidden, args.vocab
    w = (torch.randn(V, K, device="cuda") / K ** 0.5).to(torch.bfloat16).requires_grad_(True)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (M,), device="cuda")
    fn = torch.compile(lambda x, t: F.cross_entropy(F.linear(x, w).float(), t), backend="comfuse", dynamic=False)
    for _ in range(2):
        fn(x, t).backward()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(x, t).backward()
    torch.cuda.synchronize()
    print(f"step wall {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(x, t).backward()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    out = Path(os.environ.get("OUT", "/tmp/comfuse-out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "ce_backward_profile.txt").write_text(table)
    print(table[-6000:])


if __name__ == "__main__":
    main()
