"""Pure region-to-region passes: dead-code removal, common subexpressions, one-hot counts,
and the transposition that turns a column-strip region (reductions along M) into a row-strip
one, so code generation only ever reduces along N."""
from __future__ import annotations

import dataclasses

import torch

from ..ir import REDUCE, Node, Op, Region


def _renumber(region: Region, keep: list[int], alias: dict[int, int] | None = None) -> Region:
    """Keep nodes ``keep`` (ascending), redirecting uses through ``alias``."""
    alias = alias or {}
    new_index: dict[int, int] = {}
    nodes = []
    for old in keep:
        node = region.nodes[old]
        src = tuple(new_index[alias.get(s, s)] for s in node.src)
        new_index[old] = len(nodes)
        nodes.append(dataclasses.replace(node, src=src))
    outputs = tuple(dataclasses.replace(o, node=new_index[alias.get(o.node, o.node)])
                    for o in region.outputs)
    return region.replace(nodes=tuple(nodes), outputs=outputs)


def dce(region: Region) -> Region:
    """Drop nodes no output depends on. Side inputs stay, even unused ones: the launcher
    binds them by position."""
    live = {o.node for o in region.outputs}
    for i in range(len(region.nodes) - 1, -1, -1):
        if i in live:
            live.update(region.nodes[i].src)
    return _renumber(region, sorted(live))


def cse(region: Region) -> Region:
    """Merge structurally identical nodes."""
    seen: dict = {}
    alias: dict[int, int] = {}
    keep = []
    for i, node in enumerate(region.nodes):
        src = tuple(alias.get(s, s) for s in node.src)
        arg = float.hex(node.arg) if isinstance(node.arg, float) else node.arg
        key = (node.op, src, node.dtype, node.axes, arg)
        if key in seen:
            alias[i] = seen[key]
        else:
            seen[key] = i
            keep.append(i)
    return _renumber(region, keep, alias) if alias else region


def one_hot(nodes, i: int):
    """(iota, x) when ``nodes[i]`` is the 0/1 indicator of ``iota(axis) == x`` (a cast of the
    comparison, or where(.., 1, 0)) for an integer x without that axis; else None."""
    node = nodes[i]
    if node.op is Op.CAST:
        cond = node.src[0]
    elif node.op is Op.WHERE and [(nodes[s].op, nodes[s].arg) for s in node.src[1:]] == [(Op.CONST, 1.0),
                                                                                         (Op.CONST, 0.0)]:
        cond = node.src[0]
    else:
        return None
    if nodes[cond].op is not Op.EQ:
        return None
    left, right = nodes[cond].src
    for iota, x in ((left, right), (right, left)):
        if nodes[iota].op is Op.IOTA and nodes[iota].arg not in nodes[x].axes \
                and not nodes[x].dtype.is_floating_point and nodes[x].dtype != torch.bool:
            return iota, x
    return None


def one_hot_counts(region: Region) -> Region:
    """``sum[N](cast(iota(N) == x))`` for an integer x without an N axis (cross-entropy's
    "is the target a column?") is ``cast(0 <= x < N)``: a per-row value instead of tile work.

    Left as a tile reduction it depends on no accumulator value, so Triton gives it a layout
    of its own and reduces each row across all the program's warps: at 128x256 tiles that
    was 640 of the split cross-entropy kernel's 665 shuffles per tile (sm_90 PTX, 2026-11-30).
    The bound makes the region specific to N, as its sizes already are."""
    nodes = list(region.nodes)
    out: list[Node] = []
    new_index: dict[int, int] = {}
    changed = False
    for i, node in enumerate(nodes):
        src = tuple(new_index[s] for s in node.src)
        found = one_hot(nodes, node.src[0]) if node.op is Op.SUM else None
        if found is None or nodes[found[0]].arg != node.arg:
            new_index[i] = len(out)
            out.append(dataclasses.replace(node, src=src))
            continue
        x = new_index[found[1]]
        axes = node.axes
        extent = getattr(region.sizes, node.arg)
        dt = nodes[found[1]].dtype

        def add(op, src, dtype, arg=None, axes=axes):
            out.append(Node(op, src, dtype, axes, arg))
            return len(out) - 1
        zero = add(Op.CONST, (), dt, 0, frozenset())
        bound = add(Op.CONST, (), dt, extent, frozenset())
        inside = add(Op.AND, (add(Op.GE, (x, zero), torch.bool), add(Op.LT, (x, bound), torch.bool)), torch.bool)
        new_index[i] = add(Op.CAST, (inside,), node.dtype, node.dtype)
        changed = True
    if not changed:
        return region
    outputs = tuple(dataclasses.replace(o, node=new_index[o.node]) for o in region.outputs)
    return dce(region.replace(nodes=tuple(out), outputs=outputs))


_SWAP = {"M": "N", "N": "M"}


def _swap_axes(axes) -> frozenset:
    return frozenset(_SWAP.get(a, a) for a in axes)


def transpose(region: Region) -> Region:
    """The same computation over the transposed tile: C^T = B^T A^T.

    Operand roles swap (the launcher passes B^T as the new A and A^T as the new B);
    every axis set, IOTA and reduction swaps M and N. Not for a region with a second product
    (its two products share A: transposed, they would share B, which no kernel multiplies).
    """
    if region.dual:
        raise ValueError("a region with a second product is not transposed")
    nodes = []
    for n in region.nodes:
        arg = _SWAP[n.arg] if (n.op in REDUCE or n.op is Op.IOTA) else n.arg
        nodes.append(Node(n.op, n.src, n.dtype, _swap_axes(n.axes), arg))
    g = region.gemm
    # the new A is B^T ([N, K]) and the new B is A^T ([K, M]); their unit-stride dims follow
    a_major = {"N": "M", "K": "K"}.get(g.b.major, "")
    b_major = {"K": "K", "M": "N"}.get(g.a.major, "")
    gemm = dataclasses.replace(g, a=dataclasses.replace(g.b, major=a_major),
                               b=dataclasses.replace(g.a, major=b_major))
    s = region.sizes
    return region.replace(
        gemm=gemm,
        inputs=tuple(dataclasses.replace(i, axes=_swap_axes(i.axes)) for i in region.inputs),
        nodes=tuple(nodes),
        outputs=tuple(dataclasses.replace(o, axes=_swap_axes(o.axes)) for o in region.outputs),
        sizes=dataclasses.replace(s, M=s.N, N=s.M))
