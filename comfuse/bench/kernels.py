"""A compiled model's calls kernel by kernel: the torch profiler's GPU time of each kernel a
call launches, and the host time of each launch, written as a table per call.

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
