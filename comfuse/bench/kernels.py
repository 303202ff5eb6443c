"""What a compiled model ran: the torch profiler's GPU time of each kernel a call launches and
the host time of each launch, written as a table per call; the regions comfuse's pass fused in
each graph, and what the whole-graph checks kept.

Used by the models suite (``comfuse bench --suite models --profile``) and by
``scripts/models_check.py``: two forms of one model (Inductor's and comfuse's) profiled alike,
so a difference in their times can be read off kernel by kernel."""
from __future__ import annotations

import statistics
from pathlib import Path

from ..runtime.timing import kernel_times, profiled


def launch_kind(name: str) -> str:
    """What a profiler record of ``name`` launches ("" for anything else)."""
    if name == "comfuse::region":
        return "comfuse::region op"
    if name.startswith("comfuse_"):
        return "comfuse kernel, Inductor's launch"
    if name.startswith("triton_"):
        return "Inductor kernel launch"
    return ""


def host_us(call, calls: int = 5) -> dict:
    """kind -> [launches per call, median host us per launch]: the profiler's CPU records of
    kernel launches (Inductor records each Triton launch under the kernel's name)."""
    prof = profiled(call, "CPU", calls)
    durations: dict = {}
    for e in prof.events():
        kind = launch_kind(e.name)
        if kind:
            durations.setdefault(kind, []).append(e.cpu_time_total)
    return {k: [len(v) // calls, round(statistics.median(v), 1)] for k, v in sorted(durations.items())}


def regions_by_graph() -> list:
    """Per graph Inductor lowered in this process (the last 16): fused/found regions, why the
    others stayed unfused (reason -> their anchors), who launches them, their schedules, and
    the sum of the fused regions' autotuned ms minus their unfused ops' ms (what they should
    save inside the model)."""
    from .. import inductor_pass
    rows = []
    for r in inductor_pass.REPORTS:
        if not r.regions:
            continue
        fused = [x for x in r.regions if x.fused]
        tuned = [x.tuned_ms for x in fused if x.tuned_ms]
        why: dict = {}  # (why regions stayed unfused: reason -> anchors, for the results' JSON)
        for x in r.regions:
            if not x.fused:
                why.setdefault((x.reason or "")[:160], []).append(x.anchor)
        rows.append({"graph": r.function, "fused": len(fused), "found": len(r.regions), "not_fused": why,
                     "by_inductor": sum(x.launch.startswith("Inductor") for x in fused),
                     "schedules": sorted({x.schedule for x in fused}),
                     "saved_alone_ms": round(sum(u - f for f, u in tuned), 4) if tuned else None})
    return rows


def graph_checks() -> list:
    """The whole-graph checks made in this process (the last 16): each graph's fused and
    Inductor's times and which was kept."""
    from .. import graph_check
    return [dict(c) for c in graph_check.GRAPH_CHECKS]


def profile_lines(rows: list) -> list:
    """A table of the rows' profiles (``profile``'s, per call of a models-suite row): GPU ms a
    call of the forward, the step and the loss-only step, and the step's launches by kind."""
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return []
    lines = ["", "GPU time a call by the profiler (kernel tables in profiles/), and the host time of a launch:", "",
             "| model | form | forward GPU ms | step GPU ms | loss-only step GPU ms | step's launches: per call, us each |",
             "|---|---|---|---|---|---|"]
    for r in profiled:
        p = r["profile"]
        host = "; ".join(f"{k} {n} x {us}" for k, (n, us) in p["step"].get("host_us", {}).items()) or "-"
        lines.append(f"| {r['model']} | {r['form']} | {p['forward']['gpu_ms']:.3f} | {p['step']['gpu_ms']:.3f} | "
                     f"{p['loss_step']['gpu_ms']:.3f} | {host} |")
    return lines


def fused_lines(rows: list) -> list:
    """Lines saying, per comfuse row, what each graph fused and what its whole-graph check kept."""
    lines = []
    for r in rows:
        if not (r.get("regions") or r.get("graph_checks")):
            continue
        lines += ["", f"{r['model']}, {r['form']}: regions fused of those found, per graph Inductor lowered "
                      "(schedules); the whole-graph checks (ms, fused against Inductor's):"]
        lines += [f"- {g['graph']}: {g['fused']} of {g['found']}" + (f" ({', '.join(g['schedules'])})"
                                                                     if g["schedules"] else "") for g in r.get("regions", [])]
        for c in r.get("graph_checks", []):
            times = "; ".join(f"{what} {c[f'fused{w}_ms']:.3f} vs {c[f'inductor{w}_ms']:.3f}"
                              for w, what in (("", "forward"), ("_step", "step")) if f"fused{w}_ms" in c)
            lines.append(f"- check ({'training' if c.get('training') else 'inference'}, {c.get('regions')} "
                         f"region(s)): {times or 'not timed'}; kept {c.get('kept')}")
    return lines


def file_name(tag: str) -> str:
    """``tag`` as a file name of letters, digits, '-', '.' and '_' only."""
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in tag.replace("@", "-mode-"))


def profile(tag: str, call, out_dir: Path | str) -> dict:
    """Profiles ``call``: its kernels' table (GPU ms per call, launches, name; slowest first) to
    ``out_dir``/profiles/<tag>.md; returns its GPU ms per call, kernels launched per call and
    the host time of its launches by kind."""
    gpu_ms, rows = kernel_times(call)
    lines = [f"# {tag}: {gpu_ms:.3f} ms of GPU time a call", "", "| ms | launches | kernel |", "|---|---|---|"]
    lines += [f"| {ms:.4f} | {n} | {name[:120]} |" for ms, n, name in rows]
    folder = Path(out_dir) / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{file_name(tag)}.md").write_text("\n".join(lines) + "\n")
    return {"gpu_ms": round(gpu_ms, 4), "kernels": sum(n for _, n, _ in rows), "host_us": host_us(call)}
