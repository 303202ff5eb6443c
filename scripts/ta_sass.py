"""Target attention's generated chain kernel against the hand-written one of
``scripts/ta_variants.py``, as ptxas compiles them for sm_90 (runs on any machine, no GPU):
the order of global loads, shared-memory stores and tensor-core instructions in the SASS,
and where the instruction mixes differ.

A memory-bound kernel wants every load of a program issued before it waits on the first.
With runtime strides the 4-warp chain held one of its 17 loads back behind a shared-memory
store (2026-11-30); with the strides as compile-time constants it issues all 17 first.

    TRITON_INTERPRET=0 python scripts/ta_sass.py [--warps 4]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import comfuse  # noqa: E402
import ta_variants  # noqa: E402
from comfuse.planner import chain as planner_chain  # noqa: E402
from comfuse.runtime import aot, compiled as compiled_mod  # noqa: E402


def sass(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout


def opcodes(text: str) -> list[str]:
    return re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text, re.M)


def order(ops: list[str]) -> str:
    """Runs of the memory and tensor-core instructions, in program order."""
    keep = [op.split(".")[0] for op in ops if op.split(".")[0] in ("LDG", "STS", "LDS", "LDSM", "HMMA", "BAR", "STG")]
    runs = []
    for op in keep:
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return " ".join(f"{op}x{n}" for op, n in runs[:10])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warps", type=int, default=4)
    warps = ap.parse_args().warps
    plans = []
    real = planner_chain.plan_chain
    compiled_mod.plan_chain = lambda regions, links, writes, target, settings=None: plans.append(
        real(regions, links, writes, "cuda", settings)) or plans[-1]
    bf = torch.bfloat16
    args = (torch.randn(64, 16, 64, dtype=bf), torch.randn(64, 256, 64, dtype=bf), torch.randn(64, 256, 64, dtype=bf))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comfuse.explain(lambda q, k, v: torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v, args)
    generated = aot.compile_chain_for_gpu(dataclasses.replace(plans[-1], num_warps=warps))["asm"]["cubin"]
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "B": "i32", "LQ": "constexpr",
           "LK": "constexpr", "D": "constexpr", "V_FIRST": "constexpr", "DEFER": "constexpr"}
    hand = triton.compile(ASTSource(fn=ta_variants.per_sample, signature=sig,
                                    constexprs={"LQ": 16, "LK": 256, "D": 64, "V_FIRST": False, "DEFER": False},
                                    attrs={(i,): [["tt.divisibility", 16]] for i in range(5)}),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
    mixes = {}
    for name, cubin in (("generated chain", generated), ("hand-written", hand.asm["cubin"])):
        ops = opcodes(sass(cubin))
        mixes[name] = collections.Counter(ops)
        print(f"{name:16s} {len(ops):5d} instructions, {aot.resources(cubin)}\n  {order(ops)}")
    g, h = mixes["generated chain"], mixes["hand-written"]
    print("\n| instruction | generated | hand-written |\n|---|---|---|")
    for op in sorted(set(g) | set(h)):
        if g[op] != h[op]:
            print(f"| {op} | {g[op]} | {h[op]} |")


if __name__ == "__main__":
    main()
