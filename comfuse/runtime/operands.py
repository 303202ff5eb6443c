"""A region's tensors in the canonical 3-D layout its kernels take: the GEMM's operands as
[B, M, K] and [B, K, N], each side input as a [B|1, M|1, N|1] view of the caller's tensor."""
from __future__ import annotations

import torch


ROW_ALIGN_BYTES = 16  # what a TMA store, and a vectorised store, needs of every row's start
WIDE_ROW = 1024  # (elements) rows at least this long are aligned; narrower ones stay packed


def output_strides(shape, dtype: torch.dtype, rows: bool = True) -> tuple:
    """The strides a region's output is allocated with: contiguous, except that wide rows
    whose bytes are not a multiple of ROW_ALIGN_BYTES are padded to one (GPT-2's 50257
    logits a row: Inductor's pad_mm leaves them 50264 apart too). Stored unaligned, a tile's
    rows could only be written element by element. ``rows``: the last dimension is the GEMM's
    N (a per-row output shaped [batch, sequence] is not: its dimensions merge into M)."""
    shape = tuple(shape)
    strides, step = [], 1
    for d in reversed(range(len(shape))):
        strides.append(step)
        step *= shape[d]
        if rows and d == len(shape) - 1 and len(shape) > 1 and shape[d] >= WIDE_ROW:
            per = ROW_ALIGN_BYTES // dtype.itemsize if ROW_ALIGN_BYTES % dtype.itemsize == 0 else 1
            step = -(-step // per) * per
    return tuple(reversed(strides))


def empty_output(shape, dtype: torch.dtype, device, rows: bool = True) -> torch.Tensor:
    return torch.empty_strided(tuple(shape), output_strides(shape, dtype, rows), dtype=dtype, device=device)


def operand3(t: torch.Tensor, batched: bool) -> torch.Tensor:
    return t if batched else t.unsqueeze(0)


def prepare(t, bind, device: torch.device) -> torch.Tensor:
    """A side input as a canonical (B, M, N) view; axes it does not vary along have size 1."""
    if not isinstance(t, torch.Tensor):
        t = torch.tensor(t)
    if t.device != device:
        t = t.to(device)  # 0-d CPU tensors may feed CUDA ops
    v = t.expand(bind.expand_to).reshape(bind.canon)
    for d, axis in enumerate(("B", "M", "N")):
        if axis not in bind.axes and v.shape[d] != 1:
            v = v.narrow(d, 0, 1)
    return v


class Views:
    """``prepare``, remembered per layout: the canonical view of side input ``j`` is rebuilt with
    one ``as_strided`` once its sizes, strides and offset are known (when the view shares the
    tensor's storage; otherwise ``prepare`` runs every time). A call's Python time matters for
    kernels of tens of microseconds."""

    def __init__(self):
        self._known: dict = {}  # (input, shape, strides, dtype) -> (size, stride, offset) or False

    def __call__(self, j: int, t, bind, device: torch.device) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.device != device:
            return prepare(t, bind, device)
        key = (j, t.shape, t.stride(), t.dtype)
        known = self._known.get(key)
        if known is None:
            v = prepare(t, bind, device)
            same = v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            known = (tuple(v.shape), v.stride(), v.storage_offset() - t.storage_offset()) if same else False
            if len(self._known) > 64:
                self._known.clear()
            self._known[key] = known
            return v
        if known is False:
            return prepare(t, bind, device)
        size, stride, offset = known
        return t.as_strided(size, stride, t.storage_offset() + offset)
