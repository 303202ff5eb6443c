"""Region finding: from a captured aten graph to GEMM-epilogue regions in the IR.

An anchor is an ``mm`` or ``bmm`` (``linear``, ``matmul``, ``addmm`` and ``baddbmm`` reach us
as these after capture). Its region grows over the nodes after it, in graph order: a node
joins when its op has a lowering rule (rules.py), at least one of its operands is already in
the region, and every other operand is independent of the anchor (a side input such as a
bias, residual or gamma). That rule keeps the contracted graph acyclic. A side input that
elementwise ops compute for this node alone (a GELU's derivative from the saved activation,
in a backward) is computed by the region from their inputs instead (``_prologue``): read as
a tensor, it would be one more kernel writing it and the region reading it back, where
Inductor, unfused, computes it inside the kernel that reads the product. Where growth stops,
a note says why, for ``explain``. Chains (``find_chains``): regions whose output feeds the
next GEMM's A operand, run as one kernel.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import NamedTuple

import torch
import torch.fx as fx

from ..ir import GEMM_DTYPES, Gemm, Operand, Output, Region
from .builder import Builder, Unfusible, dtype_of, fill_value, meta_of, shape_of
from .capture import descendants
from .rules import RULES

aten = torch.ops.aten
ANCHORS = {aten.mm.default: False, aten.bmm.default: True}
_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


@dataclasses.dataclass(frozen=True)
class OutputBinding:
    node: fx.Node
    shape: tuple
    columns: int = 0  # nonzero: ``node`` is a product Inductor padded (``Unpadded.saved``): the
    # region writes its first ``columns`` columns and zeros in the rest


@dataclasses.dataclass
class Candidate:
    anchor: fx.Node
    members: list = dataclasses.field(default_factory=list)
    externals: list = dataclasses.field(default_factory=list)
    operands: tuple = ()
    inputs: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)
    region: Region | None = None
    reason: str = ""
    notes: list = dataclasses.field(default_factory=list)  # where growth stopped, and why
    through: list = dataclasses.field(default_factory=list)  # what it read through (Inductor's padding)


def _unfusible_anchor(anchor: fx.Node) -> str:
    a, b = anchor.args[0], anchor.args[1]
    try:
        da, db, dout = dtype_of(a), dtype_of(b), dtype_of(anchor)
        dev = meta_of(anchor).device
    except Unfusible as e:
        return str(e)
    if da != db or da not in GEMM_DTYPES:
        return f"GEMM dtypes {da}, {db} are not fused (fp32, fp16 and bf16 are)"
    if dout != da:
        return f"GEMM output dtype {dout} differs from its inputs"
    if dev.type not in ("cpu", "cuda"):
        return f"tensors on {dev.type} are not fused"
    out = shape_of(anchor)
    if 0 in out:
        return f"the GEMM output {list(out)} is empty"
    return ""


def _major(node: fx.Node, last: str, second: str) -> str:
    """Which of an operand's two matrix dims has unit stride ("" if neither)."""
    val = meta_of(node)
    if val.dim() < 2:
        return ""
    st, sh = val.stride(), val.shape
    if st[-1] == 1 or sh[-1] == 1:
        return last
    if st[-2] == 1 or sh[-2] == 1:
        return second
    return ""


def _widening(node: fx.Node) -> bool:
    """Whether ``node`` only casts its input to a wider floating dtype."""
    if node.target not in _CASTS or not node.all_input_nodes:
        return False
    src, dst = dtype_of(node.all_input_nodes[0]), dtype_of(node)
    return src.is_floating_point and dst.is_floating_point and dst.itemsize > src.itemsize


def _widening_tail(members: list, member_set: set) -> list:
    """Drop from ``members`` (in place) the widening casts at the region's end that only
    nodes outside it read, last first; return them. Written out, such a cast is a wider copy
    of a value its readers could cast as they load it (Inductor fuses the cast into them), so
    the region writes the narrower value instead."""
    dropped = []
    for node in reversed(members[1:]):
        if _widening(node) and not any(u in member_set for u in node.users):
            members.remove(node)
            member_set.discard(node)
            dropped.append(node)
    return dropped


