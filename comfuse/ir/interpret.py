"""Reference interpreter: the living definition of every op, in plain torch.

It is the oracle for passes and generated kernels. Values are 3-D tensors in
the canonical layout (B|1, M|1, N|1): an axis a value does not vary along has
size 1 and broadcasts.

``compute_dtype=torch.float64`` (the default) evaluates every floating-point
node in float64 and ignores casts between floating-point types: exact math to
compare kernels against. ``compute_dtype=None`` evaluates each node in the dtype
eager PyTorch would use (rounding after every op), like the unfused program.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .nodes import REDUCE, Op, Region

_DIM = {"B": 0, "M": 1, "N": 2}

UNARY_FNS = {
    Op.NEG: torch.neg, Op.ABS: torch.abs, Op.EXP: torch.exp, Op.EXPM1: torch.expm1,
    Op.LOG: torch.log, Op.LOG1P: torch.log1p, Op.SQRT: torch.sqrt, Op.RSQRT: torch.rsqrt,
    Op.RECIPROCAL: torch.reciprocal, Op.TANH: torch.tanh, Op.SIGMOID: torch.sigmoid,
    Op.ERF: torch.erf, Op.RELU: torch.relu, Op.SIN: torch.sin, Op.COS: torch.cos,
    Op.NOT: torch.logical_not,
}
BINARY_FNS = {
    Op.ADD: torch.add, Op.SUB: torch.sub, Op.MUL: torch.mul, Op.DIV: torch.true_divide,
    Op.MAX: torch.maximum, Op.MIN: torch.minimum, Op.EQ: torch.eq, Op.NE: torch.ne,
    Op.LT: torch.lt, Op.LE: torch.le, Op.GT: torch.gt, Op.GE: torch.ge,
    Op.AND: torch.logical_and, Op.OR: torch.logical_or,
}


def canonical_shape(region: Region, axes) -> tuple[int, int, int]:
    s = region.sizes
    return tuple(s.of(a) if a in axes else 1 for a in ("B", "M", "N"))


def second_b(region: Region, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The second product's B operand (``Gemm.b2``), which comes after the side inputs."""
    if not region.dual or len(inputs) <= len(region.inputs):
        raise ValueError("the region's second product needs its B operand after the side inputs")
    return inputs[len(region.inputs)]


def evaluate(region: Region, a: torch.Tensor, b: torch.Tensor, inputs: Sequence[torch.Tensor],
             compute_dtype: torch.dtype | None = torch.float64) -> list[torch.Tensor]:
    """Evaluate ``region`` on operands ``a`` ([B?, M, K]), ``b`` ([B?, K, N]) and side
    inputs in canonical 3-D layout (then a second product's B); return the outputs in
    canonical 3-D layout."""
    return run_nodes(region, a, b, inputs, compute_dtype)[0]


def rows_independent(region: Region) -> bool:
    """Whether each row of ``region``'s outputs depends only on the same row of its inputs (no
    reduction along M or B, no row index): it can then be evaluated a slice of rows at a time."""
    return not any((n.op in REDUCE and n.arg in ("M", "B")) or (n.op is Op.IOTA and n.arg == "M")
                   for n in region.nodes)


def evaluate_by_rows(region: Region, a: torch.Tensor, b: torch.Tensor, inputs: Sequence[torch.Tensor],
                     rows: int) -> list[torch.Tensor]:
    """``evaluate`` (float64), ``rows`` rows of A and of the side inputs at a time, for a region
    whose rows are independent (``rows_independent``): a vocabulary-wide row's intermediates
    held for a slice of the rows only. The outputs are whole."""
    M = region.sizes.M
    if rows >= M:
        return evaluate(region, a, b, inputs)
    if not rows_independent(region):
        raise ValueError("evaluate_by_rows: the region's rows depend on one another")
    parts = []
    for m0 in range(0, M, rows):
        m = min(rows, M - m0)
        part = dataclasses.replace(region, sizes=dataclasses.replace(region.sizes, M=m))
        n = len(region.inputs)  # (a second product's B, after them, is the whole of B2)
        ins = [t if j >= n or t.shape[1] == 1 else t[:, m0:m0 + m] for j, t in enumerate(inputs)]
        parts.append(evaluate(part, a[:, m0:m0 + m], b, ins))
    return [torch.cat([p[k] for p in parts], 1) if region.outputs[k].axes & {"M"} else parts[0][k]
            for k in range(len(region.outputs))]


