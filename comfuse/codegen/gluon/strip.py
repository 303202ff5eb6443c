"""A warp-specialised Gluon template (Triton 3.6, sm_90): GEMM + a row normalisation whose row
strip spans several tiles, the epilogue in warps of its own beside the next tile's mainloop.

    v   = x @ W (+ bias[N]) (+ residual[M, N])            rounded to bf16, as eager rounds it
    out = LayerNorm(v) (* gamma) (+ beta) (ReLU)          KIND_LAYERNORM
    out = v * rsqrt(mean(v^2) + eps) (* gamma)            KIND_RMSNORM
    out = softmax(v) along N                              KIND_SOFTMAX
    out = v                                               KIND_PLAIN (the GEMM alone, for timing)
    ws  = per tile and row: log-sum-exp of its 256 columns, KIND_LSE (terminal: no [M, N] output;
          and the row's logit at a target column)           cross-entropy's statistics

KIND_LSE is the terminal reduction (a loss over a vocabulary-wide row): each tile leaves one
fp32 number per row, its columns' log-sum-exp (1/512 of the bf16 logits it replaces), and the
tile holding a row's target column leaves that logit; a small combine kernel
(codegen/triton/emit.py, ``emit_lse_combine``) merges them and computes the loss. No strip
waits for another, so the tiles go in grouped order (GROUP_M row blocks at a time, as a plain
GEMM takes them) for the L2's sake, and a row may span any number of tiles.

Triton's ``tl`` language cannot warp-specialise on sm_90, so the code generator's kernels run
their epilogue after the mainloop with the tensor cores idle (7-24 us per fused GEMM + norm on
the H200, third session). Gluon, shipped with the same Triton, exposes TMA, mbarriers, WGMMA
and ``warp_specialize``, which works on Hopper. The schedule:

- A persistent grid, one CTA per SM, walking the 128 x 256 tiles in row-strip order (tile t:
  strip t // TILES_N, column tile t % TILES_N), so a strip's tiles run on neighbouring CTAs in
  the same round.
- The default partition (8 warps, two warpgroups) issues the TMA loads of A 128x64 and B
  into a ring of STAGES slots, STAGES - 1 steps ahead across tile boundaries, runs WGMMA
  128x256, and hands the finished tile to the epilogue partition through shared memory (bf16,
  64 KB; RES_TMA: first adding the residual tile the epilogue partition TMA-loaded into that
  buffer meanwhile). It starts the next tile at once. (A separate load warp would make 13
  warps, rounded to 16: 512 threads cannot have the 154+ registers the 128x256 accumulator
  needs; 12 warps can have 168.)
- The epilogue partition (EPI_WARPS warps), per 32-row chunk: v = tile + bias (+ residual),
  rounded to bf16 and kept in the buffer; each row's partial statistics over the tile's 256
  columns, exact from registers (LayerNorm: mean and M2; RMSNorm: the sum of squares; softmax:
  the max and the sum of exp(v - max)), to a workspace; one arrival on the strip's counter and
  a wait for the strip; all 128 rows' partials combined in one batch of loads (Chan's
  combination; for softmax each tile's sum rescaled by exp(max_j - max)); the chunks
  normalised and written once. Its waiting happens in its own warps: the tensor cores are on the next tile.

Co-residency: the grid is at most the SM count and every CTA needs > 114 KB of shared memory,
so each SM holds one and all are resident (given nothing else occupies the GPU). A wait by
tile t's epilogue needs its strip's other tiles to finish their mainloops; a CTA's mainloop of
tile u waits only for its own epilogue of tile u - G (the hand-off buffer), whose strip is an
earlier one (G >= TILES_N). The waits point strictly to earlier strips and cannot form a
cycle. The counters only grow (generation = launch): nothing is reset between launches, and
two launches must not run at once on the same workspace (the runtime gives each device one).

No interpreter form: Gluon does not run in Triton's CPU interpreter. CI compiles every
variant for sm_90 (``compile_sm90``); the H200 checks the results against the float64 IR
interpreter (tests/test_gpu.py).
"""
from __future__ import annotations

import dataclasses
import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...planner.template import TILE, fits

BM, BN, BK = TILE
CHUNK = 32  # rows of the tile the epilogue holds in registers at once
KIND_PLAIN, KIND_LAYERNORM, KIND_RMSNORM, KIND_SOFTMAX, KIND_LSE = 0, 1, 2, 3, 4
LOG2E = gl.constexpr(1.4426950408889634)


