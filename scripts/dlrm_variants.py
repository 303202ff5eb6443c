"""The DLRM bottom MLP (relu(relu(relu(x @ w1) @ w2) @ w3), 65536 x 512 -> 512 -> 256 -> 128,
bf16) in hand-written chain forms: can a fused chain beat the GEMMs run apart?

The chain kernel comfuse generates (planner/chain.py, codegen/triton/chain.py) streams
GEMM1's output in chunks of N1 into GEMM2; for each chunk it runs GEMM1's whole K loop, so
the program's rows of x ([rows, 512]) are read from L2 once per chunk: 8 times at 64-column
chunks. Per 128-row tile that is 1 MB of x against 0.8 MB of weights, and the chain ran at
0.1815 ms (307 TFLOP/s; the GEMMs alone 0.112 ms; H200, 2026-12-03). The forms timed here:

- ``resident``: x's rows loaded once into the program (shared memory, K = 512 at once) and
  multiplied by each chunk of w1 in one dot; the chunk loop is the only loop, so Triton's
  pipeliner prefetches the next chunk of w1 and w2 while this one computes, and the tile's
  L2 traffic is x once plus the weights once;
- ``resident persistent``: the same, a grid of SMs x programs walking the row blocks;
- comfuse's generated chain kernels, each candidate plan of ``chain_candidates`` (timed with a
  copy of their output, 16 MB: "output copy alone" is its time).

Each form is checked against float64 PyTorch before it is timed (graph replays, L2 flushed
by do_bench); the GEMMs alone (cuBLAS), eager and torch.compile run in the same call, and
the fastest forms again in interleaved rounds with them. ``DLRM_M`` sets the rows (CPU:
``TRITON_INTERPRET=1 DLRM_M=256`` checks the math). Writes $OUT/dlrm_variants.json; a
table last.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from comfuse.bench.timing import graph_rounds, graphed, measure  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _last_gemm(acc1, w3_ptr, o_ptr, rows, N1: tl.constexpr, N2: tl.constexpr, UPCAST: tl.constexpr):
    """relu(relu(acc1) @ w3) stored for ``rows``: GEMM3 on GEMM2's resident output."""
    h2 = tl.maximum(acc1, 0.0).to(w3_ptr.dtype.element_ty)
    c1 = tl.arange(0, N1)
    c2 = tl.arange(0, N2)
    w3 = tl.load(w3_ptr + c1[:, None] * N2 + c2[None, :])
    if UPCAST:
        h2 = h2.to(tl.float32)
        w3 = w3.to(tl.float32)
    out = tl.maximum(tl.dot(h2, w3), 0.0)
    tl.store(o_ptr + rows[:, None] * N2 + c2[None, :], out.to(o_ptr.dtype.element_ty))


@triton.jit
def _row_block(x_ptr, w1_ptr, w2_ptr, w3_ptr, o_ptr, rows, K: tl.constexpr, N0: tl.constexpr,
               N1: tl.constexpr, N2: tl.constexpr, SN: tl.constexpr, STAGES: tl.constexpr,
               UPCAST: tl.constexpr):
    """One block of rows through the three GEMMs; x's rows are loaded once."""
    ks = tl.arange(0, K)
    x = tl.load(x_ptr + rows[:, None] * K + ks[None, :])
    if UPCAST:  # (the interpreter's bf16 dot is wrong)
        x = x.to(tl.float32)
    chunk = tl.arange(0, SN)
    c1 = tl.arange(0, N1)
    acc1 = tl.zeros((rows.shape[0], N1), dtype=tl.float32)
    for n0 in tl.range(0, N0, SN, num_stages=STAGES):
        w1 = tl.load(w1_ptr + ks[:, None] * N0 + (n0 + chunk)[None, :])
        w2 = tl.load(w2_ptr + (n0 + chunk)[:, None] * N1 + c1[None, :])
        if UPCAST:
            w1 = w1.to(tl.float32)
            w2 = w2.to(tl.float32)
        h = tl.maximum(tl.dot(x, w1), 0.0).to(w2_ptr.dtype.element_ty)
        if UPCAST:
            h = h.to(tl.float32)
        acc1 = tl.dot(h, w2, acc1)
    _last_gemm(acc1, w3_ptr, o_ptr, rows, N1, N2, UPCAST)


