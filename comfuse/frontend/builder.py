"""Lowering a region's fx nodes to the IR, one node at a time (``Builder``).

Lowering tracks, for each fx dimension of each region value, which axis of the GEMM's
(B, M, N) space it runs along ("labels"; ``None`` for size-1 dims). Views that split or merge
dims within one axis keep the value in the region; views that mix axes, permutes, and
reductions that do not cover exactly one of M or N end the region (``Unfusible``). Values
the region reads from outside become side inputs, bound to the kernel's canonical view
(``InputBinding``).
"""
from __future__ import annotations

import dataclasses
import numbers

import torch
import torch.fx as fx

from ..ir import REDUCE, Input, Node, Op, Sizes

aten = torch.ops.aten
AXES = ("B", "M", "N")


class Unfusible(Exception):
    """A node cannot join the region; the message says why."""


@dataclasses.dataclass(frozen=True)
class Value:
    idx: int  # IR node
    labels: tuple  # per fx dim: "B" | "M" | "N" | None (size-1 dim)


@dataclasses.dataclass(frozen=True)
class InputBinding:
    """How to turn external value ``ext`` into the kernel's canonical (B, M, N) view:
    ``value.expand(expand_to).reshape(canon)``, then keep index 0 of axes not in ``axes``."""
    ext: int
    expand_to: tuple
    canon: tuple
    axes: frozenset


def meta_of(node: fx.Node):
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise Unfusible(f"{node.name} has no tensor metadata")
    return val


def shape_of(node: fx.Node) -> tuple:
    return tuple(int(s) for s in meta_of(node).shape)


def dtype_of(node: fx.Node) -> torch.dtype:
    return meta_of(node).dtype


def fill_value(node: fx.Node):
    """The scalar a constant-fill node (zeros_like, full, scalar_tensor, ...) holds, else None."""
    if node.op != "call_function":
        return None
    t = node.target
    if t is aten.scalar_tensor.default:
        return node.args[0]
    if t in (aten.full.default, aten.full_like.default):
        return node.args[1]
    if t in (aten.zeros.default, aten.zeros_like.default):
        return 0
    if t in (aten.ones.default, aten.ones_like.default):
        return 1
    return None