def evaluate_with_scale(region: Region, a: torch.Tensor, b: torch.Tensor,
                        inputs: Sequence[torch.Tensor]) -> tuple[list, list]:
    """Exact (float64) outputs and, for each, an error scale: a running forward-error
    bound in units of the rounding unit. A kernel that rounds every op to precision u is
    off by about u * scale, so ``|out - ref| / scale`` measures its error even where the
    result cancels to near zero (a sum of normalised values) or the problem is
    ill-conditioned (LayerNorm of a nearly constant row)."""
    return run_nodes(region, a, b, inputs, torch.float64, with_scale=True)


_U = 2.0 ** -24  # fp32's unit roundoff: converts a squared error back into scale units


def _scale(op: Op, node, x: list, sx: list, v: torch.Tensor) -> torch.Tensor:
    """How the error bound grows through one op: |f'(x)| * scale(x) + |f(x)|."""
    if not v.dtype.is_floating_point:
        return torch.zeros(v.shape, dtype=torch.float64, device=v.device)
    av = v.abs()
    if op in (Op.NEG, Op.ABS, Op.RELU):
        return sx[0]
    if op is Op.CAST:
        return sx[0] + av
    if op in (Op.ADD, Op.SUB):
        return sx[0] + sx[1]
    if op is Op.MUL:  # first order, plus the product of the two errors (it rules near zero)
        return sx[0] * x[1].abs() + x[0].abs() * sx[1] + _U * sx[0] * sx[1]
    if op is Op.DIV:
        return (sx[0] + (x[0] / x[1]).abs() * sx[1]) / x[1].abs()
    if op in (Op.MAX, Op.MIN):
        return torch.maximum(sx[0], sx[1])
    if op is Op.WHERE:
        return torch.where(x[0], sx[1], sx[2])
    if op is Op.SUM:
        return sx[0].sum(_DIM[node.arg], keepdim=True) + av
    if op in (Op.RMAX, Op.RMIN):
        return sx[0].amax(_DIM[node.arg], keepdim=True)
    xx = x[0]
    if op is Op.POW and node.arg == 2.0:  # (x + e)^2 - x^2 = 2 x e + e^2
        return 2 * xx.abs() * sx[0] + av + _U * sx[0] * sx[0]
    slope = {
        Op.EXP: lambda: av, Op.EXPM1: lambda: xx.exp(), Op.LOG: lambda: 1 / xx.abs(),
        Op.LOG1P: lambda: 1 / (1 + xx).abs(), Op.SQRT: lambda: 0.5 / av,
        Op.RSQRT: lambda: 0.5 * av / xx.abs(), Op.RECIPROCAL: lambda: av * av,
        Op.TANH: lambda: 1 - v * v, Op.SIGMOID: lambda: v * (1 - v),
        Op.ERF: lambda: 1.1283791670955126 * torch.exp(-xx * xx),
        Op.SIN: lambda: xx.cos().abs(), Op.COS: lambda: xx.sin().abs(),
        Op.POW: lambda: (node.arg * xx.abs() ** (node.arg - 1)).abs(),
    }[op]()
    return slope.abs() * sx[0] + av


