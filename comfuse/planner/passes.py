"""Pure region-to-region passes: dead-code removal, common subexpressions, and the
transposition that turns a column-strip region (reductions along M) into a row-strip
one, so code generation only ever reduces along N."""
from __future__ import annotations

import dataclasses

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


_SWAP = {"M": "N", "N": "M"}


def _swap_axes(axes) -> frozenset:
    return frozenset(_SWAP.get(a, a) for a in axes)


def transpose(region: Region) -> Region:
    """The same computation over the transposed tile: C^T = B^T A^T.

    Operand roles swap (the launcher passes B^T as the new A and A^T as the new B);
    every axis set, IOTA and reduction swaps M and N.
    """
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
