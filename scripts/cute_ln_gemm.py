"""GEMM + bias + residual + LayerNorm in one CuTe DSL kernel, the row statistics exchanged
through a thread-block cluster (issue 3's post-norm workload: LayerNorm(x @ W^T + b + r)).

    out[m, :] = LayerNorm(x[m, :] @ W^T + b + r[m, :]) * gamma + beta     x: M x K, W: N x K (nn.Linear's
                                                                          weight), all bf16, fp32 inside

One CTA owns a 128 x 256 tile; the C = N / 256 CTAs of a row strip form a cluster along N.
Warp-specialised (structure of the helper-written skeleton, notes/cute_hopper_brief.md):
warpgroup 0 is the producer (warp 0 issues the TMA loads of A 128x64 and B 256x64 into a
4-stage ring, setmaxnreg 40), warpgroups 1-2 the consumers (64 rows each, WGMMA 64x256x16,
setmaxnreg 232). The epilogue keeps the tile in registers: v = acc + b + r; each CTA's
per-row (mean, M2) over its 256 columns (quad shuffles), sent to every CTA of the cluster
(``mapa`` + ``st.shared::cluster``), one cluster barrier, Chan's combination of the C
partials, then (v - mean) * rstd * gamma + beta written once as bf16. ``--epilogue plain``
builds the same kernel writing acc (+ b) as bf16: the GEMM alone in this design.

Not persistent, one CTA per SM (192 KB of ring): the epilogue does not overlap the next
tile's mainloop yet. Two steps (the DSL does not travel to the GPU machine):

    CUDA_VISIBLE_DEVICES= /tmp/cv/bin/python scripts/cute_ln_gemm.py build --out build/cute_ln   # CPU, DSL
    python3 scripts/cute_ln_gemm.py run --dir build/cute_ln                                       # GPU, carry it

``run`` checks every output against a float64 reference, then times each kernel as CUDA-graph
replays in interleaved rounds against cuBLAS (F.linear), eager and torch.compile.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # (comfuse.bench.timing)

BM, BN, BK, STAGES = 128, 256, 64, 4
SHAPES = {"check": (512, 1024, 256), "suite": (8192, 1024, 1024)}  # (M, N, K), static per cubin
EPILOGUES = ("ln", "plain", "ln_local", "ln_prefetch")  # ln_local: statistics over each CTA's 256 columns
# (no exchange); _prefetch: the residual tile loaded before the mainloop

PROGRAM = r'''
import json, os, sys
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup, OperandMajorMode
from cutlass.cute.runtime import make_fake_compact_tensor
from cutlass.utils import LayoutEnum

M, N, K, BM, BN, BK, STAGES, EPI = json.loads(sys.argv[1])
PREFETCH = EPI.endswith("_prefetch")  # the residual tile loaded into registers before the mainloop
EPI = EPI.removesuffix("_prefetch")
C = N // BN                                             # CTAs per row strip = cluster size along N
XC = C if EPI == "ln" else 1                            # CTAs that exchange statistics
AB_BYTES = (BM * BK + BN * BK) * 2                      # TMA bytes per stage
XCH_FLOATS = XC * 2 * BM                                 # [source rank][mean, M2][row]
SMEM_BYTES = 1024 + STAGES * AB_BYTES + 1024 + XCH_FLOATS * 4
PRODUCER_REGS, CONSUMER_REGS = 40, 232
THREADS = 384


def peer_shared(ptr):
    """A peer CTA's shared-memory address (from ``mapa``) as ``st.shared::cluster`` takes it."""
    return llvm.inttoptr(llvm.PointerType.get(3), ptr.toint().ir_value())


def quad_sum(x):
    """Sum over the four lanes holding one accumulator row (lanes 4r .. 4r+3)."""
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    return x + cute.arch.shuffle_sync_bfly(x, offset=2)


