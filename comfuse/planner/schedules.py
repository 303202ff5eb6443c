"""The planning pipeline: from a found region to a plan, or the reason there is none.

``plan`` runs the region passes in order (each output verified), finds the reductions'
axis, partitions the stages and chooses a schedule and its tile for the target. Schedules:

- ``tile``: independent output tiles (no reduction);
- ``row_in_cta``: a program owns whole rows (rows up to ``ROW_BUDGET / 16`` wide);
- ``cooperative``: the programs of a row strip exchange per-tile partials;
- ``split``: per-row outputs only (losses over wide rows): slices of N reduce to mergeable
  statistics, then a combine kernel;
- ``ws_strip``, ``ws_split``, ``ws_stages``: the warp-specialised Gluon kernels
  (``planner.gluon``), offered by autotuning on sm_90 GPUs or forced.
"""
from __future__ import annotations

import dataclasses

from .. import settings as settings_mod
from ..ir import Op, Region, verify
from . import passes
from .gluon import GLUON_SCHEDULES, gluon_plan, why_not_stages_form
from .onepass import NotOnePass, one_pass, parts
from .records import DERIVED, CooperativeForm, NotFused, Plan, SplitForm, StagesForm, StripForm, TileForm
from .reductions import exchange_shape, moment_pairs, reduction_axis
from .stages import partition

SCHEDULES = ("tile", "row_in_cta", "cooperative", "split")  # the Triton schedules (any target)
ROW_BUDGET = 128 * 256  # most fp32 accumulator elements a row-in-CTA program holds (BLOCK_M x BLOCK_N)


def pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks(region: Region, schedule: str, target: str) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, pipeline stages) the planner gives ``schedule``."""
    s = region.sizes
    elem = 4 if region.gemm.a.dtype.itemsize == 4 else 2
    if target == "interpreter":  # small tiles: the interpreter pays per element
        bm = min(64, max(16, pow2(s.M)))
        if schedule == "row_in_cta":
            bn = max(16, pow2(s.N))
        elif schedule in ("cooperative", "split"):
            bn = 16 if s.N <= 64 else 32  # several tiles per strip even at test sizes
        else:
            bn = min(64, max(16, pow2(s.N)))
        bk = min(64, max(16, pow2(s.K)))
        return bm, bn, bk, 4, 1
    if schedule == "row_in_cta":
        bn = max(16, pow2(s.N))
        bm = max(16, min(128, ROW_BUDGET // bn, pow2(s.M)))
    elif schedule == "split":
        bn = 128 if s.N <= 4096 else 256
        bm = 128 if s.M > 64 else 64
    elif schedule == "cooperative":
        bn = 128 if s.N <= 128 * 64 else 256
        bm = 128 if s.M > 64 else 64
    else:
        bn = min(128, max(16, pow2(s.N)))
        bm = min(128, max(16, pow2(s.M)))
    bk = 64
    while bk > 16 and (bm * bk + bk * bn * region.products) * elem > 96 * 1024:  # (a B tile a product)
        bk //= 2
    per_stage = (bm * bk + bk * bn * region.products) * elem
    num_stages = max(1, min(4, (200 * 1024) // per_stage))
    num_warps = 8 if bm * bn >= 128 * 128 else 4
    return bm, bn, bk, num_warps, num_stages


def tma_blocker(region: Region) -> str:
    """'' when tensor descriptors can load both operands, else why not: each needs a unit-
    stride dim and 16-byte aligned rows (the launcher also checks the base addresses)."""
    g, s = region.gemm, region.sizes
    if g.batched:
        return "batched GEMMs use pointer loads"
    size = g.a.dtype.itemsize
    extent = {("a", "K"): s.K, ("a", "M"): s.M, ("b", "N"): s.N, ("b", "K"): s.K}
    for name, op in (("a", g.a), ("b", g.b)) + ((("b", g.b2),) if g.b2 is not None else ()):
        if not op.major:
            return f"operand {op.name} has no unit-stride dimension"
        if extent[(name, op.major)] * size % 16:
            return f"rows of operand {op.name} are not 16-byte aligned"
    return ""


def split_form(region: Region, target: str, sm_count: int, block_m: int, block_n: int) -> SplitForm:
    """Slices of N for the split schedule: enough programs to fill the GPU several times, few
    enough that the statistics stay tiny next to the row they replace."""
    tiles = cdiv(region.sizes.N, block_n)
    row_blocks = cdiv(region.sizes.M, block_m) * region.sizes.B
    op = one_pass(region)
    # 4 tiles a slice (H200, 8192x4096x128256: 1.041x cuBLAS's GEMM against 1.080x at 16); fewer
    # where that leaves under ~8 waves of programs; more where the statistics (fp32, one array
    # a slot) would pass 1 % of the bf16 row they replace
    slots = sum(len(parts(st)) for st in op.stats)
    cap = max(1, region.sizes.N // (256 * max(slots, 1)))
    per = 4
    while per > 1 and row_blocks * cdiv(tiles, per) < 8 * sm_count:
        per //= 2
    per = min(tiles, max(per, cdiv(tiles, cap)))
    if target == "interpreter":
        per = cdiv(tiles, min(tiles, 2))
    return SplitForm(chunks=cdiv(tiles, per), tiles_per_chunk=per, onepass=op)


def why_not_schedule(schedule: str, region: Region, target: str, sm_count: int) -> str:
    """'' when Triton ``schedule`` can run ``region``, else why not."""
    n = region.sizes.N
    if schedule == "tile":
        return "tiles are independent: no tile can finish a reduction" if region.reductions() else ""
    if schedule == "row_in_cta":
        width = max(16, pow2(n))
        if width * 16 > ROW_BUDGET:
            return (f"a row of N={n} (padded to {width}) is wider than one program holds "
                    f"(row-in-CTA budget {ROW_BUDGET} accumulator elements, >= 16 rows)")
        return ""
    if schedule == "split":
        try:
            one_pass(region)
        except NotOnePass as e:
            return f"not one pass: {e}"
        return ""
    if schedule == "cooperative":
        if not region.reductions():
            return "no reduction to exchange"
        tiles = cdiv(n, blocks(region, schedule, target)[1])
        if target != "interpreter" and tiles > sm_count:
            return (f"a row of N={n} needs {tiles} tiles of {blocks(region, schedule, target)[1]} at once, more "
                    f"than the {sm_count} programs that are sure to be resident together")
        return ""
    return f"unknown schedule {schedule!r} ({', '.join(SCHEDULES + GLUON_SCHEDULES)})"


def choose(region: Region, target: str, sm_count: int) -> tuple[str, str]:
    """(schedule, '') or ('', why none fits). Rows that fit a 256-wide tile stay in one
    program; wider rows go to the cooperative strip (per-row outputs: the split schedule,
    where no strip needs to wait); the interpreter prefers the cooperative strip already past
    64 columns, so tests exercise it at small sizes."""
    if not region.reductions():
        return "tile", ""
    limit = 64 if target == "interpreter" else 256
    order = ("row_in_cta", "cooperative") if region.sizes.N <= limit else ("cooperative", "row_in_cta")
    if target != "interpreter" and region.sizes.N > limit:
        order = ("split",) + order
    reasons = []
    for schedule in order:
        why = why_not_schedule(schedule, region, target, sm_count)
        if not why:
            return schedule, ""
        reasons.append(f"{schedule}: {why}")
    return "", "; ".join(reasons)


def triton_plan(schedule: str, region: Region, transposed: bool, stages, ir_forms: tuple, target: str,
                sm_count: int) -> Plan:
    """The planner's plan of a feasible Triton ``schedule`` (pointer loads, no variants)."""
    bm, bn, bk, warps, pipe = blocks(region, schedule, target)
    tiles = cdiv(region.sizes.N, bn) if schedule in ("cooperative", "split") else 1
    if schedule == "split":
        form = split_form(region, target, sm_count, bm, bn)
    elif schedule == "cooperative":
        pairs = moment_pairs(region)
        exchanges, width = exchange_shape(stages, pairs)
        form = CooperativeForm(exchanges=exchanges, exchange_width=width, moments=pairs)
    else:
        form = TileForm()
    return Plan(region, transposed, schedule, stages, bm, bn, bk, 8, warps, pipe, ir_forms, tiles_n=tiles,
                form=form)