def run_nodes(region: Region, a, b, inputs, compute_dtype, with_scale: bool = False, shifts=None,
         iota_offset: int = 0, gemm_dtype=None, acc=None):
    """``gemm_dtype``: multiply in this dtype (e.g. bf16 on tensor cores) and convert the
    product to the compute dtype, instead of multiplying in the compute dtype. ``acc``:
    the product, already computed (``a`` and ``b`` are then not read)."""
    exact = compute_dtype is not None

    def fix(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if dtype.is_floating_point:
            return value.to(compute_dtype if exact else dtype)
        return value.to(dtype)

    s = region.sizes
    device = acc.device if acc is not None else a.device
    vals: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    for node in region.nodes:
        x = [vals[i] for i in node.src]
        op = node.op
        if op is Op.ACC:
            dt = compute_dtype if exact else region.gemm.out_dtype
            rhs = second_b(region, inputs) if node.arg == 1 else b
            if acc is not None:
                v = acc.reshape(s.B, s.M, s.N)
            elif gemm_dtype is not None:
                v = torch.matmul(a.to(gemm_dtype), rhs.to(gemm_dtype)).to(dt).reshape(s.B, s.M, s.N)
            else:
                v = torch.matmul(a.to(dt), rhs.to(dt)).reshape(s.B, s.M, s.N)
        elif op is Op.INPUT:
            v = inputs[node.arg]
            if v.dim() != 3:
                raise ValueError(f"input {node.arg} must be given in canonical 3-D layout")
        elif op is Op.CONST:
            v = torch.full((1, 1, 1), node.arg, device=device)  # (no host copy: capturable)
        elif op is Op.SHIFT:  # a per-row constant near the row: its mean (any value gives the same result)
            v = vals[shifts[node.arg]].mean(2, keepdim=True)
        elif op is Op.IOTA:
            shape = canonical_shape(region, {node.arg})
            v = torch.arange(s.of(node.arg), device=device).reshape(shape)
            if node.arg == "N":
                v = v + iota_offset  # a slice of the columns (chunked evaluation)
        elif op is Op.CAST:
            target = node.arg
            if exact and target.is_floating_point and x[0].dtype.is_floating_point:
                v = x[0]  # exact mode: no rounding between floating-point types
            else:
                v = x[0].to(target)
        elif op is Op.POW:
            v = torch.pow(x[0], node.arg)
        elif op in UNARY_FNS:
            v = UNARY_FNS[op](x[0])
        elif op in BINARY_FNS:
            v = BINARY_FNS[op](x[0], x[1])
        elif op is Op.WHERE:
            v = torch.where(x[0], x[1], x[2])
        elif op is Op.SUM:
            v = x[0].sum(_DIM[node.arg], keepdim=True)
        elif op is Op.RMAX:
            v = x[0].amax(_DIM[node.arg], keepdim=True)
        elif op is Op.RMIN:
            v = x[0].amin(_DIM[node.arg], keepdim=True)
        else:  # pragma: no cover
            raise NotImplementedError(f"reference interpreter has no rule for {op}")
        vals.append(fix(v.to(device), node.dtype))
        if with_scale:
            if op is Op.ACC:
                rhs = second_b(region, inputs) if node.arg == 1 else b
                sc = torch.matmul(a.to(compute_dtype).abs(), rhs.to(compute_dtype).abs()).reshape(s.B, s.M, s.N)
            elif op in (Op.INPUT, Op.CONST, Op.IOTA):
                sc = vals[-1].abs().to(torch.float64) if vals[-1].dtype.is_floating_point else \
                    torch.zeros(vals[-1].shape, dtype=torch.float64, device=vals[-1].device)
            else:
                sc = _scale(op, node, x, [scales[i] for i in node.src], vals[-1])
            scales.append(sc.to(torch.float64))
    outs, out_scales = [], []
    for out in region.outputs:
        shape = canonical_shape(region, out.axes)
        v = vals[out.node].expand(shape)
        outs.append(v if exact else v.to(out.dtype))
        if with_scale:
            out_scales.append(scales[out.node].expand(shape))
    return outs, out_scales
