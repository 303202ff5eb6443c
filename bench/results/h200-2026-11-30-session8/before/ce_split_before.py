"""comfuse kernels ce_split_before and ce_split_before_combine: split: row strip (reductions along N); 4 stage(s), statistics (max, lse, sum) over 32 slices of 4 tiles per row block in grouped order, tile work inlined, then a combine; tma mainloop, tile 128x256x64, 8 warps, 3 pipeline stages

Generated from this IR (do not edit; regenerated when anything below changes):

region gemm_epilogue  B=1 M=8192 N=32768 K=4096
  gemm   a_1: bf16 [M,K] @ b_1: bf16 [K,N] -> fp32 accumulator (K-major @ N-major)
  in0    unsqueeze: i64 [M]
  in1    _to_copy_1: f32 [M]
  in2    ne: bool [M]
  %0 = acc = a_1 @ b_1                    : f32 [M,N]
  %1 = cast %0 to f32                     : f32 [M,N]
  %2 = rmax[N] %1                         : f32 [M]
  %3 = sub %1, %2                         : f32 [M,N]
  %4 = exp %3                             : f32 [M,N]
  %5 = sum[N] %4                          : f32 [M]
  %6 = log %5                             : f32 [M]
  %7 = sub %3, %6                         : f32 [M,N]
  %8 = input unsqueeze                    : i64 [M]
  %9 = iota N                             : i64 [N]
  %10 = eq %9, %8                         : bool [M,N]
  %11 = const 0.0                         : f32 []
  %12 = where %10, %7, %11                : f32 [M,N]
  %13 = sum[N] %12                        : f32 [M]
  %14 = const 0                           : i64 []
  %15 = const 32768                       : i64 []
  %16 = ge %8, %14                        : bool [M]
  %17 = lt %8, %15                        : bool [M]
  %18 = and %16, %17                      : bool [M]
  %19 = cast %18 to f32                   : f32 [M]
  %20 = gt %19, %11                       : bool [M]
  %21 = const nan                         : f32 []
  %22 = where %20, %13, %21               : f32 [M]
  %23 = neg %22                           : f32 [M]
  %24 = input _to_copy_1                  : f32 [M]
  %25 = mul %23, %24                      : f32 [M]
  %26 = input ne                          : bool [M]
  %27 = where %26, %25, %11               : f32 [M]
  out0   %27 (where_1): f32 [M]
"""
import triton
import triton.language as tl

from comfuse.codegen.triton.helpers import (expm1, log1p, lse_merge, max_propagate_nan, min_propagate_nan,
                                             moments_merge, pow_int, pow_real, strip_arrive,
                                             strip_barrier, strip_wait, tanh)


