"""Region finding: from a captured aten graph to GEMM-epilogue regions in the IR.

An anchor is an ``mm`` or ``bmm`` (``linear``, ``matmul``, ``addmm`` and
``baddbmm`` reach us as these after capture). Its region grows over the nodes
after it, in graph order: a node joins when its op has a lowering rule below,
at least one of its operands is already in the region, and every other operand
is independent of the anchor (a side input such as a bias, residual or gamma).
That rule keeps the contracted graph acyclic. Where growth stops, a note says
why, for ``explain``.

Lowering tracks, for each fx dimension of each region value, which axis of the
GEMM's (B, M, N) space it runs along ("labels"; ``None`` for size-1 dims).
Views that split or merge dims within one axis keep the value in the region;
views that mix axes, permutes, and reductions that do not cover exactly one of
M or N end the region.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import torch
import torch.fx as fx

from .capture import descendants
from ..ir import GEMM_DTYPES, REDUCE, Gemm, Input, Node, Op, Operand, Output, Region, Sizes

aten = torch.ops.aten
ANCHORS = {aten.mm.default: False, aten.bmm.default: True}
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


@dataclasses.dataclass(frozen=True)
class OutputBinding:
    node: fx.Node
    shape: tuple


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
    notes: list = dataclasses.field(default_factory=list)


def _meta(node: fx.Node):
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise Unfusible(f"{node.name} has no tensor metadata")
    return val


def _shape(node: fx.Node) -> tuple:
    return tuple(int(s) for s in _meta(node).shape)


def _dtype(node: fx.Node) -> torch.dtype:
    return _meta(node).dtype


def _fill_value(node: fx.Node):
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


class _Builder:
    """Lowers fx nodes into one region's IR, one node at a time."""

    def __init__(self, anchor: fx.Node, batched: bool):
        self.anchor = anchor
        self.batched = batched
        out = _shape(anchor)
        a_node, b_node = anchor.args[0], anchor.args[1]
        self.sizes = Sizes(B=out[0] if batched else 1, M=out[-2], N=out[-1], K=_shape(a_node)[-1])
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
        labels = tuple(ax if size > 1 else None
                       for ax, size in zip(("B", "M", "N") if batched else ("M", "N"), out))
        tile = frozenset({"B", "M", "N"} if batched else {"M", "N"})
        self.values[anchor] = Value(self.add(Op.ACC, (), torch.float32, axes=tile), labels)

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
        shape = _shape(node)
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
            fill = _fill_value(x)
            if fill is not None and isinstance(fill, numbers.Number):
                return self.const(fill, _dtype(x) if not float_context else torch.float32)
            return self.side_input(x, labels, shape)
        if isinstance(x, bool):
            return self.const(x, torch.bool)
        if isinstance(x, numbers.Real):
            if isinstance(x, float) or float_context:
                return self.const(x, torch.float32)
            return self.const(x, torch.int64)
        raise Unfusible(f"argument {x!r} is not a tensor or a scalar")

    def side_input(self, x: fx.Node, labels: tuple, shape: tuple) -> int:
        dtype = _dtype(x)
        if dtype == torch.float64:
            raise Unfusible(f"{x.name} is float64; float64 epilogues are not fused")
        if dtype.is_complex:
            raise Unfusible(f"{x.name} is complex")
        xs = _shape(x)
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
        shape, dtype = _shape(node), _dtype(node)
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
        shape = _shape(x)
        rank = len(shape)
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = list(range(rank))
        dims = sorted({d % max(rank, 1) for d in ([dims] if isinstance(dims, int) else dims)})
        real = [d for d in dims if shape[d] != 1]
        out_labels = tuple(None if d in dims else lab for d, lab in enumerate(value.labels)) \
            if keepdim else tuple(lab for d, lab in enumerate(value.labels) if d not in dims)
        dtype = _dtype(node)
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
        return Value(value.idx, self.reshape_labels(value.labels, _shape(node)))

    def expand(self, node: fx.Node, x) -> Value:
        value = self.values[x]
        return Value(value.idx, self.out_labels(node, [x]))

    def identity(self, node: fx.Node, x) -> Value:
        return self.values[x]


