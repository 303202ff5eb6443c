"""Readable text of a region: one line per input, node and output."""
from __future__ import annotations

import torch

from .nodes import Op, Region, sort_axes

_SHORT = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64",
          torch.bool: "bool", torch.int64: "i64", torch.int32: "i32", torch.int8: "i8",
          torch.uint8: "u8", torch.int16: "i16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


def axes_text(axes) -> str:
    return "[" + ",".join(sort_axes(axes)) + "]"


def format_node(region: Region, i: int) -> str:
    node = region.nodes[i]
    args = ", ".join(f"%{s}" for s in node.src)
    if node.op is Op.ACC:
        g = region.gemm
        rhs = f"acc = {g.a.name} @ {(g.b2 if node.arg == 1 else g.b).name}"
    elif node.op is Op.INPUT:
        rhs = f"input {region.inputs[node.arg].name}"
    elif node.op is Op.CONST:
        rhs = f"const {node.arg!r}"
    elif node.op is Op.IOTA:
        rhs = f"iota {node.arg}"
    elif node.op is Op.CAST:
        rhs = f"cast {args} to {dtype_name(node.arg)}"
    elif node.op is Op.POW:
        rhs = f"pow {args}, {node.arg!r}"
    elif node.arg is not None:  # reductions
        rhs = f"{node.op.value}[{node.arg}] {args}"
    else:
        rhs = f"{node.op.value} {args}"
    return f"%{i} = {rhs}".ljust(40) + f": {dtype_name(node.dtype)} {axes_text(node.axes)}"


def format_region(region: Region) -> str:
    s = region.sizes
    g = region.gemm
    lines = [f"region {region.kind}  B={s.B} M={s.M} N={s.N} K={s.K}"]
    a_axes = "[B,M,K]" if g.batched else "[M,K]"
    b_axes = "[B,K,N]" if g.batched else "[K,N]"
    major = f" ({g.a.major or '?'}-major @ {g.b.major or '?'}-major)" if (g.a.major or g.b.major) else ""
    lines.append(f"  gemm   {g.a.name}: {dtype_name(g.a.dtype)} {a_axes} @ {g.b.name}: "
                 f"{dtype_name(g.b.dtype)} {b_axes} -> fp32 accumulator{major}")
    if g.b2 is not None:
        lines.append(f"  gemm2  {g.a.name} @ {g.b2.name}: {dtype_name(g.b2.dtype)} {b_axes} -> a second fp32 "
                     f"accumulator ({g.b2.major or '?'}-major B)")
    for j, inp in enumerate(region.inputs):
        lines.append(f"  in{j}    {inp.name}: {dtype_name(inp.dtype)} {axes_text(inp.axes)}")
    for i in range(len(region.nodes)):
        lines.append("  " + format_node(region, i))
    for k, out in enumerate(region.outputs):
        name = f" ({out.name})" if out.name else ""
        lines.append(f"  out{k}   %{out.node}{name}: {dtype_name(out.dtype)} {axes_text(out.axes)}")
    return "\n".join(lines)