@dataclasses.dataclass(frozen=True)
class StripConfig:
    """What one compiled variant of the template does (all constexprs of the kernel)."""
    kind: int = KIND_LAYERNORM
    has_bias: bool = False
    residual: int = 2  # 0 none; 1 loaded by the epilogue chunk by chunk; 2 TMA into the hand-off buffer
    has_gamma: bool = False
    has_beta: bool = False
    relu: bool = False
    b_kmajor: bool = False  # B given as [N, K] (K contiguous, nn.Linear's weight) rather than [K, N]
    stages: int = 3
    epi_warps: int = 4
    epi_regs: int = 152
    maxnreg: int = 168
    wait: bool = True  # False: an ablation that skips the strip exchange (wrong results, timing only)
    group_m: int = 0  # 0: tiles in row-strip order (the strip kinds need it); else grouped, GROUP_M row blocks

    def constexprs(self, tiles_n: int, trace: bool = False) -> dict:
        return dict(KIND=self.kind, HAS_BIAS=self.has_bias, RES=self.residual, HAS_GAMMA=self.has_gamma,
                    HAS_BETA=self.has_beta, RELU=self.relu, B_KMAJOR=self.b_kmajor, WAIT=self.wait,
                    TRACE=trace, TILES_N=tiles_n, TILES_P2=_pow2(tiles_n), STAGES=self.stages, CHUNK=CHUNK,
                    EPI_WARPS=self.epi_warps, EPI_REGS=self.epi_regs, GROUP_M=self.group_m)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


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
    """tanh in fp32 by the special-function unit (tanh.approx.f32, sm_75 and later): one
    instruction, relative error below 2^-10.98 over the whole range (PTX ISA), under a bf16
    output's rounding (2^-9); the exp form it replaces took about twenty per element."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def bf16_pairs(x):
    """x (fp32) rounded to bf16, to nearest even, two elements by one packed conversion
    (cvt.rn.bf16x2.f32: its first operand goes to the high half, so the first element, $1,
    is the second operand and lands in the low half, as a bf16x2 register holds element 0).
    A kept value is stored into the hand-off buffer and also widened again for its pass's
    sums; with that second use ``x.to(gl.bfloat16)`` compiled one element at a time
    (cvt.rn.bf16.f32: 256 F2F a tile in LayerNorm's and multi-stage's keep passes, beside
    multi-stage's 772 MUFU), where this form is 128 packed F2FP, the instruction the output
    pass's stores already use. The same rounding, bit for bit."""
    return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [x], dtype=gl.bfloat16,
                                     is_pure=True, pack=2)


# Columns of one swizzle atom of the hand-off tile: its NVMMA layout (128-byte swizzle) stores a
# [BM, BN] bf16 tile as BN / 64 blocks of [BM, 64], one after another, each row of a block 128
# bytes and the 16-byte pieces of a row permuted by the row's index mod 8. Rows [r, r + R) of
# column block b (R a multiple of 8) are then R * 128 contiguous bytes, themselves a [R, 64]
# tile of the same layout: ``chunk_view`` indexes them at run time.
PIECE = gl.constexpr(64)


@gluon.jit
def chunk_view(tile_smem, CHUNK: gl.constexpr):
    """The hand-off tile as [BN / 64 * BM / CHUNK, CHUNK, 64] pieces, piece b * (BM / CHUNK) + c
    holding rows [c * CHUNK, (c + 1) * CHUNK) of columns [64 b, 64 b + 64) (the same bytes, see
    PIECE): a chunk of rows by a run-time index, where ``tile_smem.slice`` takes a constant one,
    so a pass's loop over its chunks need not be unrolled."""
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
def _mark(trace_ptr, n, slot: gl.constexpr, TRACE: gl.constexpr):
    """TRACE: the global timer (ns) at this point of this program's n-th tile, to
    trace[program, n, slot]: a timeline of where each partition's time goes."""
    if TRACE:
        now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                        pack=1)
        gl.store(trace_ptr + (gl.program_id(0) * 64 + n) * 16 + slot, now)


