"""The cost model (planner/cost.py) applied on a GPU: whether a region is tuned at all, which
of its candidates are, and this GPU's record of what autotuning measured, by class of plan
(``COMFUSE_CACHE_DIR/measured/record.json``: GPU -> class -> {decision key: the class's best
time over the unfused ops'}), which later regions and processes predict from."""
from __future__ import annotations

import json
import math

import torch

from .. import settings as settings_mod
from ..planner import cost
from ..planner.gluon import GLUON_SCHEDULES
from . import cache, tuning

RECORDED_GPUS = ((9, 0),)  # compute capabilities the shipped record was measured on (the H200)


def _predicts(region, device: torch.device) -> bool:
    """Whether the cost model may narrow ``region``'s candidates on ``device``: a GPU its
    record was measured on, no schedule or plan forced, and not a region kept fused for
    memory (its fastest plan runs whatever the ops' time)."""
    settings = settings_mod.get()
    return (device.type == "cuda" and not settings.plan and not settings.schedule
            and not tuning.saves_memory(region) and torch.cuda.get_device_capability(device) in RECORDED_GPUS)


def _path():
    return settings_mod.get().cache_dir / "measured" / "record.json"


def _load() -> dict:
    try:
        record = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}  # (none yet, or damaged: predictions fall back on the shipped record)
    return record if isinstance(record, dict) else {}


def measured(device: torch.device) -> dict:
    """This GPU's record: class -> {decision key: best time over the ops'}."""
    mine = _load().get(torch.cuda.get_device_name(device), {})
    return mine if isinstance(mine, dict) else {}


def predicted_loss(plans: list, region, device: torch.device) -> str:
    """'' unless the cost model predicts that none of ``plans`` can beat ``region``'s ops on
    ``device``: then the reason, and the region is not tuned."""
    return cost.why_not_tuned(plans, measured(device)) if _predicts(region, device) else ""


def shortlisted(plans: list, region, device: torch.device) -> list:
    """``plans`` narrowed on ``device``: none of a class predicted to lose (``cost.may_win``:
    the Triton split plans of an LM head that returns its logits, beside the template that may
    win), then the Triton plans of the best-estimated tile shapes (cost.SHORTLIST) and every
    Gluon plan (whose forms its roofline cannot tell apart); all of them where the cost model
    does not predict."""
    if not _predicts(region, device):
        return list(plans)
    mine = measured(device)
    hopeful = [p for p in plans if cost.may_win([p], mine)]
    kept = cost.shortlist([p for p in hopeful if p.schedule not in GLUON_SCHEDULES])
    return [p for p in hopeful if p.schedule in GLUON_SCHEDULES or any(p is k for k in kept)]


def remember(plans: list, names: list, decision: dict, key: str, device: torch.device) -> None:
    """Add what ``decision`` (autotuning's, under ``key``) measured to this GPU's record: per
    class of its plans, the best time over the unfused ops' (plans that failed left out)."""
    times = decision.get("times_ms", {})
    unfused = times.get(tuning.UNFUSED, math.inf)
    if device.type != "cuda" or not math.isfinite(unfused) or unfused <= 0:
        return
    best = {}
    for plan, name in zip(plans, names):
        t = times.get(name, math.inf)
        if math.isfinite(t):
            c = cost.plan_class(plan)
            best[c] = min(best.get(c, math.inf), t / unfused)
    if not best:
        return
    record = _load()
    mine = record.setdefault(torch.cuda.get_device_name(device), {})
    new = {c: round(ratio, 4) for c, ratio in best.items()}
    if all(mine.get(c, {}).get(key) == ratio for c, ratio in new.items()):
        return  # (a decision read again from disk: recorded already)
    for c, ratio in new.items():
        mine.setdefault(c, {})[key] = ratio
    cache.atomic_write(_path(), json.dumps(record, indent=1, sort_keys=True))