@triton.jit
def resident(x_ptr, w1_ptr, w2_ptr, w3_ptr, o_ptr, M, K: tl.constexpr, N0: tl.constexpr,
             N1: tl.constexpr, N2: tl.constexpr, BM: tl.constexpr, SN: tl.constexpr,
             STAGES: tl.constexpr, UPCAST: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    _row_block(x_ptr, w1_ptr, w2_ptr, w3_ptr, o_ptr, rows, K, N0, N1, N2, SN, STAGES, UPCAST)


@triton.jit
def resident_persistent(x_ptr, w1_ptr, w2_ptr, w3_ptr, o_ptr, M, K: tl.constexpr, N0: tl.constexpr,
                        N1: tl.constexpr, N2: tl.constexpr, BM: tl.constexpr, SN: tl.constexpr,
                        STAGES: tl.constexpr, UPCAST: tl.constexpr):
    for block in range(tl.program_id(0), M // BM, tl.num_programs(0)):
        rows = block * BM + tl.arange(0, BM)
        _row_block(x_ptr, w1_ptr, w2_ptr, w3_ptr, o_ptr, rows, K, N0, N1, N2, SN, STAGES, UPCAST)


@triton.jit
def skewed(x_ptr, w1_ptr, w2_ptr, w3_ptr, o_ptr, M, K: tl.constexpr, N0: tl.constexpr,
           N1: tl.constexpr, N2: tl.constexpr, BM: tl.constexpr, SN: tl.constexpr,
           STAGES: tl.constexpr, UPCAST: tl.constexpr):
    """``resident`` with GEMM2 one chunk behind GEMM1: each step issues GEMM1 on this chunk
    and then GEMM2 on the last one, two independent products the tensor cores can overlap."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    ks = tl.arange(0, K)
    x = tl.load(x_ptr + rows[:, None] * K + ks[None, :])
    chunk = tl.arange(0, SN)
    c1 = tl.arange(0, N1)
    w1 = tl.load(w1_ptr + ks[:, None] * N0 + chunk[None, :])
    if UPCAST:
        x = x.to(tl.float32)
        w1 = w1.to(tl.float32)
    h = tl.maximum(tl.dot(x, w1), 0.0).to(w2_ptr.dtype.element_ty)
    acc1 = tl.zeros((BM, N1), dtype=tl.float32)
    for n0 in tl.range(SN, N0, SN, num_stages=STAGES):
        w1 = tl.load(w1_ptr + ks[:, None] * N0 + (n0 + chunk)[None, :])
        w2 = tl.load(w2_ptr + (n0 - SN + chunk)[:, None] * N1 + c1[None, :])
        if UPCAST:
            w1 = w1.to(tl.float32)
            w2 = w2.to(tl.float32)
            h = h.to(tl.float32)
        ahead = tl.dot(x, w1)
        acc1 = tl.dot(h, w2, acc1)
        h = tl.maximum(ahead, 0.0).to(w2_ptr.dtype.element_ty)
    w2 = tl.load(w2_ptr + (N0 - SN + chunk)[:, None] * N1 + c1[None, :])
    if UPCAST:
        w2 = w2.to(tl.float32)
        h = h.to(tl.float32)
    acc1 = tl.dot(h, w2, acc1)
    _last_gemm(acc1, w3_ptr, o_ptr, rows, N1, N2, UPCAST)


@triton.jit
def flat(x_ptr, w1_ptr, w2_ptr, w3_ptr, o_ptr, M, K: tl.constexpr, N0: tl.constexpr,
         N1: tl.constexpr, N2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, SN: tl.constexpr,
         STAGES: tl.constexpr, UPCAST: tl.constexpr, ZERO_FIRST: tl.constexpr = False):
    """GEMM1's chunks and K steps in one loop (the pipeline never restarts): x is read per
    chunk as in the generated kernel; at a chunk's last K step GEMM2 takes it. ``ZERO_FIRST``:
    the chunk's accumulator cleared by a select at its first K step, not by zeros after its
    last (ptxas serialises the wgmmas of the latter, C7515; not the former)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    KS: tl.constexpr = K // BK
    kr = tl.arange(0, BK)
    chunk = tl.arange(0, SN)
    c1 = tl.arange(0, N1)
    acc0 = tl.zeros((BM, SN), dtype=tl.float32)
    acc1 = tl.zeros((BM, N1), dtype=tl.float32)
    for it in tl.range(0, (N0 // SN) * KS, num_stages=STAGES):
        c = it // KS
        k0 = (it % KS) * BK
        a = tl.load(x_ptr + rows[:, None] * K + (k0 + kr)[None, :])
        b = tl.load(w1_ptr + (k0 + kr)[:, None] * N0 + (c * SN + chunk)[None, :])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if ZERO_FIRST:
            acc0 = tl.where(it % KS == 0, 0.0, acc0)
        acc0 = tl.dot(a, b, acc0)
        if it % KS == KS - 1:
            w2 = tl.load(w2_ptr + (c * SN + chunk)[:, None] * N1 + c1[None, :])
            h = tl.maximum(acc0, 0.0).to(w2_ptr.dtype.element_ty)
            if UPCAST:
                w2 = w2.to(tl.float32)
                h = h.to(tl.float32)
            acc1 = tl.dot(h, w2, acc1)
            if not ZERO_FIRST:
                acc0 = tl.zeros((BM, SN), dtype=tl.float32)
    _last_gemm(acc1, w3_ptr, o_ptr, rows, N1, N2, UPCAST)


def dlrm(x, w1, w2, w3):
    return torch.relu(torch.relu(torch.relu(x @ w1) @ w2) @ w3)


def generated_chain_runs(fn, args, out) -> list:
    """[(plan, launch)] for each chain plan comfuse's autotuner times on ``fn(*args)``, each
    launch writing the chain's output into ``out`` (a copy, timed with the launch)."""
    import warnings

    import comfuse
    from comfuse.planner.chain import chain_candidates
    from comfuse.runtime.chain import build_chain
    with warnings.catch_warnings(), comfuse.settings.override(autotune="0", validate="0"):
        warnings.simplefilter("ignore")
        compiled = comfuse.compile(fn, args)
        compiled(*args)
    chain = next(m for m in next(iter(compiled._specs.values())).gm.modules()
                 if m.__class__.__name__ == "FusedChain")
    seen, forward = [], chain.forward  # the chain's own arguments (views)
    chain.forward = lambda *ext: seen.append(ext) or forward(*ext)
    compiled(*args)
    ext = seen[-1]
    runs = []
    for plan in chain_candidates(chain.plan):
        kernel = build_chain(plan)

        def run(kernel=kernel):
            chain.kernel = kernel
            out.copy_(chain.run(ext, ext[chain.a_ext], check=False)[0])
        runs.append((plan, run))
    return runs


def plan_label(plan) -> str:
    form = " early_w" if plan.early_w else f" resident_a s{plan.num_stages}" if plan.resident_a else (
        f" flat s{plan.num_stages}" if plan.flat else "")
    return f"generated bm{plan.block_m} sn{plan.stream_n} w{plan.num_warps}{form}"


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/comfuse-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    device = "cpu" if INTERPRET else "cuda"
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    M = int(os.environ.get("DLRM_M", "65536"))
    K, N0, N1, N2 = 512, 512, 256, 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    ws = [(torch.randn(a, b, generator=g) / a ** 0.5).to(device, dtype) for a, b in ((K, N0), (N0, N1), (N1, N2))]
    ref = dlrm(x.double(), *(w.double() for w in ws))
    out = torch.empty(M, N2, device=device, dtype=dtype)
    flops = 2.0 * M * (K * N0 + N0 * N1 + N1 * N2)
    sms = 132 if INTERPRET else torch.cuda.get_device_properties(0).multi_processor_count
    variants = {}
    # (rows, chunk, warps, stages) that fit the 227 KB of shared memory a program may have at
    # sm_90 (compiled for it on the CPU: x's rows, then w1's and w2's chunks per stage) and
    # hold GEMM2's [rows, 256] fp32 accumulator without spilling (128 rows: 8 warps)
    forms = [(64, 32, w, s) for w in (4, 8) for s in (1, 2, 3)] + [(64, 64, w, 1) for w in (4, 8)] + [
        (128, 16, 8, s) for s in (1, 2, 3)] + [(128, 32, 8, s) for s in (1, 2)]
    for bm, sn, warps, stages in forms if not INTERPRET else [(64, 32, 4, 1)]:
        variants[f"resident bm{bm} sn{sn} w{warps} s{stages}"] = (
            lambda bm=bm, sn=sn, w=warps, s=stages: resident[(M // bm,)](
                x, *ws, out, M, K, N0, N1, N2, bm, sn, s, INTERPRET, num_warps=w))
    persistent = [(64, 32, 4, 2, 1), (64, 32, 4, 1, 2), (64, 32, 8, 2, 1), (128, 16, 8, 3, 1), (128, 32, 8, 2, 1)]
    for bm, sn, warps, stages, per_sm in persistent if not INTERPRET else [(64, 32, 4, 1, 1)]:
        variants[f"resident persistent bm{bm} sn{sn} w{warps} s{stages} {per_sm}/SM"] = (
            lambda bm=bm, sn=sn, w=warps, s=stages, n=per_sm: resident_persistent[(min(M // bm, sms * n),)](
                x, *ws, out, M, K, N0, N1, N2, bm, sn, s, INTERPRET, num_warps=w))
    for bm, sn, warps, stages in [(128, 16, 8, 2), (128, 16, 8, 3), (64, 32, 4, 3)] if not INTERPRET else [(64, 32, 4, 1)]:
        variants[f"skewed bm{bm} sn{sn} w{warps} s{stages}"] = (
            lambda bm=bm, sn=sn, w=warps, s=stages: skewed[(M // bm,)](
                x, *ws, out, M, K, N0, N1, N2, bm, sn, s, INTERPRET, num_warps=w))
    flats = [(128, 64, 64, 8, s) for s in (3, 4, 5, 6)] + [(128, 64, 128, 8, 3), (64, 64, 64, 4, 4), (64, 64, 128, 4, 3)]
    for bm, bk, sn, warps, stages in flats if not INTERPRET else [(64, 64, 64, 4, 1)]:
        variants[f"flat bm{bm} bk{bk} sn{sn} w{warps} s{stages}"] = (
            lambda bm=bm, bk=bk, sn=sn, w=warps, s=stages: flat[(M // bm,)](
                x, *ws, out, M, K, N0, N1, N2, bm, bk, sn, s, INTERPRET, num_warps=w))
    for bm, bk, sn, warps, stages in [(128, 64, 128, 8, 3), (128, 64, 128, 8, 4)] if not INTERPRET else [(64, 64, 64, 4, 1)]:
        variants[f"flat zero-first bm{bm} bk{bk} sn{sn} w{warps} s{stages}"] = (
            lambda bm=bm, bk=bk, sn=sn, w=warps, s=stages: flat[(M // bm,)](
                x, *ws, out, M, K, N0, N1, N2, bm, bk, sn, s, INTERPRET, True, num_warps=w))
    only = os.environ.get("DLRM_ONLY")  # name prefixes, comma-separated
    if only:
        variants = {n: v for n, v in variants.items() if n.startswith(tuple(only.split(",")))}
    if not INTERPRET:
        variants.update({plan_label(p): r for p, r in generated_chain_runs(dlrm, (x, *ws), out)})
    rows, runs = [], {}
    if not INTERPRET:
        h1 = torch.relu(x @ ws[0])
        h2 = torch.relu(h1 @ ws[1])
        spare = torch.empty_like(out)
        base = {"cuBLAS GEMMs alone": lambda: (x @ ws[0], h1 @ ws[1], h2 @ ws[2]),
                "eager": lambda: dlrm(x, *ws),
                "torch.compile": torch.compile(lambda: dlrm(x, *ws), dynamic=False),
                # the generated forms are timed with a copy of their output into ``out``: this much
                "output copy alone": lambda: out.copy_(spare)}
        for name, run in base.items():
            t = measure(graphed(run, warmup_calls=2))
            rows.append({"name": name, "status": "ok", **t.as_dict(), "tflops": flops / t.median_ms / 1e9})
            runs[name] = run
            print(f"{name:48s} {t.median_ms:.4f} ms", flush=True)
    for name, run in variants.items():
        row = {"name": name}
        try:
            out.fill_(float("nan"))
            run()
            if not INTERPRET:
                torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            if not err < (1e-5 if INTERPRET else 1e-2):
                row.update(status="wrong", err=err)
            elif INTERPRET:
                row.update(status="ok", err=err)
            else:
                t = measure(graphed(run, warmup_calls=1))
                row.update(status="ok", err=err, **t.as_dict(), tflops=flops / t.median_ms / 1e9)
                runs[name] = run
        except Exception as e:  # one form failing must not stop the sweep
            row.update(status="failed", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        rows.append(row)
        print(f"{name:48s} {row.get('median_ms', float('nan')):.4f} ms {row.get('status')} "
              f"{row.get('err', row.get('reason', ''))}", flush=True)
    result = {"M": M, "flops": flops, "rows": rows}
    if not INTERPRET:
        timed = sorted((r for r in rows if "median_ms" in r and r["name"] in variants), key=lambda r: r["median_ms"])
        finalists = ["cuBLAS GEMMs alone", "eager", "torch.compile", "output copy alone"] + [r["name"] for r in timed[:4]]
        best_generated = next((r["name"] for r in timed if r["name"].startswith("generated")), None)
        if best_generated and best_generated not in finalists:
            finalists.append(best_generated)
        result["rounds"] = graph_rounds({n: runs[n] for n in finalists}, rounds=5)
    (out_dir / "dlrm_variants.json").write_text(json.dumps(result, indent=1))
    if INTERPRET:
        bad = [r for r in rows if r["status"] != "ok"]
        print(f"{len(rows) - len(bad)} of {len(rows)} forms agree with float64" + (f"; not: {bad}" if bad else ""))
        sys.exit(1 if bad else 0)
    import statistics
    print(f"\n| DLRM form, M = {M} (5 interleaved rounds, graph replays of 20 calls) | median ms | rounds min..max | TFLOP/s |")
    print("|---|---|---|---|")
    for name, t in sorted(result["rounds"].items(), key=lambda kv: statistics.median(kv[1])):
        med = statistics.median(t)
        print(f"| {name} | {med:.4f} | {min(t):.4f}..{max(t):.4f} | {flops / med / 1e9:.0f} |")


if __name__ == "__main__":
    main()
