"""Structural key: a hash of everything about a region that changes its kernel.

Names and sizes are left out (sizes are runtime arguments of the kernel); op,
dtype, axes, attributes and the graph's wiring are in.
"""
from __future__ import annotations

import hashlib

from .nodes import Region, sort_axes


def _canon(value) -> str:
    if isinstance(value, float):
        return float.hex(value)
    return repr(value)


def structural_text(region: Region) -> str:
    g = region.gemm
    parts = [region.kind, f"gemm {g.a.dtype} {g.b.dtype} {g.out_dtype} batched={g.batched} "
                          f"major={g.a.major},{g.b.major}"]
    if g.b2 is not None:
        parts.append(f"gemm2 {g.b2.dtype} major={g.b2.major}")
    parts += [f"in {i.dtype} {sort_axes(i.axes)}" for i in region.inputs]
    parts += [f"{n.op.value} {n.src} {n.dtype} {sort_axes(n.axes)} {_canon(n.arg)}" for n in region.nodes]
    parts += [f"out {o.node} {o.dtype} {sort_axes(o.axes)}" for o in region.outputs]
    return "\n".join(parts)


def structural_key(region: Region) -> str:
    return hashlib.sha256(structural_text(region).encode()).hexdigest()[:24]
