"""What does a row statistic exchanged through a thread-block cluster cost on Hopper?

Issue 3's cooperative strip exchanges per-tile partials through global memory and an
arrival counter: 1.4-8.2 us per strip on the H200 (third session), the reason fused GEMM +
norm kernels sit at 1.4-2.0x the GEMM. Triton 3.6 cannot reduce across the CTAs of a
cluster on sm_90; the CuTe DSL can (``mapa`` + ``st.shared::cluster`` + ``barrier.cluster``).
This probe measures that exchange alone: clusters of C CTAs (2, 4, 8), each thread of each
CTA sends one fp32 partial to the same slot of every CTA of its cluster, waits at the cluster
barrier and sums the C slots, ``iters`` times in a row (two buffers, alternating); and, for
comparison, the same through global memory and an arrival counter per group of C CTAs (the
cooperative strip's way). Time per exchange = (time at ITERS - time at 0) / ITERS.

Two steps, so that the GPU machine needs no CuTe DSL (its 63 MiB archive would not travel
with the working tree):

    # CPU, with nvidia-cutlass-dsl==4.8.1 in some environment (not a comfuse dependency):
    python scripts/cute_cluster_probe.py build --out build/cute      # sm_90a cubins + manifest
    # GPU machine (torch, cuda-python), carrying build/cute:
    python scripts/cute_cluster_probe.py run --dir build/cute

``build`` keeps the cubins the DSL compiles for sm_90a (``CUTE_DSL_KEEP=cubin``; the DSL's
``export_to_c`` also works, but needs the static CUDA runtime linked in). ``run`` loads them with the CUDA
driver API and launches with a cluster dimension (``cuLaunchKernelEx``), checks every CTA's
result (after the first exchange every CTA of a cluster holds the mean of its initial
values, exactly representable) and times with CUDA events (median of 50 launches).
Written 2026-12-01 (tenth session); first run on the H200 in the eleventh: all correct, per
exchange 0.24 / 0.32 / 0.63 us through the cluster (C = 2 / 4 / 8) against 1.00 / 1.01 / 1.26 us
through global memory (bench/results/h200-2026-12-01-session11/call1/cute.log).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BM = 128  # threads per CTA, one partial each
CLUSTERS = (2, 4, 8)
GROUPS = 33  # clusters per launch (33 x 4 = 132 CTAs: one per SM of an H200 at C = 4)
ITERS = 1000


def _kernel_source() -> str:
    """The DSL program, run in a subprocess with the DSL's environment variables set."""
    return r'''
import json, sys
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_fake_compact_tensor

BM, GROUPS, C = %(BM)d, %(GROUPS)d, int(sys.argv[1])


def to_cluster_shared(ptr):
    """A peer CTA's shared-memory pointer (``mapa``) as the address ``st.shared::cluster`` takes."""
    return llvm.inttoptr(llvm.PointerType.get(3), ptr.toint().ir_value())


@cute.kernel
def exchange(out: cute.Tensor, iters: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    rank = cute.arch.block_idx_in_cluster()
    buf = cute.arch.alloc_smem(Float32, 2 * C * BM, alignment=16)  # two rounds of C x BM slots
    mine = cute.make_tensor(buf, cute.make_layout(2 * C * BM))
    v = Float32(rank * BM + tidx)
    for it in cutlass.range(iters):
        slot = (it %% 2) * (C * BM)
        for peer in cutlass.range_constexpr(C):
            there = cute.arch.map_dsmem_ptr(buf + slot + rank * BM + tidx, Int32(peer))
            cute.arch.store(to_cluster_shared(there), v, ss="cluster")
        cute.arch.cluster_arrive()  # release: the stores above are visible to the cluster
        cute.arch.cluster_wait()    # acquire: every peer's stores to this CTA have landed
        total = Float32(0.0)
        for c in cutlass.range_constexpr(C):
            total += mine[slot + c * BM + tidx]
        v = total * (1.0 / C)
    out[bidx, tidx] = v


@cute.kernel
def exchange_global(out: cute.Tensor, parts: cute.Tensor, counters: cute.Tensor, iters: Int32):
    """The same exchange through global memory, as Triton's cooperative strip does it: each
    group of C CTAs (not a cluster) writes its partials, counts arrivals on a counter and
    spins until the group has arrived (every CTA resident: C * GROUPS <= 2 per SM)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    g = bidx // C
    rank = bidx %% C
    v = Float32(rank * BM + tidx)
    for it in cutlass.range(iters):
        slot = it %% 2
        parts[g, slot, rank, tidx] = v
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()  # release the CTA's partials
            cute.arch.atomic_add(counters.iterator + g, Int32(1), sem="relaxed", scope="gpu")
            target = (it + 1) * C
            seen = cute.arch.load(counters.iterator + g, Int32, sem="acquire", scope="gpu")
            while seen < target:
                seen = cute.arch.load(counters.iterator + g, Int32, sem="acquire", scope="gpu")
        cute.arch.sync_threads()
        total = Float32(0.0)
        for c in cutlass.range_constexpr(C):
            total += cute.arch.load(parts.iterator + (((g * 2 + slot) * C + c) * BM + tidx), Float32, cop="cg")
        v = total * (1.0 / C)
    out[bidx, tidx] = v


@cute.jit
def launch(out: cute.Tensor, iters: Int32):
    exchange(out, iters).launch(grid=[C * GROUPS, 1, 1], block=[BM, 1, 1], cluster=[C, 1, 1])


@cute.jit
def launch_global(out: cute.Tensor, parts: cute.Tensor, counters: cute.Tensor, iters: Int32):
    exchange_global(out, parts, counters, iters).launch(grid=[C * GROUPS, 1, 1], block=[BM, 1, 1])


out = make_fake_compact_tensor(Float32, (C * GROUPS, BM), stride_order=(1, 0), assumed_align=16)
if sys.argv[2] == "cluster":
    cute.compile(launch, out, Int32(1))
else:
    parts = make_fake_compact_tensor(Float32, (GROUPS, 2, C, BM), stride_order=(3, 2, 1, 0), assumed_align=16)
    counters = make_fake_compact_tensor(Int32, (GROUPS,), assumed_align=16)
    cute.compile(launch_global, out, parts, counters, Int32(1))
''' % {"BM": BM, "GROUPS": GROUPS}


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    program = out / "exchange_program.py"
    program.write_text(_kernel_source())
    manifest = []
    needs = {"cluster": ("mapa.shared::cluster", "st.shared::cluster", "barrier.cluster.arrive",
                         "barrier.cluster.wait"),
             "global": ("atom.global.add", "ld.acquire.gpu", "fence.acq_rel.gpu")}
    for c in CLUSTERS:
        for kind in ("cluster", "global"):
            dump = out / f"{kind}{c}"
            dump.mkdir(exist_ok=True)
            env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin",
                   "CUTE_DSL_DUMP_DIR": str(dump), "CUTE_DSL_CACHE_DIR": str(out / "cache")}
            subprocess.run([sys.executable, str(program), str(c), kind], env=env, check=True)
            cubin = next(dump.glob("*.cubin"))
            ptx = next(dump.glob("*.ptx")).read_text()
            entry = next(line.split()[2].rstrip("(") for line in ptx.splitlines() if ".entry" in line)
            for needed in needs[kind]:
                assert needed in ptx, f"{needed} missing from the PTX of the {kind} exchange, C = {c}"
            manifest.append({"kind": kind, "cluster": c, "cubin": str(cubin.relative_to(out)), "entry": entry,
                             "grid": c * GROUPS, "block": BM, "groups": GROUPS})
            print(f"{kind} exchange, {c} CTAs: {cubin.name} ({cubin.stat().st_size} bytes)")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


