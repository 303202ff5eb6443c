"""Zeroing the padded columns of a product that a region writes whole.

Inductor's ``pad_mm`` pads a GEMM's operand with zero columns; where the backward saves the
padded product, a region writes that product whole: its kernel fills the first columns and
the columns past them must be zeros, as the GEMM on the padded operand makes them. They are
zeroed by a kernel of their own, bound once per layout and launched like the region's kernels
(``launch.launch_direct``), so that a replay of the region's call (replay.py) repeats it with
the rest: the zeroing is one more launch that writes the call's output."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import filled, interpreting, launch_direct, layout_key, unrecorded

BLOCK_ROWS = 64

_bound: dict = {}  # (layout, first column) -> (run, statics)


@triton.jit
def _zero_columns(out_ptr, rows, first, width, row_stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    at = out_ptr + r[:, None].to(tl.int64) * row_stride + first + c[None, :]
    tl.store(at, tl.zeros([BLOCK_R, BLOCK_C], out_ptr.dtype.element_ty), mask=(r[:, None] < rows) & (c[None, :] < width))


def _rows(t: torch.Tensor):
    """(rows, row stride) where ``t``'s leading dimensions walk its rows at one stride and its
    last is unit-strided, else None."""
    if t.dim() < 1 or t.stride(-1) != 1:
        return None
    if t.dim() == 1:
        return 1, t.shape[0]
    rows, stride = t.shape[-2], t.stride(-2)
    for size, st in zip(reversed(t.shape[:-2]), reversed(t.stride()[:-2])):
        if size > 1 and st != rows * stride:
            return None
        rows *= size
    return rows, stride


def zero_columns(t: torch.Tensor, first: int) -> None:
    """Zero ``t``'s last-dimension columns from ``first`` on, in place."""
    width = t.shape[-1] - first
    if width <= 0 or t.numel() == 0:
        return
    shape = _rows(t)
    if shape is None:  # (no single row stride: not a bound launch, so a call that does this is not replayed)
        unrecorded()
        t.narrow(-1, first, width).zero_()
        return
    rows, row_stride = shape
    block_c = min(triton.next_power_of_2(width), 64)
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(width, block_c))
    args = [t, rows, first, width, row_stride]
    options = {"BLOCK_R": BLOCK_ROWS, "BLOCK_C": block_c}
    if t.device.type == "cpu" or interpreting():
        _zero_columns[grid](*args, **options)
        return
    key = (layout_key([t]), first)
    bound = _bound.get(key)
    if bound is None:
        if len(_bound) > 64:
            _bound.clear()
        _bound[key] = launch_direct(_zero_columns, grid, args, options, {0})  # (launches once)
        return
    run, statics = bound
    run(*filled(statics, [(0, 0)], [t]))
