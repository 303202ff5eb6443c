"""The planning pipeline: from a found region to a schedule, or the reason there is none."""
from __future__ import annotations

import dataclasses

from .. import settings as settings_mod
from ..ir import Op, Region, verify
from . import passes
from .stages import Stage, partition

SCHEDULES = ("tile", "row_in_cta")


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    region: Region  # the region in row form (reductions along N only)
    transposed: bool  # the source region reduced along M; operands and views are swapped
    schedule: str  # "tile": independent output tiles; "row_in_cta": a program owns whole rows
    stages: tuple[Stage, ...]
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    forms: tuple  # (pass name, region) for every intermediate form, for explain

    def describe(self) -> str:
        strip = "column strip (reductions along M, run transposed)" if self.transposed else \
            ("row strip (reductions along N)" if self.region.reductions() else "no reductions")
        return (f"{self.schedule}: {strip}; {len(self.stages)} stage(s); "
                f"tile {self.block_m}x{self.block_n}x{self.block_k}, "
                f"{self.num_warps} warps, {self.num_stages} pipeline stages")


@dataclasses.dataclass(frozen=True, slots=True)
class NotFused:
    reason: str
    forms: tuple = ()


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def reduction_axis(region: Region) -> tuple[str | None, str]:
    """('N' | 'M' | None, reason when reductions run along both axes)."""
    by_axis: dict[str, list[int]] = {}
    for i in region.reductions():
        by_axis.setdefault(region.nodes[i].arg, []).append(i)
    if len(by_axis) > 1:
        m, n = by_axis["M"][0], by_axis["N"][0]
        return None, (f"reductions along both M (%{m} {region.nodes[m].op.value}) and N "
                      f"(%{n} {region.nodes[n].op.value}): no strip of tiles holds both")
    return (next(iter(by_axis)) if by_axis else None), ""


def _blocks(region: Region, schedule: str, target: str, row_budget: int):
    s = region.sizes
    elem = 4 if region.gemm.a.dtype.itemsize == 4 else 2
    if target == "interpreter":  # smallest tiles that cover the problem: the interpreter pays per element
        bm = min(64, max(16, _pow2(s.M)))
        bn = max(16, _pow2(s.N)) if schedule == "row_in_cta" else min(64, max(16, _pow2(s.N)))
        bk = min(64, max(16, _pow2(s.K)))
        return bm, bn, bk, 4, 1
    if schedule == "row_in_cta":
        bn = max(16, _pow2(s.N))
        bm = max(16, min(128, row_budget // bn, _pow2(s.M)))
    else:
        bn = min(128, max(16, _pow2(s.N)))
        bm = min(128, max(16, _pow2(s.M)))
    bk = 64
    while bk > 16 and (bm * bk + bk * bn) * elem > 96 * 1024:
        bk //= 2
    per_stage = (bm * bk + bk * bn) * elem
    num_stages = max(1, min(4, (200 * 1024) // per_stage))
    num_warps = 8 if bm * bn >= 128 * 128 else 4
    return bm, bn, bk, num_warps, num_stages


def plan(region: Region, target: str = "cuda", settings=None) -> Plan | NotFused:
    """Run the passes in order; choose a schedule for ``target`` ("cuda" or "interpreter")."""
    settings = settings or settings_mod.get()
    forms = [("found", verify(region))]
    region = verify(passes.dce(region))           # drop what no output needs
    region = verify(passes.cse(region))           # merge identical nodes
    forms.append(("simplified", region))
    if len(region.nodes) == 1 and all(region.nodes[o.node].op is Op.ACC for o in region.outputs):
        return NotFused("no epilogue to fuse: a plain GEMM runs on cuBLAS", tuple(forms))
    axis, why = reduction_axis(region)             # which strip of tiles each reduction needs
    if why:
        return NotFused(why, tuple(forms))
    transposed = axis == "M"
    if transposed:
        region = verify(passes.transpose(region))  # column strip -> row strip over C^T
        forms.append(("transposed", region))
    stages = partition(region)                     # reductions are stage boundaries
    if region.reductions():
        schedule = "row_in_cta"
        width = max(16, _pow2(region.sizes.N))
        if width * 16 > settings.row_budget:
            return NotFused(
                f"a row of N={region.sizes.N} (padded to {width}) is wider than one program holds "
                f"(row-in-CTA budget {settings.row_budget} accumulator elements, at least 16 rows); "
                "cross-CTA schedules are not built yet", tuple(forms))
    else:
        schedule = "tile"
    forced = settings.schedule
    if forced and forced != schedule:
        if forced not in SCHEDULES:
            return NotFused(f"COMFUSE_SCHEDULE={forced!r} is not a schedule ({', '.join(SCHEDULES)})",
                            tuple(forms))
        if forced == "tile" and region.reductions():
            return NotFused("forced schedule 'tile' cannot finish a reduction: tiles are independent",
                            tuple(forms))
        schedule = forced  # row_in_cta also runs elementwise regions (one program per row strip)
        if schedule == "row_in_cta" and max(16, _pow2(region.sizes.N)) * 16 > settings.row_budget:
            return NotFused(f"forced schedule 'row_in_cta': a row of N={region.sizes.N} is wider "
                            "than one program holds", tuple(forms))
    bm, bn, bk, warps, pipe = _blocks(region, schedule, target, settings.row_budget)
    return Plan(region, transposed, schedule, stages, bm, bn, bk, 8, warps, pipe, tuple(forms))