class Unpadded(NamedTuple):
    b: fx.Node  # B before Inductor padded its columns
    keep: int  # the columns read
    slices: list  # the slices of the padded product that read them
    pad: fx.Node  # the constant_pad_nd
    saved: bool  # the graph returns the padded product too (a training forward saves it)


def _unpadded(anchor: fx.Node) -> Unpadded | None:
    """Where ``anchor`` is ``mm(A, constant_pad_nd(B, [0, p]))`` read only by slices of its first
    N - p columns: Inductor's ``pad_mm`` (columns padded for cuBLAS's alignment, then sliced
    off). The padded columns are zeros that nothing reads, so the region is the product with B
    itself over N - p columns; else None. The graph may return the padded product as well:
    ``pad_mm`` pads the joint graph before AOTAutograd partitions it, and a training forward
    that returns only the loss saves the padded product for the backward, which slices it again
    (its slices are views, recomputed there); the region then writes it whole."""
    if anchor.target is not aten.mm.default:
        return None
    pad = anchor.args[1]
    if not isinstance(pad, fx.Node) or pad.target is not aten.constant_pad_nd.default:
        return None
    widths = list(pad.args[1])
    value = pad.args[2] if len(pad.args) > 2 else pad.kwargs.get("value", 0)
    if value != 0 or len(widths) not in (2, 4) or widths[0] != 0 or any(widths[2:]) or widths[1] <= 0 \
            or set(pad.users) != {anchor}:
        return None
    padded = shape_of(anchor)[-1]
    keep = padded - widths[1]
    slices = [u for u in anchor.users if u.op != "output"]
    for s in slices:
        if s.target is not aten.slice.Tensor:
            return None
        dim, start, end = (list(s.args[1:4]) + [0, None, None])[:3]
        step = s.args[4] if len(s.args) > 4 else 1
        end = padded if end is None else end + padded if end < 0 else min(end, padded)
        if dim not in (1, -1) or start not in (0, None) or end != keep or step != 1:
            return None
    return Unpadded(pad.args[0], keep, slices, pad, len(slices) < len(anchor.users)) if slices else None


_PASS_THROUGH = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, *_CASTS)


def _same_value(p, q) -> bool:
    """Whether fx values ``p`` and ``q`` are one tensor: one node, or one view of one tensor."""
    return p is q or (isinstance(p, fx.Node) and isinstance(q, fx.Node) and p.op == q.op == "call_function"
                      and p.target is q.target and p.target in _PASS_THROUGH and p.args == q.args
                      and p.kwargs == q.kwargs)


def _second_product(anchor: fx.Node, value: fx.Node, taken) -> list | None:
    """Where ``value``, a side input of ``anchor``'s region, is another product of the anchor's
    A (``mm(A, B2)``, maybe viewed or cast: SwiGLU's up projection read by ``silu(gate) * up``),
    that product and the views and casts from it to ``value``, in graph order; else None. The
    region then computes both products in one mainloop (``Gemm.b2``), and the second one never
    goes to memory unless something else reads it. ``taken``: nodes already in a region."""
    path = [value]
    while path[-1].target in _PASS_THROUGH and len(path[-1].all_input_nodes) == 1:
        path.append(path[-1].all_input_nodes[0])
    base = path[-1]
    if anchor.target is not aten.mm.default or base.op != "call_function" or base.target is not aten.mm.default \
            or any(n in taken for n in path) or not _same_value(base.args[0], anchor.args[0]) \
            or _unfusible_anchor(base) or shape_of(base) != shape_of(anchor) \
            or dtype_of(base.args[1]) != dtype_of(anchor.args[1]):
        return None
    return path[::-1]


