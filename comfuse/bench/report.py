"""Reports from a ``results.json``: derived figures of merit, a Markdown page, PNG figures.

Everything here is a pure function of the results, so it is tested on synthetic data.
The epilogue cost is measured directly, as the fused time minus the GEMM-alone time,
next to the time of the epilogue run on its own (torch.compile on a precomputed GEMM
output), rather than through the paper's residual-time ratio alone: when the epilogue
overlaps the mainloop the difference can be small or even negative, and the standalone
time says what fusing saved.
"""
from __future__ import annotations

import json
from pathlib import Path

BASELINE_NAMES = ("eager", "inductor", "inductor-max-autotune", "inductor-reduce-overhead", "sdpa")
LABELS = {"eager": "eager", "inductor": "torch.compile", "inductor-max-autotune": "max-autotune",
          "inductor-reduce-overhead": "reduce-overhead",
          "comfuse-backend-reduce-overhead": "torch.compile(comfuse, reduce-overhead)",
          "sdpa": "SDPA", "comfuse": "comfuse", "comfuse-backend": "torch.compile(comfuse)",
          "comfuse-graph": "comfuse kernels (CUDA graph)",
          "gemm": "GEMM alone", "epilogue": "epilogue alone"}


def _ms(cand: dict | None):
    return cand.get("median_ms") if cand and cand.get("status") == "ok" else None


def derive(case: dict) -> dict:
    """Figures of merit for one case (None where an input is missing)."""
    c = case["candidates"]
    comfuse = _ms(c.get("comfuse")) or _ms(c.get("comfuse-backend"))
    baselines = {n: _ms(c.get(n)) for n in BASELINE_NAMES}
    baselines = {n: t for n, t in baselines.items() if t is not None}
    best_name = min(baselines, key=baselines.get) if baselines else None
    best = baselines.get(best_name) if best_name else None
    gemm = _ms(c.get("gemm"))
    epilogue = _ms(c.get("epilogue"))
    ro, ro_base = _ms(c.get("comfuse-backend-reduce-overhead")), _ms(c.get("inductor-reduce-overhead"))
    d = {"best_baseline": best_name, "best_baseline_ms": best, "comfuse_ms": comfuse,
         # (torch.compile's CUDA-graph mode with comfuse's regions against the same mode without)
         "reduce_overhead_speedup": ro_base / ro if ro and ro_base else None,
         "speedup_vs_best": best / comfuse if best and comfuse else None,
         "speedups": {n: t / comfuse for n, t in baselines.items()} if comfuse else {},
         "gemm_ms": gemm, "comfuse_over_gemm": comfuse / gemm if comfuse and gemm else None,
         "epilogue_cost_ms": comfuse - gemm if comfuse and gemm else None,
         "baseline_epilogue_cost_ms": best - gemm if best and gemm else None,
         # the speedup a fused kernel taking exactly the GEMM's time would reach: the most any
         # fusion can give a program whose GEMM runs at cuBLAS's speed
         "ceiling_vs_best": best / gemm if best and gemm else None,
         "standalone_epilogue_ms": epilogue,
         "comfuse_tflops": case["flops"] / comfuse / 1e9 if comfuse else None,
         "comfuse_tb_s": case["min_bytes"] / comfuse / 1e9 if comfuse else None}
    return d


def geomean(values) -> float | None:
    values = [v for v in values if v]
    if not values:
        return None
    import math
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _fmt(cand: dict | None) -> str:
    if not cand:
        return "-"
    status = cand.get("status")
    if status == "ok":
        if "rounds_min_ms" in cand:  # --repeat: median of the rounds' medians [their range]
            return f"{cand['median_ms']:.4f} [{cand['rounds_min_ms']:.4f}..{cand['rounds_max_ms']:.4f}]"
        return f"{cand['median_ms']:.4f} ({cand['iqr_ms']:.4f})"
    if status == "wrong":
        return f"WRONG (err {cand.get('err', float('nan')):.1e})"
    return status or "-"


