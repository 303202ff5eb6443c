"""Plans for the warp-specialised Gluon kernels (sm_90 GPUs only).

- ``ws_strip``: the hand-written template (codegen/gluon/strip.py) for LayerNorm, RMSNorm and
  softmax epilogues, matched by ``planner.template.match``;
- ``ws_split``: the template's terminal kind, per-row log-sum-exp and a target's logit
  (cross-entropy over a wide row), then a combine kernel;
- ``ws_stages``: a kernel generated from the region's stages (codegen/gluon/stages.py), for
  any row-reduction chain whose ops the generator writes (``STAGES_OPS``).

Each ``*_plan`` returns the plan of the planner's own form, or ``NotFused`` with the reason;
``why_not_stages_form`` says whether a form (``StagesForm``) is one the generator writes.
"""
from __future__ import annotations

import torch

from ..ir import REDUCE, Op, Region
from .onepass import one_pass
from .records import LseForm, NotFused, Plan, StagesForm, StripForm
from .reductions import layout_of, merge_pairs
from .template import MAX_TILES_N, fits, match, match_lse

GLUON_SCHEDULES = ("ws_strip", "ws_split", "ws_stages")
# the ops codegen/gluon/stages.py writes (tests check that its tables cover them)
STAGES_OPS = frozenset({
    Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.EQ, Op.NE, Op.LT, Op.LE, Op.GT, Op.GE, Op.AND, Op.OR,
    Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.LOG1P, Op.EXPM1, Op.RSQRT, Op.ERF, Op.SIN, Op.COS, Op.TANH,
    Op.NEG, Op.RECIPROCAL, Op.RELU, Op.SIGMOID, Op.NOT,
    Op.CAST, Op.POW, Op.MAX, Op.MIN, Op.WHERE, Op.ACC, Op.INPUT, Op.CONST, Op.IOTA}) | REDUCE
STAGES_POWERS = (2, 0.5, -0.5, 1, -1)
MAX_EXCHANGES = 6  # the per-strip partials the generated kernel keeps in its workspace
MAX_STATS = 16  # statistics it keeps in shared memory
TILE_N = 256  # the generated kernel's 128x256 tiles: the mainloop in 8 warps, the epilogue in 4


def _gluon_blocker(region: Region, transposed: bool, target: str) -> str:
    if target != "cuda":
        return "Gluon kernels do not run in Triton's interpreter (sm_90 GPUs only)"
    if transposed:
        return "the kernel reduces along N only"
    if region.dual:
        return "the warp-specialised kernels compute one product (this region has a second one)"
    return ""


def strip_template_plan(region: Region, transposed: bool, stages, ir_forms: tuple, target: str,
                        sm_count: int) -> Plan | NotFused:
    """The ws_strip plan for ``region`` (row form), or why the template does not apply."""
    def no(why):
        return NotFused(f"ws_strip: {why}", ir_forms)
    why = _gluon_blocker(region, transposed, target)
    template, why = (None, why) if why else match(region)
    s = region.sizes
    why = why or fits(s.M, s.N, s.K)
    if why:
        return no(why)
    tiles = s.N // 256
    if tiles > sm_count:
        return no(f"a strip of {tiles} tiles cannot be resident at once on {sm_count} SMs")
    return Plan(region, False, "ws_strip", stages, 128, 256, 64, 8, 8, 3, ir_forms, tiles_n=tiles, mainloop="tma",
                form=StripForm(template))


