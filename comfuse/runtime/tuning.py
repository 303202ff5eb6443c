"""Autotuning: time the candidate plans of a region against its unfused ops, keep the fastest.

On the first call of a region on a GPU every candidate plan is built, run once and
checked against the unfused ops' result (a plan that disagrees or fails scores inf),
then timed; the unfused ops are timed too. The fastest wins: a fused region is never
kept when running its ops separately is faster. Decisions are written to
``COMFUSE_CACHE_DIR/tuning/<key>.json``, the key hashing the region's structure, its
sizes, the GPU, and the torch, triton and code generator versions.
"""
from __future__ import annotations

import json
import math

import torch
import triton

from .. import settings as settings_mod
from ..bench.timing import measure
from ..ir import structural_text
from . import cache
from .check import compare, tolerance

UNFUSED = "unfused"


def enabled(device: torch.device) -> bool:
    mode = settings_mod.get().autotune.strip().lower()
    if mode in ("0", "off", "false", "no"):
        return False
    if mode in ("1", "on", "true", "yes"):
        return True
    return device.type == "cuda"  # "auto": timing through the interpreter means nothing


def key(region, device: torch.device) -> str:
    from .kernel import CODEGEN_VERSION
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-interpreter"
    s = region.sizes
    return cache.digest(structural_text(region), f"{s.B},{s.M},{s.N},{s.K}", gpu, torch.__version__,
                        triton.__version__, CODEGEN_VERSION)


def _path(k: str):
    return settings_mod.get().cache_dir / "tuning" / f"{k}.json"


def load(k: str) -> dict | None:
    path = _path(k)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a damaged entry is re-measured, never trusted


def store(k: str, decision: dict) -> None:
    cache.atomic_write(_path(k), json.dumps(decision, indent=1))


def _agree(outs, refs) -> bool:
    for o, r in zip(outs, refs):
        if not compare(o, r, tolerance(o.dtype), floor=1.0).ok:
            return False
    return True


def decide(names: list, run_fused, run_unfused, device: torch.device) -> dict:
    """Time ``run_unfused()`` and ``run_fused(i)`` for each candidate; return the decision:
    {"choice": name or "unfused", "times_ms": {name: median or inf}}."""
    reference = run_unfused()
    times = {UNFUSED: measure(run_unfused, device.type, warmup_ms=5, rep_ms=25).median_ms}
    for i, name in enumerate(names):
        try:
            if not _agree(run_fused(i), reference):
                times[name] = math.inf
                continue
            times[name] = measure(lambda: run_fused(i), device.type, warmup_ms=5, rep_ms=25).median_ms
        except Exception:
            times[name] = math.inf
    choice = min(times, key=times.get)
    return {"choice": choice, "times_ms": times}