@cute.kernel
def kernel(tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
           mBias: cute.Tensor, mR: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mD: cute.Tensor,
           eps: Float32, tiled_mma: cute.TiledMma, a_sl: cute.ComposedLayout, b_sl: cute.ComposedLayout):
    tidx, _, _ = cute.arch.thread_idx()
    bm, bn, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    wg = cute.arch.make_warp_uniform(tidx // 128)
    rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
    if warp == 0:
        cpasync.prefetch_descriptor(tma_a)
        cpasync.prefetch_descriptor(tma_b)

    smem = cutlass.memory.SmemAllocator()
    bars = smem.allocate_array(cutlass.Int64, 2 * STAGES)
    sA = smem.allocate_tensor(BFloat16, a_sl.outer, byte_alignment=1024, swizzle=a_sl.inner)
    sB = smem.allocate_tensor(BFloat16, b_sl.outer, byte_alignment=1024, swizzle=b_sl.inner)
    xch = smem.allocate_array(Float32, XCH_FLOATS)
    mainloop = pipeline.PipelineTmaAsync.create(
        barrier_storage=bars, num_stages=STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),  # one arrive per consumer warp
        tx_count=AB_BYTES, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
    if cutlass.const_expr(XC > 1):
        # every CTA of the cluster is running before any writes into another's shared memory
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

    gA = cute.local_tile(mA, (BM, BK), (bm, None))
    gB = cute.local_tile(mB, (BN, BK), (bn, None))
    tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                       cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
    tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                       cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
    k_tiles = cute.size(gA, mode=[2])

    if wg == 0:
        # ---- producer warpgroup: warp 0 streams A and B through the ring
        cute.arch.setmaxregister_decrease(PRODUCER_REGS)
        if warp == 0:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            for kt in cutlass.range(k_tiles, unroll=1):
                mainloop.producer_acquire(state)
                bar = mainloop.producer_get_barrier(state)
                cute.copy(tma_a, tAgA[(None, state.count)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB[(None, state.count)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                mainloop.producer_commit(state)
                state.advance()
            mainloop.producer_tail(state)
        if cutlass.const_expr(XC > 1):
            cute.arch.cluster_arrive()   # (the exchange's barrier counts every thread of the cluster)
            cute.arch.cluster_wait()
    else:
        # ---- consumer warpgroups: 64 rows each
        cute.arch.setmaxregister_increase(CONSUMER_REGS)
        ctid = tidx - 128
        thr_wg = tiled_mma.get_slice((wg - 1) * 128)
        tCrA = tiled_mma.make_fragment_A(thr_wg.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_wg.partition_B(sB))
        thr = tiled_mma.get_slice(ctid)
        tile = (BM, BN)
        tCcD = thr.partition_C(cute.local_tile(cute.make_identity_tensor(mD.shape), tile, (bm, bn)))
        acc = cute.make_rmem_tensor(tCcD.shape, Float32)
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        num_kb = cute.size(tCrA, mode=[2])
        tCgR = thr.partition_C(cute.local_tile(mR, tile, (bm, bn)))
        rR = cute.make_rmem_tensor(tCgR.shape, BFloat16)
        if cutlass.const_expr(PREFETCH and EPI != "plain"):
            cute.autovec_copy(tCgR, rR)  # (its DRAM latency passes under the mainloop)
        rd = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        rl = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        for kt in cutlass.range(k_tiles, unroll=1):
            mainloop.consumer_wait(rd)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(num_kb):
                cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, rd.index)], tCrB[(None, None, kb, rd.index)], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)
            if kt > 0:
                mainloop.consumer_release(rl)
                rl.advance()
            rd.advance()
        warpgroup.wait_group(0)
        mainloop.consumer_release(rl)

        # ---- epilogue over the resident tile. Element i of the fragment lies in row half
        # (i // 2) % 2 of this thread's two rows (wgmma's m64nNk16 layout: rows lane/4 and
        # lane/4 + 8 of the warp's 16, columns 2 * (lane % 4) + i % 2 + 8 * (i // 4)).
        tCgD = thr.partition_C(cute.local_tile(mD, tile, (bm, bn)))
        rD = cute.make_rmem_tensor(tCgD.shape, BFloat16)
        n_vals = cute.size(acc)
        if cutlass.const_expr(EPI == "plain"):
            for i in cutlass.range_constexpr(n_vals):
                row, col = tCcD[i]
                rD[i] = (acc[i] + mBias[col].to(Float32)).to(BFloat16)
        else:
            if cutlass.const_expr(not PREFETCH):
                cute.autovec_copy(tCgR, rR)
            s0 = Float32(0.0)
            s1 = Float32(0.0)
            for i in cutlass.range_constexpr(n_vals):
                row, col = tCcD[i]
                v = acc[i] + mBias[col].to(Float32) + rR[i].to(Float32)
                acc[i] = v
                if cutlass.const_expr((i // 2) % 2 == 0):
                    s0 += v
                else:
                    s1 += v
            mean0 = quad_sum(s0) * (1.0 / BN)
            mean1 = quad_sum(s1) * (1.0 / BN)
            q0 = Float32(0.0)
            q1 = Float32(0.0)
            for i in cutlass.range_constexpr(n_vals):
                if cutlass.const_expr((i // 2) % 2 == 0):
                    d = acc[i] - mean0
                    q0 += d * d
                else:
                    d = acc[i] - mean1
                    q1 += d * d
            q0 = quad_sum(q0)
            q1 = quad_sum(q1)
            lane = tidx % 32
            r0 = 64 * (wg - 1) + 16 * (warp % 4) + lane // 4      # this thread's first row in the tile
            if cutlass.const_expr(XC > 1):
                if lane % 4 == 0:
                    for peer in cutlass.range_constexpr(C):
                        for h, (mu, m2) in enumerate(((mean0, q0), (mean1, q1))):
                            base = xch + (rank * 2) * BM + r0 + 8 * h
                            cute.arch.store(peer_shared(cute.arch.map_dsmem_ptr(base, Int32(peer))), mu, ss="cluster")
                            cute.arch.store(peer_shared(cute.arch.map_dsmem_ptr(base + BM, Int32(peer))), m2,
                                            ss="cluster")
                cute.arch.cluster_arrive()   # release: this CTA's partials are visible to the cluster
                cute.arch.cluster_wait()     # acquire: every CTA's partials have landed here
                view = cute.make_tensor(xch, cute.make_layout((BM, 2, C), stride=(1, BM, 2 * BM)))
                stats = []
                for h in cutlass.range_constexpr(2):
                    mu = Float32(0.0)
                    for c in cutlass.range_constexpr(C):
                        mu += view[r0 + 8 * h, 0, c]
                    mu = mu * (1.0 / C)
                    m2 = Float32(0.0)
                    for c in cutlass.range_constexpr(C):   # Chan: sum of M2 + n * spread of the means
                        dm = view[r0 + 8 * h, 0, c] - mu
                        m2 += view[r0 + 8 * h, 1, c] + BN * dm * dm
                    stats.append((mu, cute.math.rsqrt(m2 * (1.0 / N) + eps)))
            else:
                stats = [(mean0, cute.math.rsqrt(q0 * (1.0 / BN) + eps)), (mean1, cute.math.rsqrt(q1 * (1.0 / BN) + eps))]
            for i in cutlass.range_constexpr(n_vals):
                row, col = tCcD[i]
                mu, rstd = stats[(i // 2) % 2]
                rD[i] = ((acc[i] - mu) * rstd * mG[col].to(Float32) + mBeta[col].to(Float32)).to(BFloat16)
        cute.autovec_copy(rD, tCgD)


@cute.jit
def host(a: cute.Tensor, b: cute.Tensor, bias: cute.Tensor, r: cute.Tensor, g: cute.Tensor, beta: cute.Tensor,
         d: cute.Tensor, eps: Float32):
    tiled_mma = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K,
                                            Float32, (2, 1, 1), tiler_mn=(64, BN))
    a_sl = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BM, BN, BK), BFloat16, STAGES)
    b_sl = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BM, BN, BK), BFloat16, STAGES)
    tma_a, tA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a,
                                            cute.slice_(a_sl, (None, None, 0)), (BM, BK))
    tma_b, tB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), b,
                                            cute.slice_(b_sl, (None, None, 0)), (BN, BK))
    print("TMA_A", tma_a._trait.value.type)
    print("TMA_B", tma_b._trait.value.type)
    cluster = [1, XC, 1]
    kernel(tma_a, tA, tma_b, tB, bias, r, g, beta, d, eps, tiled_mma, a_sl, b_sl).launch(
        grid=[M // BM, N // BN, 1], block=[THREADS, 1, 1], cluster=cluster, smem=SMEM_BYTES)


def t(shape):
    return make_fake_compact_tensor(BFloat16, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)), assumed_align=16)