class Builder:
    """Lowers fx nodes into one region's IR, one node at a time."""

    def __init__(self, anchor: fx.Node, batched: bool, unpadded=None):
        """``unpadded``: (B's node before Inductor padded its columns, the columns kept) where
        the anchor multiplies a zero-padded B and only its first columns are read (regions.py,
        ``_unpadded``): the region then multiplies the unpadded B over those columns."""
        self.anchor = anchor
        self.batched = batched
        out = shape_of(anchor)
        a_node, b_node = anchor.args[0], anchor.args[1]
        if unpadded is not None:
            b_node, n = unpadded
            out = out[:-1] + (n,)
        self.sizes = Sizes(B=out[0] if batched else 1, M=out[-2], N=out[-1], K=shape_of(a_node)[-1])
        self.axis_size = {"M": self.sizes.M, "N": self.sizes.N}
        if batched:
            self.axis_size["B"] = self.sizes.B
        self.nodes: list[Node] = []
        self._cse: dict = {}
        self.inputs: list[Input] = []
        self.bindings: list[InputBinding] = []
        self._input_cse: dict = {}
        self.externals: list = []
        self._ext_index: dict = {}
        self.values: dict = {}
        self.operands = (self.external(a_node), self.external(b_node))
        self.second = None  # the product of A with another B, once the region takes one
        self.values[anchor] = Value(self.add(Op.ACC, (), torch.float32, axes=self._tile()), self._labels(out))

    def _tile(self) -> frozenset:
        return frozenset({"B", "M", "N"} if self.batched else {"M", "N"})

    def _labels(self, out: tuple) -> tuple:
        return tuple(ax if size > 1 else None
                     for ax, size in zip(("B", "M", "N") if self.batched else ("M", "N"), out))

    def second_product(self, node: fx.Node) -> None:
        """Take ``node``, the anchor's A times another B (``regions._second_product``), as the
        region's second accumulator (``Gemm.b2``)."""
        self.second = node
        self.operands = self.operands + (self.external(node.args[1]),)
        self.values[node] = Value(self.add(Op.ACC, (), torch.float32, arg=1, axes=self._tile()),
                                  self._labels(shape_of(node)))

    def snapshot(self) -> tuple:
        """What ``restore`` needs to undo the nodes, inputs and values added after this."""
        return (len(self.nodes), dict(self._cse), len(self.inputs), len(self.bindings), dict(self._input_cse),
                len(self.externals), dict(self._ext_index), dict(self.values), self.operands, self.second)

    def restore(self, state: tuple) -> None:
        (n, self._cse, i, j, self._input_cse, e, self._ext_index, self.values, self.operands,
         self.second) = state
        del self.nodes[n:], self.inputs[i:], self.bindings[j:], self.externals[e:]

    # ---- IR construction -------------------------------------------------------------
    def add(self, op: Op, src: tuple, dtype: torch.dtype, arg=None, axes=None) -> int:
        src = tuple(src)
        if axes is None:
            axes = frozenset().union(*(self.nodes[s].axes for s in src))
            if op in REDUCE:
                axes = axes - {arg}
        key = (op, src, dtype, axes, arg if not isinstance(arg, float) else float.hex(arg))
        if key in self._cse:
            return self._cse[key]
        self.nodes.append(Node(op, src, dtype, frozenset(axes), arg))
        self._cse[key] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def const(self, value, dtype: torch.dtype) -> int:
        if dtype.is_floating_point:
            return self.add(Op.CONST, (), torch.float32, float(value), axes=frozenset())
        if dtype == torch.bool:
            return self.add(Op.CONST, (), torch.bool, bool(value), axes=frozenset())
        return self.add(Op.CONST, (), torch.int64, int(value), axes=frozenset())

    def external(self, node: fx.Node) -> int:
        if node not in self._ext_index:
            self._ext_index[node] = len(self.externals)
            self.externals.append(node)
        return self._ext_index[node]

    # ---- labels ------------------------------------------------------------------------
    def infer_labels(self, shape: tuple, fixed: dict) -> tuple:
        """The one way to read ``shape`` as (B, M, N) that respects ``fixed`` labels."""
        order = [a for a in AXES if a in self.axis_size and self.axis_size[a] > 1]
        dims = [i for i, s in enumerate(shape) if s != 1]
        found: list = []

        def rec(p: int, ai: int, acc: dict):
            if len(found) > 1:
                return
            if p == len(dims):
                found.append(dict(acc))
                return
            for aj in range(ai, len(order)):
                axis, prod = order[aj], 1
                for q in range(p, len(dims)):
                    prod *= shape[dims[q]]
                    if prod > self.axis_size[axis]:
                        break
                    if any(fixed.get(dims[r], axis) != axis for r in range(p, q + 1)):
                        break
                    if prod == self.axis_size[axis]:
                        rec(q + 1, aj + 1, {**acc, **{dims[r]: axis for r in range(p, q + 1)}})
        rec(0, 0, {})
        if not found:
            raise Unfusible(f"shape {list(shape)} does not map onto the GEMM's "
                            f"{self._space()} space")
        if len(found) > 1:
            raise Unfusible(f"shape {list(shape)} maps onto {self._space()} in more than one way")
        return tuple(found[0].get(i) for i in range(len(shape)))

    def _space(self) -> str:
        return "(" + ", ".join(f"{a}={s}" for a, s in self.axis_size.items()) + ")"

    def out_labels(self, node: fx.Node, args) -> tuple:
        shape = shape_of(node)
        fixed: dict = {}
        for a in args:
            if isinstance(a, fx.Node) and a in self.values:
                labels = self.values[a].labels
                offset = len(shape) - len(labels)
                for j, lab in enumerate(labels):
                    if lab is not None:
                        if fixed.setdefault(offset + j, lab) != lab:
                            raise Unfusible("operands disagree on which axis a dimension runs along")
        return self.infer_labels(shape, fixed)

    def reshape_labels(self, labels: tuple, out_shape: tuple) -> tuple:
        groups = []
        for lab in labels:
            if lab is not None and (not groups or groups[-1] != lab):
                groups.append(lab)
        out, gi, prod = [], 0, 1
        for s in out_shape:
            if s == 1:
                out.append(None)
                continue
            if gi >= len(groups):
                raise Unfusible(f"view to {list(out_shape)} mixes the GEMM's axes")
            size = self.axis_size[groups[gi]]
            prod *= s
            if size % prod:
                raise Unfusible(f"view to {list(out_shape)} mixes the GEMM's axes")
            out.append(groups[gi])
            if prod == size:
                gi, prod = gi + 1, 1
        if gi != len(groups):
            raise Unfusible(f"view to {list(out_shape)} mixes the GEMM's axes")
        return tuple(out)

    # ---- operands ----------------------------------------------------------------------
    def operand(self, x, labels: tuple, shape: tuple, float_context: bool) -> int:
        """The IR node for fx argument ``x`` of a node whose output has ``labels``/``shape``."""
        if isinstance(x, fx.Node):
            if x in self.values:
                return self.values[x].idx
            fill = fill_value(x)
            if fill is not None and isinstance(fill, numbers.Number):
                return self.const(fill, dtype_of(x) if not float_context else torch.float32)
            return self.side_input(x, labels, shape)
        if isinstance(x, bool):
            return self.const(x, torch.bool)
        if isinstance(x, numbers.Real):
            if isinstance(x, float) or float_context:
                return self.const(x, torch.float32)
            return self.const(x, torch.int64)
        raise Unfusible(f"argument {x!r} is not a tensor or a scalar")

    def side_input(self, x: fx.Node, labels: tuple, shape: tuple) -> int:
        dtype = dtype_of(x)
        if dtype == torch.float64:
            raise Unfusible(f"{x.name} is float64; float64 epilogues are not fused")
        if dtype.is_complex:
            raise Unfusible(f"{x.name} is complex")
        xs = shape_of(x)
        if len(xs) > len(shape):
            raise Unfusible(f"{x.name} has more dims than the value it feeds")
        offset = len(shape) - len(xs)
        axes = set()
        for j, s in enumerate(xs):
            if s != 1:
                if s != shape[offset + j]:
                    raise Unfusible(f"{x.name} does not broadcast to {list(shape)}")
                axes.add(labels[offset + j])
        axes.discard(None)
        axes = frozenset(axes)
        canon = tuple(self.axis_size[a] if a in labels else 1 for a in AXES if a != "B" or self.batched)
        if not self.batched:
            canon = (1,) + canon
        key = (x, shape, axes)
        if key not in self._input_cse:
            self.inputs.append(Input(x.name, dtype, axes))
            self.bindings.append(InputBinding(self.external(x), shape, canon, axes))
            self._input_cse[key] = len(self.inputs) - 1
        j = self._input_cse[key]
        return self.add(Op.INPUT, (), dtype, j, axes=axes)

    def leaf(self, x: fx.Node) -> Value:
        """``x``, read from outside, as a region value with the one reading of its shape as
        (B, M, N) (Unfusible where there is none or more than one): a value that ops the
        region computes ahead of its epilogue read (``regions._prologue``)."""
        shape = shape_of(x)
        labels = self.infer_labels(shape, {})
        return Value(self.side_input(x, labels, shape), labels)

    def as_float(self, i: int) -> int:
        if self.nodes[i].dtype.is_floating_point:
            return i
        return self.add(Op.CAST, (i,), torch.float32, torch.float32)

    def as_bool(self, i: int) -> int:
        if self.nodes[i].dtype == torch.bool:
            return i
        return self.add(Op.CAST, (i,), torch.bool, torch.bool)

    # ---- generic rules -----------------------------------------------------------------
    def elementwise(self, node: fx.Node, op: Op, args) -> Value:
        labels = self.out_labels(node, args)
        shape, dtype = shape_of(node), dtype_of(node)
        float_out = dtype.is_floating_point
        src = [self.operand(a, labels, shape, float_out and op is not Op.WHERE) for a in args]
        return Value(self.apply(op, src, dtype), labels)

    def apply(self, op: Op, src: list, dtype: torch.dtype) -> int:
        """Add ``op`` over lowered sources, inserting the casts torch's type promotion implies."""
        if dtype == torch.float64:
            raise Unfusible("float64 values are not fused")
        src = list(src)
        if op is Op.WHERE:
            src[0] = self.as_bool(src[0])
            if dtype.is_floating_point:
                src[1], src[2] = self.as_float(src[1]), self.as_float(src[2])
        elif op in (Op.AND, Op.OR, Op.NOT):
            src = [self.as_bool(s) for s in src]
        elif dtype.is_floating_point:
            src = [self.as_float(s) for s in src]
        return self.add(op, tuple(src), dtype)

    def reduce(self, node: fx.Node, op: Op, x, dims, keepdim: bool) -> Value:
        if not isinstance(x, fx.Node) or x not in self.values:
            raise Unfusible("reduces a value from outside the region")
        value = self.values[x]
        shape = shape_of(x)
        rank = len(shape)
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = list(range(rank))
        dims = sorted({d % max(rank, 1) for d in ([dims] if isinstance(dims, int) else dims)})
        real = [d for d in dims if shape[d] != 1]
        out_labels = tuple(None if d in dims else lab for d, lab in enumerate(value.labels)) \
            if keepdim else tuple(lab for d, lab in enumerate(value.labels) if d not in dims)
        dtype = dtype_of(node)
        if not real:  # reducing size-1 dims only: the value itself
            return Value(self.add(Op.CAST, (value.idx,), dtype, dtype), out_labels)
        axes = {value.labels[d] for d in real}
        if len(axes) > 1:
            raise Unfusible(f"reduction over {' and '.join(sorted(axes))} at once "
                            "(a full reduction) is not fusible into one strip")
        (axis,) = axes
        if axis == "B":
            raise Unfusible("reduction over the batch axis is not fusible")
        covered = {d for d, lab in enumerate(value.labels) if lab == axis}
        if covered != set(real):
            raise Unfusible(f"reduction over part of axis {axis} (dims {real} of {list(shape)})")
        other = "N" if axis == "M" else "M"
        if other not in self.nodes[value.idx].axes:
            raise Unfusible(f"reduction along {axis} of a value that was already reduced along "
                            f"{other}: it spans every strip")
        src = value.idx
        if op in (Op.RMAX, Op.RMIN) and not self.nodes[src].dtype.is_floating_point:
            raise Unfusible("max/min of integer values is not fused")
        if dtype.is_floating_point:
            src = self.as_float(src)
        return Value(self.add(op, (src,), dtype, axis), out_labels)

    def view(self, node: fx.Node, x) -> Value:
        if not isinstance(x, fx.Node) or x not in self.values:
            raise Unfusible("views a value from outside the region")
        value = self.values[x]
        return Value(value.idx, self.reshape_labels(value.labels, shape_of(node)))

    def expand(self, node: fx.Node, x) -> Value:
        value = self.values[x]
        return Value(value.idx, self.out_labels(node, [x]))

    def identity(self, node: fx.Node, x) -> Value:
        return self.values[x]


# ---- the op table ------------------------------------------------------------------------
