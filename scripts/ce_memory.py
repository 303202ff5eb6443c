"""Linear + cross-entropy training step: peak memory and time of torch.compile(backend=
"comfuse") against Inductor, forward and backward measured apart, with what comfuse ran.

    python scripts/ce_memory.py [--tokens 8192 --hidden 4096 --vocab 128256]

Prints one line per compiler and a table last; writes JSON to $OUT/ce_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402,F401  (registers the backend)
from comfuse import backend  # noqa: E402
from comfuse.bench.timing import measure  # noqa: E402
from comfuse.runtime import onepass_grad  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    M, K, V = args.tokens, args.hidden, args.vocab
    torch.manual_seed(0)
    w = (torch.randn(V, K, device="cuda") / K ** 0.5).to(torch.bfloat16).requires_grad_(True)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (M,), device="cuda")
    sliced = []
    real = onepass_grad.backward
    onepass_grad.backward = lambda *a, **k: sliced.append(1) or real(*a, **k)

    def loss(x, t):
        return F.cross_entropy(F.linear(x, w).float(), t)

    def phases(fn):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(x, t)
        torch.cuda.synchronize()
        fwd = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        mid = torch.cuda.memory_allocated()
        out.backward()
        torch.cuda.synchronize()
        bwd = torch.cuda.max_memory_allocated() - mid
        return out.detach(), fwd, bwd, max(fwd, bwd + mid - base)

    def step(fn):
        x.grad = w.grad = None
        fn(x, t).backward()

    rows = {}
    for name in ("comfuse", "inductor"):
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn = torch.compile(loss, backend="comfuse" if name == "comfuse" else "inductor", dynamic=False)
            phases(fn)  # build (and autotune)
            sliced.clear()
            value, fwd, bwd, peak = phases(fn)
            gx, gw = x.grad.clone(), w.grad.clone()
            timing = measure(lambda: step(fn), rep_ms=300)
        row = {"loss": value.item(), "forward_peak_GiB": fwd / 2**30, "backward_peak_GiB": bwd / 2**30,
               "step_peak_GiB": peak / 2**30, "step_ms": timing.as_dict(), "sliced_backward_calls": len(sliced)}
        if name == "comfuse":
            report = backend.lower.last_report
            row["regions"] = [{"fused": r.fused, "schedule": r.schedule, "reason": r.reason, "plan": r.plan}
                              for r in (report.regions if report else [])]
            row["registry"] = [{"plan": getattr(getattr(m, "plan", None), "schedule", None),
                                "prefer_unfused": getattr(m, "prefer_unfused", None)}
                               for m, *_ in backend._REGISTRY.values()]
            ours = (gx, gw)
        else:
            row["grad_max_abs_diff"] = [(a.float() - b.float()).abs().max().item() for a, b in zip(ours, (gx, gw))]
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "/tmp/comfuse-out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "ce_memory.json").write_text(json.dumps({"shape": [M, K, V], "rows": rows}, indent=1))
    print(f"\n| compiler | M x K x V | forward peak GiB | backward peak GiB | step peak GiB | step ms (IQR) |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {M}x{K}x{V} | {r['forward_peak_GiB']:.2f} | {r['backward_peak_GiB']:.2f} | "
              f"{r['step_peak_GiB']:.2f} | {r['step_ms']['median_ms']:.2f} ({r['step_ms']['iqr_ms']:.2f}) |")


if __name__ == "__main__":
    main()