# the plan fields COMFUSE_PLAN may set besides its form's
OVERRIDABLE = ("mainloop", "block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")


def parse_override(text: str) -> dict:
    """COMFUSE_PLAN's "field=value,..." as {field: value} (ints, true/false, or text)."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"COMFUSE_PLAN: {item!r} is not field=value")
        raw = raw.strip()
        low = raw.lower()
        out[name.strip()] = True if low in ("true", "yes", "on") else False if low in ("false", "no", "off") else \
            int(raw) if raw.lstrip("-").isdigit() else raw
    return out


def why_not_form(plan: Plan) -> str:
    """'' when ``plan``'s fields make a kernel the code generator writes, else why not."""
    f = plan.form
    if plan.mainloop not in ("pointer", "tma"):
        return f"mainloop={plan.mainloop!r}: tma or pointer"
    if plan.schedule in GLUON_SCHEDULES:
        if plan.mainloop != "tma" or (plan.block_m, plan.block_n, plan.block_k) != (128, 256, 64):
            return "the Gluon kernels take 128x256x64 tiles and a TMA mainloop"
        if isinstance(f, StagesForm):
            return why_not_stages_form(plan.region, f)
        if isinstance(f, StripForm) and f.residual_tma and f.template.residual is None:
            return "residual_tma: the template's region has no residual"
        return ""
    if plan.mainloop == "tma" and tma_blocker(plan.region):
        return f"a TMA mainloop: {tma_blocker(plan.region)}"
    if getattr(f, "persistent", False) and plan.schedule != "tile":
        return "persistent: a tile plan's form"
    if getattr(f, "prefetch", False) and not any({"M", "N"} <= set(i.axes) for i in plan.region.inputs):
        return "prefetch: the region has no [M, N] side input"
    return ""


