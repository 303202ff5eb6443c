"""Autotune suite workloads (bf16, a fresh tuning cache) and print each one's error against
float64, the plan it kept, and every candidate's median time (its tuning decision).

    python scripts/autotune_check.py [--only ln_postnorm,softmax] [--shape 8192x1024x1024]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import comfuse  # noqa: E402
from comfuse.bench.workloads import SUITE  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="ln_postnorm,softmax")
    ap.add_argument("--shape", default="8192x1024x1024", help="MxKxN")
    args = ap.parse_args()
    M, K, N = (int(v) for v in args.shape.split("x"))
    for name in args.only.split(","):
        wl = SUITE[name]
        xs = wl.inputs(M, K, N, dtype=torch.bfloat16, device="cuda")
        cache = Path(tempfile.mkdtemp())
        with comfuse.settings.override(autotune="1", cache_dir=cache), warnings.catch_warnings():
            warnings.simplefilter("ignore", comfuse.ComfuseWarning)
            compiled = comfuse.compile(wl.fn, xs)
            out = compiled(*xs)
        ref = wl.fn(*[t.double() if t.is_floating_point() else t for t in xs])
        err = ((out.double() - ref).norm() / ref.norm()).item()
        (r,) = compiled.report.regions
        print(f"{name} {args.shape}: rel err {err:.2e}; {'fused: ' + r.plan if r.fused else 'unfused: ' + r.reason}")
        for f in sorted((cache / "tuning").glob("*.json")):
            decision = json.loads(f.read_text())
            times = ", ".join(f"{k} {v:.4f}" for k, v in decision.get("times_ms", {}).items())
            print(f"  kept {decision.get('choice')}; ms: {times}")


if __name__ == "__main__":
    main()
