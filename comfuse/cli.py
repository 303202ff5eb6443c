"""The ``comfuse`` command: demo, explain, bench, profile, cache."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path


def _load_target(target: str):
    """FILE.py:FUNC -> (function, example inputs). See README ("explain a function")."""
    if ":" not in target:
        raise SystemExit(f"comfuse explain: expected FILE.py:FUNC, got {target!r}")
    path, func = target.rsplit(":", 1)
    file = Path(path)
    if not file.exists():
        raise SystemExit(f"comfuse explain: no such file {path}")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise SystemExit(f"comfuse explain: {path}:{e.lineno}: {e.msg}") from None
    except Exception as e:  # (the user's module failed to run: one line, not a traceback)
        raise SystemExit(f"comfuse explain: running {path} failed: {type(e).__name__}: {e}") from None
    finally:
        sys.path.pop(0)
    fn = getattr(module, func, None)
    if fn is None:
        raise SystemExit(f"comfuse explain: {path} defines no {func!r}")
    for name in (f"{func}_inputs", "example_inputs"):
        inputs = getattr(module, name, None)
        if inputs is None:
            continue
        if isinstance(inputs, dict):
            inputs = inputs.get(func)
            if inputs is None:
                continue
        if callable(inputs):
            inputs = inputs()
        if not isinstance(inputs, (tuple, list)):  # (a bare tensor would unpack along its rows)
            raise SystemExit(f"comfuse explain: {path}: {name} must be a tuple or list of arguments, "
                             f"got {type(inputs).__name__} (write (x,) for one argument)")
        return fn, tuple(inputs)
    raise SystemExit(f"comfuse explain: {path} must define {func}_inputs or example_inputs "
                     "(a tuple of example arguments, or a function returning one)")


def _sm90_summary(planned) -> str:
    from .runtime import aot
    try:
        info = (aot.compile_chain_for_gpu(planned) if hasattr(planned, "links")
                else aot.compile_for_gpu(planned))
    except Exception as e:  # report, do not fail the explanation
        return f"compilation failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    ptx = info["asm"].get("ptx", "")
    res = aot.resources(info["asm"]["cubin"]) if "cubin" in info["asm"] else {}
    regs = (f"{res['reg']} registers/thread, {res.get('stack', 0)} bytes/thread of spills, "
            if "reg" in res else "")
    return (f"{regs}wgmma {ptx.count('wgmma.mma_async')}, mma.sync {ptx.count('mma.sync')}, "
            f"TMA loads {ptx.count('cp.async.bulk.tensor')}, atomics {ptx.count('atom.')}, "
            f"shared memory {info['shared_bytes']} bytes, local-memory accesses "
            f"{ptx.count('ld.local') + ptx.count('st.local')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="comfuse", description="comfuse: GEMMs fused with the work around them; "
                                     "the commands below try, explain, time and manage it.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="compile, check and (on a GPU) time the built-in suite")
    p_demo.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p_demo.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p_demo.add_argument("--only", default="", help="comma-separated workload names")
    p_explain = sub.add_parser("explain", help="report the regions of FILE.py:FUNC")
    p_explain.add_argument("target", help="FILE.py:FUNC; the file also defines FUNC_inputs or example_inputs")
    p_explain.add_argument("--forms", action="store_true", help="print every planner form of each region")
    p_explain.add_argument("--source", action="store_true", help="print each generated kernel")
    p_explain.add_argument("--sm90", action="store_true",
                           help="compile each kernel for the H200 (no GPU needed) and report tensor-core "
                                "instructions, TMA, shared memory and spills")
    p_bench = sub.add_parser("bench", help="the paper's evaluation: time comfuse against eager, "
                             "torch.compile and the GEMM alone; write JSON, Markdown and figures")
    p_bench.add_argument("--suite", default="all", choices=["paper", "b2b", "attention", "blocks", "models", "all"],
                         help="all = paper, b2b and attention; blocks (Hugging Face layers) and models (whole "
                              "models, inference and training, every torch.compile mode, each in a process of "
                              "its own) run alone")
    p_bench.add_argument("--quick", action="store_true", help="one shape per workload")
    p_bench.add_argument("--out", default="bench/results/latest", help="output folder")
    p_bench.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p_bench.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p_bench.add_argument("--candidates", default="",
                         help="comma-separated candidates (default: all but inductor-reduce-overhead and "
                              "comfuse-backend-reduce-overhead, torch.compile's CUDA-graph mode without and with "
                              "comfuse, which run when named)")
    p_bench.add_argument("--only", default="", help="comma-separated subset of the suite's workloads")
    p_bench.add_argument("--shapes", default="",
                         help="paper suite: measure each workload at these M,K,N (';'-separated), e.g. "
                              "8191,1024,1024;8192,1024,768; 'suite': each workload at its own shapes, "
                              "without the extra sweep")
    p_bench.add_argument("--resume", action="store_true",
                         help="keep the cases already in OUT/results.json (models suite: the rows that ran "
                              "without error, on the same GPU and software)")
    p_bench.add_argument("--repeat", type=int, default=1,
                         help="time the candidates in this many interleaved rounds; report the median "
                              "of the rounds' medians and their range (for noisy machines)")
    p_bench.add_argument("--graph", action="store_true",
                         help="time every candidate as CUDA-graph replays of one call: the GPU's time "
                              "without Python's launch path (which for ~40 us workloads on a busy host "
                              "can double a time); comfuse's autotuning then times graph replays too, "
                              "unless COMFUSE_TUNE_TIMING is set")
    p_bench.add_argument("--report-only", action="store_true", help="rewrite the report of OUT/results.json")
    p_bench.add_argument("--layers", type=int, default=0,
                         help="models suite: layers per model (default: BERT-base's and GPT-2 small's 12, one "
                              "Llama-3-8B-shaped layer)")
    p_bench.add_argument("--small", action="store_true",
                         help="models suite: small widths (256) and 2 x 128 tokens, one layer (a CPU's size)")
    p_bench.add_argument("--rounds", type=int, default=5, help="models suite: rounds of back-to-back calls")
    p_bench.add_argument("--row-limit", type=float, default=0,
                         help="models suite: stop a model and form's process after this many seconds (its row "
                              "says so; --resume runs it again); 0: no limit")
    p_bench.add_argument("--profile", action="store_true",
                         help="models suite: profile each form's forward, step and loss-only step kernel by "
                              "kernel (tables in OUT/profiles/; GPU time and launch host time in the report)")
    p_bench.add_argument("--no-warm", action="store_true",
                         help="models suite: skip the warm first calls (a second process per model and form)")
    p_prof = sub.add_parser("profile", help="DRAM bytes of a fused kernel and its unfused pipeline (ncu)")
    p_prof.add_argument("workload", help="a workload of the bench suites, e.g. ln_postnorm")
    p_prof.add_argument("--shape", default="8192,1024,1024", help="M,K,N for GEMM + epilogue workloads")
    p_prof.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p_prof.add_argument("--out", default=None, help="folder for profile-<workload>.json/.md")
    p_cache = sub.add_parser("cache", help="show or clear the disk cache (kernel sources, autotuning decisions, graph verdicts)")
    p_cache.add_argument("action", choices=["info", "clear"])
    args = parser.parse_args(argv)

    if args.command == "demo":
        from .demo import run
        only = [s for s in args.only.split(",") if s]
        return run(device=args.device, dtype=args.dtype, only=only)
    if args.command == "explain":
        import os
        import subprocess

        import comfuse
        from .runtime.launch import interpreting
        if args.sm90 and interpreting():  # Triton compiles for a GPU only outside interpreter mode
            env = {**os.environ, "TRITON_INTERPRET": "0"}
            return subprocess.call([sys.executable, "-m", "comfuse.cli"] + list(argv or sys.argv[1:]), env=env)
        fn, inputs = _load_target(args.target)
        report = comfuse.explain(fn, inputs)
        print(report)
        for r in report.regions:
            if args.forms:
                for name, text in r.forms:
                    print(f"\n-- region {r.index}, form '{name}' --\n{text}")
            if args.source and r.kernel_path:
                print(f"\n-- region {r.index}, kernel {r.kernel_path} --\n{Path(r.kernel_path).read_text()}")
            if args.sm90:
                planned = r.planned
                if r.kind == "gemm_epilogue" and r.found is not None:  # plan for the H200, whatever the tensors' device
                    from .planner import plan
                    planned = plan(r.found, target="cuda")
                    planned = None if not hasattr(planned, "schedule") else planned
                elif r.kind == "b2b" and r.found is not None and r.schedule != "sdpa":
                    from .planner.chain import plan_chain
                    planned = plan_chain(*r.found, target="cuda")
                    planned = None if not hasattr(planned, "links") else planned
                if planned is not None and hasattr(planned, "describe"):
                    print(f"\n-- region {r.index} compiled for sm_90 ({planned.describe()}): "
                          f"{_sm90_summary(planned)}")
        return 0
    if args.command == "bench" and args.suite == "models":
        import json as _json

        from .bench import models
        if args.report_only:
            results = _json.loads((Path(args.out) / "results.json").read_text())
        else:
            picked = [m for m in args.only.split(",") if m] or list(models.DEFAULT_MODELS)
            forms = [c for c in args.candidates.split(",") if c] or list(models.FORMS)
            results = models.run(picked, forms, args.out, args.layers or None, args.small, args.rounds,
                                 not args.no_warm, args.device, progress=lambda m: print(m, file=sys.stderr),
                                 resume=args.resume, row_limit=args.row_limit, profile=args.profile)
        for path in models.write(results, args.out):
            print(f"wrote {path}")
        print(models.markdown(results))
        return 0
    if args.command == "bench":
        import json as _json

        from .bench import report, runner
        if args.report_only:
            results = _json.loads((Path(args.out) / "results.json").read_text())
        else:
            cands = [c for c in args.candidates.split(",") if c] or None
            if args.repeat < 1:
                raise SystemExit("--repeat must be at least 1")
            own = args.shapes.strip() == "suite"  # each workload's own shapes, no sweep
            try:
                shapes = [] if own else [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")
                                         if s.strip()]
            except ValueError:
                raise SystemExit(f"--shapes {args.shapes!r}: expected M,K,N[;M,K,N...] integers") from None
            if any(len(s) != 3 or min(s) < 1 for s in shapes):
                raise SystemExit(f"--shapes {args.shapes!r}: each shape is three positive sizes M,K,N")
            results = runner.run(args.suite, args.quick, args.out, args.device, args.dtype, cands,
                                 args.resume, repeat=args.repeat, graph=args.graph,
                                 only=[w for w in args.only.split(",") if w] or None, shapes=shapes or None,
                                 sweep=not own)
        for path in report.write(results, args.out):
            print(f"wrote {path}")
        print(report.markdown(results))
        return 0
    if args.command == "profile":
        from .bench.profile import profile, profile_markdown
        print(profile_markdown(profile(args.workload, args.shape, args.dtype, args.out)))
        return 0
    if args.command == "cache":
        from .runtime import cache
        if args.action == "clear":
            print(f"removed {cache.clear()} files (kernel sources, autotuning decisions, graph verdicts) "
                  f"from {cache.kernel_dir().parent}")
        else:
            held = ", ".join(f"{n} {what}" for what, n in cache.counts().items())
            print(f"{cache.kernel_dir().parent}: {held}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
