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
4096 columns, fewer when M is large: 1024 at M = 8192), besides the gradient buffers
themselves: each slice's gradient is written into a buffer of B's layout, never padded to
the full width. The GEMMs run in the operands' dtype on cuBLAS (as eager's do; in fp32 they
took 20x longer); the rest runs in fp32 with the IR's reference semantics, on CUDA through
``torch.compile`` (a few fused kernels per slice; COMFUSE_GRAD_COMPILE), else as plain
torch operations.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import settings as settings_mod
from ..ir.interpret import _run
from ..ir.nodes import Output
from ..planner.onepass import OnePass, evaluate_combine
from ..planner.onepass import parts as parts_of

CHUNK = 4096  # widest slice
IDLE_GRADIENT = 1e-6  # a statistic whose gradient is this small beside the largest one's is dropped
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


def _piece(op: OnePass, width: int):
    """The tile graph on a slice of ``width`` columns, its outputs the statistics' tile
    values in fp32, and the shift statistics {index: node} the interpreter needs."""
    r = op.tile
    piece = r.replace(sizes=dataclasses.replace(r.sizes, N=width),
                      outputs=tuple(Output(st.node, torch.float32, r.nodes[st.node].axes) for st in op.stats))
    return piece, {i: st.node for i, st in enumerate(op.stats) if st.kind == "shift"}


def _piece_values(op: OnePass, a3, b_piece, in_pieces, n0: int, n1: int, acc=None) -> list:
    """As ``_tile_values``, given B's and the side inputs' slices already cut (or the
    slice's GEMM product ``acc``, fp32)."""
    piece, shifts = _piece(op, n1 - n0)
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


def _parts(kind: str) -> tuple:
    return ("mean", "m2") if kind == "moments" else ("",)


def _compile_wanted(device: torch.device) -> bool:
    mode = settings_mod.get().grad_compile
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"COMFUSE_GRAD_COMPILE={mode!r}: choose auto, 0 or 1")
    return mode == "1" or (mode == "auto" and device.type == "cuda")


_SURROGATES: dict = {}  # (id(op), width, idle, compiled) -> (op, function)


def _surrogate_fn(op: OnePass, width: int, idle: frozenset, compiled: bool):
    """f(product, side input slices, statistics' gradients, merged statistics, counts, column
    offset) -> a scalar whose gradient with respect to the slice's GEMM product (and side
    inputs) is the region's: ``g * t`` for a sum, ``g * softmax-weight * t`` for a log-sum-exp,
    ``g * [t == max]`` for a maximum, ``g * t / n + g2 * (t - mean)^2`` for moments, where t
    are the statistics' tile values on the slice. One function per (region, slice width),
    kept across calls; ``compiled``: through ``torch.compile``, so the slice's elementwise
    work and its gradient run as a few fused kernels instead of one kernel per operation
    (the work the backward spent most of its time on: 262 ms for a 40 ms Inductor step at
    8192 x 4096 x 128256, H200 2026-11-30)."""
    key = (id(op), width, idle, compiled)
    found = _SURROGATES.get(key)
    if found is not None and found[0] is op:
        return found[1]
    piece, shifts = _piece(op, width)
    kinds = [st.kind for st in op.stats]

    def surrogate(product, in_pieces, g_list, m_list, counts, offset):
        values = _run(piece, None, None, in_pieces, torch.float32, shifts=shifts, iota_offset=offset,
                      acc=product.float())[0]
        total, j = None, 0
        for i, (kind, v) in enumerate(zip(kinds, values)):
            g, m = g_list[j], m_list[j]  # moments: the mean's; the M2's follow
            j += len(_parts(kind))
            if i in idle or not v.requires_grad:
                continue  # no path to the operands, or a zero gradient (a max that cancels)
            v = v.float()
            if kind == "sum":
                term = (g * v).sum()
            elif kind == "lse":
                term = (g * torch.exp(v.detach() - m) * v).sum()
            elif kind in ("max", "min"):  # the gradient goes to the extreme element(s)
                term = (g / counts[i] * (v.detach() == m).float() * v).sum()
            elif kind == "moments":
                term = (g * v / counts[i]).sum() + (g_list[j - 1] * (v - m) ** 2).sum()
            else:
                continue
            total = term if total is None else total + term
        return total
    fn = torch.compile(surrogate, dynamic=False) if compiled else surrogate
    if len(_SURROGATES) > 64:
        _SURROGATES.clear()
    _SURROGATES[key] = (op, fn)
    return fn


