"""Backward of a split (one-pass) region without its full-width intermediate.

A loss over a vocabulary-wide row (cross-entropy: per-row statistics of the logits, then
a few per-row numbers) has a gradient that needs the logits again, but never all of them
at once. This recomputes them a slice of N at a time:

1. statistics pass: every slice's GEMM and tile values, merged into the per-row
   statistics (no autograd);
2. the combine step under autograd, on the statistics as leaves: the gradient of each
   output with respect to each statistic, per row;
3. gradient pass: every slice again, now under autograd, pulled back through a surrogate
   whose gradient with respect to the slice's tile values is what each statistic's is:
   ``g * t`` for a sum, ``g * softmax-weight * t`` for a log-sum-exp, ``g * [t == max]``
   for a maximum, ``g * t / n + g2 * (t - mean)^2`` for moments.

Peak extra memory is a few [M, slice] tensors instead of [M, N] (a slice holds up to
4096 columns, fewer when M is large: 1024 at M = 8192), besides the gradient buffers themselves: each slice's gradient is written
into a buffer of B's layout, never padded to the full width. Every step is plain torch: the GEMMs run in the operands' dtype on cuBLAS (as
eager's do; in fp32 they took 20x longer), the rest in fp32 with the IR's reference
semantics.
"""
from __future__ import annotations

import dataclasses

import torch

from ..ir.interpret import _run
from ..ir.nodes import Output
from ..planner.onepass import OnePass, evaluate_combine
from ..planner.onepass import parts as parts_of

CHUNK = 4096  # widest slice
SLICE_ELEMENTS = 1 << 23  # an [M, slice] fp32 temporary stays within 32 MB where M allows


def _slice_inputs(op: OnePass, inputs, n0: int, n1: int) -> list:
    out = []
    for spec, t in zip(op.tile.inputs, inputs):
        out.append(t[:, :, n0:n1] if "N" in spec.axes and t.shape[2] > 1 else t)
    return out


def _tile_values(op: OnePass, a3, b3, inputs, n0: int, n1: int) -> list:
    """The statistics' tile values on columns [n0, n1), in fp32 (differentiable)."""
    return _piece_values(op, a3, b3[:, :, n0:n1], _slice_inputs(op, inputs, n0, n1), n0, n1)


def _gemm_dtype(a3, b3):
    """The dtype the slices' GEMMs run in: the operands' own when both are fp16 or bf16
    (tensor cores, as eager's GEMM), else fp32."""
    return a3.dtype if a3.dtype in (torch.float16, torch.bfloat16) and a3.dtype == b3.dtype else torch.float32


def _piece_values(op: OnePass, a3, b_piece, in_pieces, n0: int, n1: int, acc=None) -> list:
    """As ``_tile_values``, given B's and the side inputs' slices already cut (or the
    slice's GEMM product ``acc``, fp32)."""
    r = op.tile
    piece = r.replace(sizes=dataclasses.replace(r.sizes, N=n1 - n0),
                      outputs=tuple(Output(st.node, torch.float32, r.nodes[st.node].axes) for st in op.stats))
    shifts = {i: st.node for i, st in enumerate(op.stats) if st.kind == "shift"}
    low = None if acc is not None else _gemm_dtype(a3, b_piece)
    return _run(piece, a3, b_piece, in_pieces, torch.float32, gemm_dtype=low,
                shifts=shifts, iota_offset=n0, acc=acc)[0]


def _merge(kind: str, acc, v):
    if kind == "sum":
        s = v.sum(2, keepdim=True)
        return s if acc is None else acc + s
    if kind in ("max", "shift"):
        m = v.amax(2, keepdim=True)
        return m if acc is None else torch.maximum(acc, m)
    if kind == "min":
        m = v.amin(2, keepdim=True)
        return m if acc is None else torch.minimum(acc, m)
    if kind == "lse":
        m = torch.logsumexp(v, 2, keepdim=True)
        return m if acc is None else torch.logaddexp(acc, m)
    # moments: (count, mean, M2) merged by Chan's formula
    n = torch.full_like(v[:, :, :1], float(v.shape[2]))
    mean = v.mean(2, keepdim=True)
    m2 = ((v - mean) ** 2).sum(2, keepdim=True)
    if acc is None:
        return n, mean, m2
    na, ma, m2a = acc
    tot = na + n
    d = mean - ma
    return tot, ma + d * n / tot, m2a + m2 + d * d * na * n / tot