@triton.jit
def ce_split_before_tile(
    a_desc,  # a_1: A, K-major tensor descriptor
    b_desc,  # b_1: B, N-major tensor descriptor
    in0_ptr,  # unsqueeze
    in1_ptr,  # _to_copy_1
    in2_ptr,  # ne
    out0_ptr,  # where_1
    ws_ptr,  # fp32 [statistic arrays, CHUNKS, M]: each slice's statistics
    M,
    N,
    K,
    CHUNKS,  # slices of N per row block
    TILES_PER_CHUNK,  # N tiles per slice
    stride_in0_m,
    stride_in1_m,
    stride_in2_m,
    stride_out0_m,
    pid_m, chunk, t,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE_INDEX: tl.constexpr, EVEN_N: tl.constexpr, CHUNKS_POW2: tl.constexpr,
):
    """Tile t of the slice: its GEMM and tile values, merged into the slice's statistics."""
    pid_n = chunk * TILES_PER_CHUNK + t
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if WIDE_INDEX:  # some tensor spans more than 2**31 elements
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    mask_m = offs_m < M
    mask_n = (offs_n < N) | EVEN_N  # EVEN_N: N is a multiple of BLOCK_N, no column masks

    # ---- mainloop: tensor-descriptor (TMA) tile loads, zero past the edges; fp32 accumulation ----
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([pid_m * BLOCK_M, k0])
        b = b_desc.load([k0, pid_n * BLOCK_N])
        if UPCAST_OPERANDS:  # Triton 3.6's interpreter multiplies bf16 bit patterns
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

    # ---- the slice's statistics so far: fresh on its first tile, else from the workspace ----
    tl.debug_barrier()  # the previous tile's stores, by other threads of this program
    stat0 = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # max of %1
    stat1_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max
    stat1_s = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum of exp(x - max)
    stat2 = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum of %28
    if t > 0:
        stat0 = tl.load(ws_ptr + (0 * CHUNKS + chunk) * M + offs_m, mask=mask_m, other=float("-inf"))
        stat1_m = tl.load(ws_ptr + (1 * CHUNKS + chunk) * M + offs_m, mask=mask_m, other=float("-inf"))
        stat1_s = tl.load(ws_ptr + (2 * CHUNKS + chunk) * M + offs_m, mask=mask_m, other=0.0)
        stat2 = tl.load(ws_ptr + (3 * CHUNKS + chunk) * M + offs_m, mask=mask_m, other=0.0)

    # ---- tile values the statistics reduce ----
    v0 = acc  # GEMM result
    v1 = v0  # cast torch.float32
    v8 = tl.load(in0_ptr + offs_m[:, None] * stride_in0_m, mask=mask_m[:, None], other=0)  # load unsqueeze
    v9 = offs_n[None, :]  # iota N
    v10 = v9 == v8  # eq
    v28 = tl.where(v10, v1, 0.0)  # where
    # ---- this tile's partials, merged into the slice's statistics, stored ----
    tile_max1 = tl.reduce(tl.where(mask_n[None, :], v1.to(tl.float32), float("-inf")), 1, max_propagate_nan)
    stat0 = tl.maximum(stat0, tile_max1, propagate_nan=tl.PropagateNan.ALL)
    tile_s = tl.sum(tl.where(mask_n[None, :], tl.exp(v1.to(tl.float32) - tile_max1[:, None]), 0.0), axis=1)
    stat1_m, stat1_s = lse_merge(stat1_m, stat1_s, tile_max1, tile_s)
    stat2 += tl.sum(tl.where(mask_n[None, :], v28.to(tl.float32), 0.0), axis=1)
    tl.store(ws_ptr + (0 * CHUNKS + chunk) * M + offs_m, stat0, mask=mask_m)
    tl.store(ws_ptr + (1 * CHUNKS + chunk) * M + offs_m, stat1_m, mask=mask_m)
    tl.store(ws_ptr + (2 * CHUNKS + chunk) * M + offs_m, stat1_s, mask=mask_m)
    tl.store(ws_ptr + (3 * CHUNKS + chunk) * M + offs_m, stat2, mask=mask_m)


