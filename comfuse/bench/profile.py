"""``comfuse profile``: DRAM traffic of a fused kernel and of its unfused pipeline, from
Nsight Compute's hardware counters, against the minimum (each input read once, each
output written once).

The profiled process (``python -m comfuse.bench.profile --target ...``) builds and warms
up the program first, then runs it once inside an NVTX range; ``ncu --nvtx
--nvtx-include comfuse_profile/`` profiles only the kernels launched in that range.
Clocks are left as they are (``--clock-control none``).
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
RANGE = "comfuse_profile"


def find_ncu() -> str | None:
    exe = shutil.which("ncu")
    if exe:
        return exe
    found = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu") + glob.glob("/usr/local/cuda*/bin/ncu"))
    return found[-1] if found else None


def parse_csv(text: str) -> list[dict]:
    """Rows of ``ncu --csv --print-units base``: one per (kernel, metric)."""
    start = text.find('"ID"')
    if start < 0:
        return []
    rows = []
    for rec in csv.DictReader(io.StringIO(text[start:])):
        try:
            value = float(str(rec.get("Metric Value", "")).replace(",", ""))
        except ValueError:
            continue
        rows.append({"id": rec.get("ID"), "kernel": rec.get("Kernel Name", ""),
                     "metric": rec.get("Metric Name"), "value": value})
    return rows


def summarize(rows: list[dict]) -> dict:
    kernels: dict = {}
    for r in rows:
        k = kernels.setdefault(r["id"], {"kernel": r["kernel"]})
        k[r["metric"]] = r["value"]
    read = sum(k.get("dram__bytes_read.sum", 0) for k in kernels.values())
    write = sum(k.get("dram__bytes_write.sum", 0) for k in kernels.values())
    time_ns = sum(k.get("gpu__time_duration.sum", 0) for k in kernels.values())
    return {"kernels": [k["kernel"][:80] for k in kernels.values()], "read_bytes": read,
            "write_bytes": write, "time_us": time_ns / 1e3}


def _target(workload: str, shape: str, variant: str, dtype: str) -> None:
    """Run inside ncu: warm up, then one run inside the NVTX range."""
    import warnings

    import torch

    import comfuse
    from . import workloads
    from .runner import DTYPES
    case = ("paper", workload, tuple(int(s) for s in shape.split(","))) if workload in workloads.SUITE \
        else (("b2b" if workload in workloads.B2B else "attention"), workload, None)
    prog = workloads.build(case, DTYPES[dtype], "cuda")
    if variant == "fused":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = comfuse.compile(prog.fn, prog.args)
        run = lambda: compiled(*prog.args)  # noqa: E731
        info = {"fused": [r.fused for r in compiled.report.regions]}
    else:
        run = lambda: prog.fn(*prog.args)  # noqa: E731
        info = {}
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(RANGE)
    run()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    info.update(min_bytes=prog.min_bytes, shape=list(prog.shape), workload=workload)
    print("COMFUSE_PROFILE_INFO " + json.dumps(info))


def profile(workload: str, shape: str, dtype: str = "bf16", out_dir: str | None = None,
            progress=print) -> dict:
    ncu = find_ncu()
    if ncu is None:
        raise SystemExit("comfuse profile: Nsight Compute (ncu) was not found on PATH or under "
                         "/opt/nvidia/nsight-compute; it is on the GPU machine (see docs/gpu.md)")
    result = {"workload": workload, "shape": shape, "dtype": dtype, "ncu": ncu, "variants": {}}
    for variant in ("fused", "unfused"):
        cmd = [ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", f"{RANGE}/",
               "--metrics", ",".join(METRICS), "--csv", "--print-units", "base",
               sys.executable, "-m", "comfuse.bench.profile", "--target", workload, shape, variant, dtype]
        progress(f"profiling {workload} {shape} {variant} with ncu ...")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        text = proc.stdout + proc.stderr
        if proc.returncode != 0 or "ERR_NVGPUCTRPERM" in text or "Failed to initialize" in text:
            tail = "\n".join(text.strip().splitlines()[-8:])
            raise SystemExit(f"comfuse profile: ncu could not read the counters (exit "
                             f"{proc.returncode}):\n{tail}")
        info_line = next((ln for ln in text.splitlines() if ln.startswith("COMFUSE_PROFILE_INFO ")), None)
        info = json.loads(info_line.split(" ", 1)[1]) if info_line else {}
        summary = summarize(parse_csv(proc.stdout))
        summary.update(info)
        result["variants"][variant] = summary
        result["min_bytes"] = info.get("min_bytes")
        if info.get("shape"):  # the program's own (a chain's or attention's is not --shape)
            result["shape"] = "x".join(str(s) for s in info["shape"])
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile-{workload}.json").write_text(json.dumps(result, indent=1))
        (out / f"profile-{workload}.md").write_text(profile_markdown(result))
    return result


def profile_markdown(result: dict) -> str:
    mb = 1e6
    lines = [f"### DRAM traffic: {result['workload']} {result['shape']} ({result['dtype']})", "",
             "| variant | kernels | read MB | written MB | total MB | minimum MB | total / minimum | kernel time us |",
             "|---|---|---|---|---|---|---|---|"]
    minimum = result.get("min_bytes") or 0
    for name, v in result["variants"].items():
        total = v["read_bytes"] + v["write_bytes"]
        lines.append(f"| {name} | {len(v['kernels'])} | {v['read_bytes'] / mb:.1f} | "
                     f"{v['write_bytes'] / mb:.1f} | {total / mb:.1f} | {minimum / mb:.1f} | "
                     f"{total / minimum if minimum else float('nan'):.2f} | {v['time_us']:.1f} |")
    lines.append("")
    for name, v in result["variants"].items():
        lines.append(f"- {name} kernels: " + "; ".join(v["kernels"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", nargs=4, metavar=("WORKLOAD", "SHAPE", "VARIANT", "DTYPE"))
    ns = parser.parse_args()
    if ns.target:
        _target(*ns.target)
