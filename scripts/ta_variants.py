"""Target attention (softmax(q @ k^T) @ v, 4096 x 16 x 256 x 64, bf16) in hand-written forms:
which kernel shape reads K and V at the bandwidth the H200 gives?

The chain kernel comfuse generates (planner/chain.py, codegen/triton/chain.py) runs one
program per sample: load K, GEMM1, softmax, load V, GEMM2, store. The floor is reading K and
V once (268 MB, ~63 us at the measured 4.24 TB/s copy rate); the generated kernel took
0.092 ms (2026-11-30). The forms timed here:

- ``per-sample``: the generated kernel's shape (grid = samples);
- ``per-sample, V first``: V's load issued with K's, before GEMM1;
- ``persistent``: a grid of SMs x programs-per-SM walking the samples with
  ``tl.range(..., num_stages=S)``, so that Triton's pipeliner prefetches later samples'
  K and V while this one computes;
- the same with TMA descriptors (``tma``);
- comfuse's generated chain kernels, each candidate plan (the copy into ``out`` is timed
  with them: 8 MB, about 3 us).

Every form is checked against float64 PyTorch before it is timed; eager, torch.compile and
SDPA are timed in the same run (with ``GRAPH=1`` the forms as CUDA-graph replays: their GPU
time without the Python launch; ``TA_QUICK=1``: the per-sample forms only). Writes $OUT/ta_variants.json and prints a table last.
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
from comfuse.bench.timing import graphed, measure  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dlrm_variants import generated_chain_runs  # noqa: E402


@triton.jit
def _softmax_parts(q, kt):
    """exp(q @ kt - row max) and its row sums: the unnormalised softmax every form shares."""
    s = tl.dot(q, kt)
    m = tl.max(s, axis=1)
    p = tl.exp(s - m[:, None])
    return p, tl.sum(p, axis=1)


@triton.jit
def _sample(q_ptr, k_ptr, v_ptr, o_ptr, b, LQ: tl.constexpr, LK: tl.constexpr, D: tl.constexpr,
            V_FIRST: tl.constexpr, DEFER: tl.constexpr):
    """One sample: out[b] = softmax(q[b] @ k[b]^T) @ v[b]; contiguous [B, L, D] tensors."""
    rows = tl.arange(0, LQ)
    keys = tl.arange(0, LK)
    dims = tl.arange(0, D)
    base_q = b * (LQ * D)
    base_k = b * (LK * D)
    q = tl.load(q_ptr + base_q + rows[:, None] * D + dims[None, :])
    kt = tl.load(k_ptr + base_k + keys[None, :] * D + dims[:, None])  # [D, LK]
    if V_FIRST:
        v = tl.load(v_ptr + base_k + keys[:, None] * D + dims[None, :])
    p, total = _softmax_parts(q, kt)
    if not V_FIRST:
        v = tl.load(v_ptr + base_k + keys[:, None] * D + dims[None, :])
    if DEFER:
        o = tl.dot(p.to(tl.bfloat16), v) / total[:, None]
    else:
        o = tl.dot((p / total[:, None]).to(tl.bfloat16), v)
    tl.store(o_ptr + base_q + rows[:, None] * D + dims[None, :], o.to(tl.bfloat16))


@triton.jit
def _sample_hinted(q_ptr, k_ptr, v_ptr, o_ptr, b, LQ: tl.constexpr, LK: tl.constexpr, D: tl.constexpr,
                   EVICT: tl.constexpr):
    """``_sample`` (V after GEMM1, normalised before GEMM2) with K and V loaded under an
    eviction hint: each is read once, so it need not stay in L2."""
    rows = tl.arange(0, LQ)
    keys = tl.arange(0, LK)
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + b * (LQ * D) + rows[:, None] * D + dims[None, :])
    kt = tl.load(k_ptr + b * (LK * D) + keys[None, :] * D + dims[:, None], eviction_policy=EVICT)
    p, total = _softmax_parts(q, kt)
    v = tl.load(v_ptr + b * (LK * D) + keys[:, None] * D + dims[None, :], eviction_policy=EVICT)
    o = tl.dot((p / total[:, None]).to(tl.bfloat16), v)
    tl.store(o_ptr + b * (LQ * D) + rows[:, None] * D + dims[None, :], o.to(tl.bfloat16))


@triton.jit
def per_sample_group(q_ptr, k_ptr, v_ptr, o_ptr, B, LQ: tl.constexpr, LK: tl.constexpr, D: tl.constexpr,
                     SAMPLES: tl.constexpr, EVICT: tl.constexpr):
    """SAMPLES consecutive samples per program, one after another (fewer, longer programs)."""
    for i in tl.static_range(SAMPLES):
        _sample_hinted(q_ptr, k_ptr, v_ptr, o_ptr, tl.program_id(0) * SAMPLES + i, LQ, LK, D, EVICT)


@triton.jit
def per_sample_tma(q_desc, k_desc, v_desc, o_ptr, B, LQ: tl.constexpr, LK: tl.constexpr, D: tl.constexpr):
    """One sample per program, operands through TMA (no register staging of K and V)."""
    b = tl.program_id(0)
    q = q_desc.load([b * LQ, 0])
    k = k_desc.load([b * LK, 0])
    p, total = _softmax_parts(q, k.T)
    v = v_desc.load([b * LK, 0])
    o = tl.dot((p / total[:, None]).to(tl.bfloat16), v)
    rows = tl.arange(0, LQ)
    dims = tl.arange(0, D)
    tl.store(o_ptr + b * (LQ * D) + rows[:, None] * D + dims[None, :], o.to(tl.bfloat16))


@triton.jit
def per_sample(q_ptr, k_ptr, v_ptr, o_ptr, B, LQ: tl.constexpr, LK: tl.constexpr, D: tl.constexpr,
               V_FIRST: tl.constexpr, DEFER: tl.constexpr):
    _sample(q_ptr, k_ptr, v_ptr, o_ptr, tl.program_id(0), LQ, LK, D, V_FIRST, DEFER)


@triton.jit
def persistent(q_ptr, k_ptr, v_ptr, o_ptr, B, LQ: tl.constexpr, LK: tl.constexpr, D: tl.constexpr,
               STAGES: tl.constexpr, DEFER: tl.constexpr):
    for b in tl.range(tl.program_id(0), B, tl.num_programs(0), num_stages=STAGES):
        _sample(q_ptr, k_ptr, v_ptr, o_ptr, b, LQ, LK, D, True, DEFER)


@triton.jit
def persistent_tma(q_desc, k_desc, v_desc, o_desc, B, LQ: tl.constexpr, LK: tl.constexpr,
                   STAGES: tl.constexpr, DEFER: tl.constexpr):
    for b in tl.range(tl.program_id(0), B, tl.num_programs(0), num_stages=STAGES):
        q = q_desc.load([b * LQ, 0])
        k = k_desc.load([b * LK, 0])
        v = v_desc.load([b * LK, 0])
        p, total = _softmax_parts(q, k.T)
        if DEFER:
            o = tl.dot(p.to(tl.bfloat16), v) / total[:, None]
        else:
            o = tl.dot((p / total[:, None]).to(tl.bfloat16), v)
        o_desc.store([b * LQ, 0], o.to(tl.bfloat16))


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/comfuse-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    from triton.tools.tensor_descriptor import TensorDescriptor
    B, LQ, LK, D = 4096, 16, 256, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, L, D, device="cuda", dtype=torch.bfloat16) for L in (LQ, LK, LK))
    ref = torch.softmax(q.double() @ k.double().transpose(1, 2), -1) @ v.double()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(B, LQ, D, device="cuda", dtype=torch.bfloat16)
    floor_ms = (2 * B * LK * D + 2 * B * LQ * D) * 2 / 4.24e12 * 1e3
    variants = {}
    for warps in (4, 8):
        for v_first in (False, True):
            for defer in (False, True):
                variants[f"per-sample w{warps}{' V first' if v_first else ''}{' defer' if defer else ''}"] = (
                    lambda w=warps, vf=v_first, d=defer: per_sample[(B,)](
                        q, k, v, out, B, LQ, LK, D, vf, d, num_warps=w))
    for warps in (4, 8):
        for samples in (1, 2):
            for evict in ("", "evict_first"):
                if samples == 1 and not evict:
                    continue  # that is "per-sample w4/w8" above
                variants[f"per-sample x{samples} w{warps} {evict or 'no hint'}"] = (
                    lambda w=warps, n=samples, e=evict: per_sample_group[(B // n,)](
                        q, k, v, out, B, LQ, LK, D, n, e, num_warps=w))
    quick = os.environ.get("TA_QUICK") == "1"  # the per-sample forms only
    for warps in () if quick else (4, 8):
        for per_sm in (1, 2, 3, 4):
            for stages in (2, 3, 4):
                grid = (min(B, sms * per_sm),)
                variants[f"persistent w{warps} {per_sm}/SM s{stages}"] = (
                    lambda w=warps, g=grid, s=stages: persistent[g](
                        q, k, v, out, B, LQ, LK, D, s, True, num_warps=w))
    descs = (TensorDescriptor.from_tensor(q.view(B * LQ, D), [LQ, D]),
             TensorDescriptor.from_tensor(k.view(B * LK, D), [LK, D]),
             TensorDescriptor.from_tensor(v.view(B * LK, D), [LK, D]),
             TensorDescriptor.from_tensor(out.view(B * LQ, D), [LQ, D]))
    for warps in (4, 8):
        variants[f"per-sample tma w{warps}"] = (
            lambda w=warps: per_sample_tma[(B,)](*descs[:3], out, B, LQ, LK, D, num_warps=w))
    for warps in () if quick else (4, 8):
        for per_sm in (1, 2, 3):
            for stages in (2, 3):
                grid = (min(B, sms * per_sm),)
                variants[f"persistent tma w{warps} {per_sm}/SM s{stages}"] = (
                    lambda w=warps, g=grid, s=stages: persistent_tma[g](
                        *descs, B, LQ, LK, s, True, num_warps=w))
    fn = lambda: torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v  # noqa: E731
    # comfuse's own, in the same run (their 4-warp form ran 10 % slower than 8 warps,
    # 2026-11-30, with fewer registers than the hand-written 4-warp kernel)
    attention = lambda q, k, v: torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v  # noqa: E731
    for plan, run in generated_chain_runs(attention, (q, k, v), out):
        variants[f"generated chain w{plan.num_warps} bm{plan.block_m}"] = run
    compiled = torch.compile(fn, dynamic=False)
    rows = []
    for name, run in [("eager", fn), ("torch.compile", compiled),
                      ("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0))]:
        t = measure(run)
        rows.append({"name": name, **t.as_dict()})
        print(f"{name:40s} {t.median_ms:.4f} ms", flush=True)
    for name, run in variants.items():
        row = {"name": name}
        try:
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                row.update(status="wrong", err=err)
            else:
                t = measure(graphed(run, warmup_calls=1) if os.environ.get("GRAPH") == "1" else run)
                row.update(status="ok", err=err, **t.as_dict(), tb_s=(floor_ms / t.median_ms) * 4.24)
        except Exception as e:  # one form failing must not stop the sweep
            row.update(status="failed", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        rows.append(row)
        print(f"{name:40s} {row.get('median_ms', float('nan')):.4f} ms {row.get('status')} "
              f"{row.get('err', row.get('reason', ''))}", flush=True)
    (out_dir / "ta_variants.json").write_text(json.dumps({"floor_ms": floor_ms, "rows": rows}, indent=1))
    ok = sorted((r for r in rows if "median_ms" in r), key=lambda r: r["median_ms"])
    print(f"\n| target attention form (floor {floor_ms:.4f} ms) | median ms | [q1..q3] |")
    print("|---|---|---|")
    for r in ok[:12] + [r for r in ok[12:] if r["name"] in ("eager", "torch.compile", "sdpa")]:
        print(f"| {r['name']} | {r['median_ms']:.4f} | {r['q1_ms']:.4f}..{r['q3_ms']:.4f} |")


if __name__ == "__main__":
    main()
