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
from .build import build
from .chain import build_chain
from .kernel import even_n
from .launch import interpreting

_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.bool: "*i1",
        torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8",
        torch.uint8: "*u8"}


def _compile(kernel, sig: dict, extra: dict, arch: int, sizes: dict | None = None):
    """triton.compile of a built kernel for CUDA sm_``arch``; ``sig`` types its runtime
    parameters, the kernel's constexprs (plus ``extra``) complete it.

    ``sizes`` (parameter name -> the value a launch would pass, for strides and sizes)
    specialises as Triton's JIT does at a launch: an integer equal to 1 becomes a constant,
    pointers and integers divisible by 16 are marked so. Without it every load is compiled
    for unknown strides (scalar 2-byte loads, no cp.async pipelining), which is not what
    runs on the GPU."""
    constexprs = dict(kernel.source.constexprs, **extra)
    attrs = {}
    if sizes is not None:
        names = kernel.fn.arg_names
        for name, kind in sig.items():
            if kind.startswith("*"):
                attrs[(names.index(name),)] = [["tt.divisibility", 16]]
            elif kind == "i32" and name in sizes:
                if sizes[name] == 1:
                    constexprs[name] = 1
                elif sizes[name] % 16 == 0:
                    attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    sig = dict(sig, **{name: "constexpr" for name in constexprs})
    return triton.compile(ASTSource(fn=kernel.fn, signature=sig, constexprs=constexprs, attrs=attrs),
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
        if p.role in ("a", "b", "b2"):
            sig[p.name] = _PTR[_operand(r, p.role).dtype]
        elif p.role == "in":
            sig[p.name] = _PTR[r.inputs[p.index].dtype]
        elif p.role == "out":
            sig[p.name] = _PTR[r.outputs[p.index].dtype]
        elif p.role in ("a_desc", "b_desc", "b2_desc"):
            op = _operand(r, p.role.removesuffix("_desc"))
            if p.role == "a_desc":
                block = [plan.block_m, plan.block_k] if op.major == "K" else [plan.block_k, plan.block_m]
            else:
                block = [plan.block_k, plan.block_n] if op.major == "N" else [plan.block_n, plan.block_k]
            sig[p.name] = f"tensordesc<{_PTR[op.dtype][1:]}[{block[0]}, {block[1]}]>"
        elif p.role == "workspace":
            sig[p.name] = "*fp32"
        elif p.role == "counters":
            sig[p.name] = "*i64"
        else:
            sig[p.name] = "i32"
    compiled = _compile(kernel, sig, dict(UPCAST_OPERANDS=False, DOT_PRECISION="tf32" if tf32 else "ieee",
                                          WIDE_INDEX=False, EVEN_N=even_n(plan, r.sizes.N)),
                        arch, _launch_values(kernel, plan))
    asm = dict(compiled.asm)
    ptx = asm.get("ptx", "")
    return {"asm": asm, "shared_bytes": compiled.metadata.shared, "name": kernel.source.name,
            "wgmma": ptx.count("wgmma.mma_async"), "mma": ptx.count("mma.sync"),
            "atomics": ptx.count("atom."), "schedule": plan.schedule,
            "tma": ptx.count("cp.async.bulk.tensor"),
            "cp_async": len(re.findall(r"cp\.async\.c[ag]\.", ptx)),  # pipelined pointer loads
            "registers": getattr(compiled, "n_regs", None)}


def _operand(region, role: str):
    """The GEMM operand a kernel parameter of ``role`` ("a", "b" or "b2") takes."""
    return {"a": region.gemm.a, "b": region.gemm.b, "b2": region.gemm.b2}[role]


def warmup_arguments(plan: Plan) -> tuple:
    """(JIT function, arguments, options) of ``plan``'s kernel as its first launch on
    contiguous tensors passes them, dtypes standing for tensors (as ``JITFunction.warmup``
    takes them) and the strip count for a cooperative grid's slots: compiling with them
    compiles what that launch would."""
    kernel = build(plan)
    r = plan.region
    values = _launch_values(kernel, plan)
    fixed = {"workspace": torch.float32, "counters": torch.int64, "tiles_n": plan.tiles_n,
             "groups": -(-r.sizes.M // plan.block_m) * r.sizes.B}
    args = []
    for p in kernel.source.params:
        if p.role in ("a", "b", "b2"):
            args.append(_operand(r, p.role).dtype)
        elif p.role in ("in", "out"):
            args.append((r.inputs if p.role == "in" else r.outputs)[p.index].dtype)
        else:
            args.append(fixed[p.role] if p.role in fixed else values[p.name])
    options = dict(kernel.source.constexprs, UPCAST_OPERANDS=False, DOT_PRECISION="ieee", WIDE_INDEX=False,
                   EVEN_N=even_n(plan, r.sizes.N), num_warps=kernel.source.num_warps,
                   num_stages=kernel.source.num_stages)
    return kernel.fn, args, options


def _launch_values(kernel, plan: Plan) -> dict:
    """The sizes and strides a launch on contiguous tensors passes (see ``_compile``)."""
    r = plan.region
    s = r.sizes
    dims = {"B": s.B, "M": s.M, "N": s.N, "K": s.K}
    values = {"M": s.M, "N": s.N, "K": s.K, "NUM_B": s.B}
    operand = {"stride_a": (("B", "M", "K"), r.gemm.a.major or "K"),
               "stride_b": (("B", "K", "N"), r.gemm.b.major or "N")}
    if r.dual:
        operand["stride_b2"] = (("B", "K", "N"), r.gemm.b2.major or "N")
    for p in kernel.source.params:
        if p.role in operand:
            axes, minor = operand[p.role]
            values[p.name] = _unit_strides(dims, axes, minor)[p.axis]
        elif p.role in ("stride_in", "stride_out"):
            spec = (r.inputs if p.role == "stride_in" else r.outputs)[p.index]
            axes = tuple(a for a in ("B", "M", "N") if a in spec.axes)
            values[p.name] = _unit_strides(dims, axes, axes[-1])[p.axis]
    return values


def _unit_strides(dims: dict, axes: tuple, minor: str) -> dict:
    """Axis -> stride of a contiguous tensor over ``axes`` whose unit-stride axis is ``minor``."""
    order = [a for a in axes if a != minor] + [minor]
    strides, inner = {}, 1
    for a in reversed(order):
        strides[a] = inner
        inner *= dims[a]
    return strides


def _chain_launch_values(kernel, plan) -> dict:
    """As ``_launch_values``, for a chain: contiguous operands, side inputs and outputs."""
    values = {"M": plan.regions[0].sizes.M, "K": plan.regions[0].sizes.K}
    for p in kernel.source.params:
        if p.role == "size" and p.index is not None:
            values[p.name] = plan.regions[p.index].sizes.N
        elif p.role == "stride_a":
            r = plan.regions[0]
            dims = {"B": r.sizes.B, "M": r.sizes.M, "K": r.sizes.K}
            values[p.name] = _unit_strides(dims, ("B", "M", "K"), r.gemm.a.major or "K")[p.axis]
        elif p.role == "stride_b":
            r = plan.regions[p.index]
            dims = {"B": r.sizes.B, "K": r.sizes.K, "N": r.sizes.N}
            values[p.name] = _unit_strides(dims, ("B", "K", "N"), r.gemm.b.major or "N")[p.axis]
        elif p.role in ("stride_in", "stride_out"):
            r = plan.regions[p.index[0]]
            spec = (r.inputs if p.role == "stride_in" else r.outputs)[p.index[1]]
            dims = {"B": r.sizes.B, "M": r.sizes.M, "N": r.sizes.N}
            axes = tuple(a for a in ("B", "M", "N") if a in spec.axes)
            values[p.name] = _unit_strides(dims, axes, axes[-1])[p.axis]
    return values


def compile_chain_for_gpu(plan, arch: int = 90) -> dict:
    """As ``compile_for_gpu``, for a back-to-back chain's kernel."""
    if interpreting():
        raise RuntimeError("Triton is in interpreter mode in this process; set TRITON_INTERPRET=0")
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
    first = plan.regions[0]
    values = _chain_launch_values(kernel, plan)
    strides = {p.name: values[p.name] for p in kernel.source.params  # (constexprs in the source)
               if p.role.startswith("stride_") and p.axis != "B"}
    for name in strides:
        sig.pop(name)
    compiled = _compile(kernel, sig, dict(UPCAST_OPERANDS=False, DOT_PRECISION="ieee",
                                          EVEN_M=first.sizes.M % plan.block_m == 0, **strides), arch, values)
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


def partitions(cubin: bytes) -> list:
    """The SASS of a warp-specialised kernel cut at its ``USETMAXREG`` instructions (each
    partition of ``gl.warp_specialize`` sets its own register count first): a list of
    (registers set, or None before the first; instructions up to the next cut), read with
    the nvdisasm that Triton ships; empty when the tool is missing. The epilogue partition of
    a generated ws_stages kernel is the one at 152 registers."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists():
        return []
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True).stdout
    out, regs, count = [], None, 0
    for ins in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", text):
        if "USETMAXREG" in ins:
            out.append((regs, count))
            found = re.search(r"0x([0-9a-f]+)\s*$", ins)
            regs, count = int(found.group(1), 16) if found else None, 0
        count += 1
    return out + [(regs, count)]