def merge_slices(op: OnePass, ws: torch.Tensor) -> list:
    """The statistics as the slice loop below merges them, from a split kernel's workspace
    ``ws`` [statistic arrays, CHUNKS, M] (``Kernel.split_statistics``): each [1, M, 1]
    (moments: (count, mean, M2))."""
    acc, j = [], 0
    for st in op.stats:
        if st.kind == "sum":
            acc.append(ws[j].sum(0))
        elif st.kind == "max":
            acc.append(ws[j].amax(0))
        elif st.kind == "min":
            acc.append(ws[j].amin(0))
        elif st.kind == "lse":
            m, s = ws[j], ws[j + 1]
            row = m.amax(0)
            scaled = torch.where(m > float("-inf"), s * torch.exp(m - row), torch.zeros_like(s))
            acc.append(row + torch.log(scaled.sum(0)))
        elif st.kind == "moments":  # Chan: mean = sum n_c mean_c / n; M2 = sum M2_c + n_c (mean_c - mean)^2
            n, mean, m2 = ws[j], ws[j + 1], ws[j + 2]
            total = n.sum(0)
            row_mean = (n * mean).sum(0) / total.clamp_min(1.0)
            row_m2 = (m2 + n * (mean - row_mean) ** 2).sum(0)
            acc.append(tuple(v.view(1, -1, 1) for v in (total, row_mean, row_m2)))
            j += 3
            continue
        else:
            raise ValueError(f"no workspace merge for a {st.kind} statistic")
        acc[-1] = acc[-1].view(1, -1, 1)
        j += len(parts_of(st))
    return acc