def _ratio_line(cases, key: str, title: str) -> list:
    """A paragraph of one derived ratio per case and their geometric mean (none if no case has it)."""
    pairs = [(c, derive(c)[key]) for c in cases]
    pairs = [(c, r) for c, r in pairs if r]
    if not pairs:
        return []
    return ["", f"{title}: " + ", ".join(f"{c['workload']} {'x'.join(map(str, c['shape']))} {r:.2f}x"
                                         for c, r in pairs) + f"; geometric mean {geomean(r for _, r in pairs):.2f}x"]


def markdown(results: dict) -> str:
    meta, ceil = results["meta"], results.get("ceilings", {})
    lines = ["# comfuse bench results", ""]
    lines.append(f"- GPU: {meta.get('gpu')}, {meta.get('sm_count', '?')} SMs, driver "
                 f"{meta.get('driver', '?')}, SM clock at start {meta.get('sm_clock', '?')} "
                 f"(max {meta.get('sm_clock_max', '?')}), memory clock {meta.get('mem_clock', '?')}")
    lines.append(f"- torch {meta.get('torch')}, triton {meta.get('triton')}, CUDA {meta.get('cuda')}, "
                 f"Python {meta.get('python')}; dtype {meta.get('dtype')}; date {meta.get('date')}")
    if meta.get("note"):
        lines.append(f"- run: {meta['note']}")
    if ceil:
        lines.append(f"- measured ceilings: device copy {ceil['copy_tb_s']:.2f} TB/s, bf16 GEMM "
                     f"8192^3 {ceil['bf16_gemm_tflops']:.0f} TFLOP/s")
    how = ("`triton.testing.do_bench`, CUDA events, L2 flushed between repetitions"
           + (", each repetition a CUDA-graph replay of one call (GPU time, no Python launch)"
              if meta.get("graph") else ", each repetition a Python call")
           if meta.get("device") == "cuda" else
           "wall clock on the CPU through Triton's interpreter: a smoke test, not a measurement")
    rounds = meta.get("repeat", 1)
    shown = ("median of the medians of {0} interleaved rounds [range of the round medians]".format(rounds)
             if rounds > 1 else "median (IQR)")
    lines.append(f"- times: {shown} in ms, each round >= 20 repetitions ({how}); every candidate's "
                 "output was checked against float64 PyTorch before it was timed; WRONG results "
                 "are reported, not timed")
    if meta.get("tune_timing"):
        lines.append("- comfuse's autotuning timed its candidates by "
                     + ("CUDA-graph replays" if meta["tune_timing"] == "graph" else "Python launches")
                     + " (COMFUSE_TUNE_TIMING)")
    lines.append("")
    cols = ["gemm", "eager", "inductor", "inductor-max-autotune", "sdpa", "comfuse", "comfuse-backend"]
    if any("comfuse-graph" in c["candidates"] for c in results["cases"]):
        cols.append("comfuse-graph")  # diagnostic only: not used in any speedup
    for name in ("inductor-reduce-overhead", "comfuse-backend-reduce-overhead"):  # (asked for by name)
        if any(name in c["candidates"] for c in results["cases"]):
            cols.append(name)
    for suite in ("paper", "b2b", "attention", "blocks", "models"):  # ("models": blocks, in older results)
        cases = [c for c in results["cases"] if c["suite"] == suite]
        if not cases:
            continue
        lines += [f"## {suite}", "",
                  "| workload | shape | " + " | ".join(LABELS.get(c, c) for c in cols) +
                  " | best baseline | speedup | comfuse / GEMM | epilogue cost (fused - GEMM) | "
                  "epilogue alone | comfuse plan |",
                  "|" + "---|" * (len(cols) + 8)]
        for case in cases:
            d = derive(case)
            cand = case["candidates"]
            plan = cand.get("comfuse", {})
            plan_text = f"{plan.get('fused', '?')} fused {plan.get('schedules', '')}".strip()
            if plan.get("reason"):
                plan_text += f"; {plan['reason'][:80]}"
            lines.append("| " + " | ".join([
                case["workload"], "x".join(map(str, case["shape"])),
                *[_fmt(cand.get(c)) for c in cols],
                LABELS.get(d["best_baseline"], "-") if d["best_baseline"] else "-",
                f"{d['speedup_vs_best']:.2f}x" if d["speedup_vs_best"] else "-",
                f"{d['comfuse_over_gemm']:.2f}" if d["comfuse_over_gemm"] else "-",
                f"{d['epilogue_cost_ms']:.4f}" if d["epilogue_cost_ms"] is not None else "-",
                _fmt(cand.get("epilogue")), plan_text]) + " |")
        g = geomean(derive(c)["speedup_vs_best"] for c in cases)
        if g:
            lines += ["", f"Geometric-mean speedup of comfuse over the best baseline: {g:.2f}x"]
        lines += _ratio_line(cases, "ceiling_vs_best", "Ceiling (best baseline / GEMM alone, the speedup of a "
                             "fused kernel as fast as the GEMM alone)")
        lines += _ratio_line(cases, "reduce_overhead_speedup", "torch.compile(comfuse) against torch.compile, "
                             "both in mode reduce-overhead (CUDA graphs)")
        lines.append("")
    forced = sorted({n for c in results["cases"] for n in c["candidates"] if n.startswith("comfuse[")})
    if forced:
        lines += ["## comfuse with each schedule forced", "",
                  "| workload | shape | " + " | ".join(forced) + " |", "|" + "---|" * (len(forced) + 2)]
        for case in results["cases"]:
            lines.append(f"| {case['workload']} | {'x'.join(map(str, case['shape']))} | " +
                         " | ".join(_fmt(case["candidates"].get(n)) for n in forced) + " |")
        lines.append("")
    missing = {}
    for case in results["cases"]:
        for name, cand in case["candidates"].items():
            if cand.get("status") in ("unavailable", "failed", "not run"):
                missing.setdefault(name, cand.get("reason", ""))
    if missing:
        lines += ["## Not measured", ""]
        lines += [f"- {name}: {reason}" for name, reason in sorted(missing.items())]
        lines.append("")
    return "\n".join(lines)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def figures(results: dict, out_dir: str | Path) -> list[Path]:
    """speedup.png, roofline.png and epilogue.png; returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cases = results["cases"]
    labels = [f"{c['workload']}\n{'x'.join(map(str, c['shape']))}" for c in cases]
    derived = [derive(c) for c in cases]
    written = []
    gpu = results["meta"].get("gpu", "")

    # 1. speedup of comfuse over each baseline (the paper's Figures 7, 9-11)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cases) + 2), 4.5))
    names = [n for n in BASELINE_NAMES if any(n in d["speedups"] for d in derived)]
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(cases))]
        ys = [d["speedups"].get(name, 0) for d in derived]
        ax.bar(xs, ys, width, label=f"vs {LABELS[name]}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)), labels, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("speedup of comfuse (baseline time / comfuse time)")
    ax.set_title(f"comfuse speedup, {gpu}")
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "speedup.png"))

    # 2. roofline: achieved TFLOP/s against arithmetic intensity, under the measured ceilings
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ceil = results.get("ceilings") or {}
    intensity = [c["flops"] / c["min_bytes"] for c in cases]
    if ceil and intensity:
        lo, hi = min(intensity) / 4, max(intensity) * 4
        xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
        roof = [min(ceil["bf16_gemm_tflops"], x * ceil["copy_tb_s"]) for x in xs]
        ax.plot(xs, roof, color="black", linewidth=1, label="measured ceilings")
    for name, marker in (("comfuse", "o"), ("best", "s"), ("gemm", "^")):
        pts = []
        for c, d, x in zip(cases, derived, intensity):
            t = d["comfuse_ms"] if name == "comfuse" else d["best_baseline_ms"] if name == "best" else d["gemm_ms"]
            if t:
                pts.append((x, c["flops"] / t / 1e9))
        if pts:
            ax.scatter(*zip(*pts), marker=marker,
                       label={"best": "best baseline", "gemm": "GEMM alone (cuBLAS)"}.get(name, name))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOP per byte of minimum traffic")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title("roofline")
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "roofline.png"))

    # 3. the epilogue's cost, measured directly
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cases) + 2), 4.5))
    series = (("epilogue_cost_ms", "comfuse: fused - GEMM alone"),
              ("baseline_epilogue_cost_ms", "best baseline - GEMM alone"),
              ("standalone_epilogue_ms", "epilogue alone (torch.compile)"))
    for k, (key, label) in enumerate(series):
        xs = [i + (k - 1) * 0.27 for i in range(len(cases))]
        ax.bar(xs, [d[key] or 0 for d in derived], 0.27, label=label)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)), labels, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("ms")
    ax.set_title("what the epilogue costs")
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "epilogue.png"))
    return written


def write(results: dict, out_dir: str | Path) -> list[Path]:
    """results.json, results.md and the figures in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    paths = [out / "results.json", out / "results.md"]
    try:
        paths += figures(results, out)
    except ImportError:
        (out / "figures-missing.txt").write_text("matplotlib is not installed: "
                                                 "pip install -e '.[bench]' for figures\n")
    return paths