def lse_template_plan(region: Region, transposed: bool, stages, ir_forms: tuple, target: str) -> Plan | NotFused:
    """The ws_split plan for ``region`` (row form), or why the template's terminal kind does
    not apply."""
    why = _gluon_blocker(region, transposed, target)
    template, why = (None, why) if why else match_lse(region)
    s = region.sizes
    why = why or fits(s.M, s.N, s.K, terminal=True)
    if why:
        return NotFused(f"ws_split: {why}", ir_forms)
    return Plan(region, False, "ws_split", stages, 128, 256, 64, 8, 8, 3, ir_forms, tiles_n=-(-s.N // 256),
                mainloop="tma", form=LseForm(template, one_pass(region)))


def why_not_stages(region: Region, stages) -> str:
    """'' when the generator can write this region, else why not."""
    g = region.gemm
    if region.kind != "gemm_epilogue" or g.batched:
        return "one unbatched GEMM and its epilogue"
    if g.out_dtype != region.gemm.a.dtype:
        return "the GEMM's product must be rounded as its operands' dtype (the hand-off buffer is bf16)"
    for i, node in enumerate(region.nodes):
        if node.op not in STAGES_OPS:
            return f"no Gluon form for {node.op.value} (%{i})"
        if node.op in REDUCE and node.arg != "N":
            return "reductions must run along N"
        if node.op is Op.POW and node.arg not in STAGES_POWERS:
            return f"pow with exponent {node.arg}"
        if node.op is Op.CAST:
            src = region.nodes[node.src[0]].dtype
            if not node.arg.is_floating_point or not (src.is_floating_point or src == torch.bool):
                return f"cast from {src} to {node.arg}"
    for inp in region.inputs:
        if not inp.dtype.is_floating_point or "B" in inp.axes:
            return f"side input {inp.name}: floating point, axes within [M, N]"
    for out in region.outputs:
        if not out.dtype.is_floating_point or out.axes not in (frozenset("MN"), frozenset("M")):
            return f"output {out.name}: floating point, [M, N] or [M]"
    if not region.reductions():
        return "no reduction (the tile schedules need no exchange)"
    reds = [len(s.reductions) for s in stages if s.reductions]
    if len(reds) > MAX_EXCHANGES or sum(reds) > MAX_STATS:
        return f"{len(reds)} exchanges / {sum(reds)} statistics: more than the kernel keeps"
    return ""


def tma_residual(region: Region):
    """The index of the [M, N] input that the mainloop partition can add into the tile before
    the hand-off (TMA-loaded into the buffer meanwhile), or None: a bf16 input read once, by an
    add whose other side is the GEMM's tile through adds of broadcast values ([N], [M] or
    scalar) and floating-point casts, each node of that chain used once (so no pass needs the
    tile without it). LayerNorm(x @ w + b + r) qualifies; the sum is then (acc + r) + b, not
    (acc + b) + r: one rounding to bf16 fewer than eager's, at the hand-off."""
    nodes = region.nodes
    users = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for src in node.src:
            users[src].append(i)
    for o in region.outputs:
        users[o.node].append(-1)

    def on_tile_chain(i: int) -> bool:
        while True:
            node = nodes[i]
            if len(users[i]) != 1:
                return False
            if node.op is Op.ACC:
                return True
            if node.op is Op.CAST and node.arg.is_floating_point:
                i = node.src[0]
            elif node.op in (Op.ADD, Op.SUB) and nodes[node.src[1]].axes != frozenset("MN"):
                i = node.src[0]
            elif node.op is Op.ADD and nodes[node.src[0]].axes != frozenset("MN"):
                i = node.src[1]
            else:
                return False
    for j, inp in enumerate(region.inputs):
        if inp.axes != frozenset("MN") or inp.dtype != torch.bfloat16:
            continue
        reads = [i for i, node in enumerate(nodes) if node.op is Op.INPUT and node.arg == j]
        if len(reads) != 1 or len(users[reads[0]]) != 1:
            continue
        add = users[reads[0]][0]
        if add < 0 or nodes[add].op is not Op.ADD:
            continue
        other = [s for s in nodes[add].src if s != reads[0]]
        if len(other) == 1 and on_tile_chain(other[0]):
            return j
    return None


def why_not_stages_form(region: Region, form: StagesForm) -> str:
    """'' when the generator writes ``form`` for ``region``, else why not."""
    if form.lanes not in (8, 32):
        return f"lanes={form.lanes}: the epilogue lays a row over 8 or 32 lanes"
    if form.tail % 32 or not 0 <= form.tail <= 128:
        return f"tail={form.tail}: rows of the last tile, a multiple of 32 up to 128"
    if form.res_tma and tma_residual(region) is None:
        return "res_tma: no bf16 [M, N] input that the mainloop can add into the tile"
    if form.roll and form.lanes != 8:
        return "roll: a pass loops over its chunks with 8 lanes a row (a row's lanes span 64 columns)"
    if form.lookahead and not form.roll:
        return "lookahead: loads a chunk ahead inside a pass's loop (roll)"
    if form.last_in_ring and (not form.tail or form.res_tma):
        return "last_in_ring: the last tile in the B ring is a shared last tile's form (tail), without res_tma"
    return ""


def stages_template_plan(region: Region, transposed: bool, stages, ir_forms: tuple, target: str,
                         sm_count: int) -> Plan | NotFused:
    """The ws_stages plan for ``region`` (row form) in the planner's own form (8 lanes a row,
    passes unrolled), or why the generated Gluon kernel does not apply."""
    def no(why):
        return NotFused(f"ws_stages: {why}", ir_forms)
    why = _gluon_blocker(region, transposed, target)
    if why:
        return no(why)
    g, s = region.gemm, region.sizes
    if g.a.dtype != torch.bfloat16 or g.b.dtype != torch.bfloat16:
        return no("the kernel multiplies bf16 operands")
    if g.a.major != "K" or g.b.major not in ("N", "K"):
        return no("the kernel loads A row-major and B with a unit-stride dimension (TMA)")
    why = fits(s.M, s.N, s.K) or why_not_stages(region, stages)
    if why:
        return no(why)
    tiles = s.N // TILE_N
    if tiles > sm_count:
        return no(f"a strip of {tiles} tiles cannot be resident at once on {sm_count} SMs")
    if tiles > MAX_TILES_N:
        return no(f"a strip of {tiles} tiles {TILE_N} wide is more than the combine holds ({MAX_TILES_N})")
    pairs = merge_pairs(region)
    form = StagesForm(exchanges=len(layout_of(stages, pairs).exchanges), moments=pairs)
    return Plan(region, False, "ws_stages", stages, 128, TILE_N, 64, 8, 8, 3, ir_forms, tiles_n=tiles,
                mainloop="tma", form=form)


def gluon_plan(schedule: str, region: Region, transposed: bool, stages, ir_forms: tuple, target: str,
               sm_count: int) -> Plan | NotFused:
    """The plan of Gluon ``schedule`` for ``region``, or why not."""
    if schedule == "ws_split":
        return lse_template_plan(region, transposed, stages, ir_forms, target)
    if schedule == "ws_stages":
        return stages_template_plan(region, transposed, stages, ir_forms, target, sm_count)
    return strip_template_plan(region, transposed, stages, ir_forms, target, sm_count)