def _take_second_product(b: Builder, node: fx.Node, anchor: fx.Node, taken) -> tuple[list, tuple | None]:
    """(the nodes of a second product (``_second_product``) among ``node``'s inputs, lowered into
    ``b``; ``b``'s state from before, for ``Builder.restore``), or ([], None) where there is none
    or it cannot be lowered."""
    if b.second is not None or anchor.target is not aten.mm.default:
        return [], None
    for i in node.all_input_nodes:
        path = None if i in taken else _second_product(anchor, i, taken)
        if not path:
            continue
        state = b.snapshot()
        try:
            b.second_product(path[0])
            for n in path[1:]:
                b.values[n] = RULES[n.target](b, n)
        except Unfusible:
            b.restore(state)
            continue
        return path, state
    return [], None


# ops a region may compute from their inputs ahead of its epilogue: every lowering rule but
# the reductions and gather, which need values computed in the region along an axis
_NOT_PROLOGUE = (aten.sum.dim_IntList, aten.sum.default, aten.amax.default, aten.amin.default, aten.gather.default)
_MOVES_NOTHING = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                            aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
                            aten.clone.default, aten.alias.default})  # (views: a prologue of these alone saves nothing)
PROLOGUE_LIMIT = 32  # the most nodes a region computes for one side input


def _prologue(node: fx.Node, order: dict, members: set, downstream: set, claimed, known) -> list:
    """The nodes, in graph order, that compute ``node``'s side inputs and that the region may
    compute itself: elementwise ops with a lowering rule, outside every region and not
    downstream of the anchor, whose every reader is ``node`` or another of them (so their
    values need never be written). ``known``: values the region already has."""
    chain: set = set()
    seen: set = set()
    todo = [(-order[i], i) for i in node.all_input_nodes if i not in members and i not in known]
    heapq.heapify(todo)
    while todo:  # latest first: a node's readers are judged before it
        _, p = heapq.heappop(todo)
        if p in seen:
            continue
        seen.add(p)
        if p.op != "call_function" or p.target not in RULES or p.target in _NOT_PROLOGUE or p in claimed \
                or p in downstream or p in known or fill_value(p) is not None \
                or any(u is not node and u not in chain for u in p.users):
            continue
        chain.add(p)
        if len(chain) > PROLOGUE_LIMIT:
            return []
        for i in p.all_input_nodes:
            heapq.heappush(todo, (-order[i], i))
    if all(p.target in _MOVES_NOTHING for p in chain):
        return []
    return sorted(chain, key=order.__getitem__)


def _take_prologue(b: Builder, node: fx.Node, order: dict, members: set, downstream: set,
                   claimed) -> tuple[list, tuple | None]:
    """(``_prologue``'s nodes for ``node``, lowered into ``b`` after the values they read from
    outside; ``b``'s state from before), or ([], None) where there are none or they cannot be
    lowered (their result is then read as a side input, as before)."""
    chain = _prologue(node, order, members, downstream, claimed, b.values)
    if not chain:
        return [], None
    state = b.snapshot()
    inside = set(chain)
    try:
        for n in chain:
            for i in n.all_input_nodes:
                if i not in inside and i not in b.values and fill_value(i) is None:
                    b.values[i] = b.leaf(i)
            b.values[n] = RULES[n.target](b, n)
    except (Unfusible, KeyError):  # (KeyError: a rule reading a constant fill as a value)
        b.restore(state)
        return [], None
    return chain, state


def _without_prologue(b: Builder, rule, node: fx.Node):
    """``node`` lowered reading its side inputs from memory (a rule may need one computed
    outside the region: gather's index), or None where it cannot be."""
    try:
        return rule(b, node)
    except Unfusible:
        return None


