"""The search space: the plans autotuning times for a region, read from tables.

The planner's own plan comes first, then each feasible Triton schedule's plan and its tile
shapes (``TILE_SHAPES``), each of those with a TMA mainloop where the operands allow, the
TMA tile plans on a persistent grid, the plans with a whole-tile side input loaded before
the mainloop (``prefetch``), and on a GPU the Gluon plans: the template where it matches,
and the generated kernel in each of its forms (``STAGES_FORMS``). With ``COMFUSE_PLAN`` set
(a developer's forced form) the planner's plan is the only candidate.
"""
from __future__ import annotations

import dataclasses

from .. import settings as settings_mod
from ..ir import Region
from .gluon import GLUON_SCHEDULES, lse_template_plan, stages_template_plan, strip_template_plan, tma_residual
from .schedules import SCHEDULES, cdiv, plan, split_form, tma_blocker, triton_plan, why_not_schedule
from .records import NotFused, Plan

# tile shapes timed beside the planner's own, (BLOCK_M, BLOCK_N, BLOCK_K, warps) with 3 pipeline
# stages; split: smaller tiles too, since its statistics' tile values spill at 128x256
TILE_SHAPES = {
    "tile": ((128, 256, 64, 8), (64, 128, 64, 4), (128, 64, 64, 4)),
    # 128x128 with 3 stages (98 KB): two programs an SM, one's epilogue beside the other's mainloop
    "cooperative": ((64, 128, 64, 4), (128, 256, 64, 8), (128, 128, 64, 8)),
    "row_in_cta": (),
    "split": ((128, 256, 64, 8), (128, 128, 64, 4), (64, 128, 64, 4), (128, 64, 64, 4)),
}
# the generated Gluon kernel's forms, each a change of the planner's form (8 lanes a row, passes
# unrolled, the epilogue partition on every row); "residual": only where the mainloop can add a
# residual into the tile and the exchanges merge; "ahead": lookahead where an [M, N] input exists
STAGES_FORMS = (
    ({}, ""),
    ({"lanes": 32}, ""),
    ({"tail": 96}, ""),
    ({"tail": 96, "res_tma": True, "keep": False}, "residual"),
    ({"roll": True}, ""),
    ({"tail": 96, "roll": True}, ""),
    ({"tail": 96, "res_tma": True, "keep": False, "roll": True}, "residual"),
    ({"tail": 128, "roll": True, "last_in_ring": True, "lookahead": "ahead"}, ""),
)


def _has_full_input(region: Region) -> bool:
    return any({"M", "N"} <= set(i.axes) for i in region.inputs)


def _prefetchable(p: Plan) -> bool:
    return p.schedule in ("cooperative", "row_in_cta", "tile") and p.block_m * p.block_n <= 128 * 128 \
        and not getattr(p.form, "persistent", False)


def _shapes(base: Plan, target: str, sm_count: int) -> list:
    """``base`` in each of its schedule's other tile shapes (TILE_SHAPES)."""
    out = []
    for bm, bn, bk, warps in TILE_SHAPES[base.schedule]:
        if base.region.dual and bm * bn > 128 * 128:  # (two accumulators a program)
            continue
        changes = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=3)
        if base.schedule == "cooperative":
            tiles = cdiv(base.region.sizes.N, bn)
            if tiles > sm_count:
                continue
            changes["tiles_n"] = tiles
        elif base.schedule == "split":
            shape = split_form(base.region, target, sm_count, bm, bn)
            changes["tiles_n"] = cdiv(base.region.sizes.N, bn)
            changes["form"] = dataclasses.replace(base.form, chunks=shape.chunks, tiles_per_chunk=shape.tiles_per_chunk)
        out.append(dataclasses.replace(base, **changes))
    return out


def _with_form(p: Plan, **fields) -> Plan:
    return dataclasses.replace(p, form=dataclasses.replace(p.form, **fields))


def stages_forms(gen: Plan) -> list:
    """The generated kernel's plan in each of its forms that applies (STAGES_FORMS)."""
    residual = tma_residual(gen.region) is not None and bool(gen.form.moments)
    ahead = _has_full_input(gen.region)
    out = []
    for fields, needs in STAGES_FORMS:
        if needs == "residual" and not residual:
            continue
        fields = {k: (ahead if v == "ahead" else v) for k, v in fields.items()}
        out.append(_with_form(gen, **fields))
    return out


def gluon_candidates(first: Plan, target: str, sm_count: int) -> list:
    """The Gluon plans for ``first``'s region: the template (with its residual TMA-loaded or
    not), the generated kernel's forms, and for a loss over wide rows the template's terminal
    kind."""
    args = (first.region, first.transposed, first.stages, first.ir_forms, target)
    out = []
    ws = strip_template_plan(*args, sm_count)
    if isinstance(ws, Plan):
        out.append(ws)
        if ws.form.template.residual is not None:
            out.append(_with_form(ws, residual_tma=True))
    gen = stages_template_plan(*args, sm_count)
    if isinstance(gen, Plan):
        out += stages_forms(gen)
    if first.schedule == "split":
        lse = lse_template_plan(*args)
        if isinstance(lse, Plan):
            out.append(lse)
    return out


def candidates(region: Region, target: str = "cuda", settings=None, sm_count: int = 132) -> list:
    """The plans worth timing for ``region``: the planner's choice first, then the rest of the
    search space (module docstring). Empty when nothing fits (``plan`` says why)."""
    settings = settings or settings_mod.get()
    first = plan(region, target, settings, sm_count)
    if isinstance(first, NotFused):
        return []
    if settings.plan:
        return [first]
    if first.schedule in GLUON_SCHEDULES:  # forced: its forms
        return stages_forms(first) if first.schedule == "ws_stages" else [first]
    out = [first]
    for schedule in [settings.schedule] if settings.schedule else SCHEDULES:
        if why_not_schedule(schedule, first.region, target, sm_count):
            continue
        base = first if schedule == first.schedule else \
            triton_plan(schedule, first.region, first.transposed, first.stages, first.ir_forms, target, sm_count)
        if base is not first:
            out.append(base)
        if target != "interpreter":
            out += [v for v in _shapes(base, target, sm_count) if v not in out]
    if target == "interpreter":
        return out
    if not tma_blocker(first.region):
        out += [dataclasses.replace(p, mainloop="tma", num_stages=max(p.num_stages, 3))
                for p in list(out) if p.schedule != "row_in_cta"]
    # the TMA tile plans on a persistent grid: the next tile's loads in flight during this
    # tile's epilogue
    out += [_with_form(p, persistent=True) for p in list(out) if p.schedule == "tile" and p.mainloop == "tma"]
    if _has_full_input(first.region):
        # a residual read after the mainloop waits on DRAM with the SM otherwise idle
        out += [_with_form(p, prefetch=True) for p in list(out) if _prefetchable(p)]
    if target == "cuda" and not settings.schedule:
        out += gluon_candidates(first, target, sm_count)
    return out
