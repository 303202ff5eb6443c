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

Peak extra memory is a few [M, slice] tensors instead of [M, N] (the default slice holds
4096 columns). Every step is plain torch (cuBLAS GEMMs), evaluated with the IR's
reference semantics in fp32.
"""
from __future__ import annotations

import dataclasses

import torch

from ..ir.interpret import _run
from ..ir.nodes import Output
from ..planner.onepass import OnePass, evaluate_combine

CHUNK = 4096


def _slice_inputs(op: OnePass, inputs, n0: int, n1: int) -> list:
    out = []
    for spec, t in zip(op.tile.inputs, inputs):
        out.append(t[:, :, n0:n1] if "N" in spec.axes and t.shape[2] > 1 else t)
    return out


def _tile_values(op: OnePass, a3, b3, inputs, n0: int, n1: int) -> list:
    """The statistics' tile values on columns [n0, n1), in fp32 (differentiable)."""
    r = op.tile
    piece = r.replace(sizes=dataclasses.replace(r.sizes, N=n1 - n0),
                      outputs=tuple(Output(st.node, torch.float32, r.nodes[st.node].axes) for st in op.stats))
    shifts = {i: st.node for i, st in enumerate(op.stats) if st.kind == "shift"}
    return _run(piece, a3, b3[:, :, n0:n1], _slice_inputs(op, inputs, n0, n1), torch.float32,
                shifts=shifts, iota_offset=n0)[0]


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


def backward(op: OnePass, views, grads, chunk: int | None = None) -> None:
    """Accumulate into the leaves behind ``views()`` (a function returning a3 [B, M, K],
    b3 [B, K, N] and the canonical side inputs, built from tensors that require grad) the
    gradients of the region's outputs, given ``grads`` (canonical [B, M|1, 1], or None)."""
    N = op.tile.sizes.N
    chunk = chunk or CHUNK
    with torch.no_grad():  # 1. the statistics
        a3, b3, inputs = views()
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
    with torch.enable_grad():  # 3. statistics -> slices of the GEMM and the side inputs
        for n0 in range(0, N, chunk):
            a3, b3, inputs = views()
            values = _tile_values(op, a3, b3, inputs, n0, min(N, n0 + chunk))
            surrogate = None
            for i, (st, v) in enumerate(zip(op.stats, values)):
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
            if surrogate is not None and surrogate.requires_grad:
                surrogate.backward()