def grow(anchor: fx.Node, order: dict, claimed: frozenset = frozenset()) -> Candidate:
    cand = Candidate(anchor=anchor)
    cand.reason = _unfusible_anchor(anchor)
    if cand.reason:
        return cand
    unpadded = _unpadded(anchor)
    b = Builder(anchor, ANCHORS[anchor.target], (unpadded.b, unpadded.keep) if unpadded else None)
    members = [anchor]
    member_set = {anchor}
    if unpadded:  # the slices of the padded product are the region's accumulator; the pad is
        # the region's too (its unfused ops pad B as the graph did, from the one B it reads)
        members = [unpadded.pad, anchor, *unpadded.slices]
        member_set.update(members)
        for s in unpadded.slices:
            b.values[s] = b.values[anchor]
        cand.through.append(f"{anchor.name}: the product with {unpadded.b.name} over its {unpadded.keep} columns "
                            "(the columns Inductor padded for alignment are zeros, sliced off)")
    downstream = descendants([anchor])
    graph_nodes = list(anchor.graph.nodes)
    for node in graph_nodes[order[anchor] + 1:]:
        if node not in downstream or node.op != "call_function" or node in claimed or node in member_set:
            continue
        inputs = node.all_input_nodes
        if not any(i in member_set for i in inputs):
            continue
        blocked = [i for i in inputs if i not in member_set and i in downstream]
        if blocked:
            cand.notes.append(f"{node.name}: uses {blocked[0].name}, which runs outside the region")
            continue
        rule = RULES.get(node.target)
        if rule is None:
            cand.notes.append(f"{node.name}: {node.target} is not an epilogue op comfuse fuses")
            continue
        second, state = ([], None) if unpadded else _take_second_product(b, node, anchor, claimed | member_set)
        prologue = []
        if not second:
            prologue, state = _take_prologue(b, node, order, member_set, downstream, claimed)
        try:
            value = rule(b, node)
        except Unfusible as e:
            if state is not None:  # (a second product or a prologue only joins with the node that reads it)
                b.restore(state)
            value = _without_prologue(b, rule, node) if prologue else None
            if value is None:
                cand.notes.append(f"{node.name}: {e}")
                continue
            prologue = []
        if prologue:
            members += prologue
            member_set.update(prologue)
            cand.through.append(f"{node.name}: computes {', '.join(n.name for n in prologue)} itself, from what "
                                "they read, rather than reading the result from memory")
        if second:
            members += second
            member_set.update(second)
            downstream |= descendants([second[0]])
            cand.through.append(f"{second[0].name}: {anchor.args[0].name}'s product with {second[0].args[1].name}, "
                                f"computed in {anchor.name}'s mainloop")
        b.values[node] = value
        members.append(node)
        member_set.add(node)
    for node in _widening_tail(members, member_set):
        cand.notes.append(f"{node.name}: a widening cast read only outside the region is left to "
                          "its readers (a wider copy in memory costs bytes and bandwidth)")
    cand.members = members
    cand.externals = b.externals
    cand.operands = b.operands
    cand.inputs = b.bindings
    outputs = []
    for m in members:
        if any(u not in member_set for u in m.users):
            value = b.values[m]
            axes = b.nodes[value.idx].axes | {lab for lab in value.labels if lab is not None}
            canon = math.prod(b.sizes.of(a) for a in axes)
            columns = unpadded.keep if unpadded and m is anchor else 0  # (the padded product, saved)
            shape = shape_of(m)
            if canon != (math.prod(shape[:-1]) * columns if columns else math.prod(shape)):
                cand.reason = f"internal: output {m.name} does not match its canonical layout"
                return cand
            outputs.append(Output(value.idx, dtype_of(m), frozenset(axes), m.name))
            cand.outputs.append(OutputBinding(m, shape_of(m), columns))
    a_node, b_node = anchor.args[0], (unpadded.b if unpadded else anchor.args[1])
    b2 = b.second.args[1] if b.second is not None else None
    gemm = Gemm(Operand(a_node.name, dtype_of(a_node), _major(a_node, "K", "M")),
                Operand(b_node.name, dtype_of(b_node), _major(b_node, "N", "K")),
                ANCHORS[anchor.target], dtype_of(anchor),
                Operand(b2.name, dtype_of(b2), _major(b2, "N", "K")) if b2 is not None else None)
    cand.region = Region("gemm_epilogue", gemm, tuple(b.inputs), tuple(b.nodes), tuple(outputs),
                         b.sizes)
    return cand