# ---- the op table ------------------------------------------------------------------------

def _unary(op: Op):
    return lambda b, n: b.elementwise(n, op, [n.args[0]])


def _binary(op: Op):
    def rule(b, n):
        x, y = n.args[0], n.args[1]
        alpha = n.kwargs.get("alpha", 1)
        if alpha == 1:
            return b.elementwise(n, op, [x, y])
        labels, shape, dtype = b.out_labels(n, [x, y]), _shape(n), _dtype(n)
        xi, yi = (b.operand(a, labels, shape, True) for a in (x, y))
        scaled = b.apply(Op.MUL, [yi, b.const(alpha, torch.float32)], dtype)
        return Value(b.apply(op, [xi, scaled], dtype), labels)
    return rule


def _cast(b, n):
    x = n.args[0]
    kw = dict(n.kwargs)
    dtype = kw.pop("dtype", None)
    device = kw.pop("device", None)
    for k in ("layout", "memory_format", "non_blocking", "pin_memory"):
        kw.pop(k, None)
    if kw:
        raise Unfusible(f"copy with {sorted(kw)} is not an epilogue op")
    if device is not None and torch.device(device) != _meta(x).device:
        raise Unfusible("moves the value to another device")
    if dtype is None or dtype == _dtype(x):
        return b.identity(n, x)
    return _cast_to(b, x, dtype)


def _cast_to(b, x, dtype):
    if dtype == torch.float64 or dtype.is_complex:
        raise Unfusible(f"cast to {dtype} is not fused")
    value = b.values[x]
    return Value(b.add(Op.CAST, (value.idx,), dtype, dtype), value.labels)


def _convert(b, n):
    return _cast_to(b, n.args[0], n.args[1])


def _pow(b, n):
    x, c = n.args[0], n.args[1]
    if not isinstance(c, numbers.Real) or isinstance(c, bool):
        raise Unfusible("pow with a tensor exponent is not fused")
    if c == 0:
        labels = b.out_labels(n, [x])
        return Value(b.const(1.0, torch.float32), labels)
    labels = b.out_labels(n, [x])
    xi = b.as_float(b.values[x].idx)
    return Value(b.add(Op.POW, (xi,), _dtype(n), float(c)), labels)


def _pow_scalar_base(b, n):
    base, x = n.args[0], n.args[1]
    if not isinstance(base, numbers.Real) or base <= 0:
        raise Unfusible("pow with a non-positive scalar base is not fused")
    labels = b.out_labels(n, [x])
    xi = b.as_float(b.values[x].idx)
    scaled = b.add(Op.MUL, (xi, b.const(math.log(base), torch.float32)), _dtype(n))
    return Value(b.add(Op.EXP, (scaled,), _dtype(n)), labels)


def _clamp(b, n):
    x = n.args[0]
    lo = n.args[1] if len(n.args) > 1 else n.kwargs.get("min")
    hi = n.args[2] if len(n.args) > 2 else n.kwargs.get("max")
    labels = b.out_labels(n, [a for a in (x, lo, hi) if isinstance(a, fx.Node)])
    shape, dtype = _shape(n), _dtype(n)
    floaty = dtype.is_floating_point
    v = b.values[x].idx
    if lo is not None:
        v = b.apply(Op.MAX, [v, b.operand(lo, labels, shape, floaty)], dtype)
    if hi is not None:
        v = b.apply(Op.MIN, [v, b.operand(hi, labels, shape, floaty)], dtype)
    return Value(v, labels)


def _bound(op: Op):
    """clamp_min / clamp_max: one bound, scalar or tensor."""
    def rule(b, n):
        x, bound = n.args[0], n.args[1]
        labels, shape, dtype = b.out_labels(n, [x, bound]), _shape(n), _dtype(n)
        floaty = dtype.is_floating_point
        return Value(b.apply(op, [b.values[x].idx, b.operand(bound, labels, shape, floaty)], dtype),
                     labels)
    return rule