INDEX_BASELINES = ("eager", "inductor", "inductor-max-autotune")  # the index's speedup is over these
INDEX_ORDER = ("gemm", "eager", "inductor", "inductor-max-autotune", "sdpa", "comfuse", "comfuse-backend")


def _shapes_text(meta: dict) -> str:
    if meta.get("shapes"):
        return ", ".join("x".join(map(str, s)) for s in meta["shapes"])
    if meta.get("quick"):
        return "one shape per workload (--quick)"
    if meta.get("suite") == "paper" and meta.get("sweep") is False:
        return "each workload at its own shapes (--shapes suite)"
    return "the suite's own"


def index_section(name: str, results: dict) -> list:
    """One folder's lines in the index: its run, then per case every candidate's median and
    comfuse's speedup over the best of eager / torch.compile / max-autotune measured."""
    meta, cases = results["meta"], results["cases"]
    cols = [c for c in meta.get("candidates", []) if any(c in case["candidates"] for case in cases)]
    cols.sort(key=lambda c: INDEX_ORDER.index(c) if c in INDEX_ORDER else len(INDEX_ORDER))
    gpu = f"{meta.get('gpu')} ({meta.get('sm_count', '?')} SMs, driver {meta.get('driver', '?')})"
    lines = [f"## [`{name}/`]({name}/results.md)", "",
             f"- suite: {meta.get('suite')}; date: {meta.get('date')}; GPU: {gpu}",
             f"- torch {meta.get('torch')}, triton {meta.get('triton')}, CUDA {meta.get('cuda')}, "
             f"dtype {meta.get('dtype')}; shapes: {_shapes_text(meta)}; "
             + (f"{meta['repeat']} interleaved rounds" if (meta.get("repeat") or 1) > 1 else "one round")
             + ("; CUDA-graph replays" if meta.get("graph") else "; Python calls")]
    if meta.get("note"):
        lines.append(f"- run: {meta['note']}")
    # (the ceiling, best baseline / GEMM alone, bounds a fused GEMM + epilogue or GEMM chain)
    ceiling = meta.get("suite") in ("paper", "b2b") and any(derive(c)["ceiling_vs_best"] for c in cases)
    lines += ["", "| workload | shape | " + " | ".join(LABELS.get(c, c) for c in cols) + " | speedup |"
              + (" ceiling |" if ceiling else ""),
              "|" + "---|" * (len(cols) + 3 + ceiling)]
    speedups = []
    for case in cases:
        d = derive(case)
        # over the fastest of the baselines measured: the smallest of the per-baseline speedups
        over = [s for n, s in d["speedups"].items() if n in INDEX_BASELINES]
        speedups.append(min(over) if over else None)
        row = [case["workload"], "x".join(map(str, case["shape"]))]
        row += [f"{_ms(case['candidates'].get(c)):.4f}" if _ms(case["candidates"].get(c))
                else _fmt(case["candidates"].get(c)) for c in cols]
        row.append(f"{speedups[-1]:.2f}x" if speedups[-1] else "-")
        if ceiling:
            row.append(f"{d['ceiling_vs_best']:.2f}x" if d["ceiling_vs_best"] else "-")
        lines.append("| " + " | ".join(row) + " |")
    g = geomean(speedups)
    if g and len(cases) > 1:
        lines += ["", f"Geometric mean of the speedups: {g:.2f}x"]
    if ceiling and len(cases) > 1:
        g = geomean(derive(c)["ceiling_vs_best"] for c in cases)
        lines += ["", f"Geometric mean of the ceilings: {g:.2f}x"]
    return lines