def find_regions(gm: fx.GraphModule) -> list:
    """One candidate per anchor, in graph order; a node joins at most one region (the
    first anchor's that reaches it), so regions never overlap. An anchor whose product a
    later product of the same A reads in its epilogue (``silu(x @ wg) * (x @ wu)`` written up
    projection first) is taken by that later anchor's region as its second product instead."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mms = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.mm.default]
    later = {n: mms[i + 1:] for i, n in enumerate(mms)}
    claimed: set = set()
    cands = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in ANCHORS or n in claimed:  # (a second product's)
            continue
        cand = _taken_by_a_later_product(n, later.get(n, ()), order, frozenset(claimed)) \
            or grow(n, order, frozenset(claimed))
        claimed.update(cand.members)
        cands.append(cand)
    return cands


def _taken_by_a_later_product(anchor: fx.Node, later_mms, order: dict, claimed: frozenset) -> Candidate | None:
    """The region of one of ``later_mms`` (the ``mm`` nodes after ``anchor``) that multiplies
    ``anchor``'s A and takes ``anchor`` as its second product, if one does."""
    for later in later_mms:
        if later not in claimed and _same_value(later.args[0], anchor.args[0]):
            cand = grow(later, order, claimed)
            if cand.region is not None and not cand.reason and anchor in cand.members:
                return cand
    return None


def find_chains(cands: list) -> list:
    """Back-to-back GEMMs: lists of candidate indices where an output of candidate i is the
    A operand of candidate i+1's GEMM and nothing else reads it."""
    by_output = {}
    single = [c.region is not None and not c.reason and not c.region.dual for c in cands]  # (a chain's
    # kernels compute one product a GEMM)
    for i, c in enumerate(cands):
        if single[i]:
            for k, ob in enumerate(c.outputs):
                by_output[ob.node] = (i, k)
    nxt = {}
    for j, c in enumerate(cands):
        if not single[j]:
            continue
        a = c.anchor.args[0]
        if a in by_output and set(a.users) == {c.anchor}:
            i, k = by_output[a]
            nxt[i] = (j, k)
    targets = {j for j, _ in nxt.values()}
    def reads_inside(j, inside, link) -> bool:
        # a later GEMM may read an earlier one's values only through the link (a residual
        # taken from an earlier region would need that region's output in memory)
        return any(e in inside and e is not link for e in cands[j].externals)

    chains = []
    for head in sorted(nxt):
        if head in targets:
            continue
        chain, links, i = [head], [], head
        inside = set(cands[head].members)
        while i in nxt:
            j, k = nxt[i]
            link = cands[j].anchor.args[0]
            if reads_inside(j, inside, link):
                if reads_inside(j, set(cands[i].members), link):
                    break
                # j reads an earlier region, not i: close the chain before i, start again at i
                if len(chain) > 2:
                    chains.append((chain[:-1], links[:-1]))
                chain, links, inside = [i], [], set(cands[i].members)
            links.append(k)
            chain.append(j)
            inside.update(cands[j].members)
            i = j
        if len(chain) > 1:
            chains.append((chain, links))
    return chains


__all__ = ["Candidate", "OutputBinding", "find_chains", "find_regions", "grow", "merge"]


def merge(cands: list) -> Candidate:
    """One candidate for the whole chain: its members, the values it reads from outside,
    and the values read after it (the links are neither)."""
    members = [m for c in cands for m in c.members]
    inside = set(members)
    externals = []
    for c in cands:
        for e in c.externals:
            if e not in inside and e not in externals:
                externals.append(e)
    links = {cands[i + 1].anchor.args[0] for i in range(len(cands) - 1)}
    outputs = [ob for c in cands for ob in c.outputs if ob.node not in links]
    return Candidate(anchor=cands[0].anchor, members=members, externals=externals,
                     outputs=outputs, region=cands[0].region)