@triton.jit
def ce_split_before(
    a_desc,  # a_1: A, K-major tensor descriptor
    b_desc,  # b_1: B, N-major tensor descriptor
    in0_ptr,  # unsqueeze
    in1_ptr,  # _to_copy_1
    in2_ptr,  # ne
    out0_ptr,  # where_1
    ws_ptr,  # fp32 [statistic arrays, CHUNKS, M]: each slice's statistics
    M,
    N,
    K,
    CHUNKS,  # slices of N per row block
    TILES_PER_CHUNK,  # N tiles per slice
    stride_in0_m,
    stride_in1_m,
    stride_in2_m,
    stride_out0_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE_INDEX: tl.constexpr, EVEN_N: tl.constexpr, CHUNKS_POW2: tl.constexpr,
):
    """split: row strip (reductions along N); 4 stage(s), statistics (max, lse, sum) over 32 slices of 4 tiles per row block in grouped order, tile work inlined, then a combine; tma mainloop, tile 128x256x64, 8 warps, 3 pipeline stages: statistics of one slice of N"""
    pid = tl.program_id(0)
    # grouped order, as a plain GEMM takes its tiles: GROUP_M row blocks at a time, each
    # slice's B columns shared by the GROUP_M programs in flight beside each other
    num_pid_m = tl.cdiv(M, BLOCK_M)
    group = GROUP_M * CHUNKS
    first_m = (pid // group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_m
    chunk = (pid % group) // group_m
    # the last slice may hold fewer tiles (CHUNKS * TILES_PER_CHUNK can exceed the tiles)
    tiles = tl.minimum(TILES_PER_CHUNK, tl.cdiv(N, BLOCK_N) - chunk * TILES_PER_CHUNK)
    for t in range(0, tiles):
        ce_split_before_tile(
            a_desc, b_desc, in0_ptr, in1_ptr, in2_ptr, out0_ptr, ws_ptr, M, N, K, CHUNKS, TILES_PER_CHUNK, stride_in0_m, stride_in1_m, stride_in2_m, stride_out0_m,
            pid_m, chunk, t,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, UPCAST_OPERANDS, DOT_PRECISION, WIDE_INDEX, EVEN_N, CHUNKS_POW2,
        )


@triton.jit
def ce_split_before_combine(
    a_desc,  # a_1: A, K-major tensor descriptor
    b_desc,  # b_1: B, N-major tensor descriptor
    in0_ptr,  # unsqueeze
    in1_ptr,  # _to_copy_1
    in2_ptr,  # ne
    out0_ptr,  # where_1
    ws_ptr,  # fp32 [statistic arrays, CHUNKS, M]: each slice's statistics
    M,
    N,
    K,
    CHUNKS,  # slices of N per row block
    TILES_PER_CHUNK,  # N tiles per slice
    stride_in0_m,
    stride_in1_m,
    stride_in2_m,
    stride_out0_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE_INDEX: tl.constexpr, EVEN_N: tl.constexpr, CHUNKS_POW2: tl.constexpr,
):
    """merge each row's statistics over the slices of N; compute the outputs"""
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    chunks = tl.arange(0, CHUNKS_POW2)
    both = (chunks < CHUNKS)[:, None] & mask_m[None, :]
    stat0 = tl.reduce(tl.load(ws_ptr + (0 * CHUNKS + chunks[:, None]) * M + offs_m[None, :], mask=both, other=float("-inf")), 0, max_propagate_nan)  # max of %1
    slice_m = tl.load(ws_ptr + (1 * CHUNKS + chunks[:, None]) * M + offs_m[None, :], mask=both, other=float("-inf"))
    slice_s = tl.load(ws_ptr + (2 * CHUNKS + chunks[:, None]) * M + offs_m[None, :], mask=both, other=0.0)
    row_m = tl.reduce(slice_m, 0, max_propagate_nan)
    scaled = tl.where(slice_m > float("-inf"), slice_s * tl.exp(slice_m - row_m[None, :]), 0.0)
    stat1 = row_m + tl.log(tl.sum(scaled, axis=0))  # log-sum-exp of %1
    stat2 = tl.sum(tl.load(ws_ptr + (3 * CHUNKS + chunks[:, None]) * M + offs_m[None, :], mask=both, other=0.0), axis=0)  # sum of %28
    # ---- per-row combine step ----
    v0 = stat0[:, None]  # statistic (0, '')
    v3 = v0 * -1.0  # mul
    v4 = stat1[:, None]  # statistic (1, '')
    v5 = v4 + v3  # add
    v6 = tl.exp(v5)  # exp
    v7 = tl.log(v6)  # log
    v8 = v7 * -1.0  # mul
    v9 = v3 + v8  # add
    v11 = 0.0 * -1.0  # mul
    v12 = v9 + v11  # add
    v14 = 0.0 * 32768.0  # mul
    v15 = stat2[:, None]  # statistic (2, '')
    v16 = 1.0 * v15  # mul
    v17 = v14 + v16  # add
    v18 = tl.load(in0_ptr + offs_m[:, None] * stride_in0_m, mask=mask_m[:, None], other=0)  # load unsqueeze
    v20 = v18 >= 0  # ge
    v22 = v18 < 32768  # lt
    v23 = v20 & v22  # and
    v24 = v23.to(tl.float32)  # cast torch.float32
    v25 = v12 * v24  # mul
    v26 = v17 + v25  # add
    v27 = v24 > 0.0  # gt
    v29 = tl.where(v27, v26, float("nan"))  # where
    v30 = -v29  # neg
    v31 = tl.load(in1_ptr + offs_m[:, None] * stride_in1_m, mask=mask_m[:, None], other=0.0).to(tl.float32)  # load _to_copy_1
    v32 = v30 * v31  # mul
    v33 = tl.load(in2_ptr + offs_m[:, None] * stride_in2_m, mask=mask_m[:, None], other=0)  # load ne
    v34 = tl.where(v33, v32, 0.0)  # where
    tl.store(out0_ptr + offs_m[:, None] * stride_out0_m, v34.to(tl.float32), mask=mask_m[:, None])  # where_1
