"""A linear layer's cross-entropy loss and its gradients, computed together over chunks of
rows, so that the [rows, vocabulary] logits never exist whole, in either pass.

For a scalar loss L = reduce_i CE(h_i W^T + b, t_i), the gradient with respect to the logits
is known once the forward has each row's log-sum-exp: (softmax(z_i) - onehot(t_i)) * s_i,
with s_i = 1 / (rows not ignored) for a mean, 1 for a sum, 0 for an ignored row. The
backward only scales it by the upstream gradient g (a scalar). So the forward computes, per
chunk of rows: the chunk's logits (one GEMM), each row's log-sum-exp and loss and, in
place, its logits' gradient (``_rows``: one program per row, two passes over it), then the
chunk's share of dL/dh (a GEMM into its rows) and of dL/dW and dL/db (accumulated). The
backward multiplies those by g. The GEMMs are the same three a training step runs without
this; what goes is the [rows, vocabulary] tensor written, saved and read back: at a
vocabulary of 128256 and 8192 rows, 2.1 GB of bf16 logits held from the forward to the
backward and 2.1 GB of their gradient.

dL/dW accumulates in the weight's dtype over the chunks (one rounding per chunk; an fp32
accumulator would hold another [vocabulary, hidden] fp32 tensor). A chunk holds at most
CHUNK_BYTES of logits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import fallback, summary
from .launch import interpreting

CHUNK_BYTES = 256 << 20  # a chunk's logits, at most (and at least MIN_CHUNK_ROWS rows)
MIN_CHUNK_ROWS = 128
BLOCK_V = 4096  # the columns a row's program reads at a time (8 warps: 8 KB of bf16 in flight)


def chunk_rows(rows: int, vocab: int, itemsize: int) -> int:
    """Rows per chunk: the most whose logits fit CHUNK_BYTES, in multiples of MIN_CHUNK_ROWS
    (at least that, at most ``rows``)."""
    fit = CHUNK_BYTES // max(vocab * itemsize, 1)
    return max(1, min(rows, max(MIN_CHUNK_ROWS, fit // MIN_CHUNK_ROWS * MIN_CHUNK_ROWS)))


@triton.jit
def _rows(logits, stride, target, losses, scale, vocab, ignore_index,
          BLOCK: tl.constexpr, GRADS: tl.constexpr):
    """Row ``program_id``: its log-sum-exp over ``vocab`` columns (one pass, a running
    maximum), its loss (0 where ignored) into ``losses``, and with GRADS its logits replaced by
    their gradient, (softmax - onehot(target)) * scale (0 where ignored)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    cols = tl.arange(0, BLOCK)
    top = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        new = tl.maximum(top, tl.max(x, axis=0))
        total = total * tl.exp(top - new) + tl.sum(tl.exp(x - new), axis=0)
        top = new
    lse = top + tl.log(total)
    t = tl.load(target + row)
    keep = t != ignore_index
    picked = tl.load(base + tl.where(keep, t, 0)).to(tl.float32)
    tl.store(losses + row, tl.where(keep, lse - picked, 0.0))
    if GRADS:
        s = tl.where(keep, tl.load(scale), 0.0)
        for start in range(0, vocab, BLOCK):
            inside = start + cols < vocab
            x = tl.load(base + start + cols, mask=inside, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(start + cols == t, 1.0, 0.0)) * s
            tl.store(base + start + cols, g.to(logits.dtype.element_ty), mask=inside)


def _rows_by_torch(z, t, losses, scale, ignore_index: int, grads: bool) -> None:
    """``_rows`` in torch ops (CPU tensors where Triton's interpreter is off)."""
    t = t.long()
    keep = t != ignore_index
    lse = torch.logsumexp(z.float(), dim=1)
    picked = z.float().gather(1, torch.where(keep, t, 0)[:, None])[:, 0]
    losses.copy_(torch.where(keep, lse - picked, 0.0))
    if grads:
        g = torch.softmax(z.float(), dim=1)
        g[torch.arange(len(t), device=z.device)[keep], t[keep]] -= 1.0
        z.copy_(g * torch.where(keep, scale, 0.0)[:, None])


_FAILED: list = []  # why ``_rows`` failed to build or launch in this process, once it has


def _on_rows(z, t, losses, scale, ignore_index: int, grads: bool) -> None:
    if not _FAILED and (z.device.type == "cuda" or interpreting()):
        try:
            _rows[(z.shape[0],)](z, z.stride(0), t, losses, scale, z.shape[1], ignore_index, BLOCK=BLOCK_V,
                                 GRADS=grads, num_warps=8)
            return
        except Exception as e:  # (a launch fails before it writes anything)
            fallback("the LM loss's row kernel failed", e, "its rows are computed by torch ops from now on")
            _FAILED.append(summary(e))
    _rows_by_torch(z, t, losses, scale, ignore_index, grads)


def linear_cross_entropy(h, w, b, t, ignore_index: int, reduction: str, out_dtype, need: tuple) -> tuple:
    """(loss, dL/dh, dL/dw, dL/db) for ``cross_entropy(h @ w.T + b, t)`` (``reduction`` "mean"
    or "sum"; rows whose target is ``ignore_index`` count for nothing), the loss in
    ``out_dtype``; ``need``: which of the three gradients to compute (an empty tensor stands
    for each other). ``h``: [rows, hidden]; ``w``: [vocabulary, hidden]; ``b``: [vocabulary]
    or None; ``t``: [rows] integers."""
    rows, vocab = h.shape[0], w.shape[0]
    torch._assert_async(((t == ignore_index) | ((t >= 0) & (t < vocab))).all(),
                        "cross_entropy: a target is outside [0, vocabulary) and is not ignore_index")
    counted = (t != ignore_index).sum()
    scale = (1.0 / counted.float()) if reduction == "mean" else torch.ones((), device=h.device)
    scale = scale.reshape(1).float()
    grads = any(need)
    dh = h.new_empty(h.shape) if need[0] else h.new_empty(0)
    dw = w.new_empty(w.shape) if need[1] else w.new_empty(0)
    db = torch.zeros(vocab, device=h.device, dtype=torch.float32) if need[2] else None
    losses = torch.empty(rows, device=h.device, dtype=torch.float32)
    step = chunk_rows(rows, vocab, h.element_size())
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        hc = h[r0:r1]
        z = torch.mm(hc, w.t()) if b is None else torch.addmm(b, hc, w.t())
        _on_rows(z, t[r0:r1], losses[r0:r1], scale, ignore_index, grads)
        if need[0]:
            torch.mm(z, w, out=dh[r0:r1])
        if need[1]:
            if r0 == 0:
                torch.mm(z.t(), hc, out=dw)
            else:
                dw.addmm_(z.t(), hc)
        if need[2]:
            db += z.sum(0, dtype=torch.float32)
    loss = losses.sum() * scale[0]
    db = db.to(b.dtype) if need[2] else (b.new_empty(0) if b is not None else h.new_empty(0))
    return loss.to(out_dtype), dh, dw, db
