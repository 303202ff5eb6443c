"""The Gluon template (comfuse/codegen/gluon/strip.py) on the suite's workloads, three ways at
the same shapes, each output checked against float64 before it is timed:

- direct (``--direct``): ``strip.launch`` through Triton's JIT on the suite's operands (B as
  [K, N]) and on B transposed to nn.Linear's [N, K]; one launch of each traced;
- comfuse: ``comfuse.compile`` with the template forced (COMFUSE_SCHEDULE=ws_strip; ws_split,
  the terminal log-sum-exp kind, for linear_ce, with its peak memory above the inputs; autotuning
  off): its kernels listed by the profiler, its host time per call (``--profile``: where that
  goes, by cProfile);
- comfuse autotuned (``--auto``): what autotuning keeps, and its time.

Written to find why the template timed far slower inside comfuse than in its own script
(twelfth session): the host time of a call, 130-430 us, not the kernel (thirteenth session).

    python scripts/ws_diag.py [--only rmsnorm,ln_postnorm,mblr,softmax] [--shapes 8192x1024x1024]

A short table is printed last (graph replays, interleaved rounds, x cuBLAS ``x @ w``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import comfuse  # noqa: E402
from comfuse import settings as settings_mod  # noqa: E402
from comfuse.bench.timing import graph_rounds, kernel_times, print_ratio_table, ratio_rows  # noqa: E402
from comfuse.bench.workloads import SUITE, paper_program  # noqa: E402
from comfuse.codegen.gluon import strip  # noqa: E402

# workload -> the template configuration computing it, and (bias, residual, gamma, beta) positions
# among the program's side inputs (after x and w)
CONFIGS = {
    "rmsnorm": (dict(kind=strip.KIND_RMSNORM, has_gamma=True), dict(gamma=0), 1e-6),
    "ln_postnorm": (dict(kind=strip.KIND_LAYERNORM, has_bias=True, has_gamma=True, has_beta=True),
                    dict(bias=0, residual=1, gamma=2, beta=3), 1e-5),
    "mblr": (dict(kind=strip.KIND_LAYERNORM, has_bias=True, has_gamma=True, has_beta=True, relu=True),
             dict(bias=0, gamma=1, beta=2), 1e-5),
    "softmax": (dict(kind=strip.KIND_SOFTMAX), {}, 0.0),
}


def rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def direct_forms(name, prog, ref, num_sms, log):
    """name -> callable for each direct variant that checked out."""
    base, roles, eps = CONFIGS[name]
    x, w, side = prog.args[0], prog.args[1], prog.args[2:]
    M, K = x.shape
    N = w.shape[1]
    kw = {role: side[i] for role, i in roles.items()}
    ws = torch.empty(strip.workspace_numel(M, N), device="cuda", dtype=torch.float32)
    counters = torch.zeros(M // strip.BM, device="cuda", dtype=torch.int64)
    w_nk = w.t().contiguous()
    forms = {}
    for b_label, b, kmajor in (("B [K,N]", w, False), ("B [N,K]", w_nk, True)):
        for res in ((0, 1, 2) if "residual" in kw else (0,)):
            cfg = strip.StripConfig(**base, residual=res, b_kmajor=kmajor)
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            label = f"direct {b_label} res={res}"

            def go(cfg=cfg, b=b, out=out, trace=None):
                return strip.launch(cfg, x, b, out, bias=kw.get("bias"), residual=kw.get("residual") if cfg.residual
                                    else None, gamma=kw.get("gamma"), beta=kw.get("beta"), eps=eps, ws=ws,
                                    counters=counters, num_sms=num_sms, trace=trace)
            try:
                go()
                torch.cuda.synchronize()
            except Exception as e:
                log(f"  {label}: failed: {type(e).__name__}: {str(e)[:800]}")
                continue
            err = rel_err(out, ref)
            log(f"  {label}: rel err {err:.2e} {'OK' if err < 2e-2 else 'WRONG'}")
            if err >= 2e-2:
                continue
            trace = torch.zeros(num_sms, 64, 16, device="cuda", dtype=torch.int64)
            grid = go(trace=trace)
            torch.cuda.synchronize()
            from gluon_ln_gemm import timeline
            log(f"  {label} timeline:\n" + timeline(trace, grid, (M // strip.BM) * (N // strip.BN)))
            forms[label] = go
            log(f"  {label} host loop: {host_us(go):.1f} us a call")
    return forms


def host_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def peak_above(fn) -> float:
    """MB a call allocates at its peak above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def log_kernels(log, label: str, fn) -> None:
    """The kernels one call of ``fn`` launches (profiler), the slowest 8."""
    total, rows = kernel_times(fn)
    log(f"  comfuse {label} kernels ({total:.4f} ms a call):")
    for ms, n, k in rows[:8]:
        log(f"    {ms:.4f} ms  x{n}  {k[:100]}")


