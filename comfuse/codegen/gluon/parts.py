"""The Gluon device functions the warp-specialised kernels share (Triton 3.6, sm_90): the
template (``strip.py``) and every kernel generated from a region's stages (``stages.py``)
import them from here.

- ``mma_partition``: a persistent grid's mainloop in 8 warps (two warpgroups). It issues the
  TMA loads of A 128x64 and B into a ring of STAGES slots, STAGES - 1 steps ahead across tile
  boundaries, runs WGMMA 128x256, and hands each finished tile to the epilogue partition
  through a shared-memory buffer (bf16, 64 KB: rounded as eager's bf16 GEMM rounds its output),
  then starts the next tile at once. RES 2: it first adds the residual the epilogue partition
  TMA-loaded into that buffer (``load_residual``). With SPARE the program's last tile goes into
  the B ring instead, free once the last K step is done.
- the math the epilogues use: ``exp_fast``, ``exp2_fast``, ``tanh_fast`` (special-function
  unit), ``log1p`` / ``expm1`` (exact for small x), ``bf16_pairs`` (packed rounding);
- ``chunk_view`` / ``chunk_load`` / ``chunk_store``: a chunk of the hand-off tile's rows by a
  run-time index, so that an epilogue pass can loop over its chunks rather than unroll them.

Co-residency: the grid is at most the SM count and every program needs more than half an
SM's shared memory, so each SM holds one and all are resident (nothing else on the GPU).
"""
from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...planner.template import TILE

BM, BN, BK = TILE
LOG2E = gl.constexpr(1.4426950408889634)
# Columns of one swizzle atom of the hand-off tile: its NVMMA layout (128-byte swizzle) stores a
# [BM, BN] bf16 tile as BN / 64 blocks of [BM, 64], one after another, each row of a block 128
# bytes and the 16-byte pieces of a row permuted by the row's index mod 8. Rows [r, r + R) of
# column block b (R a multiple of 8) are then R * 128 contiguous bytes, themselves a [R, 64]
# tile of the same layout: ``chunk_view`` indexes them at run time.
PIECE = gl.constexpr(64)


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def layouts(b_kmajor: bool):
    """Shared-memory layouts of the A, B and tile (residual / hand-off) blocks (remembered:
    building them took a fifth of a call's host time)."""
    return (gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([BN, BK] if b_kmajor else [BK, BN], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16))


TILE_LAYOUT = gl.constexpr(layouts(False)[2])  # the hand-off buffer's


@gluon.jit
def exp2_fast(x):
    """2^x in fp32 by the special-function unit: ex2.approx.ftz.f32 (relative error about
    2^-22, as gl.exp2's; results below 2^-126 flush to zero, which saves the three
    instructions of gl.exp2's subnormal fix-up per element)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def exp_fast(x):
    """e^x as ``exp2_fast(x * log2(e))``."""
    return exp2_fast(x * 1.4426950408889634)


@gluon.jit
def tanh_fast(x):
    """tanh in fp32 by the special-function unit (tanh.approx.f32): one instruction, relative
    error below 2^-10.98 over the whole range (PTX ISA), under a bf16 output's rounding (2^-9)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def bf16_pairs(x):
    """x (fp32) rounded to bf16, to nearest even, two elements by one packed conversion
    (cvt.rn.bf16x2.f32: its first operand goes to the high half, so the first element, $1,
    is the second operand and lands in the low half, as a bf16x2 register holds element 0).
    ``x.to(gl.bfloat16)`` of a value also used in fp32 compiled one element at a time; this is
    the same rounding, bit for bit, in half the instructions."""
    return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [x], dtype=gl.bfloat16,
                                     is_pure=True, pack=2)


@gluon.jit
def log1p(x):
    """log(1 + x) in fp32, exact for small x (Kahan: log(u) * x / (u - 1) with u = 1 + x
    corrects u's rounding), as codegen/triton/helpers.log1p."""
    u = 1.0 + x
    r = gl.where(u == 1.0, x, gl.log(u) * (x / (u - 1.0)))
    return gl.where(u == float("inf"), u, r)