@gluon.jit
def _tile_coords(t, num_tiles, TILES_N: gl.constexpr, GROUP_M: gl.constexpr):
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
def _issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, i, total, k_steps, num_tiles, B_KMAJOR: gl.constexpr,
                TILES_N: gl.constexpr, GROUP_M: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                BK: gl.constexpr):
    """TMA loads of this program's flattened iteration ``i`` (its tile i // k_steps, K step
    i % k_steps) into ring slot i % STAGES, if there is such an iteration."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    s = i % STAGES
    pid_m, pid_n = _tile_coords(gl.program_id(0) + (i // k_steps) * gl.num_programs(0), num_tiles, TILES_N,
                                GROUP_M)
    kk = i % k_steps
    pred = i < total
    mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [pid_m * BM, kk * BK], ready.index(s), a_bufs.index(s), pred=pred)
    if B_KMAJOR:
        tma.async_copy_global_to_shared(b_desc, [pid_n * BN, kk * BK], ready.index(s), b_bufs.index(s), pred=pred)
    else:
        tma.async_copy_global_to_shared(b_desc, [kk * BK, pid_n * BN], ready.index(s), b_bufs.index(s), pred=pred)


@gluon.jit
def _mma_partition(a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, tile_ready, tile_free, num_tiles, k_steps,
                   trace_ptr, TRACE: gl.constexpr, RES: gl.constexpr, B_KMAJOR: gl.constexpr,
                   TILES_N: gl.constexpr, GROUP_M: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                   BK: gl.constexpr, num_warps: gl.constexpr, spare_smem, spare_ready, SPARE: gl.constexpr):
    """The mainloop and the hand-off (see the module's docstring). With SPARE, the program's
    last tile goes into ``spare_smem`` (the B operand's ring, free once the last K step is
    done: generated kernels, ``_Module.last_in_ring``), completing ``spare_ready``, without waiting for
    the epilogue to free the hand-off buffer (a RES 0 hand-off; the other arguments a dummy
    otherwise)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    my_tiles = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0))
    total = my_tiles * k_steps
    for i in gl.static_range(STAGES - 1):
        _issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, i, total, k_steps, num_tiles, B_KMAJOR, TILES_N, GROUP_M,
                    BM, BN, BK)
    i = 0
    for n in range(my_tiles):
        _mark(trace_ptr, n, 0, TRACE)
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
            _issue_load(a_desc, b_desc, a_bufs, b_bufs, ready, i + STAGES - 1, total, k_steps, num_tiles, B_KMAJOR,
                        TILES_N, GROUP_M, BM, BN, BK)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _mark(trace_ptr, n, 1, TRACE)
        if SPARE:
            if n == my_tiles - 1:  # every K step's loads consumed, the last WGMMA done: the ring is free
                _mark(trace_ptr, n, 2, TRACE)
                fence_async_shared()  # (the ring's async-proxy reads, before these generic writes)
                spare_smem.store(acc.to(gl.bfloat16))
                gl.thread_barrier()
                mbarrier.arrive(spare_ready)
            else:
                _hand_off(acc, tile_smem, tile_ready, tile_free, n, trace_ptr, TRACE, RES, acc_layout)
        else:
            _hand_off(acc, tile_smem, tile_ready, tile_free, n, trace_ptr, TRACE, RES, acc_layout)
        _mark(trace_ptr, n, 3, TRACE)


@gluon.jit
def _hand_off(acc, tile_smem, tile_ready, tile_free, n, trace_ptr, TRACE: gl.constexpr, RES: gl.constexpr,
              acc_layout: gl.constexpr):
    """Tile n's product into the hand-off buffer once the epilogue has freed it (RES 2: the
    buffer holds the tile's residual, TMA-loaded by the epilogue partition, added first)."""
    if RES == 2:
        mbarrier.wait(tile_free, n & 1)
        acc = acc + tile_smem.load(acc_layout).to(gl.float32)
    else:
        mbarrier.wait(tile_free, (n & 1) ^ 1)  # the epilogue is done with the last tile
    _mark(trace_ptr, n, 2, TRACE)
    tile_smem.store(acc.to(gl.bfloat16))
    gl.thread_barrier()
    mbarrier.arrive(tile_ready)