def backward(op: OnePass, views, grads, chunk: int | None = None, statistics=None) -> None:
    """Accumulate into the leaves behind ``views()`` (a function returning a3 [B, M, K],
    b3 [B, K, N] and the canonical side inputs, built from tensors that require grad) the
    gradients of the region's outputs, given ``grads`` (canonical [B, M|1, 1], or None).
    ``statistics()``, when given, returns the merged statistics (``merge_slices`` of the
    fused kernel's workspace) instead of the first pass over the slices in torch, or None
    to have that pass run."""
    N = op.tile.sizes.N
    rows = op.tile.sizes.B * op.tile.sizes.M
    chunk = chunk or max(min(CHUNK, 256), min(CHUNK, SLICE_ELEMENTS // max(rows, 1) // 128 * 128))
    with torch.no_grad():  # 1. the statistics
        a3, b3, inputs = views()
        acc = statistics() if statistics is not None else None
        if acc is None:
            acc = [None] * len(op.stats)
            for n0 in range(0, N, chunk):
                values = _tile_values(op, a3, b3, inputs, n0, min(N, n0 + chunk))
                acc = [_merge(st.kind, a, v.float()) for st, a, v in zip(op.stats, acc, values)]
    merged, leaves = {}, []
    for i, (st, a) in enumerate(zip(op.stats, acc)):
        parts = {"mean": a[1], "m2": a[2]} if st.kind == "moments" else {"": a}
        for part, value in parts.items():
            leaf = value.detach().requires_grad_(True)
            merged[(i, part)] = leaf
            leaves.append(((i, part), leaf))
    with torch.enable_grad():  # 2. outputs -> statistics
        outs = evaluate_combine(op, merged, [t.detach().float() if t.is_floating_point() else t
                                             for t in inputs], a3.device)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if not pairs:
            return
        got = torch.autograd.grad([o for o, _ in pairs], [leaf for _, leaf in leaves],
                                  [g.float().reshape(o.shape) for o, g in pairs], allow_unused=True)
    g_stat = {key: (g if g is not None else torch.zeros_like(leaf)) for (key, leaf), g in zip(leaves, got)}
    # statistics whose gradient is exactly zero everywhere (cross-entropy's max: the shift
    # cancels in the combine) cost the slices nothing: one check per statistic, here
    idle = {i for i, st in enumerate(op.stats)
            if not any(bool(g_stat[key].any()) for key in g_stat if key[0] == i)}
    # 3. statistics -> slices of the GEMM and the side inputs. Autograd runs from each
    # slice's GEMM product (an fp32 leaf) to the surrogate only; the two gradient GEMMs are
    # explicit, in the operands' dtype, and their results go straight into buffers of the
    # full operands' layout (autograd through a slice view would pad every slice's
    # gradient to the full [K, N]). The buffers are pushed back through the canonical
    # views once at the end.
    with torch.enable_grad():
        a3, b3, inputs = views()
    dt = _gemm_dtype(a3, b3)
    a_op = a3.detach().to(dt)
    grad_a = torch.zeros(a3.shape, dtype=torch.float32, device=a3.device) if a3.requires_grad else None
    grad_b = torch.empty_like(b3) if b3.requires_grad else None
    grad_in = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) if t.requires_grad else None
               for t in inputs]
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        b_op = b3[:, :, n0:n1].detach().to(dt)
        in_pieces = [p.detach().requires_grad_(t.requires_grad)
                     for p, t in zip(_slice_inputs(op, inputs, n0, n1), inputs)]
        product = torch.matmul(a_op, b_op).float().requires_grad_(True)
        with torch.enable_grad():
            values = _piece_values(op, None, None, in_pieces, n0, n1, acc=product)
            surrogate = None
            for i, (st, v) in enumerate(zip(op.stats, values)):
                if not v.requires_grad or i in idle:
                    continue  # no path to the operands, or a zero gradient (a max that cancels)
                v = v.float()
                if st.kind == "sum":
                    term = (g_stat[(i, "")] * v).sum()
                elif st.kind == "lse":
                    w = torch.exp(v.detach() - merged[(i, "")].detach())
                    term = (g_stat[(i, "")] * w * v).sum()
                elif st.kind in ("max", "min"):  # the gradient goes to the extreme element(s)
                    term = (g_stat[(i, "")] * (v.detach() == merged[(i, "")].detach()).float() * v).sum()
                elif st.kind == "moments":
                    mean = merged[(i, "mean")].detach()
                    term = (g_stat[(i, "mean")] * v / acc[i][0]).sum() + (g_stat[(i, "m2")] * (v - mean) ** 2).sum()
                else:
                    continue
                surrogate = term if surrogate is None else surrogate + term
            if surrogate is None or not surrogate.requires_grad:
                if grad_b is not None:  # (an empty_like buffer: every slice must be written)
                    grad_b[:, :, n0:n1] = 0
                continue
            side = [p for p in in_pieces if p.requires_grad]
            got = torch.autograd.grad(surrogate, [product, *side], allow_unused=True)
        g_product, g_side = got[0], iter(got[1:])
        if g_product is not None:
            d = g_product.to(dt)
            del g_product, product, values
            if grad_a is not None:
                grad_a.add_(torch.matmul(d, b_op.transpose(1, 2)))
            if grad_b is not None:
                grad_b[:, :, n0:n1] = torch.matmul(a_op.transpose(1, 2), d).sum(0, keepdim=True) \
                    if grad_b.shape[0] == 1 and d.shape[0] > 1 else torch.matmul(a_op.transpose(1, 2), d)
        elif grad_b is not None:
            grad_b[:, :, n0:n1] = 0
        for j, (piece, t) in enumerate(zip(in_pieces, inputs)):
            if piece.requires_grad:
                g = next(g_side)
                if g is None:
                    continue
                if "N" in op.tile.inputs[j].axes and t.shape[2] > 1:
                    grad_in[j][:, :, n0:n1] += g.float()
                else:
                    grad_in[j] += g.float()
    targets, pulls = [], []
    if grad_a is not None:
        targets.append(a3), pulls.append(grad_a.to(a3.dtype))
    if grad_b is not None:
        targets.append(b3), pulls.append(grad_b)
    for t, g in zip(inputs, grad_in):
        if g is not None:
            targets.append(t), pulls.append(g.to(t.dtype))
    if targets:
        torch.autograd.backward(targets, pulls)
