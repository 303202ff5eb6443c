"""A warp-specialised Gluon template (Triton 3.6, sm_90): GEMM + a row normalisation whose row
strip spans several tiles, the epilogue in warps of its own beside the next tile's mainloop.

    v   = x @ W (+ bias[N]) (+ residual[M, N])            rounded to bf16, as eager rounds it
    out = LayerNorm(v) (* gamma) (+ beta) (ReLU)          KIND_LAYERNORM
    out = v * rsqrt(mean(v^2) + eps) (* gamma)            KIND_RMSNORM
    out = softmax(v) along N                              KIND_SOFTMAX
    ws  = per tile and row: log-sum-exp of its 256 columns, KIND_LSE (terminal: no [M, N] output,
          the row's logit at a target column, and with      cross-entropy's statistics;
          EXACT_MAX the tile's row max)
    out = v                                               with LSE_OUT (the logits beside them, by TMA)

KIND_LSE is the terminal reduction (a loss over a vocabulary-wide row): each tile leaves one
fp32 number per row, its columns' log-sum-exp (1/512 of the bf16 logits it replaces), and the
tile holding a row's target column leaves that logit; a small combine kernel
(codegen/triton/emit.py, ``emit_lse_combine``) merges them and computes the loss. No strip
waits for another, so the tiles go in grouped order (GROUP_M row blocks at a time, as a plain
GEMM takes them) for the L2's sake, and a row may span any number of tiles.

Triton's ``tl`` language cannot warp-specialise on sm_90, so the Triton kernels run their
epilogue after the mainloop with the tensor cores idle. Gluon, shipped with the same Triton,
exposes TMA, mbarriers, WGMMA and ``warp_specialize``, which works on Hopper. The schedule:

- A persistent grid, one CTA per SM, walking the 128 x 256 tiles in row-strip order (tile t:
  strip t // TILES_N, column tile t % TILES_N), so a strip's tiles run on neighbouring CTAs in
  the same round.
- The default partition (8 warps, ``parts.mma_partition``) runs the mainloop and hands the
  finished tile to the epilogue partition through shared memory. (A separate load warp would
  make 13 warps, rounded to 16: 512 threads cannot have the 154+ registers the 128x256
  accumulator needs; 12 warps can have 168.)
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

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ...planner.template import fits
from .parts import BK, BM, BN, LOG2E, exp2_fast, layouts, load_residual, mma_partition, pow2, tile_coords

CHUNK = 32  # rows of the tile the epilogue holds in registers at once
KIND_LAYERNORM, KIND_RMSNORM, KIND_SOFTMAX, KIND_LSE = 1, 2, 3, 4


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
    group_m: int = 0  # 0: tiles in row-strip order (the strip kinds need it); else grouped, GROUP_M row blocks
    lse_out: bool = False  # KIND_LSE: also write the bf16 tile (the logits) by TMA through ``r_desc``
    exact_max: bool = False  # KIND_LSE: also store each tile's row max (a saved row max is then exact)
    pick: bool = True  # KIND_LSE: store the logit at each row's target (else the combine reads it from the logits)

    def constexprs(self, tiles_n: int, even_n: bool = True) -> dict:
        """``even_n``: N is whole tiles (KIND_LSE may take a last partial tile: its columns past N,
        zeros from TMA, are masked out of the statistics; the logits' TMA store clips them)."""
        return dict(KIND=self.kind, HAS_BIAS=self.has_bias, RES=self.residual, HAS_GAMMA=self.has_gamma,
                    HAS_BETA=self.has_beta, RELU=self.relu, B_KMAJOR=self.b_kmajor, TILES_N=tiles_n,
                    TILES_P2=pow2(tiles_n), STAGES=self.stages, CHUNK=CHUNK, EPI_WARPS=self.epi_warps,
                    EPI_REGS=self.epi_regs, GROUP_M=self.group_m, LSE_OUT=self.lse_out, EVEN_N=even_n,
                    EXACT_MAX=self.exact_max, PICK=self.pick)


@gluon.jit
def _epilogue_partition(tile_smem, mean_smem, rstd_smem, tile_ready, tile_free, r_desc, bias_ptr, res_ptr, gamma_ptr,
                        beta_ptr, out_ptr, aux_ptr, ws_ptr, counter_ptr, num_tiles, M, N, eps,
                        KIND: gl.constexpr, HAS_BIAS: gl.constexpr, RES: gl.constexpr,
                        HAS_GAMMA: gl.constexpr, HAS_BETA: gl.constexpr, RELU: gl.constexpr,
                        TILES_N: gl.constexpr, TILES_P2: gl.constexpr, GROUP_M: gl.constexpr, BM: gl.constexpr,
                        BN: gl.constexpr, CHUNK: gl.constexpr, EPI_WARPS: gl.constexpr, LSE_OUT: gl.constexpr,
                        EVEN_N: gl.constexpr, EXACT_MAX: gl.constexpr, PICK: gl.constexpr):
    """The epilogue (see the module's docstring). Workspace: [strips, 2, TILES_N, BM] fp32; for
    KIND_LSE [TILES_N, M] (each tile's log-sum-exp per row), then [M] (the target's logit,
    written by the tile holding the row's target, with PICK; ``aux_ptr``: the targets, int64 [M]), with
    EXACT_MAX then [TILES_N, M] (each tile's row max); with LSE_OUT the tile itself too, by TMA
    through ``r_desc`` (the logits a model returns beside its loss)."""
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
        load_residual(r_desc, tile_smem, tile_free, gl.program_id(0), num_tiles, TILES_N, BM, BN)
    n = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        strip, tn = tile_coords(t, num_tiles, TILES_N, GROUP_M)
        off_m = strip * BM
        off_n = tn * BN
        if HAS_BIAS:
            bias = gl.load(bias_ptr + off_n + cols).to(gl.float32)
        if RES == 1:
            r_next = gl.load(res_ptr + (off_m + rows)[:, None] * N + (off_n + cols)[None, :])
        if KIND == 4 and PICK:  # where the rows' targets fall in this tile, read while the tile is computed:
            # each warp holds all BM (its own test of whether any is here), the chunks read
            # theirs from shared memory (mean_smem: this kind has no mean)
            local = gl.load(aux_ptr + off_m + pcol) - off_n
            found = gl.max(((local >= 0) & (local < BN)).to(gl.int32), axis=0)
            mean_smem.store(local.to(gl.float32))  # (exact: |local| < 2^24)
            gl.thread_barrier()
        mbarrier.wait(tile_ready, n & 1)
        if LSE_OUT:  # the logits by one TMA store of the tile (clipped at N), beside the statistics
            fence_async_shared()
            tma.async_copy_shared_to_global(r_desc, [off_m, off_n], tile_smem)
        for c in gl.static_range(BM // CHUNK):
            part = tile_smem.slice(c * CHUNK, CHUNK, dim=0)
            v = part.load(layout).to(gl.float32)
            if HAS_BIAS:
                v = v + bias[None, :]
            if RES == 1:
                v = v + r_next.to(gl.float32)
                if c + 1 < BM // CHUNK:
                    r_next = gl.load(res_ptr + (off_m + (c + 1) * CHUNK + rows)[:, None] * N + (off_n + cols)[None, :])
            v = v.to(gl.bfloat16)
            if (HAS_BIAS or RES == 1) and KIND != 4:
                part.store(v)
            v = v.to(gl.float32)
            slot = ws_ptr + (strip * 2 * TILES_N + tn) * BM + c * CHUNK + rows
            if KIND == 4:  # this tile's log-sum-exp per row; the logit at the row's target, if here
                if not EVEN_N:  # the last tile's columns past N: no part of any row
                    v = gl.where(((off_n + cols) < N)[None, :], v, -float("inf"))
                mx = gl.max(v, axis=1)
                total = gl.sum(exp2_fast(v * LOG2E - (mx * LOG2E)[:, None]), axis=1)  # (one FFMA an element)
                row = off_m + c * CHUNK + rows
                gl.store(ws_ptr + tn * M + row, mx + gl.log(total))
                if EXACT_MAX:
                    gl.store(ws_ptr + (TILES_N + 1 + tn) * M + row, mx)
                if PICK:
                    if found > 0:  # (a tile of 256 columns holds few targets)
                        col = mean_smem.slice(c * CHUNK, CHUNK).load(row_l).to(gl.int32)
                        here = (col >= 0) & (col < BN)
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
            old = gl.atomic_add(counter_ptr + strip, 1, sem="acq_rel", scope="gpu")
            target = (old // TILES_N + 1) * TILES_N
            seen = gl.atomic_add(counter_ptr + strip, 0, sem="acquire", scope="gpu")
            while seen < target:
                seen = gl.atomic_add(counter_ptr + strip, 0, sem="acquire", scope="gpu")
            gl.thread_barrier()
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
        if LSE_OUT:
            tma.store_wait(0)  # the store has read the tile
        gl.thread_barrier()  # every warp has read the tile (and the statistics)
        if RES == 2:
            fence_async_shared()  # generic reads of the buffer before the TMA writes into it
            load_residual(r_desc, tile_smem, tile_free, t + gl.num_programs(0), num_tiles, TILES_N, BM, BN)
        else:
            mbarrier.arrive(tile_free)
        n += 1


@gluon.jit
def strip_kernel(a_desc, b_desc, r_desc, bias_ptr, res_ptr, gamma_ptr, beta_ptr, out_ptr, aux_ptr, ws_ptr,
                 counter_ptr, M, N, K, eps,
                 KIND: gl.constexpr, HAS_BIAS: gl.constexpr, RES: gl.constexpr, HAS_GAMMA: gl.constexpr,
                 HAS_BETA: gl.constexpr, RELU: gl.constexpr, B_KMAJOR: gl.constexpr, TILES_N: gl.constexpr,
                 TILES_P2: gl.constexpr, STAGES: gl.constexpr,
                 CHUNK: gl.constexpr, EPI_WARPS: gl.constexpr, EPI_REGS: gl.constexpr, GROUP_M: gl.constexpr,
                 LSE_OUT: gl.constexpr, EVEN_N: gl.constexpr, EXACT_MAX: gl.constexpr, PICK: gl.constexpr,
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
        (mma_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, tile_ready, tile_free, num_tiles,
                         k_steps, RES, B_KMAJOR, TILES_N, GROUP_M, BM, BN, BK, num_warps, tile_smem, tile_ready,
                         False)),
        (_epilogue_partition, (tile_smem, mean_smem, rstd_smem, tile_ready, tile_free, r_desc, bias_ptr, res_ptr,
                               gamma_ptr, beta_ptr, out_ptr, aux_ptr, ws_ptr, counter_ptr, num_tiles, M, N, eps,
                               KIND, HAS_BIAS, RES, HAS_GAMMA, HAS_BETA, RELU, TILES_N, TILES_P2, GROUP_M, BM, BN,
                               CHUNK, EPI_WARPS, LSE_OUT, EVEN_N, EXACT_MAX, PICK)),
    ], [EPI_WARPS], [EPI_REGS])


def call_arguments(cfg: StripConfig, a, b, out, bias=None, residual=None, gamma=None, beta=None,
                   targets=None, tile=None) -> list:
    """strip_kernel's first ``PER_CALL`` arguments, those that hold a call's data pointers: the
    three TMA descriptors (A, B, and the residual's, or with ``lse_out`` the logits' (``out``),
    or else ``tile``'s or the output's: it only gives the tile's shape and layout then) and the
    tensors (the output standing in for an absent one; KIND_LSE writes no output unless
    ``lse_out``, ``out`` is any bf16 [BM, BN] tensor then). The rest depend only on the layout."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    la, lb, lt = layouts(cfg.b_kmajor)
    return [TensorDescriptor.from_tensor(a, [BM, BK], la),
            TensorDescriptor.from_tensor(b, [BN, BK] if cfg.b_kmajor else [BK, BN], lb),
            TensorDescriptor.from_tensor(residual if residual is not None else out if cfg.lse_out
                                         else tile if tile is not None else out, [BM, BN], lt),
            *(out if t is None else t for t in (bias, residual, gamma, beta)), out,
            out if targets is None else targets]


PER_CALL = 9
GROUP_M = 8  # KIND_LSE's grouped order: row blocks of A in flight together (a plain GEMM's usual 8)


def arguments(cfg: StripConfig, a, b, out, *, bias=None, residual=None, gamma=None, beta=None, eps=1e-5,
              ws, counters, num_sms: int = 132, targets=None, tile=None) -> tuple:
    """(grid, positional arguments, options) of one launch of ``strip_kernel``: ``a`` [M, K]
    row-major, ``b`` [K, N] (or [N, K] when cfg.b_kmajor) with unit inner stride, ``out`` [M, N]
    contiguous, all bf16; bias / gamma / beta [N]; residual [M, N] contiguous; ``ws`` (float32,
    at least workspace_numel) and ``counters`` (int64, M / 128 entries, zero before the first
    launch, never reset), both the caller's to keep (runtime/strip_kernel.py: made once per
    size, so that a launch bound for another layout allocates nothing it keeps). KIND_LSE:
    ``targets`` int64 [M] and ``out`` any bf16 [BM, BN] tensor (nothing is written to it; the
    results are in ``ws``), or with ``lse_out`` the [M, N] logits (rows 16-byte aligned); it
    reads no counters."""
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
    tiles_n = -(-N // BN)
    if cfg.kind != KIND_LSE and tiles_n > num_sms:
        raise ValueError(f"a strip of {tiles_n} tiles cannot be resident at once on {num_sms} SMs")
    grid = (min(num_sms, (M // BM) * tiles_n), )
    args = [*call_arguments(cfg, a, b, out, bias, residual, gamma, beta, targets, tile), ws, counters, M, N, K, eps]
    return grid, args, dict(cfg.constexprs(tiles_n, N % BN == 0), num_warps=8, maxnreg=cfg.maxnreg)


def workspace_numel(M: int, N: int, kind: int = KIND_LAYERNORM, exact_max: bool = False) -> int:
    if kind == KIND_LSE:  # [TILES_N, M] log-sum-exps, then [M] target logits (then [TILES_N, M] maxima)
        return (-(-N // BN) * (2 if exact_max else 1) + 1) * M
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
           "eps": "fp32"}
    constexprs = dict(cfg.constexprs(-(-N // BN), N % BN == 0), num_warps=8)
    sig.update({k: "constexpr" for k in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3, 14)}
    return triton.compile(GluonASTSource(strip_kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 8, "maxnreg": cfg.maxnreg})