def run(folder: Path) -> None:
    import torch

    from cute_launch import Kernel, parse_ptx_params, u32, u64

    torch.cuda.init()
    torch.empty(1, device="cuda")  # a current context (torch's primary one)
    rows = []
    for item in json.loads((folder / "manifest.json").read_text()):
        c = item["cluster"]
        cubin = folder / item["cubin"]
        _, params = parse_ptx_params(next(cubin.parent.glob("*.ptx")).read_text())
        kernel = Kernel(cubin.read_bytes(), item["entry"], params, 0)
        out = torch.full((item["grid"], item["block"]), float("nan"), device="cuda")
        parts = torch.zeros(item["groups"], 2, c, item["block"], device="cuda")
        counters = torch.zeros(item["groups"], dtype=torch.int32, device="cuda")
        cluster = item["kind"] == "cluster"

        def launch(iters: int):
            if cluster:
                blobs = [u64(out.data_ptr()), u32(iters)]
            else:  # arrival counts start at zero every launch (a memset in both timings)
                counters.zero_()
                blobs = [u64(out.data_ptr()), u64(parts.data_ptr()), u64(counters.data_ptr()), u32(iters)]
            kernel.launch(blobs, grid=(item["grid"],), block=(item["block"],),
                          stream=torch.cuda.current_stream().cuda_stream, cluster=(c,) if cluster else None)

        launch(3)
        torch.cuda.synchronize()
        t = torch.arange(item["block"], device="cuda", dtype=torch.float32)
        want = (t + item["block"] * (c - 1) / 2).expand_as(out)  # mean over the cluster of rank * BM + t
        ok = torch.equal(out, want)
        times = {}
        for iters in (0, ITERS):
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(50)]
            launch(iters)
            for start, end in events:
                start.record()
                launch(iters)
                end.record()
            torch.cuda.synchronize()
            times[iters] = statistics.median(s.elapsed_time(e) for s, e in events)
        per = (times[ITERS] - times[0]) / ITERS * 1e3
        rows.append((item["kind"], c, ok, times[0], times[ITERS], per))
        print(f"{item['kind']} exchange, {c} CTAs: correct {ok}, 0 iterations {times[0]:.4f} ms, "
              f"{ITERS} {times[ITERS]:.4f} ms, {per:.3f} us per exchange", flush=True)
    print("\n| exchange | CTAs per group | correct | launch, 0 exchanges (ms) | 1000 exchanges (ms) | us per exchange |")
    print("|---|---|---|---|---|---|")
    for kind, c, ok, t0, t1, per in rows:
        print(f"| {kind} | {c} | {ok} | {t0:.4f} | {t1:.4f} | {per:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build", help="compile the sm_90a cubins (CPU; needs nvidia-cutlass-dsl)")
    b.add_argument("--out", default="build/cute")
    r = sub.add_parser("run", help="load the cubins and time them (GPU; needs cuda-python)")
    r.add_argument("--dir", default="build/cute")
    args = ap.parse_args()
    build(Path(args.out)) if args.step == "build" else run(Path(args.dir))


if __name__ == "__main__":
    main()
