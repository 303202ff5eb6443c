"""GEMM + bias + residual + LayerNorm through the warp-specialised Gluon template
(comfuse/codegen/gluon/strip.py): variants and ablations checked against float64, timed
against cuBLAS, eager and torch.compile, and one launch traced (where each partition's time goes).

    out[m, :] = LayerNorm(x[m, :] @ W^T + b + r[m, :]) * gamma + beta     x: M x K, W: N x K, bf16

    python scripts/gluon_ln_gemm.py compile            # CPU: compile each variant for sm_90, print resources
    python scripts/gluon_ln_gemm.py run [--rounds 3]   # GPU: check against float64, stress, trace, time

``run`` checks each variant against a float64 reference before timing it (the largest error at
most 1.25x eager's own plus 0.01), repeats 200 launches and checks again (the strip counters
only grow), traces one launch of the first variant, and times CUDA-graph replays (20 calls a
graph) in interleaved rounds after heating the GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")  # (comfuse would pick the interpreter on a CPU machine)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton  # noqa: E402

from comfuse.bench.timing import graph_rounds, print_ratio_table, ratio_rows  # noqa: E402
from comfuse.bench.workloads import linear_ln_problem  # noqa: E402
from comfuse.codegen.gluon import strip  # noqa: E402

LN = dict(kind=strip.KIND_LAYERNORM, has_bias=True, has_gamma=True, has_beta=True, b_kmajor=True)
VARIANTS = {  # name: (template configuration, ablation: output not checked)
    "ln": (strip.StripConfig(**LN, residual=2), False),
    "ln_ldg": (strip.StripConfig(**LN, residual=1), False),
    "plain": (strip.StripConfig(kind=strip.KIND_PLAIN, has_bias=True, residual=0, b_kmajor=True), False),
    "ln_nowait": (strip.StripConfig(**LN, residual=2, wait=False), True),
    "ln_nores": (strip.StripConfig(**LN, residual=0), True),
}


def compile_step(names):
    from comfuse.runtime.aot import resources
    for name in names:
        try:
            k = strip.compile_sm90(VARIANTS[name][0])
        except Exception as e:  # report every variant
            print(f"{name}: compile failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        print(f"{name}: shared {k.metadata.shared} B, {resources(k.asm['cubin'])}", flush=True)


PHASES = [  # (name, from mark, to mark): the marks of strip._mark
    ("MMA: mainloop", 0, 1), ("MMA: wait for the buffer (and residual)", 1, 2), ("MMA: hand-off store", 2, 3),
    ("EPI: wait for the tile", 4, 5), ("EPI: v, partials", 5, 6), ("EPI: strip wait", 6, 7),
    ("EPI: combine", 7, 8), ("EPI: normalise, store", 8, 9)]


def timeline(trace, grid, num_tiles) -> str:
    """Median microseconds of each phase over all tiles, and what is left after the last mainloop."""
    import torch
    t = trace[:grid].double()
    lines = []
    per = -(-num_tiles // grid)
    valid = torch.zeros(grid, 64, dtype=torch.bool, device=t.device)
    for p in range(grid):
        valid[p, :len(range(p, num_tiles, grid))] = True
    for name, a, b in PHASES:
        d = ((t[..., b] - t[..., a]) / 1e3)[valid]
        lines.append(f"    {name:42s} median {d.median().item():7.2f} us, max {d.max().item():7.2f}")
    gap = ((t[:, 1:per, 0] - t[:, :per - 1, 3]) / 1e3)[valid[:, 1:per]]
    if gap.numel():
        lines.append(f"    {'MMA: hand-off to next mainloop':42s} median {gap.median().item():7.2f} us")
    start = t[..., 0][valid].min()
    last_mma = t[..., 1][valid].max()
    end = t[..., 9][valid].max()
    lines.append(f"    span {(end - start).item() / 1e3:.2f} us, of which after the last mainloop "
                 f"{(end - last_mma).item() / 1e3:.2f} us")
    return "\n".join(lines)


def _check(out, ref, eager_err):
    """(summary, ok): the largest |out - ref| against float64 is at most 1.25x eager's own
    (eager rounds the GEMM output and the sums to bf16 too) plus 0.01."""
    import torch
    err = (out.double() - ref).abs().max().item()
    ok = bool(torch.isfinite(out).all()) and err <= 1.25 * eager_err + 0.01
    return f"max abs error {err:.4f} (eager's {eager_err:.4f})", ok


def run_step(names, rounds, shapes):
    import torch
    import torch.nn.functional as F
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{num_sms} SMs", flush=True)
    table = []
    for (M, N, K) in shapes:
        p = linear_ln_problem(M, N, K)
        x, w, b, r, gamma, beta, ref_y, ref_ln = (p[k] for k in ("x", "w", "b", "r", "gamma", "beta", "ref_y",
                                                                 "ref_ln"))
        eager_err = {True: (F.layer_norm(F.linear(x, w, b) + r, (N,), gamma, beta, 1e-5).double() - ref_ln)
                     .abs().max().item(),
                     False: (F.linear(x, w, b).double() - ref_y).abs().max().item()}
        ws = torch.empty(strip.workspace_numel(M, N), device="cuda", dtype=torch.float32)
        counters = torch.zeros(M // strip.BM, device="cuda", dtype=torch.int64)
        forms = {}
        for name in names:
            cfg, ablation = VARIANTS[name]
            normed = cfg.kind != strip.KIND_PLAIN
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

            def go(cfg=cfg, out=out, trace=None):
                return strip.launch(cfg, x, w, out, bias=b, residual=r if cfg.residual else None, gamma=gamma,
                                    beta=beta, ws=ws, counters=counters, num_sms=num_sms, trace=trace)
            ref = ref_ln if normed else ref_y
            try:
                out.fill_(float("nan"))
                go()
                torch.cuda.synchronize()
            except Exception as e:
                print(f"{name} {M}x{N}x{K}: failed: {type(e).__name__}: {str(e)[:1500]}", flush=True)
                continue
            if ablation:
                print(f"{name} {M}x{N}x{K}: ablation, output not checked", flush=True)
                forms[f"gluon {name} (ablation)"] = go
                continue
            # the plain variant rounds twice (the hand-off, then + bias): twice eager's error
            err, ok = _check(out, ref, eager_err[normed] * (1 if normed else 2))
            print(f"{name} {M}x{N}x{K}: {err} {'OK' if ok else 'WRONG'}", flush=True)
            if ok and normed:  # stress: many launches back to back, the result checked at the end
                for _ in range(200):
                    go()
                torch.cuda.synchronize()
                err, ok = _check(out, ref, eager_err[normed])
                print(f"    after 200 more launches: {err} {'OK' if ok else 'WRONG'}", flush=True)
            if ok:
                forms[f"gluon {name}"] = go
            if ok and normed and name == names[0]:  # where the time goes, one launch traced
                trace = torch.zeros(num_sms, 64, 16, device="cuda", dtype=torch.int64)
                grid = go(trace=trace)
                torch.cuda.synchronize()
                print(f"  {name} timeline (one traced launch):\n" + timeline(trace, grid, (M // strip.BM) * (N // strip.BN)),
                      flush=True)
        forms["cuBLAS F.linear"] = lambda: F.linear(x, w)
        forms["cuBLAS F.linear + bias"] = lambda: F.linear(x, w, b)

        def eager():
            return F.layer_norm(F.linear(x, w, b) + r, (N,), gamma, beta, 1e-5)
        forms["eager"] = eager
        forms["torch.compile"] = torch.compile(eager, dynamic=False)  # (a recompile per shape, not dynamic code)
        table += ratio_rows(f"{M}x{N}x{K}", graph_rounds(forms, rounds), "cuBLAS F.linear")
    print_ratio_table(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["compile", "run"])
    ap.add_argument("--only", default=None, help="comma-separated variants (default: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default="8192x1024x1024", help="MxNxK, comma-separated")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(VARIANTS)
    if args.step == "compile":
        compile_step(names)
    else:
        run_step(names, args.rounds, [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")])


if __name__ == "__main__":
    main()
