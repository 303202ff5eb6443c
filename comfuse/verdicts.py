"""What the backend kept for a graph, remembered on disk for later processes.

A graph's first call decides which compilation runs it (graph_check.py): Inductor's with
comfuse's pass and fused regions in it (``FUSED``), the same where no region stayed fused
(``UNFUSED``: Inductor's code, reached through the pass), or Inductor's own compilation
without the pass (``INDUCTOR``, where the fused graph lost the whole-graph check). Reaching
that verdict costs the pass's lowering and, on a GPU, autotuning and a timed comparison.
The verdict is written to ``COMFUSE_CACHE_DIR/verdicts/<key>.json``; a later process that
meets the same graph (its code, its inputs' shapes, strides, dtypes and devices, grad mode,
the settings, Inductor's mode, the GPU and the versions) builds that one compilation and
checks nothing, so Inductor's own disk caches (its FX graph and AOTAutograd caches) answer
for it as they do for Inductor alone.
"""
from __future__ import annotations

import json
import logging

import torch
import torch.fx as fx
import triton

from . import settings as settings_mod
from .runtime import cache

log = logging.getLogger("comfuse.backend")

FUSED = "fused"
UNFUSED = "unfused"
INDUCTOR = "inductor"
KINDS = (FUSED, UNFUSED, INDUCTOR)


def _tensor_text(value) -> str:
    if not isinstance(value, torch.Tensor):
        return repr(value)
    device = value.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{tuple(value.shape)}/{value.stride()}/{value.dtype}/{where}/{value.requires_grad}"


def key(gm: fx.GraphModule, example_inputs, settings_text: str, options_text: str) -> str | None:
    """The verdict's key for Dynamo's graph ``gm`` on ``example_inputs`` (static sizes), or
    None where the graph cannot be named (its code does not print)."""
    try:
        code = gm.code
    except Exception:  # (a graph module without generated code)
        return None
    inputs = ";".join(_tensor_text(v) for v in example_inputs)
    return cache.digest("verdict", code, inputs, str(torch.is_grad_enabled()), settings_text, options_text,
                        torch.__version__, triton.__version__, cache.CODEGEN_VERSION)


def _path(k: str):
    return settings_mod.get().cache_dir / "verdicts" / f"{k}.json"


def load(k: str | None) -> dict | None:
    """The stored verdict ({"kept": one of KINDS, ...}) or None (none stored, or a damaged
    entry, which is decided again)."""
    if k is None:
        return None
    try:
        record = json.loads(_path(k).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("kept") in KINDS else None


def store(k: str | None, kept: str, **details) -> None:
    """Write the verdict ``kept`` (one of KINDS) for key ``k``; a failure to write costs only
    the next process's time, and is logged."""
    if k is None:
        return
    try:
        cache.atomic_write(_path(k), json.dumps({"kept": kept, **details}, indent=1))
    except OSError as e:
        log.info("backend: the graph's verdict was not stored (%s)", e)