def _where(b, n):
    return b.elementwise(n, Op.WHERE, list(n.args[:3]))


def _masked_fill(b, n):
    x, mask, value = n.args[0], n.args[1], n.args[2]
    return b.elementwise(n, Op.WHERE, [mask, value, x])


def _isnan(b, n):
    x = n.args[0]
    labels = b.out_labels(n, [x])
    v = b.values[x].idx
    return Value(b.add(Op.NE, (v, v), torch.bool), labels)


def _isinf(b, n):
    x = n.args[0]
    labels = b.out_labels(n, [x])
    v = b.add(Op.ABS, (b.values[x].idx,), _dtype(x))
    return Value(b.add(Op.EQ, (v, b.const(math.inf, torch.float32)), torch.bool), labels)


def _sum(b, n):
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    keepdim = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    return b.reduce(n, Op.SUM, n.args[0], dims, keepdim)


def _full_sum(b, n):
    raise Unfusible("sum over every dimension (a full reduction) is not fusible into one strip")


def _amax(op):
    def rule(b, n):
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", [])
        keepdim = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        return b.reduce(n, op, n.args[0], dims, keepdim)
    return rule


def _gather(b, n):
    """gather(x, dim, index) with one index per row: sum(where(iota == index, x, 0)).

    A row whose index matches no column (out of range) gives NaN rather than a silent 0.
    """
    x, dim, index = n.args[0], n.args[1], n.args[2]
    if x not in b.values or not isinstance(index, fx.Node) or index in b.values:
        raise Unfusible("gather needs a region value and an index computed outside the region")
    value = b.values[x]
    shape = _shape(x)
    dim %= len(shape)
    axis = value.labels[dim]
    if axis not in ("M", "N") or sum(1 for lab in value.labels if lab == axis) != 1:
        raise Unfusible("gather along a dimension that is not a whole M or N axis")
    ishape = _shape(index)
    if len(ishape) != len(shape) or ishape[dim] != 1 or any(
            ishape[d] not in (1, shape[d]) for d in range(len(shape)) if d != dim):
        raise Unfusible("gather with more than one index per row is not fused")
    out_labels = tuple(None if d == dim else lab for d, lab in enumerate(value.labels))
    out_shape = _shape(n)
    idx = b.side_input(index, out_labels, out_shape)
    xi = b.as_float(value.idx)
    hit = b.add(Op.EQ, (b.add(Op.IOTA, (), torch.int64, axis, axes=frozenset({axis})), idx), torch.bool)
    picked = b.add(Op.SUM, (b.add(Op.WHERE, (hit, xi, b.const(0.0, torch.float32)), _dtype(n)),),
                   _dtype(n), axis)
    count = b.add(Op.SUM, (b.add(Op.CAST, (hit,), torch.float32, torch.float32),), torch.float32, axis)
    found = b.add(Op.GT, (count, b.const(0.0, torch.float32)), torch.bool)
    result = b.add(Op.WHERE, (found, picked, b.const(math.nan, torch.float32)), _dtype(n))
    return Value(result, out_labels)


def _fill_like(b, n):
    """zeros_like / ones_like / full_like of a region value: a constant with its shape."""
    value = b.values[n.args[0]]
    fill = _fill_value(n)
    if not isinstance(fill, numbers.Number):
        raise Unfusible("fill with a non-scalar value")
    return Value(b.const(fill, _dtype(n)), value.labels)


def _view(b, n):
    return b.view(n, n.args[0])


def _expand(b, n):
    return b.expand(n, n.args[0])


def _identity(b, n):
    return b.identity(n, n.args[0])


def _div(b, n):
    mode = n.kwargs.get("rounding_mode")
    if mode is not None:
        raise Unfusible(f"division with rounding_mode={mode!r} is not fused")
    return b.elementwise(n, Op.DIV, [n.args[0], n.args[1]])