@gluon.jit
def expm1(x):
    """exp(x) - 1 in fp32, exact for small x, as codegen/triton/helpers.expm1."""
    u = gl.exp(x)
    r = gl.where(u == 1.0, x, (u - 1.0) * (x / gl.log(u)))
    r = gl.where(u - 1.0 == -1.0, -1.0, r)
    return gl.where(u == float("inf"), u, r)


@gluon.jit
def chunk_view(tile_smem, CHUNK: gl.constexpr):
    """The hand-off tile as [BN / 64 * BM / CHUNK, CHUNK, 64] pieces, piece b * (BM / CHUNK) + c
    holding rows [c * CHUNK, (c + 1) * CHUNK) of columns [64 b, 64 b + 64) (the same bytes, see
    PIECE): a chunk of rows by a run-time index, where ``tile_smem.slice`` takes a constant one."""
    BM: gl.constexpr = tile_smem.shape[0]
    BN: gl.constexpr = tile_smem.shape[1]
    return tile_smem._reinterpret(gl.bfloat16, [BN // PIECE * (BM // CHUNK), CHUNK, PIECE], tile_smem.layout)


@gluon.jit
def chunk_load(view, c, layout: gl.constexpr, PIECES: gl.constexpr):
    """Chunk c of the tile (``chunk_view``) as one [CHUNK, 64 * PIECES] tensor in ``layout``,
    whose lanes of a row span 64 columns (VEC * LANES_N == 64): each piece then lands in the
    registers a thread holds of it, and joining them moves no data."""
    PER: gl.constexpr = view.shape[0] // PIECES
    R: gl.constexpr = view.shape[1]
    p0 = view.index(c).load(layout)
    p1 = view.index(PER + c).load(layout)
    if PIECES == 2:
        x = gl.permute(gl.join(p0, p1), (0, 2, 1))  # [R, piece, 64]
    else:
        p2 = view.index(2 * PER + c).load(layout)
        p3 = view.index(3 * PER + c).load(layout)
        # (join's new dimension is the last: [R, 64, piece % 2, piece // 2])
        x = gl.permute(gl.join(gl.join(p0, p1), gl.join(p2, p3)), (0, 3, 2, 1))  # [R, piece // 2, piece % 2, 64]
    return gl.convert_layout(gl.reshape(x, [R, PIECE * PIECES]), layout)


@gluon.jit
def chunk_store(view, c, x, layout: gl.constexpr, PIECES: gl.constexpr):
    """``chunk_load``'s inverse: x [CHUNK, 64 * PIECES] written over chunk c of the tile."""
    PER: gl.constexpr = view.shape[0] // PIECES
    R: gl.constexpr = view.shape[1]
    y = gl.permute(gl.reshape(x, [R, PIECES, PIECE]), (0, 2, 1))  # [R, 64, piece]
    if PIECES == 2:
        p0, p1 = gl.split(y)
        view.index(c).store(gl.convert_layout(p0, layout))
        view.index(PER + c).store(gl.convert_layout(p1, layout))
    else:
        lo, hi = gl.split(gl.reshape(y, [R, PIECE, 2, 2]))  # (piece % 2 == 0, == 1), each [R, 64, piece // 2]
        p0, p2 = gl.split(lo)
        p1, p3 = gl.split(hi)
        view.index(c).store(gl.convert_layout(p0, layout))
        view.index(PER + c).store(gl.convert_layout(p1, layout))
        view.index(2 * PER + c).store(gl.convert_layout(p2, layout))
        view.index(3 * PER + c).store(gl.convert_layout(p3, layout))


@gluon.jit
def tile_coords(t, num_tiles, TILES_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(row block, column tile) of tile t: row-strip order (GROUP_M 0: a strip's tiles are
    consecutive), or grouped: GROUP_M row blocks at a time, column by column, so the programs
    in flight share a few row blocks of A and columns of B in L2."""
    if GROUP_M == 0:
        return t // TILES_N, t % TILES_N
    else:
        per_group = GROUP_M * TILES_N
        first = (t // per_group) * GROUP_M
        rows = gl.minimum(num_tiles // TILES_N - first, GROUP_M)
        return first + (t % per_group) % rows, (t % per_group) // rows


@gluon.jit
def issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, i, total, k_steps, num_tiles, B_KMAJOR: gl.constexpr,
               TILES_N: gl.constexpr, GROUP_M: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
               BK: gl.constexpr):
    """TMA loads of this program's flattened iteration ``i`` (its tile i // k_steps, K step
    i % k_steps) into ring slot i % STAGES, if there is such an iteration."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    s = i % STAGES
    pid_m, pid_n = tile_coords(gl.program_id(0) + (i // k_steps) * gl.num_programs(0), num_tiles, TILES_N, GROUP_M)
    kk = i % k_steps
    pred = i < total
    mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [pid_m * BM, kk * BK], ready.index(s), a_bufs.index(s), pred=pred)
    if B_KMAJOR:
        tma.async_copy_global_to_shared(b_desc, [pid_n * BN, kk * BK], ready.index(s), b_bufs.index(s), pred=pred)
    else:
        tma.async_copy_global_to_shared(b_desc, [kk * BK, pid_n * BN], ready.index(s), b_bufs.index(s), pred=pred)


@gluon.jit
def mma_partition(a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, tile_ready, tile_free, num_tiles, k_steps,
                  RES: gl.constexpr, B_KMAJOR: gl.constexpr, TILES_N: gl.constexpr, GROUP_M: gl.constexpr,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, num_warps: gl.constexpr, spare_smem,
                  spare_ready, SPARE: gl.constexpr):
    """The mainloop and the hand-off (see the module's docstring). With SPARE, the program's
    last tile goes into ``spare_smem`` (the B operand's ring, free once the last K step is
    done), completing ``spare_ready``, without waiting for the epilogue to free the hand-off
    buffer (a RES 0 hand-off; the two arguments are the buffer and its barrier otherwise)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    my_tiles = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0))
    total = my_tiles * k_steps
    for i in gl.static_range(STAGES - 1):
        issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, i, total, k_steps, num_tiles, B_KMAJOR, TILES_N, GROUP_M,
                   BM, BN, BK)
    i = 0
    for n in range(my_tiles):
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
        for kk in range(k_steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            if B_KMAJOR:
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            else:
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
            # at most this step's WGMMA in flight: the previous step's slot is free for the load
            # STAGES - 1 iterations ahead
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, i + STAGES - 1, total, k_steps, num_tiles, B_KMAJOR,
                       TILES_N, GROUP_M, BM, BN, BK)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if SPARE:
            if n == my_tiles - 1:  # every K step's loads consumed, the last WGMMA done: the ring is free
                fence_async_shared()  # (the ring's async-proxy reads, before these generic writes)
                spare_smem.store(acc.to(gl.bfloat16))
                gl.thread_barrier()
                mbarrier.arrive(spare_ready)
            else:
                hand_off(acc, tile_smem, tile_ready, tile_free, n, RES, acc_layout)
        else:
            hand_off(acc, tile_smem, tile_ready, tile_free, n, RES, acc_layout)


@gluon.jit
def hand_off(acc, tile_smem, tile_ready, tile_free, n, RES: gl.constexpr, acc_layout: gl.constexpr):
    """Tile n's product into the hand-off buffer once the epilogue has freed it (RES 2: the
    buffer holds the tile's residual, TMA-loaded by the epilogue partition, added first)."""
    if RES == 2:
        mbarrier.wait(tile_free, n & 1)
        acc = acc + tile_smem.load(acc_layout).to(gl.float32)
    else:
        mbarrier.wait(tile_free, (n & 1) ^ 1)  # the epilogue is done with the last tile
    tile_smem.store(acc.to(gl.bfloat16))
    fence_async_shared()  # (these generic writes, before an epilogue's TMA store reads them)
    gl.thread_barrier()
    mbarrier.arrive(tile_ready)


@gluon.jit
def load_residual(r_desc, tile_smem, bar, t, num_tiles, TILES_N: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """TMA load of tile t's residual into the hand-off buffer, completing ``bar`` (if t exists)."""
    pred = t < num_tiles
    mbarrier.expect(bar, r_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(r_desc, [(t // TILES_N) * BM, (t % TILES_N) * BN], bar, tile_smem, pred=pred)