@gluon.jit
def _load_residual(r_desc, tile_smem, bar, t, num_tiles, TILES_N: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """TMA load of tile t's residual into the hand-off buffer, completing ``bar`` (if t exists)."""
    pred = t < num_tiles
    mbarrier.expect(bar, r_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(r_desc, [(t // TILES_N) * BM, (t % TILES_N) * BN], bar, tile_smem, pred=pred)


@gluon.jit
def _epilogue_partition(tile_smem, mean_smem, rstd_smem, tile_ready, tile_free, r_desc, bias_ptr, res_ptr, gamma_ptr,
                        beta_ptr, out_ptr, aux_ptr, ws_ptr, counter_ptr, num_tiles, M, N, eps, trace_ptr,
                        TRACE: gl.constexpr, KIND: gl.constexpr, HAS_BIAS: gl.constexpr, RES: gl.constexpr,
                        HAS_GAMMA: gl.constexpr, HAS_BETA: gl.constexpr, RELU: gl.constexpr, WAIT: gl.constexpr,
                        TILES_N: gl.constexpr, TILES_P2: gl.constexpr, GROUP_M: gl.constexpr, BM: gl.constexpr,
                        BN: gl.constexpr, CHUNK: gl.constexpr, EPI_WARPS: gl.constexpr):
    """The epilogue (see the module's docstring). Workspace: [strips, 2, TILES_N, BM] fp32; for
    KIND_LSE [TILES_N, M] (each tile's log-sum-exp per row), then [M] (the target's logit,
    written by the tile holding the row's target; ``aux_ptr``: the targets, int64 [M])."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [EPI_WARPS, 1], [1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    rows = gl.arange(0, CHUNK, layout=row_l)
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    # the partials [TILES_P2, BM]: each warp reads whole rows of BM contiguous floats (coalesced)
    part_l: gl.constexpr = gl.BlockedLayout([1, BM // 32], [1, 32], [EPI_WARPS, 1], [1, 0])
    prow = gl.arange(0, TILES_P2, layout=gl.SliceLayout(1, part_l))
    pcol = gl.arange(0, BM, layout=gl.SliceLayout(0, part_l))
    pmask = (prow < TILES_N)[:, None] & (pcol < BM)[None, :]
    if RES == 2:
        _load_residual(r_desc, tile_smem, tile_free, gl.program_id(0), num_tiles, TILES_N, BM, BN)
    n = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        strip, tn = _tile_coords(t, num_tiles, TILES_N, GROUP_M)
        off_m = strip * BM
        off_n = tn * BN
        if HAS_BIAS:
            bias = gl.load(bias_ptr + off_n + cols).to(gl.float32)
        if RES == 1:
            r_next = gl.load(res_ptr + (off_m + rows)[:, None] * N + (off_n + cols)[None, :])
        _mark(trace_ptr, n, 4, TRACE)
        mbarrier.wait(tile_ready, n & 1)
        _mark(trace_ptr, n, 5, TRACE)
        for c in gl.static_range(BM // CHUNK):
            part = tile_smem.slice(c * CHUNK, CHUNK, dim=0)
            v = part.load(layout).to(gl.float32)
            if HAS_BIAS:
                v = v + bias[None, :]
            if RES == 1:
                v = v + r_next.to(gl.float32)
                if c + 1 < BM // CHUNK:
                    r_next = gl.load(res_ptr + (off_m + (c + 1) * CHUNK + rows)[:, None] * N + (off_n + cols)[None, :])
            if KIND == 0:
                gl.store(out_ptr + (off_m + c * CHUNK + rows)[:, None] * N + (off_n + cols)[None, :],
                         v.to(gl.bfloat16))
            else:
                v = v.to(gl.bfloat16)
                if (HAS_BIAS or RES == 1) and KIND != 4:
                    part.store(v)
                v = v.to(gl.float32)
                slot = ws_ptr + (strip * 2 * TILES_N + tn) * BM + c * CHUNK + rows
                if KIND == 4:  # this tile's log-sum-exp per row; the logit at the row's target, if here
                    mx = gl.max(v, axis=1)
                    total = gl.sum(exp2_fast((v - mx[:, None]) * LOG2E), axis=1)
                    row = off_m + c * CHUNK + rows
                    gl.store(ws_ptr + tn * M + row, mx + gl.log(total))
                    local = gl.load(aux_ptr + row) - off_n
                    here = (local >= 0) & (local < BN)
                    if gl.max(here.to(gl.int32), axis=0) > 0:  # (a tile of 256 columns holds few targets)
                        col = gl.where(here, local, -1).to(gl.int32)
                        pick = gl.sum(gl.where(cols[None, :] == col[:, None], v, 0.0), axis=1)
                        gl.store(ws_ptr + TILES_N * M + row, pick, mask=here)
                elif KIND == 1:  # this tile's mean and M2 per row
                    mean = gl.sum(v, axis=1) / BN
                    d = v - mean[:, None]
                    gl.store(slot, mean)
                    gl.store(slot + TILES_N * BM, gl.sum(d * d, axis=1))
                elif KIND == 2:  # this tile's sum of squares per row
                    gl.store(slot, gl.sum(v * v, axis=1))
                else:  # this tile's max and sum of exp(v - max) per row
                    mx = gl.max(v, axis=1)
                    gl.store(slot, mx)
                    gl.store(slot + TILES_N * BM, gl.sum(exp2_fast((v - mx[:, None]) * LOG2E), axis=1))
        if KIND == 1 or KIND == 2 or KIND == 3:
            gl.thread_barrier()  # every warp has published its partials
            _mark(trace_ptr, n, 6, TRACE)
            if WAIT:
                old = gl.atomic_add(counter_ptr + strip, 1, sem="acq_rel", scope="gpu")
                target = (old // TILES_N + 1) * TILES_N
                seen = gl.atomic_add(counter_ptr + strip, 0, sem="acquire", scope="gpu")
                while seen < target:
                    seen = gl.atomic_add(counter_ptr + strip, 0, sem="acquire", scope="gpu")
                gl.thread_barrier()
            _mark(trace_ptr, n, 7, TRACE)
            # all TILES_N partials of all BM rows in one batch of loads
            pbase = ws_ptr + strip * 2 * TILES_N * BM + prow[:, None] * BM + pcol[None, :]
            first = gl.load(pbase, mask=pmask, other=0.0, cache_modifier=".cg")
            if KIND == 1:  # Chan: mean of the means; M2 = sum of M2_j + BN (mean_j - mean)^2
                mean = gl.sum(first, axis=0) / TILES_N
                dm = gl.where(pmask, first - mean[None, :], 0.0)
                m2 = gl.sum(gl.load(pbase + TILES_N * BM, mask=pmask, other=0.0, cache_modifier=".cg")
                            + BN * dm * dm, axis=0)
                mean_smem.store(mean)
                rstd_smem.store(gl.rsqrt(m2 / N + eps))
            elif KIND == 2:
                rstd_smem.store(gl.rsqrt(gl.sum(first, axis=0) / N + eps))
            else:  # the row max over the strip, and 1 / the sum of exp(v - max), rescaled per tile
                first = gl.where(pmask, first, -float("inf"))
                mx = gl.max(first, axis=0)
                scale = gl.where(pmask, exp2_fast((first - mx[None, :]) * LOG2E), 0.0)
                total = gl.sum(gl.load(pbase + TILES_N * BM, mask=pmask, other=0.0, cache_modifier=".cg") * scale,
                               axis=0)
                mean_smem.store(mx * LOG2E)
                rstd_smem.store(1.0 / total)
            gl.thread_barrier()
            _mark(trace_ptr, n, 8, TRACE)
            if HAS_GAMMA:
                gamma = gl.load(gamma_ptr + off_n + cols).to(gl.float32)
            if HAS_BETA:
                beta = gl.load(beta_ptr + off_n + cols).to(gl.float32)
            for c in gl.static_range(BM // CHUNK):
                v = tile_smem.slice(c * CHUNK, CHUNK, dim=0).load(layout).to(gl.float32)
                rstd_c = rstd_smem.slice(c * CHUNK, CHUNK).load(row_l)
                if KIND == 1:
                    v = v - mean_smem.slice(c * CHUNK, CHUNK).load(row_l)[:, None]
                if KIND == 3:  # exp2(v log2e - max log2e) / sum
                    v = exp2_fast(v * LOG2E - mean_smem.slice(c * CHUNK, CHUNK).load(row_l)[:, None])
                o = v * rstd_c[:, None]
                if HAS_GAMMA:
                    o = o * gamma[None, :]
                if HAS_BETA:
                    o = o + beta[None, :]
                if RELU:
                    o = gl.maximum(o, 0.0)
                gl.store(out_ptr + (off_m + c * CHUNK + rows)[:, None] * N + (off_n + cols)[None, :],
                         o.to(gl.bfloat16))
        gl.thread_barrier()  # every warp has read the tile (and the statistics)
        _mark(trace_ptr, n, 9, TRACE)
        if RES == 2:
            fence_async_shared()  # generic reads of the buffer before the TMA writes into it
            _load_residual(r_desc, tile_smem, tile_free, t + gl.num_programs(0), num_tiles, TILES_N, BM, BN)
        else:
            mbarrier.arrive(tile_free)
        n += 1


@gluon.jit
def strip_kernel(a_desc, b_desc, r_desc, bias_ptr, res_ptr, gamma_ptr, beta_ptr, out_ptr, aux_ptr, ws_ptr,
                 counter_ptr, M, N, K, eps, trace_ptr,
                 KIND: gl.constexpr, HAS_BIAS: gl.constexpr, RES: gl.constexpr, HAS_GAMMA: gl.constexpr,
                 HAS_BETA: gl.constexpr, RELU: gl.constexpr, B_KMAJOR: gl.constexpr, WAIT: gl.constexpr,
                 TRACE: gl.constexpr, TILES_N: gl.constexpr, TILES_P2: gl.constexpr, STAGES: gl.constexpr,
                 CHUNK: gl.constexpr, EPI_WARPS: gl.constexpr, EPI_REGS: gl.constexpr, GROUP_M: gl.constexpr,
                 num_warps: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = r_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    tile_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], r_desc.layout)
    mean_smem = gl.allocate_shared_memory(gl.float32, [BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    rstd_smem = gl.allocate_shared_memory(gl.float32, [BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tile_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    tile_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(tile_ready, count=1)
    mbarrier.init(tile_free, count=1)
    fence_async_shared()
    num_tiles = (M // BM) * TILES_N
    k_steps = gl.cdiv(K, BK)
    gl.warp_specialize([
        (_mma_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, tile_ready, tile_free, num_tiles,
                          k_steps, trace_ptr, TRACE, RES, B_KMAJOR, TILES_N, GROUP_M, BM, BN, BK, num_warps,
                          tile_smem, tile_ready, False)),
        (_epilogue_partition, (tile_smem, mean_smem, rstd_smem, tile_ready, tile_free, r_desc, bias_ptr, res_ptr,
                               gamma_ptr, beta_ptr, out_ptr, aux_ptr, ws_ptr, counter_ptr, num_tiles, M, N, eps,
                               trace_ptr, TRACE, KIND, HAS_BIAS, RES, HAS_GAMMA, HAS_BETA, RELU, WAIT, TILES_N,
                               TILES_P2, GROUP_M, BM, BN, CHUNK, EPI_WARPS)),
    ], [EPI_WARPS], [EPI_REGS])


@functools.cache
def layouts(b_kmajor: bool, bn: int = BN):
    """Shared-memory layouts of the A, B and tile (residual / hand-off) blocks for tiles
    ``bn`` wide (remembered: building them was a fifth of a call's profiled host time; H200,
    thirteenth session)."""
    return (gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([bn, BK] if b_kmajor else [BK, bn], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([BM, bn], gl.bfloat16))


TILE_LAYOUT = gl.constexpr(layouts(False)[2])  # the hand-off buffer's (generated kernels, gluon/stages.py)
TILE_LAYOUT_N128 = gl.constexpr(layouts(False, 128)[2])  # the same for 128-wide tiles (COMFUSE_WS_TILE_N=128)


def call_arguments(cfg: StripConfig, a, b, out, bias=None, residual=None, gamma=None, beta=None,
                   targets=None) -> list:
    """strip_kernel's first ``PER_CALL`` arguments, those that hold a call's data pointers: the
    three TMA descriptors (A, B, and the residual's, or the output's where there is no residual:
    it only gives the tile's shape and layout then) and the tensors (the output standing in for
    an absent one; KIND_LSE writes no output, ``out`` is any bf16 [BM, BN] tensor then). The rest
    depend only on the layout."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    la, lb, lt = layouts(cfg.b_kmajor)
    return [TensorDescriptor.from_tensor(a, [BM, BK], la),
            TensorDescriptor.from_tensor(b, [BN, BK] if cfg.b_kmajor else [BK, BN], lb),
            TensorDescriptor.from_tensor(residual if residual is not None else out, [BM, BN], lt),
            *(out if t is None else t for t in (bias, residual, gamma, beta)), out,
            out if targets is None else targets]


PER_CALL = 9
GROUP_M = 8  # KIND_LSE's grouped order: row blocks of A in flight together (a plain GEMM's usual 8)


def arguments(cfg: StripConfig, a, b, out, *, bias=None, residual=None, gamma=None, beta=None, eps=1e-5,
              ws=None, counters=None, num_sms: int = 132, trace=None, targets=None) -> tuple:
    """(grid, positional arguments, options) of one launch: see ``launch``."""
    import torch
    M, K = a.shape
    if cfg.kind == KIND_LSE:
        N = b.shape[0] if cfg.b_kmajor else b.shape[1]
        why = fits(M, N, K, terminal=True)
        if not why and (targets is None or targets.dtype != torch.int64 or targets.shape != (M, )):
            why = "KIND_LSE takes int64 targets [M]"
        if not why and cfg.residual:
            why = "KIND_LSE takes no residual"
    else:
        N = out.shape[1]
        why = fits(M, N, K)
    if why:
        raise ValueError(why)
    tiles_n = N // BN
    if cfg.kind not in (KIND_PLAIN, KIND_LSE) and tiles_n > num_sms:
        raise ValueError(f"a strip of {tiles_n} tiles cannot be resident at once on {num_sms} SMs")
    grid = (min(num_sms, (M // BM) * tiles_n), )
    args = [*call_arguments(cfg, a, b, out, bias, residual, gamma, beta, targets), ws if ws is not None else out,
            counters if counters is not None else torch.zeros(1, dtype=torch.int64, device=out.device),
            M, N, K, eps, counters if trace is None else trace]
    return grid, args, dict(cfg.constexprs(tiles_n, trace is not None), num_warps=8, maxnreg=cfg.maxnreg)


def launch(cfg: StripConfig, a, b, out, **kw) -> int:
    """One launch through Triton's JIT: ``a`` [M, K] row-major, ``b`` [K, N] (or [N, K] when
    cfg.b_kmajor) with unit inner stride, ``out`` [M, N] contiguous, all bf16; bias / gamma /
    beta [N]; residual [M, N] contiguous; ``ws`` (float32, at least workspace_numel) and
    ``counters`` (int64, M / 128 entries, zero before the first launch, never reset). KIND_LSE:
    ``targets`` int64 [M] and ``out`` any bf16 [BM, BN] tensor (nothing is written to it; the
    results are in ``ws``). Returns the grid size. (runtime/strip_kernel.py launches the
    compiled kernel directly after its first call per layout.)"""
    grid, args, options = arguments(cfg, a, b, out, **kw)
    strip_kernel[grid](*args, **options)
    return grid[0]


def workspace_numel(M: int, N: int, kind: int = KIND_LAYERNORM) -> int:
    if kind == KIND_LSE:  # [TILES_N, M] log-sum-exps, then [M] target logits
        return (N // BN + 1) * M
    return (M // BM) * 2 * (N // BN) * BM


def compile_sm90(cfg: StripConfig, M: int = 8192, N: int = 1024, K: int = 1024):
    """Compile one variant for sm_90 on any machine (no GPU needed); returns Triton's kernel
    (``.asm["cubin"]``, ``.metadata``). Integers are marked divisible by 16 as Triton's JIT
    specialises them at a launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    la, lb, lt = layouts(cfg.b_kmajor)
    bshape = [BN, BK] if cfg.b_kmajor else [BK, BN]
    sig = {"a_desc": f"tensordesc<bf16[{BM}, {BK}],{la!r}>",
           "b_desc": f"tensordesc<bf16[{bshape[0]}, {bshape[1]}],{lb!r}>",
           "r_desc": f"tensordesc<bf16[{BM}, {BN}],{lt!r}>",
           "bias_ptr": "*bf16", "res_ptr": "*bf16", "gamma_ptr": "*bf16", "beta_ptr": "*bf16",
           "out_ptr": "*bf16", "aux_ptr": "*i64" if cfg.kind == KIND_LSE else "*bf16", "ws_ptr": "*fp32",
           "counter_ptr": "*i64", "M": "i32", "N": "i32", "K": "i32",
           "eps": "fp32", "trace_ptr": "*i64"}
    constexprs = dict(cfg.constexprs(N // BN), num_warps=8)
    sig.update({k: "constexpr" for k in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3, 14)}
    return triton.compile(GluonASTSource(strip_kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 8, "maxnreg": cfg.maxnreg})