def comfuse_forms(prog, ref, log, profile=False, out_dir=None, auto=False, schedules=("ws_strip", )):
    forms = {}
    for schedule in schedules:
        try:
            forms.update(forced_form(prog, ref, log, profile, out_dir,
                                     "ws_split" if prog.workload == "linear_ce" else schedule))
        except Exception as e:
            log(f"  comfuse {schedule}: failed: {type(e).__name__}: {str(e)[:800]}")
    if auto:  # what autotuning keeps (the template, a Triton plan or Inductor's code)
        chosen = comfuse.compile(prog.fn, prog.args)
        out = chosen(*prog.args)
        torch.cuda.synchronize()
        for r in chosen.report.regions:
            log(f"  comfuse autotuned: fused={r.fused} schedule={r.schedule} reason={r.reason!r} plan={r.plan}")
        err = rel_err(out, ref)
        log(f"  comfuse autotuned: rel err {err:.2e} {'OK' if err < 2e-2 else 'WRONG'}; host loop "
            f"{host_us(lambda: chosen(*prog.args)):.1f} us a call")
        log_kernels(log, "autotuned", lambda: chosen(*prog.args))
        if err < 2e-2:
            forms["comfuse autotuned"] = lambda: chosen(*prog.args)
    return forms


def forced_form(prog, ref, log, profile, out_dir, spec) -> dict:
    """{"comfuse <spec>": callable} when comfuse with the schedule forced checks out; ``spec``:
    a schedule, or "ws_stages/8": with its epilogue's rows over 8 lanes (COMFUSE_WS_LANES)."""
    forms = {}
    schedule, _, lanes = spec.partition("/")
    forced = dict(schedule=schedule, autotune="0", validate="0", ws_lanes=int(lanes or 0))
    with settings_mod.override(**forced):
        # (every call forced, the later ones outside this block too: they would autotune)
        fused = settings_mod.pinned(comfuse.compile(prog.fn, prog.args), **forced)
        out = fused(*prog.args)
        torch.cuda.synchronize()
        if prog.workload == "linear_ce":
            M, N = prog.args[0].shape[0], prog.args[1].shape[1]
            log(f"  comfuse {spec}: peak {peak_above(lambda: fused(*prog.args)):.1f} MB above the inputs; "
                f"the bf16 logits would be {M * N * 2 / 2**20:.0f} MB; eager's peak "
                f"{peak_above(lambda: prog.fn(*prog.args)):.0f} MB")
        rep = comfuse.explain(prog.fn, prog.args)
        for r in rep.regions:
            log(f"  comfuse region: fused={r.fused} schedule={r.schedule} reason={r.reason!r} plan={r.plan}")
        err = rel_err(out, ref)
        log(f"  comfuse {spec}: rel err {err:.2e} {'OK' if err < 2e-2 else 'WRONG'}")
        log_kernels(log, spec, lambda: fused(*prog.args))
        log(f"  comfuse {spec} host loop: {host_us(lambda: fused(*prog.args)):.1f} us a call")
        if profile:  # where the host time of a call goes
            import cProfile
            import io
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fused(*prog.args)
            prof.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            (out_dir / f"profile_{prog.workload}.txt").write_text(buf.getvalue())
        if err < 2e-2:
            forms[f"comfuse {spec}"] = lambda: fused(*prog.args)
    return forms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="rmsnorm,ln_postnorm,mblr,softmax")
    ap.add_argument("--shapes", default="", help="MxKxN, comma-separated (default: each workload's suite shapes)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--direct", action="store_true", help="also time strip.launch directly (and trace it)")
    ap.add_argument("--profile", action="store_true", help="cProfile 200 comfuse calls (to $OUT)")
    ap.add_argument("--max-autotune", action="store_true", help="also time torch.compile max-autotune-no-cudagraphs")
    ap.add_argument("--auto", action="store_true", help="also comfuse with autotuning (its choice, timed)")
    ap.add_argument("--schedules", default="ws_strip",
                    help="comma-separated schedules to force (ws_strip, ws_stages (its rows over 8 lanes, the planner's choice), ws_stages/32 or ws_stages/8: its rows over 32 or 8 "
                         "lanes; linear_ce always ws_split)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    logf = open(out_dir / "ws_diag.log", "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {num_sms} SMs")
    if args.auto:  # autotuning's candidates and their times, into the log
        import logging
        handler = logging.StreamHandler(logf)
        handler.setFormatter(logging.Formatter("  tuning: %(message)s"))
        logging.getLogger("comfuse.tuning").addHandler(handler)
        logging.getLogger("comfuse.tuning").setLevel(logging.DEBUG)
    table = []
    for name in args.only.split(","):
        shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes
                  else SUITE[name].gpu_shapes)
        for shape in shapes:
            prog = paper_program(name, shape, torch.bfloat16, "cuda")
            ref = prog.fn(*(a.double() if a.is_floating_point() else a for a in prog.args))
            if ref.dim() == 0:  # a loss: rel_err of a scalar
                ref = ref.reshape(1)
            label = f"{name} {'x'.join(map(str, shape))}"
            log(f"{label} (M x K x N)")
            forms = direct_forms(name, prog, ref, num_sms, log) if args.direct and name in CONFIGS else {}
            try:
                forms.update(comfuse_forms(prog, ref, log, args.profile, out_dir, args.auto,
                                           tuple(args.schedules.split(","))))
            except Exception as e:
                log(f"  comfuse: failed: {type(e).__name__}: {str(e)[:800]}")
            forms["cuBLAS GEMM"] = prog.gemm
            forms["eager"] = lambda prog=prog: prog.fn(*prog.args)
            # dynamic=False: the same function at a second shape would otherwise recompile with
            # dynamic shapes (automatic dynamic), slower code (fourteenth session: 0.1025 against
            # 0.0570 ms static, multi_stage 8192x1024x1024), as comfuse bench compiles it
            forms["torch.compile"] = lambda c=torch.compile(prog.fn, dynamic=False), a=prog.args: c(*a)
            if args.max_autotune:
                forms["max-autotune"] = lambda c=torch.compile(prog.fn, mode="max-autotune-no-cudagraphs",
                                                               dynamic=False), \
                    a=prog.args: c(*a)
            log(f"  torch.compile host loop: {host_us(forms['torch.compile']):.1f} us a call")
            times = graph_rounds(forms, args.rounds)
            rows = ratio_rows(label, times, "cuBLAS GEMM")
            table += rows
            for _, form, med, lo, hi, ratio in rows:
                log(f"  = {form}: {med:.4f} ms [{lo:.4f}..{hi:.4f}] {ratio:.3f}x GEMM")
    print_ratio_table(table)
    import io
    import contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_ratio_table(table)
    logf.write(buf.getvalue())


if __name__ == "__main__":
    main()