def models_index_section(name: str, results: dict) -> list:
    """A ``comfuse bench --suite models`` folder's lines in the index: per model and form the
    forward with its loss, the training step (median ms), the step's peak and the cold first
    step, or why the row has none."""
    meta = results["meta"]
    lines = [f"## [`{name}/`]({name}/results.md)", "",
             f"- suite: models; date: {meta.get('date')}; GPU: {meta.get('gpu')} (driver {meta.get('driver', '?')})",
             f"- torch {meta.get('torch')}, triton {meta.get('triton')}, CUDA {meta.get('cuda')}; "
             f"{meta.get('rounds')} rounds of back-to-back calls, host time included", "",
             "| model | form | forward ms | step ms | step peak GiB | first step s |", "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        what = f"{r['model']} ({r['layers']} layer{'' if r['layers'] == 1 else 's'}) | {r['form']}"
        if "error" in r or "skipped" in r:
            lines.append(f"| {what} | {'error' if 'error' in r else 'n/a'}: {r.get('error') or r.get('skipped')} | | | |")
            continue
        lines.append(f"| {what} | {r['forward_ms'][0]:.3f} | {r['step_ms'][0]:.3f} | {r.get('step_peak_gib')} "
                     f"| {r.get('first_step_s')} |")
    return lines


def write_index(results_dir: str | Path) -> Path:
    """``results_dir``/README.md: one section per ``*/results.json`` under it (or
    ``*/*/results.json``: a folder of several runs), newest first."""
    root = Path(results_dir)
    found = [*root.glob("*/results.json"), *root.glob("*/*/results.json")]
    runs = [(p.parent.relative_to(root).as_posix(), json.loads(p.read_text())) for p in found]
    runs.sort(key=lambda r: (r[1]["meta"].get("date", ""), r[0]), reverse=True)
    lines = ["# Benchmark results", "",
             "One folder per run (or a folder of runs), `<date>-<gpu>-<suite>[-what]/`, newest first, each as `comfuse bench` "
             "writes it: `results.json` (every candidate's times, errors against float64, the machine), "
             "`results.md` (the tables), figures and comfuse's tuning decisions (`tuning/`) where kept. "
             "Older runs are in git history. `docs/results.md` summarises them. This page is written by "
             "`python -m comfuse.bench.report bench/results`.", "",
             "Times are medians in ms. Speedup: comfuse's over the fastest of eager, torch.compile and "
             "max-autotune measured; ceiling: the best baseline over cuBLAS's GEMM alone (the speedup of a "
             "fused kernel exactly as fast as the GEMM).", ""]
    for name, results in runs:
        section = models_index_section if "rows" in results else index_section  # (older "models": blocks)
        lines += section(name, results) + [""]
    path = root / "README.md"
    path.write_text("\n".join(lines))
    return path


if __name__ == "__main__":
    import sys

    print(write_index(sys.argv[1] if len(sys.argv) > 1 else "bench/results"))
