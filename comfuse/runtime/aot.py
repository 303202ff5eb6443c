"""Ahead-of-time compilation of a generated kernel for a GPU target, without a GPU.

``triton.compile`` can build PTX and a cubin for sm_90 on a CPU-only machine,
which proves the generated source is valid Triton for the H200 and shows what
the compiler made of it (tensor-core instructions, registers, shared memory).
Triton must not be in interpreter mode in this process (set TRITON_INTERPRET=0
before importing comfuse).
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..planner import Plan
from .kernel import build, interpreting

_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.bool: "*i1",
        torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8",
        torch.uint8: "*u8"}


def _compile(kernel, sig: dict, extra: dict, arch: int):
    """triton.compile of a built kernel for CUDA sm_``arch``; ``sig`` types its runtime
    parameters, the kernel's constexprs (plus ``extra``) complete it."""
    constexprs = dict(kernel.source.constexprs, **extra)
    sig = dict(sig, **{name: "constexpr" for name in constexprs})
    return triton.compile(ASTSource(fn=kernel.fn, signature=sig, constexprs=constexprs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": kernel.source.num_warps,
                                   "num_stages": kernel.source.num_stages})


def compile_for_gpu(plan: Plan, arch: int = 90, tf32: bool = False) -> dict:
    """Compile ``plan``'s kernel for CUDA sm_``arch``; return Triton's asm dict plus metadata."""
    if interpreting():
        raise RuntimeError("Triton is in interpreter mode in this process; set TRITON_INTERPRET=0 "
                           "before importing comfuse to compile for a GPU")
    kernel = build(plan)
    r = plan.region
    sig = {}
    for p in kernel.source.params:
        if p.role in ("a", "b"):
            sig[p.name] = _PTR[(r.gemm.a if p.role == "a" else r.gemm.b).dtype]
        elif p.role == "in":
            sig[p.name] = _PTR[r.inputs[p.index].dtype]
        elif p.role == "out":
            sig[p.name] = _PTR[r.outputs[p.index].dtype]
        elif p.role in ("a_desc", "b_desc"):
            op = r.gemm.a if p.role == "a_desc" else r.gemm.b
            if p.role == "a_desc":
                block = [plan.block_m, plan.block_k] if op.major == "K" else [plan.block_k, plan.block_m]
            else:
                block = [plan.block_k, plan.block_n] if op.major == "N" else [plan.block_n, plan.block_k]
            sig[p.name] = f"tensordesc<{_PTR[op.dtype][1:]}[{block[0]}, {block[1]}]>"
        elif p.role == "workspace":
            sig[p.name] = "*fp32"
        elif p.role == "counters":
            sig[p.name] = "*i32"
        else:
            sig[p.name] = "i32"
    compiled = _compile(kernel, sig, dict(UPCAST_OPERANDS=False, DOT_PRECISION="tf32" if tf32 else "ieee",
                                          WIDE_INDEX=False), arch)
    asm = dict(compiled.asm)
    ptx = asm.get("ptx", "")
    return {"asm": asm, "shared_bytes": compiled.metadata.shared, "name": kernel.source.name,
            "wgmma": ptx.count("wgmma.mma_async"), "mma": ptx.count("mma.sync"),
            "atomics": ptx.count("atom."), "schedule": plan.schedule,
            "tma": ptx.count("cp.async.bulk.tensor"),
            "registers": getattr(compiled, "n_regs", None)}


def compile_chain_for_gpu(plan, arch: int = 90) -> dict:
    """As ``compile_for_gpu``, for a back-to-back chain's kernel."""
    if interpreting():
        raise RuntimeError("Triton is in interpreter mode in this process; set TRITON_INTERPRET=0")
    from .chain import build_chain
    kernel = build_chain(plan)
    sig = {}
    for p in kernel.source.params:
        if p.role == "a":
            sig[p.name] = _PTR[plan.regions[0].gemm.a.dtype]
        elif p.role == "b":
            sig[p.name] = _PTR[plan.regions[p.index].gemm.b.dtype]
        elif p.role == "in":
            sig[p.name] = _PTR[plan.regions[p.index[0]].inputs[p.index[1]].dtype]
        elif p.role == "out":
            sig[p.name] = _PTR[plan.regions[p.index[0]].outputs[p.index[1]].dtype]
        else:
            sig[p.name] = "i32"
    compiled = _compile(kernel, sig, dict(UPCAST_OPERANDS=False, DOT_PRECISION="ieee"), arch)
    ptx = compiled.asm.get("ptx", "")
    return {"asm": dict(compiled.asm), "shared_bytes": compiled.metadata.shared,
            "wgmma": ptx.count("wgmma.mma_async"), "mma": ptx.count("mma.sync")}


def resources(cubin: bytes) -> dict:
    """Registers per thread, stack bytes per thread (register spills) and static shared
    memory of a cubin, read with the cuobjdump that Triton ships (``-res-usage``); empty
    when the tool is missing."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}
