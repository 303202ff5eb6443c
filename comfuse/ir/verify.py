"""The verifier: structural rules every region must satisfy after every pass."""
from __future__ import annotations

import numbers

import torch

from .nodes import (ARITY, COMPARE, ELEMENTWISE, FLOAT_DTYPES, GEMM_DTYPES, LEAF, REDUCE, Op,
                    Region)


class IRError(ValueError):
    """A region breaks a rule of the IR (a bug in whatever pass built it)."""


def verify(region: Region) -> Region:
    """Check ``region``; return it unchanged, or raise IRError naming the broken rule."""
    def fail(msg: str):
        raise IRError(f"invalid region: {msg}")

    if region.kind != "gemm_epilogue":
        fail(f"unknown kind {region.kind!r}")
    g = region.gemm
    if g.a.dtype not in GEMM_DTYPES or g.b.dtype != g.a.dtype:
        fail(f"GEMM operand dtypes {g.a.dtype}, {g.b.dtype} are not one of {GEMM_DTYPES}")
    if g.b2 is not None and (g.b2.dtype != g.b.dtype or g.batched):
        fail("a second product needs B's dtype and an unbatched GEMM")
    tile = region.tile_axes
    for s in ("B", "M", "N", "K"):
        if region.sizes.of(s) < 0:
            fail(f"size {s}={region.sizes.of(s)} is negative")
    for j, inp in enumerate(region.inputs):
        if not inp.axes <= tile:
            fail(f"input {j} has axes {set(inp.axes)} outside the tile {set(tile)}")
    for i, node in enumerate(region.nodes):
        where = f"%{i} ({node.op.value})"
        if len(node.src) != ARITY[node.op]:
            fail(f"{where} takes {ARITY[node.op]} sources, has {len(node.src)}")
        if any(not 0 <= s < i for s in node.src):
            fail(f"{where} uses a value that is not defined before it: {node.src}")
        if not node.axes <= tile:
            fail(f"{where} has axes {set(node.axes)} outside the tile {set(tile)}")
        srcs = [region.nodes[s] for s in node.src]
        if node.op is Op.ACC:
            if node.axes != tile or node.dtype != torch.float32:
                fail(f"{where} must be fp32 over the whole tile")
            if node.arg not in (None, 1) or (node.arg == 1 and not region.dual):
                fail(f"{where} names product {node.arg!r}; the GEMM has {'two' if region.dual else 'one'}")
        elif node.op is Op.INPUT:
            if not isinstance(node.arg, int) or not 0 <= node.arg < len(region.inputs):
                fail(f"{where} names input {node.arg!r}, which does not exist")
            inp = region.inputs[node.arg]
            if node.axes != inp.axes or node.dtype != inp.dtype:
                fail(f"{where} disagrees with input {node.arg}'s axes or dtype")
        elif node.op is Op.CONST:
            if not isinstance(node.arg, (bool, numbers.Real)) or node.axes:
                fail(f"{where} must hold a Python scalar and have no axes")
        elif node.op is Op.IOTA:
            if node.arg not in ("M", "N") or node.axes != {node.arg}:
                fail(f"{where} must index M or N and vary along it alone")
        elif node.op in ELEMENTWISE:
            union = frozenset().union(*(s.axes for s in srcs))
            if node.axes != union:
                fail(f"{where} has axes {set(node.axes)}, its sources give {set(union)}")
            if node.op in COMPARE and node.dtype != torch.bool:
                fail(f"{where} is a comparison and must be bool")
            if node.op is Op.WHERE and srcs[0].dtype != torch.bool:
                fail(f"{where} needs a bool condition, got {srcs[0].dtype}")
            if node.op is Op.CAST and not isinstance(node.arg, torch.dtype):
                fail(f"{where} must name its target dtype")
            if node.op is Op.POW and not isinstance(node.arg, numbers.Real):
                fail(f"{where} must hold a constant exponent")
        elif node.op in REDUCE:
            axis = node.arg
            if axis not in ("M", "N") or axis not in srcs[0].axes:
                fail(f"{where} reduces along {axis!r}, which its source does not vary along")
            if node.axes != srcs[0].axes - {axis}:
                fail(f"{where} must drop exactly axis {axis}")
            if node.op in (Op.RMAX, Op.RMIN) and node.dtype not in FLOAT_DTYPES:
                fail(f"{where} reduces a non-float value")
        else:  # pragma: no cover - every op is in one of the groups above
            fail(f"{where} has no rule")
        assert node.op in LEAF or node.op in ELEMENTWISE or node.op in REDUCE
    if not region.outputs:
        fail("a region must have at least one output")
    for k, out in enumerate(region.outputs):
        if not 0 <= out.node < len(region.nodes):
            fail(f"output {k} names node %{out.node}, which does not exist")
        if not region.nodes[out.node].axes <= out.axes <= tile:
            fail(f"output {k} stores axes {set(out.axes)}, narrower than its value's or outside the tile")
    return region