RULES = {
    aten.neg.default: _unary(Op.NEG), aten.abs.default: _unary(Op.ABS),
    aten.exp.default: _unary(Op.EXP), aten.expm1.default: _unary(Op.EXPM1),
    aten.log.default: _unary(Op.LOG), aten.log1p.default: _unary(Op.LOG1P),
    aten.sqrt.default: _unary(Op.SQRT), aten.rsqrt.default: _unary(Op.RSQRT),
    aten.reciprocal.default: _unary(Op.RECIPROCAL), aten.tanh.default: _unary(Op.TANH),
    aten.sigmoid.default: _unary(Op.SIGMOID), aten.erf.default: _unary(Op.ERF),
    aten.relu.default: _unary(Op.RELU), aten.sin.default: _unary(Op.SIN),
    aten.cos.default: _unary(Op.COS), aten.logical_not.default: _unary(Op.NOT),
    aten.bitwise_not.default: _unary(Op.NOT),
    aten.add.Tensor: _binary(Op.ADD), aten.add.Scalar: _binary(Op.ADD),
    aten.sub.Tensor: _binary(Op.SUB), aten.sub.Scalar: _binary(Op.SUB),
    aten.mul.Tensor: _binary(Op.MUL), aten.mul.Scalar: _binary(Op.MUL),
    aten.div.Tensor: _div, aten.div.Scalar: _div, aten.div.Tensor_mode: _div,
    aten.maximum.default: _binary(Op.MAX), aten.minimum.default: _binary(Op.MIN),
    aten.eq.Tensor: _binary(Op.EQ), aten.eq.Scalar: _binary(Op.EQ),
    aten.ne.Tensor: _binary(Op.NE), aten.ne.Scalar: _binary(Op.NE),
    aten.lt.Tensor: _binary(Op.LT), aten.lt.Scalar: _binary(Op.LT),
    aten.le.Tensor: _binary(Op.LE), aten.le.Scalar: _binary(Op.LE),
    aten.gt.Tensor: _binary(Op.GT), aten.gt.Scalar: _binary(Op.GT),
    aten.ge.Tensor: _binary(Op.GE), aten.ge.Scalar: _binary(Op.GE),
    aten.logical_and.default: _binary(Op.AND), aten.logical_or.default: _binary(Op.OR),
    aten.bitwise_and.Tensor: _binary(Op.AND), aten.bitwise_or.Tensor: _binary(Op.OR),
    aten.where.self: _where, aten.masked_fill.Scalar: _masked_fill,
    aten.masked_fill.Tensor: _masked_fill,
    aten.isnan.default: _isnan, aten.isinf.default: _isinf,
    aten.pow.Tensor_Scalar: _pow, aten.pow.Scalar: _pow_scalar_base,
    aten.clamp.default: _clamp, aten.clamp.Tensor: _clamp,
    aten.clamp_min.default: _bound(Op.MAX), aten.clamp_max.default: _bound(Op.MIN),
    aten._to_copy.default: _cast, aten.clone.default: _identity, aten.alias.default: _identity,
    aten.lift_fresh_copy.default: _identity,
    aten.sum.dim_IntList: _sum, aten.sum.default: _full_sum,
    aten.amax.default: _amax(Op.RMAX), aten.amin.default: _amax(Op.RMIN),
    aten.gather.default: _gather,
    aten.zeros_like.default: _fill_like, aten.ones_like.default: _fill_like,
    aten.full_like.default: _fill_like,
    aten.view.default: _view, aten._unsafe_view.default: _view, aten.reshape.default: _view,
    aten.unsqueeze.default: _view, aten.squeeze.dim: _view, aten.squeeze.dims: _view,
    aten.squeeze.default: _view, aten.expand.default: _expand,
}
for _name in ("ScalarSelf", "ScalarOther", "Scalar"):
    if hasattr(aten.where, _name):
        RULES[getattr(aten.where, _name)] = _where