def _extremes(op: OnePass, which: list, a_op, b3, inputs, dt, N: int, chunk: int) -> dict:
    """{statistic: (its value, how many elements equal it)} per row, [B, M, 1] each, for the
    max/min statistics ``which``, from the slices as the gradient pass computes them."""
    found = {}
    with torch.no_grad():
        for n0 in range(0, N, chunk):
            n1 = min(N, n0 + chunk)
            product = torch.matmul(a_op, b3[:, :, n0:n1].detach().to(dt))
            pieces = [p.detach() for p in _slice_inputs(op, inputs, n0, n1)]
            values = _piece_values(op, None, None, pieces, n0, n1, acc=product.float())
            for i in which:
                v = values[i].float()
                m = v.amax(2, keepdim=True) if op.stats[i].kind == "max" else v.amin(2, keepdim=True)
                c = (v == m).sum(2, keepdim=True).float()
                if i in found:
                    pm, pc = found[i]
                    best = torch.maximum(pm, m) if op.stats[i].kind == "max" else torch.minimum(pm, m)
                    m, c = best, pc * (pm == best) + c * (m == best)
                found[i] = (m, c)
    return found


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
        parts = dict(zip(_parts(st.kind), a[1:])) if st.kind == "moments" else {"": a}
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
    # statistics whose gradient is zero everywhere (cross-entropy's max: the shift cancels
    # in the combine, leaving rounding noise of ~1e-8 of the others) cost the slices
    # nothing: one check per statistic, here
    size = {i: max((float(g.abs().max()) for key, g in g_stat.items() if key[0] == i and g.numel()), default=0.0)
            for i in range(len(op.stats))}
    largest = max(size.values(), default=0.0)
    idle = {i for i, v in size.items() if v <= IDLE_GRADIENT * largest}
    # 3. statistics -> slices of the GEMM and the side inputs. Autograd runs from each
    # slice's GEMM product (a leaf in the GEMM's dtype) to the surrogate only; the two gradient GEMMs are
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
    flat = [(i, p) for i, st in enumerate(op.stats) for p in _parts(st.kind)]  # the surrogate's order
    g_list = [g_stat[key] for key in flat]
    m_list = [merged[key].detach() for key in flat]
    counts = [a[0] if st.kind == "moments" else None for st, a in zip(op.stats, acc)]
    compile_slices = _compile_wanted(a3.device)
    extremes = [i for i, st in enumerate(op.stats) if st.kind in ("max", "min") and i not in idle]
    if extremes:
        # a maximum's gradient goes to the elements equal to it, split among ties (as eager's
        # amax): equality needs the very values the gradient pass computes, not the fused
        # kernel's (its sums differ in the last bits), so those are found again here, with
        # the same torch operations (the slices then run uncompiled: Inductor may round
        # differently)
        compile_slices = False
        found = _extremes(op, extremes, a_op, b3, inputs, dt, N, chunk)
        for i, (value, ties) in found.items():
            m_list[flat.index((i, ""))], counts[i] = value, ties
    idle = frozenset(idle)
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        b_op = b3[:, :, n0:n1].detach().to(dt)
        in_pieces = [p.detach().requires_grad_(t.requires_grad)
                     for p, t in zip(_slice_inputs(op, inputs, n0, n1), inputs)]
        product = torch.matmul(a_op, b_op).requires_grad_(True)  # (its gradient comes back in dt)
        surrogate_of = _surrogate_fn(op, n1 - n0, idle, compile_slices)
        offset = torch.full((), n0, dtype=torch.int64, device=a3.device)  # (a tensor: one compile)
        with torch.enable_grad():
            surrogate = surrogate_of(product, in_pieces, g_list, m_list, counts, offset)
            if surrogate is None or not surrogate.requires_grad:
                if grad_b is not None:  # (an empty_like buffer: every slice must be written)
                    grad_b[:, :, n0:n1] = 0
                continue
            side = [p for p in in_pieces if p.requires_grad]
            got = torch.autograd.grad(surrogate, [product, *side], allow_unused=True)
        g_product, g_side = got[0], iter(got[1:])
        if g_product is not None:
            d = g_product.to(dt)
            del g_product, product, surrogate
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
