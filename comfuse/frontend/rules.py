"""The lowering rule of each aten op an epilogue may hold: ``RULES[target](builder, node)``
returns the node's IR value or raises ``Unfusible`` with the reason."""
from __future__ import annotations

import math
import numbers

import torch
import torch.fx as fx

from ..ir import Op
from .builder import Unfusible, Value, dtype_of, fill_value, meta_of, shape_of

aten = torch.ops.aten


def _unary(op: Op):
    return lambda b, n: b.elementwise(n, op, [n.args[0]])


def _binary(op: Op):
    def rule(b, n):
        x, y = n.args[0], n.args[1]
        alpha = n.kwargs.get("alpha", 1)
        if alpha == 1:
            return b.elementwise(n, op, [x, y])
        labels, shape, dtype = b.out_labels(n, [x, y]), shape_of(n), dtype_of(n)
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
    if device is not None and torch.device(device) != meta_of(x).device:
        raise Unfusible("moves the value to another device")
    if dtype is None or dtype == dtype_of(x):
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
    return Value(b.add(Op.POW, (xi,), dtype_of(n), float(c)), labels)


def _pow_scalar_base(b, n):
    base, x = n.args[0], n.args[1]
    if not isinstance(base, numbers.Real) or base <= 0:
        raise Unfusible("pow with a non-positive scalar base is not fused")
    labels = b.out_labels(n, [x])
    xi = b.as_float(b.values[x].idx)
    scaled = b.add(Op.MUL, (xi, b.const(math.log(base), torch.float32)), dtype_of(n))
    return Value(b.add(Op.EXP, (scaled,), dtype_of(n)), labels)


def _clamp(b, n):
    x = n.args[0]
    lo = n.args[1] if len(n.args) > 1 else n.kwargs.get("min")
    hi = n.args[2] if len(n.args) > 2 else n.kwargs.get("max")
    labels = b.out_labels(n, [a for a in (x, lo, hi) if isinstance(a, fx.Node)])
    shape, dtype = shape_of(n), dtype_of(n)
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
        labels, shape, dtype = b.out_labels(n, [x, bound]), shape_of(n), dtype_of(n)
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
    v = b.add(Op.ABS, (b.values[x].idx,), dtype_of(x))
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
    shape = shape_of(x)
    dim %= len(shape)
    axis = value.labels[dim]
    if axis not in ("M", "N") or sum(1 for lab in value.labels if lab == axis) != 1:
        raise Unfusible("gather along a dimension that is not a whole M or N axis")
    ishape = shape_of(index)
    if len(ishape) != len(shape) or ishape[dim] != 1 or any(
            ishape[d] not in (1, shape[d]) for d in range(len(shape)) if d != dim):
        raise Unfusible("gather with more than one index per row is not fused")
    out_labels = tuple(None if d == dim else lab for d, lab in enumerate(value.labels))
    out_shape = shape_of(n)
    idx = b.side_input(index, out_labels, out_shape)
    xi = b.as_float(value.idx)
    hit = b.add(Op.EQ, (b.add(Op.IOTA, (), torch.int64, axis, axes=frozenset({axis})), idx), torch.bool)
    picked = b.add(Op.SUM, (b.add(Op.WHERE, (hit, xi, b.const(0.0, torch.float32)), dtype_of(n)),),
                   dtype_of(n), axis)
    count = b.add(Op.SUM, (b.add(Op.CAST, (hit,), torch.float32, torch.float32),), torch.float32, axis)
    found = b.add(Op.GT, (count, b.const(0.0, torch.float32)), torch.bool)
    result = b.add(Op.WHERE, (found, picked, b.const(math.nan, torch.float32)), dtype_of(n))
    return Value(result, out_labels)


def _fill_like(b, n):
    """zeros_like / ones_like / full_like of a region value: a constant with its shape."""
    value = b.values[n.args[0]]
    fill = fill_value(n)
    if not isinstance(fill, numbers.Number):
        raise Unfusible("fill with a non-scalar value")
    return Value(b.const(fill, dtype_of(n)), value.labels)


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