fn = cute.compile(host, t((M, K)), t((N, K)), t((N,)), t((M, N)), t((N,)), t((N,)), t((M, N)), Float32(1e-5))
open(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "host_llvm.mlir"), "w").write(str(fn.ir_module))
print("SMEM_BYTES", SMEM_BYTES)
print("THREADS", THREADS)
print("CLUSTER", XC)
'''


def build(out: Path, only: str | None) -> None:
    from cute_launch import parse_ptx_params
    out.mkdir(parents=True, exist_ok=True)
    prog = out / "ln_gemm_program.py"
    prog.write_text(PROGRAM)
    manifest = []
    for name, (M, N, K) in SHAPES.items():
        for epi in EPILOGUES:
            tag = f"{name}_{epi}"
            if only and only not in tag:
                continue
            dump = out / tag
            dump.mkdir(exist_ok=True)
            for f in dump.iterdir():
                f.unlink()
            env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin",
                   "CUTE_DSL_DUMP_DIR": str(dump), "CUDA_VISIBLE_DEVICES": "",
                   "CUTE_DSL_CACHE_DIR": str(out / "cache")}
            res = subprocess.run([sys.executable, str(prog), json.dumps([M, N, K, BM, BN, BK, STAGES, epi])],
                                 env=env, capture_output=True, text=True)
            (dump / "build.log").write_text(res.stdout + res.stderr)
            if res.returncode:
                print(res.stdout[-3000:], res.stderr[-8000:])
                raise SystemExit(f"{tag}: compile failed")
            log = res.stdout
            ptx = next(dump.glob("*.ptx")).read_text()
            cubin = next(dump.glob("*.cubin"))
            entry, params = parse_ptx_params(ptx)
            box = {op: [int(x) for x in re.search(rf'TMA_{op} .*tma_gbasis = <"\((\d+),(\d+)\)', log).groups()]
                   for op in ("A", "B")}
            counts = {k: len(re.findall(k, ptx)) for k in
                      ("wgmma.mma_async", "setmaxnreg", "cp.async.bulk.tensor", "mapa", "st.shared::cluster",
                       "barrier.cluster.arrive", "st.global", "ld.global")}
            regs = re.search(r"\.maxnreg (\d+)", ptx)
            manifest.append({"name": tag, "shape": [M, N, K], "epilogue": epi, "cubin": str(cubin.relative_to(out)),
                             "entry": entry, "params": params, "box": box,
                             "smem": int(re.search(r"SMEM_BYTES (\d+)", log).group(1)),
                             "threads": int(re.search(r"THREADS (\d+)", log).group(1)),
                             "cluster": int(re.search(r"CLUSTER (\d+)", log).group(1)),
                             "ptx_counts": counts, "maxnreg": regs and int(regs.group(1))})
            print(f"{tag}: params={[p['size'] for p in params]} box={box} counts={counts}", flush=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


def occupancy(k, item) -> str:
    """How many CTAs (or clusters) of this kernel the GPU holds at once (the wave size)."""
    cu = k.cu
    out = []
    for c in (1, 2, 4):
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = 64, 4, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = item["threads"], 1, 1
        cfg.sharedMemBytes = item["smem"]
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = 1, c, 1
        cfg.attrs, cfg.numAttrs = [attr], 1
        err, n = cu.cuOccupancyMaxActiveClusters(k.fn, cfg)
        out.append(f"clusters of {c}: {n} at once ({n * c} CTAs)" if int(err) == 0 else f"clusters of {c}: error {err}")
    return "; ".join(out)


def run(folder: Path, rounds: int) -> None:
    import torch
    import torch.nn.functional as F
    from cute_launch import DTYPE, Kernel, encode_tiled, f32, u8, u64
    from comfuse.bench.timing import graph_rounds, print_ratio_table, ratio_rows
    from comfuse.bench.workloads import linear_ln_problem
    torch.cuda.init()
    torch.empty(1, device="cuda")
    dev = torch.cuda.get_device_name()
    print(f"{dev}, torch {torch.__version__}", flush=True)
    items = json.loads((folder / "manifest.json").read_text())
    rows = []
    for shape in sorted({tuple(i["shape"]) for i in items}):
        M, N, K = shape
        p = linear_ln_problem(M, N, K)
        x, w, b, r, gamma, beta, ref_y, ref_ln = (p[k] for k in ("x", "w", "b", "r", "gamma", "beta", "ref_y",
                                                                 "ref_ln"))
        chunks = (ref_y + r.double()).view(M, N // BN, BN)
        ref_local = (F.layer_norm(chunks, (BN,), eps=1e-5).view(M, N) * gamma.double() + beta.double())
        forms = {}
        for item in (i for i in items if tuple(i["shape"]) == shape):
            k = Kernel((folder / item["cubin"]).read_bytes(), item["entry"], item["params"], item["smem"])
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            da = encode_tiled(DTYPE["bfloat16"], x.data_ptr(), [K, M], [K * 2], item["box"]["A"], 128)
            db = encode_tiled(DTYPE["bfloat16"], w.data_ptr(), [K, N], [K * 2], item["box"]["B"], 128)
            blobs = [da, db] + [u64(t.data_ptr()) for t in (b, r, gamma, beta, out)] + [f32(1e-5), u8(0)]
            cluster = (1, item["cluster"], 1) if item["cluster"] > 1 else None

            def go(k=k, blobs=blobs, item=item, cluster=cluster, out=out):  # (out kept alive: blobs hold its address)
                k.launch(blobs, grid=(M // BM, N // BN, 1), block=(item["threads"], 1, 1),
                         stream=torch.cuda.current_stream().cuda_stream, cluster=cluster)
            out.fill_(float("nan"))
            go()
            torch.cuda.synchronize()
            epi = item["epilogue"].removesuffix("_prefetch")
            ref = {"ln": ref_ln, "plain": ref_y, "ln_local": ref_local}[epi]
            err = (out.double() - ref).abs().max().item()
            tol = 0.05 if epi == "ln" else 0.02 * max(1.0, ref.abs().max().item() / 8)
            ok = bool(torch.isfinite(out).all()) and err <= tol
            print(f"{item['name']}: max abs error {err:.4f} (tolerance {tol:.3f}) {'OK' if ok else 'WRONG'}",
                  flush=True)
            if ok:
                forms[f"cute {item['epilogue']}"] = go
                print(f"    {occupancy(k, item)}", flush=True)
            if ok and item["epilogue"] == "plain" and N // BN > 1:  # the cluster launch alone
                out.fill_(float("nan"))
                go(cluster=(1, N // BN, 1))
                torch.cuda.synchronize()
                if (out.double() - ref).abs().max().item() <= tol:
                    forms[f"cute plain, clusters of {N // BN}"] = lambda go=go: go(cluster=(1, N // BN, 1))
        if M < 4096:
            continue
        forms["cuBLAS F.linear"] = lambda: F.linear(x, w)
        forms["cuBLAS F.linear + bias"] = lambda: F.linear(x, w, b)

        def eager():
            return F.layer_norm(F.linear(x, w, b) + r, (N,), gamma, beta, 1e-5)
        forms["eager"] = eager
        compiled = torch.compile(eager, dynamic=False)
        try:
            compiled()
            forms["torch.compile"] = compiled
        except Exception as e:  # (report, do not stop the timing)
            print("torch.compile failed:", type(e).__name__, str(e)[:200])
        rows += ratio_rows(f"{M}x{N}x{K}", graph_rounds(forms, rounds), "cuBLAS F.linear")
    print_ratio_table(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build", help="compile the sm_90a cubins (CPU; needs nvidia-cutlass-dsl 4.8.1)")
    b.add_argument("--out", default="build/cute_ln")
    b.add_argument("--only", default=None, help="build only the variants whose name contains this")
    r = sub.add_parser("run", help="check and time the cubins (GPU; needs torch and cuda-python)")
    r.add_argument("--dir", default="build/cute_ln")
    r.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    build(Path(args.out), args.only) if args.step == "build" else run(Path(args.dir), args.rounds)


if __name__ == "__main__":
    main()
