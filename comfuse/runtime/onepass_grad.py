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
4096 columns, fewer when M is large: 2048 at M = 8192), besides the gradient buffers
themselves: each slice's gradient is written into a buffer of B's layout, never padded to
the full width. The GEMMs run in the operands' dtype on cuBLAS (as eager's do; in fp32 they
took 20x longer); the rest runs in fp32 with the IR's reference semantics, on CUDA through
``torch.compile`` (a few fused kernels per slice), else as plain
torch operations.
"""
from __future__ import annotations

import dataclasses

import torch

from ..ir.interpret import run_nodes
from ..ir.nodes import Output
from ..planner.onepass import OnePass, evaluate_combine
from ..planner.onepass import parts as parts_of

CHUNK = 4096  # widest slice
IDLE_GRADIENT = 1e-6  # a statistic whose gradient is this small beside the largest one's is dropped
SLICE_ELEMENTS = 1 << 24  # an [M, slice] fp32 temporary stays within 64 MB where M allows (2048
# columns at M = 8192: half the slices of 1 << 23, whose per-slice Python and fp32 gradient
# accumulation bounded the step)


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
    return run_nodes(piece, a3, b_piece, in_pieces, torch.float32, gemm_dtype=low,
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


COMPILE_ON = ("cuda",)  # devices whose slices run through torch.compile (plain ops elsewhere: one kernel each)


def _compile_wanted(device: torch.device) -> bool:
    return device.type in COMPILE_ON


_SURROGATES: dict = {}  # (id(op), width, idle, compiled, wanted) -> (op, function)


def _surrogate_fn(op: OnePass, width: int, idle: frozenset, compiled: bool, wanted: tuple):
    """f(product, side input slices, statistics' gradients, merged statistics, counts, column
    offset) -> (gradient of the slice's GEMM product, in its dtype; gradients of the side
    input slices flagged in ``wanted``). The gradients are those of a surrogate scalar whose
    gradient with respect to the slice's tile values is the region's: ``g * t`` for a sum,
    ``g * softmax-weight * t`` for a log-sum-exp, ``g * [t == max]`` for a maximum,
    ``g * t / n + g2 * (t - mean)^2`` for moments, where t are the statistics' tile values on
    the slice. The gradient is taken functionally (``torch.func.grad``), so one call does the
    slice's elementwise work and its gradient without the autograd engine; ``compiled``:
    through ``torch.compile``, as a few fused kernels (the work the backward spent most of its
    time on: 262 ms for a 40 ms Inductor step at 8192 x 4096 x 128256, H200 2026-11-30). One
    function per (region, slice width, idle statistics, wanted side inputs), kept across calls."""
    key = (id(op), width, idle, compiled, wanted)
    found = _SURROGATES.get(key)
    if found is not None and found[0] is op:
        return found[1]
    piece, shifts = _piece(op, width)
    kinds = [st.kind for st in op.stats]

    def scalar(product, grad_pieces, fixed_pieces, g_list, m_list, counts, offset):
        taken, kept = iter(grad_pieces), iter(fixed_pieces)
        in_pieces = [next(taken) if w else next(kept) for w in wanted]
        values = run_nodes(piece, None, None, in_pieces, torch.float32, shifts=shifts, iota_offset=offset,
                      acc=product.float())[0]
        total, j = product.new_zeros((), dtype=torch.float32), 0  # (zero gradients if nothing is live)
        for i, (kind, v) in enumerate(zip(kinds, values)):
            g, m = g_list[j], m_list[j]  # moments: the mean's; the M2's follow
            j += len(_parts(kind))
            if i in idle:
                continue  # a zero gradient (a max that cancels)
            v = v.float()
            if kind == "sum":
                total = total + (g * v).sum()
            elif kind == "lse":
                total = total + (g * torch.exp(v.detach() - m) * v).sum()
            elif kind in ("max", "min"):  # the gradient goes to the extreme element(s)
                total = total + (g / counts[i] * (v.detach() == m).float() * v).sum()
            elif kind == "moments":
                total = total + (g * v / counts[i]).sum() + (g_list[j - 1] * (v - m) ** 2).sum()
        return total

    gradient = torch.func.grad(scalar, argnums=(0, 1))
    fn = torch.compile(gradient, dynamic=False) if compiled else gradient
    if len(_SURROGATES) > 64:
        _SURROGATES.clear()
    _SURROGATES[key] = (op, fn)
    return fn


def _accumulate_product(acc: torch.Tensor, d: torch.Tensor, b_op: torch.Tensor) -> None:
    """acc (fp32) += d @ b_op^T. On CUDA, one GEMM that adds into fp32 (cuBLAS with beta = 1,
    ``out_dtype``) where this torch has it; else a GEMM in d's dtype and an add (a pass over
    the fp32 [M, K] buffer per slice: 15 ms of a 150 ms step at vocabulary 128256)."""
    global _FP32_ADDMM
    if _FP32_ADDMM and acc.is_cuda and acc.shape[0] == 1 and d.dtype != acc.dtype:
        try:
            torch.addmm(acc[0], d[0], b_op[0].transpose(0, 1), out_dtype=acc.dtype, out=acc[0])
            return
        except (RuntimeError, TypeError):  # not in this build: the two-step form from now on
            _FP32_ADDMM = False
    acc.add_(torch.matmul(d, b_op.transpose(1, 2)))


_FP32_ADDMM = True


def pack_statistics(op: OnePass, acc: list) -> torch.Tensor:
    """Merged statistics (``merge_slices``'s list) as one [parts, M] fp32 tensor, for a
    forward to hand to its backward."""
    rows = []
    for st, a in zip(op.stats, acc):
        rows.extend(v.reshape(-1) for v in (a if st.kind == "moments" else (a,)))
    return torch.stack(rows).float()


def packed_rows(op: OnePass) -> int:
    return sum(3 if st.kind == "moments" else 1 for st in op.stats)


def unpack_statistics(op: OnePass, packed: torch.Tensor) -> list:
    """The inverse of ``pack_statistics``: each [1, M, 1] (moments: (count, mean, M2))."""
    acc, j = [], 0
    for st in op.stats:
        n = 3 if st.kind == "moments" else 1
        views = tuple(packed[j + k].view(1, -1, 1) for k in range(n))
        acc.append(views if st.kind == "moments" else views[0])
        j += n
    return acc


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
    # 3. statistics -> slices of the GEMM and the side inputs. A functional gradient runs
    # from each slice's GEMM product (in the GEMM's dtype) to the surrogate only; the two
    # gradient GEMMs are explicit, in the operands' dtype, and their results go straight into buffers of the
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
    wanted = tuple(t.requires_grad for t in inputs)
    live = any(i not in idle for i in range(len(op.stats)))
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        if not live:  # every statistic's gradient is zero: so is every slice's
            if grad_b is not None:  # (an empty_like buffer: every slice must be written)
                grad_b[:, :, n0:n1] = 0
            continue
        b_op = b3[:, :, n0:n1].detach().to(dt)
        pieces = [p.detach() for p in _slice_inputs(op, inputs, n0, n1)]
        product = torch.matmul(a_op, b_op)
        gradient_of = _surrogate_fn(op, n1 - n0, idle, compile_slices, wanted)
        offset = torch.full((), n0, dtype=torch.int64, device=a3.device)  # (a tensor: one compile)
        d, g_side = gradient_of(product, [p for p, w in zip(pieces, wanted) if w],
                                [p for p, w in zip(pieces, wanted) if not w], g_list, m_list, counts, offset)
        del product
        d = d.to(dt)  # (the gradient of a product in dt comes back in dt)
        if grad_a is not None:
            _accumulate_product(grad_a, d, b_op)
        if grad_b is not None and grad_b.shape[0] == 1 and d.shape[0] == 1 and grad_b.dtype == dt:
            # straight into the buffer's columns (cuBLAS writes a strided slice; no copy)
            torch.mm(a_op[0].transpose(0, 1), d[0], out=grad_b[0, :, n0:n1])
        elif grad_b is not None:
            grad_b[:, :, n0:n1] = torch.matmul(a_op.transpose(1, 2), d).sum(0, keepdim=True) \
                if grad_b.shape[0] == 1 and d.shape[0] > 1 else torch.matmul(a_op.transpose(1, 2), d)
        g_side = iter(g_side)
        for j, t in enumerate(inputs):
            if wanted[j]:
                g = next(g_side)
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