def with_override(plan: Plan, text: str) -> Plan | NotFused:
    """``plan`` with COMFUSE_PLAN's fields set (docs/design.md), or why they do not apply."""
    try:
        values = parse_override(text)
    except ValueError as e:
        return NotFused(str(e), plan.ir_forms)
    own = {f.name for f in dataclasses.fields(plan.form)} - set(DERIVED) if plan.form is not None else set()
    unknown = set(values) - own - set(OVERRIDABLE)
    if unknown:
        return NotFused(f"COMFUSE_PLAN: {', '.join(sorted(unknown))} not a field of a {plan.schedule} plan "
                        f"({', '.join(sorted(own | set(OVERRIDABLE)))})", plan.ir_forms)
    top = {k: v for k, v in values.items() if k in OVERRIDABLE}
    form = dataclasses.replace(plan.form, **{k: v for k, v in values.items() if k in own}) if own else plan.form
    changed = dataclasses.replace(plan, form=form, **top)
    if plan.schedule == "cooperative" and "block_n" in top:
        changed = dataclasses.replace(changed, tiles_n=cdiv(plan.region.sizes.N, changed.block_n))
    why = why_not_form(changed)
    return NotFused(f"COMFUSE_PLAN ({text}): {why}", plan.ir_forms) if why else changed


def only_a_bias(region: Region) -> bool:
    """Whether the region computes one output, its GEMM plus one vector along N (a linear
    layer's bias) in the GEMM's own dtype. A linear layer reaches Inductor as ``addmm``, whose
    bias cuBLAS adds in its own epilogue: fusing it saves no memory traffic, and tuning it
    cost seconds of compiling candidates (GPT-2's attention projection: 4-12 plans, none
    faster). A cast before the add (a wider sum) is not an addmm and still fuses."""
    if len(region.outputs) != 1 or region.outputs[0].dtype != region.gemm.out_dtype:
        return False
    counts = {Op.ADD: 0, Op.INPUT: 0}
    for node in region.nodes:
        if node.op is Op.INPUT and node.axes != frozenset("N"):
            return False
        if node.op in counts:
            counts[node.op] += 1
        elif node.op is not Op.ACC:
            return False
    return counts[Op.ADD] == counts[Op.INPUT] == 1


def plan(region: Region, target: str = "cuda", settings=None, sm_count: int = 132) -> Plan | NotFused:
    """Run the passes in order; choose a schedule for ``target`` ("cuda" or "interpreter");
    ``sm_count`` bounds how many programs a cooperative strip may need at once."""
    settings = settings or settings_mod.get()
    ir_forms = [("found", verify(region))]
    region = verify(passes.dce(region))             # drop what no output needs
    region = verify(passes.cse(region))             # merge identical nodes
    region = verify(passes.one_hot_counts(region))  # "is x a column?" without tile work
    ir_forms.append(("simplified", region))
    if len(region.nodes) == 1 and all(region.nodes[o.node].op is Op.ACC for o in region.outputs):
        return NotFused("no epilogue to fuse: a plain GEMM runs on cuBLAS", tuple(ir_forms))
    if only_a_bias(region):
        return NotFused("no epilogue to fuse beyond a bias, which cuBLAS adds inside the GEMM (addmm)",
                        tuple(ir_forms))
    axis, why = reduction_axis(region)              # which strip of tiles each reduction needs
    if why:
        return NotFused(why, tuple(ir_forms))
    transposed = axis == "M"
    if transposed and region.dual:
        return NotFused("a second product with reductions along M: column strips multiply the other way "
                        "round, and the two products share A, not B", tuple(ir_forms))
    if transposed:
        region = verify(passes.transpose(region))  # column strip -> row strip over C^T
        ir_forms.append(("transposed", region))
    stages = partition(region)                      # reductions are stage boundaries
    ir_forms = tuple(ir_forms)
    forced = settings.schedule                      # the schedule: forced, or the first that fits
    if forced in GLUON_SCHEDULES:
        result = gluon_plan(forced, region, transposed, stages, ir_forms, target, sm_count)
    elif forced:
        why = why_not_schedule(forced, region, target, sm_count)
        if why:
            return NotFused(f"forced schedule {forced!r}: {why}", ir_forms)
        result = triton_plan(forced, region, transposed, stages, ir_forms, target, sm_count)
    else:
        schedule, why = choose(region, target, sm_count)
        if why:
            return NotFused(f"no schedule fits: {why}", ir_forms)
        result = triton_plan(schedule, region, transposed, stages, ir_forms, target, sm_count)
    if settings.plan and isinstance(result, Plan):  # the developer's forced form
        result = with_override(result, settings.plan)
    return result


def gluon_offers(region: Region, sm_count: int = 132) -> list:
    """[(schedule, '' when an sm_90 GPU would be offered it, else why not)] for each Gluon
    schedule, whatever the machine: ``explain`` lists them, so that what the warp-specialised
    kernels would take is visible on a CPU too."""
    out = []
    for schedule in GLUON_SCHEDULES:
        with settings_mod.override(schedule=schedule, plan=""):
            p = plan(region, "cuda", settings_mod.get(), sm_count)
        why = p.reason if isinstance(p, NotFused) else ""
        out.append((schedule, why.removeprefix(f"{schedule}: ")))
    return out
