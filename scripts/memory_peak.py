"""Where a training step's peak GPU memory goes: an LM head and its cross-entropy through
``torch.compile(backend="comfuse")`` against Inductor alone, on a GPU.

For each form: the gradients against fp32 eager (one vector), the peak memory beyond the
inputs in the forward (up to the loss) and in the backward, and the tensors alive at the
step's peak, largest first, each with the line of code that allocated it (an Inductor
wrapper's line, a comfuse runtime line, or the script's). comfuse's report of every graph is
written beside. Full listing to ``$OUT/memory_peak.md``; the table last to stdout.

    python scripts/memory_peak.py [--rows 8192] [--hidden 4096] [--vocab 128256]
"""
from __future__ import annotations

import argparse
import linecache
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402,F401  (registers the backend)
from comfuse import inductor_pass, settings  # noqa: E402

FORMS = {  # name: (backend, settings)
    "inductor": ("inductor", {}),
    "comfuse": ("comfuse", {}),
    "comfuse, autotuning off": ("comfuse", {"autotune": "0", "graph_check": "0"}),
}


def where(frames: list) -> str:
    """The innermost frame worth naming: generated wrapper code, comfuse, or this script."""
    for f in frames:
        name = f.get("filename", "")
        if "torchinductor" in name or "/comfuse/" in name or name.endswith("memory_peak.py"):
            text = linecache.getline(name, f.get("line", 0)).strip()
            return f"{Path(name).name}:{f.get('line')} {f.get('name')}: {text[:140]}"
    return "(no Python frame of the wrapper, comfuse or this script)"


def live_at_peak(snapshot: dict) -> list:
    """[(bytes, where)] of the allocations alive when the most memory was allocated, from the
    allocator's history."""
    live, total, best, best_live = {}, 0, -1, {}
    for trace in snapshot["device_traces"]:
        for e in trace:
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e.get("frames", []))
                total += e["size"]
                if total > best:
                    best, best_live = total, dict(live)
            elif e["action"] == "free_requested" and e["addr"] in live:
                total -= live.pop(e["addr"])[0]
    return sorted(((size, where(frames)) for size, frames in best_live.values()), reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "/tmp/comfuse-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    M, K, V = args.rows, args.hidden, args.vocab
    w = (torch.randn(V, K, device="cuda") / K ** 0.5).to(torch.bfloat16).requires_grad_(True)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (M,), device="cuda")

    def loss(x, t):
        return F.cross_entropy(F.linear(x, w).float(), t)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    F.cross_entropy(F.linear(xf, wf), t).backward()
    want = torch.cat([xf.grad.flatten(), wf.grad.flatten()])
    del xf, wf
    listing, table = [], ["| form | peak GiB forward / backward | gradients rel. error |", "|---|---|---|"]
    for name, (backend, over) in FORMS.items():
        torch._dynamo.reset()
        inductor_pass.REPORTS.clear()
        try:
            with settings.override(**over):
                fn = torch.compile(loss, backend=backend, dynamic=False)
                for _ in range(2):  # (the first call compiles and tunes)
                    x.grad = w.grad = None
                    fn(x, t).backward()
                got = torch.cat([x.grad.float().flatten(), w.grad.float().flatten()])
                err = float((got - want).norm() / want.norm())
                x.grad = w.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.memory._record_memory_history(max_entries=100000)
                value = fn(x, t)
                torch.cuda.synchronize()
                forward = (torch.cuda.max_memory_allocated() - base) / 2**30
                torch.cuda.reset_peak_memory_stats()
                value.backward()
                torch.cuda.synchronize()
                backward = (torch.cuda.max_memory_allocated() - base) / 2**30
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
            table.append(f"| {name} | {forward:.3f} / {backward:.3f} | {err:.2e} |")
            listing.append(f"## {name}\n\npeak GiB forward {forward:.3f}, backward {backward:.3f}; "
                           f"gradients {err:.2e}\n\nalive at the step's peak (GiB, allocated at):\n")
            listing += [f"- {size / 2**30:.3f} {at}" for size, at in live_at_peak(snapshot)[:12]]
            listing += ["", "```"] + [str(r) for r in inductor_pass.REPORTS] + ["```", ""]
        except Exception as e:  # reported, not hidden
            torch.cuda.memory._record_memory_history(enabled=None)
            table.append(f"| {name} | error: {type(e).__name__}: {str(e)[:150]} | |")
    (out_dir / "memory_peak.md").write_text("\n".join(listing + table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