if hasattr(torch.ops, "prims") and hasattr(torch.ops.prims, "convert_element_type"):
    RULES[torch.ops.prims.convert_element_type.default] = _convert


# ---- growth ------------------------------------------------------------------------------

def _unfusible_anchor(anchor: fx.Node) -> str:
    a, b = anchor.args[0], anchor.args[1]
    try:
        da, db, dout = _dtype(a), _dtype(b), _dtype(anchor)
        dev = _meta(anchor).device
    except Unfusible as e:
        return str(e)
    if da != db or da not in GEMM_DTYPES:
        return f"GEMM dtypes {da}, {db} are not fused (fp32, fp16 and bf16 are)"
    if dout != da:
        return f"GEMM output dtype {dout} differs from its inputs"
    if dev.type not in ("cpu", "cuda"):
        return f"tensors on {dev.type} are not fused"
    out = _shape(anchor)
    if 0 in out:
        return f"the GEMM output {list(out)} is empty"
    return ""


def _major(node: fx.Node, last: str, second: str) -> str:
    """Which of an operand's two matrix dims has unit stride ("" if neither)."""
    val = _meta(node)
    if val.dim() < 2:
        return ""
    st, sh = val.stride(), val.shape
    if st[-1] == 1 or sh[-1] == 1:
        return last
    if st[-2] == 1 or sh[-2] == 1:
        return second
    return ""


def grow(anchor: fx.Node, order: dict, claimed: frozenset = frozenset()) -> Candidate:
    cand = Candidate(anchor=anchor)
    cand.reason = _unfusible_anchor(anchor)
    if cand.reason:
        return cand
    b = _Builder(anchor, ANCHORS[anchor.target])
    members = [anchor]
    member_set = {anchor}
    downstream = descendants([anchor])
    graph_nodes = list(anchor.graph.nodes)
    for node in graph_nodes[order[anchor] + 1:]:
        if node not in downstream or node.op != "call_function" or node in claimed:
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
        try:
            value = rule(b, node)
        except Unfusible as e:
            cand.notes.append(f"{node.name}: {e}")
            continue
        b.values[node] = value
        members.append(node)
        member_set.add(node)
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
            if canon != math.prod(_shape(m)):
                cand.reason = f"internal: output {m.name} does not match its canonical layout"
                return cand
            outputs.append(Output(value.idx, _dtype(m), frozenset(axes), m.name))
            cand.outputs.append(OutputBinding(m, _shape(m)))
    a_node, b_node = anchor.args[0], anchor.args[1]
    gemm = Gemm(Operand(a_node.name, _dtype(a_node), _major(a_node, "K", "M")),
                Operand(b_node.name, _dtype(b_node), _major(b_node, "N", "K")),
                ANCHORS[anchor.target], _dtype(anchor))
    cand.region = Region("gemm_epilogue", gemm, tuple(b.inputs), tuple(b.nodes), tuple(outputs),
                         b.sizes)
    return cand


def find_regions(gm: fx.GraphModule) -> list:
    """One candidate per anchor, in graph order; a node joins at most one region (the
    first anchor's that reaches it), so regions never overlap."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    claimed: set = set()
    cands = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in ANCHORS:
            cand = grow(n, order, frozenset(claimed))
            claimed.update(cand.members)
            cands.append(cand)
    return cands


def find_chains(cands: list) -> list:
    """Back-to-back GEMMs: lists of candidate indices where an output of candidate i is the
    A operand of candidate i+1's GEMM and nothing else reads it."""
    by_output = {}
    for i, c in enumerate(cands):
        if c.region is not None and not c.reason:
            for k, ob in enumerate(c.outputs):
                by_output[ob.node] = (i, k)
    nxt = {}
    for j, c in enumerate(cands):
        if c.region is None or c.reason:
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


__all__ = ["Candidate", "InputBinding", "OutputBinding", "RULES", "Unfusible", "find_chains",
           "find_regions"]


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
