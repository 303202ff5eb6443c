"""The planning pipeline: from a found region to a schedule, or the reason there is none."""
from __future__ import annotations

import dataclasses
import torch

from .. import settings as settings_mod
from ..ir import Op, Region, verify
from . import passes
from .onepass import NotOnePass, one_pass, parts
from .stages import Stage, partition

SCHEDULES = ("tile", "row_in_cta", "cooperative", "split")
# "ws_strip": the warp-specialised Gluon template (codegen/gluon/strip.py) for LayerNorm /
# RMSNorm / softmax epilogues on sm_90; "ws_split": the same template's terminal kind (per-row
# log-sum-exp and a target's logit: cross-entropy) and a combine kernel. Autotuning candidates,
# or forced with COMFUSE_SCHEDULE
# "ws_stages": a warp-specialised Gluon kernel generated from the region's stages
# (codegen/gluon/stages.py): any row reduction chain the generator can write
TEMPLATE_SCHEDULES = ("ws_strip", "ws_split", "ws_stages")


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    region: Region  # the region in row form (reductions along N only)
    transposed: bool  # the source region reduced along M; operands and views are swapped
    schedule: str  # "tile": independent output tiles; "row_in_cta": a program owns whole rows;
    # "cooperative": the TILES_N programs of a row strip exchange per-tile partials;
    # "split": per-row outputs only; programs reduce slices of N to mergeable statistics
    stages: tuple[Stage, ...]
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    forms: tuple  # (pass name, region) for every intermediate form, for explain
    tiles_n: int = 1  # cooperative: tiles per row strip (programs that exchange)
    exchanges: int = 0  # cooperative: exchanges per strip (stages that end in reductions)
    exchange_width: int = 0  # cooperative: most reductions published at one exchange
    mainloop: str = "pointer"  # "pointer": masked loads; "tma": tensor descriptors (Hopper)
    chunks: int = 0  # split: programs per row block, each reducing a slice of N
    tiles_per_chunk: int = 0  # split: N tiles one program walks
    grouped: bool = False  # split: (row block, slice) pairs in grouped order, GROUP_M row blocks at a time
    inline_tile: bool = False  # split: the tile's work inlined in the slice loop (else a function of its own)
    flatten: bool = False  # split, inlined: Triton fuses the slice and K loops, so the next tile's loads overlap this tile's epilogue
    onepass: object = None  # split: the region's one-pass form (derived from ``region``)
    prefetch: bool = False  # load whole-tile side inputs (residuals) before the mainloop
    overlap: bool = False  # cooperative: a strip's first exchange waits behind the next strip's mainloop
    moments: tuple = ()  # cooperative: (sum, sum of squared deviations) pairs exchanged at once;
    # ws_stages: the merged exchanges, ((kind, first, second), ...) (codegen/gluon/stages.merge_pairs)
    persistent: bool = False  # tile, TMA: one program per SM walks the tiles, its tile and K loops fused by Triton
    template: object = None  # ws_strip: the planner.template.StripTemplate the region matched
    # ws_stages: lanes of a warp along a row of the epilogue's chunks (a row reduction takes
    # log2(lanes) shuffles); 32 or 8 (the planner's choice: H200, sixteenth session, sustained,
    # x cuBLAS's GEMM at 8192x4096x4096: multi-stage 1.00-1.08x against 1.42-1.47x, LayerNorm
    # 1.080x against 1.101x, softmax 1.058x against 1.070x; at 8192x1024x1024 within 3 %
    # either way but softmax, 1.364x against 1.522x)
    lanes: int = 32
    # ws_stages: the output tile written from the hand-off buffer by one TMA bulk store, not by
    # each thread (COMFUSE_WS_TMA_STORE=1: correct on the H200, no faster; sixteenth session)
    tma_store: bool = False
    # ws_stages: rows of each program's last tile whose epilogue the mainloop's 8 warps run once
    # their last tile is handed off, a multiple of 32 (0: the epilogue partition runs every row;
    # COMFUSE_WS_TAIL; 96 at 8 lanes an autotuning candidate)
    tail: int = 0
    # ws_stages: the region's residual (codegen/gluon/stages.tma_residual) TMA-loaded into the
    # hand-off buffer and added by the mainloop partition (COMFUSE_WS_RES_TMA; without it, an
    # autotuning candidate with nothing kept and the last tile shared: ``candidates``)
    res_tma: bool = False
    # ws_stages: each chunk of an epilogue pass issues the next chunk's loads before its own
    # work (COMFUSE_WS_LOOKAHEAD, experimental)
    lookahead: bool = False
    # ws_stages, merged: an exchange's value kept in the hand-off buffer for the later passes
    # where they need nothing else of the tile (codegen/gluon/stages._Writer.keepable; False:
    # recomputed, COMFUSE_WS_KEEP=0, experimental)
    keep: bool = True
    # ws_stages: adjacent columns a thread of the epilogue takes at a time (0: all its
    # 256 / lanes; COMFUSE_WS_VEC, 8 by default, which at 32 lanes is all of a thread's)
    vec: int = 0
    # ws_stages: 16-bit-typed adds and products of 16-bit operands computed in that type
    # (codegen/gluon/stages.narrow_nodes; COMFUSE_WS_NARROW, experimental)
    narrow: bool = False
    # ws_stages: exp(x - a row's value) as one FFMA and an ex2 an element (COMFUSE_WS_EXP_FMA,
    # experimental)
    exp_fma: bool = False
    # ws_stages: each epilogue pass a run-time loop over its chunks rather than unrolled
    # (COMFUSE_WS_ROLL; only at 8 lanes a row with 8 adjacent columns a lane)
    roll: bool = False
    # ws_stages, with ``tail``: each program's last tile handed off in the B operand's ring, its
    # mainloop warps not waiting for the buffer (COMFUSE_WS_LAST_IN_RING)
    last_in_ring: bool = False
    # ws_stages: rows of an epilogue chunk, 0 for the default (stages_kernel.CHUNK, 16), or 32
    # (COMFUSE_WS_CHUNK, experimental)
    chunk: int = 0

    @property
    def rollable(self) -> bool:
        """Whether this plan's passes could loop over their chunks (``rollable``)."""
        return rollable(self.lanes, self.vec or self.block_n // self.lanes)

    @property
    def epi_warps(self) -> int:
        """ws_stages: warps of the epilogue partition, 4 beside the 8 mainloop warps of a
        128x256 tile; 8 beside the 4 of a 128x128 tile (COMFUSE_WS_TILE_N=128, experimental)."""
        return 4 if self.block_n == 256 else 8

    def describe(self) -> str:
        if self.schedule == "ws_stages":
            return (f"ws_stages: warp-specialised Gluon kernel generated from the region's "
                    f"{len(self.stages)} stage(s); "
                    f"persistent grid of {self.block_m}x{self.block_n}x{self.block_k} tiles, TMA mainloop in "
                    f"{self.num_warps} warps, the epilogue in {self.epi_warps} warps of its own beside the next tile's "
                    f"mainloop; {self.tiles_n} tiles per row "
                    f"strip exchange per-row partials {self.exchanges} time(s)"
                    f"{' (' + ', '.join(k for k, _, _ in self.moments) + ' pairs merged)' if self.moments else ''}"
                    f", then write each output once{' (by one TMA store)' if self.tma_store else ''}; "
                    f"{self.lanes} lanes a row"
                    f"{f'; the mainloop warps take the last {self.tail} rows of the last tile' if self.tail else ''}"
                    f"{'; the residual by TMA into the hand-off buffer, added by the mainloop' if self.res_tma else ''}"
                    f"{'; each chunk loads the next ahead' if self.lookahead else ''}"
                    f"{'; nothing kept in the buffer' if self.moments and not self.keep else ''}"
                    f"{f'; {self.vec} adjacent columns a lane at a time' if self.vec else ''}"
                    f"{'; 16-bit adds and products in 16 bits' if self.narrow else ''}"
                    f"{'; exp(x - row max) by one FFMA' if self.exp_fma else ''}"
                    f"{'; each pass a loop over its chunks, not unrolled' if self.roll else ''}"
                    f"{'; the last tile handed off in the B ring' if self.last_in_ring else ''}"
                    f"{f'; chunks of {self.chunk} rows' if self.chunk else ''}")
        if self.schedule == "ws_split":
            return (f"ws_split: warp-specialised Gluon template computing the {self.template.describe()}; "
                    f"persistent grid of {self.block_m}x{self.block_n}x{self.block_k} tiles in grouped order, TMA "
                    f"mainloop in 8 warps, the epilogue in 4 warps of its own beside the next tile's mainloop; one "
                    f"fp32 log-sum-exp per row and tile ({self.tiles_n} per row), then a combine kernel")
        if self.schedule == "ws_strip":
            return (f"ws_strip: warp-specialised Gluon template computing {self.template.describe()}; "
                    f"persistent grid of {self.block_m}x{self.block_n}x{self.block_k} tiles, TMA mainloop in "
                    f"8 warps, the epilogue in 4 warps of its own beside the next tile's mainloop; "
                    f"{self.tiles_n} tiles per row strip exchange per-row partials through global memory"
                    f"{'; residual TMA-loaded during the mainloop' if self.prefetch else ''}")
        strip = "column strip (reductions along M, run transposed)" if self.transposed else \
            ("row strip (reductions along N)" if self.region.reductions() else "no reductions")
        coop = (f", {self.tiles_n} tiles per strip exchange {self.exchanges} time(s)"
                if self.schedule == "cooperative" else "")
        if self.schedule == "split":
            stats = ", ".join(s.kind for s in self.onepass.stats)
            coop = (f", statistics ({stats}) over {self.chunks} slices of {self.tiles_per_chunk} "
                    f"tiles per row block{' in grouped order' if self.grouped else ''}"
                    f"{', tile work inlined' if self.inline_tile else ''}"
                    f"{' (slice and K loops fused)' if self.flatten else ''}, then a combine")
        return (f"{self.schedule}: {strip}; {len(self.stages)} stage(s){coop}; "
                f"{self.mainloop} mainloop, tile {self.block_m}x{self.block_n}x{self.block_k}, "
                f"{self.num_warps} warps, {self.num_stages} pipeline stages"
                f"{'; side inputs loaded before the mainloop' if self.prefetch else ''}"
                f"{'; exchange overlapped with the next strip' if self.overlap else ''}"
                f"{'; persistent grid, tile and K loops fused' if self.persistent else ''}")


@dataclasses.dataclass(frozen=True, slots=True)
class NotFused:
    reason: str
    forms: tuple = ()


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def moment_pairs(region: Region) -> tuple[tuple[int, int], ...]:
    """(R1, R2) node pairs where R1 = sum[N](x) and R2 = sum[N](d * d) with d = x - R1 / N:
    a row's sum and its sum of squared deviations from the row mean (LayerNorm's variance).
    A cooperative strip exchanges both at R1's exchange as tile moments (sum and the tile's
    own centred sum of squares, merged by Chan's formula), one exchange instead of two."""
    nodes, n = region.nodes, region.sizes.N
    pairs = []
    for j, node in enumerate(nodes):
        if node.op is not Op.SUM or node.arg != "N" or not node.dtype.is_floating_point:
            continue
        sq = nodes[node.src[0]]
        if sq.op is Op.MUL and sq.src[0] == sq.src[1]:
            d = sq.src[0]
        elif sq.op is Op.POW and sq.arg == 2:
            d = sq.src[0]
        else:
            continue
        if nodes[d].op is not Op.SUB:
            continue
        x, mean = nodes[d].src
        m = nodes[mean]
        if m.op not in (Op.DIV, Op.MUL) or nodes[m.src[1]].op is not Op.CONST:
            continue
        c = float(nodes[m.src[1]].arg)
        if (m.op is Op.DIV and c != n) or (m.op is Op.MUL and abs(c * n - 1.0) > 1e-12):
            continue
        r1 = nodes[m.src[0]]
        if r1.op is Op.SUM and r1.arg == "N" and r1.src[0] == x and r1.dtype.is_floating_point:
            pairs.append((m.src[0], j))
    return tuple(pairs)


def _exchange_shape(stages, pairs) -> tuple[int, int]:
    """(exchanges, most arrays published at one) of a cooperative plan: a paired R2 needs no
    exchange of its own, a paired R1 publishes two arrays."""
    r1s, r2s = {a for a, _ in pairs}, {b for _, b in pairs}
    widths = []
    for st in stages:
        live = [i for i in st.reductions if i not in r2s]
        if live:
            widths.append(len(live) + sum(1 for i in live if i in r1s))
    return len(widths), max(widths, default=0)


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
    if target == "interpreter":  # small tiles: the interpreter pays per element
        bm = min(64, max(16, _pow2(s.M)))
        if schedule == "row_in_cta":
            bn = max(16, _pow2(s.N))
        elif schedule in ("cooperative", "split"):
            bn = 16 if s.N <= 64 else 32  # several tiles per strip even at test sizes
        else:
            bn = min(64, max(16, _pow2(s.N)))
        bk = min(64, max(16, _pow2(s.K)))
        return bm, bn, bk, 4, 1
    if schedule == "row_in_cta":
        bn = max(16, _pow2(s.N))
        bm = max(16, min(128, row_budget // bn, _pow2(s.M)))
    elif schedule == "split":
        bn = 128 if s.N <= 4096 else 256
        bm = 128 if s.M > 64 else 64
    elif schedule == "cooperative":
        bn = 128 if s.N <= 128 * 64 else 256
        bm = 128 if s.M > 64 else 64
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


def tma_blocker(region: Region) -> str:
    """'' when tensor descriptors can load both operands, else why not: each needs a unit-
    stride dim and 16-byte aligned rows (the launcher also checks the base addresses)."""
    g, s = region.gemm, region.sizes
    if g.batched:
        return "batched GEMMs use pointer loads"
    size = g.a.dtype.itemsize
    extent = {("a", "K"): s.K, ("a", "M"): s.M, ("b", "N"): s.N, ("b", "K"): s.K}
    for name, op in (("a", g.a), ("b", g.b)):
        if not op.major:
            return f"operand {op.name} has no unit-stride dimension"
        if extent[(name, op.major)] * size % 16:
            return f"rows of operand {op.name} are not 16-byte aligned"
    return ""


def _split_shape(region: Region, target: str, settings, sm_count: int, blocks=None) -> dict:
    """Slices of N for the split schedule: enough programs to fill the GPU several times,
    few enough that the statistics stay tiny next to the row they replace. ``blocks``:
    (BLOCK_M, BLOCK_N) other than the planner's."""
    bm, bn = blocks or _blocks(region, "split", target, settings.row_budget)[:2]
    tiles = _cdiv(region.sizes.N, bn)
    row_blocks = _cdiv(region.sizes.M, bm) * region.sizes.B
    op = one_pass(region)
    # 4 tiles per slice: at 8192x4096x128256 it ran 1.041x cuBLAS's GEMM where 16 per slice (the
    # rule before, ~16 waves of programs) ran 1.080x (H200, tenth session, 3 interleaved rounds;
    # 1.029x vs 1.056x in the ninth). Fewer per slice where that leaves under ~8 waves of
    # programs (with 4 waves, 2026-11-30, the last ran a third full: 1.25x the plain tiles); more
    # where the statistics (fp32, one array per slot) would pass 1% of the bf16 row they replace.
    slots = sum(len(parts(st)) for st in op.stats)
    cap = max(1, region.sizes.N // (256 * max(slots, 1)))
    per = 4
    while per > 1 and row_blocks * _cdiv(tiles, per) < 8 * sm_count:
        per //= 2
    per = min(tiles, max(per, _cdiv(tiles, cap)))
    if target == "interpreter":
        per = _cdiv(tiles, min(tiles, 2))
    # grouped order: 3.92 vs 4.15 ms slice-fastest at 4 tiles per slice; the tile's work inlined
    # in the slice loop: 3.29 vs 3.74 ms, though ptxas spills 296 bytes (H200, 8192x4096x32768
    # cross-entropy, 128x256x64 TMA tiles, cuBLAS mm 3.13; bench/results/h200-2026-11-30-session7)
    return dict(tiles_n=tiles, chunks=_cdiv(tiles, per), tiles_per_chunk=per, onepass=op, grouped=True,
                inline_tile=True)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _feasible(schedule: str, region: Region, target: str, settings, sm_count: int) -> str:
    """'' when ``schedule`` can run ``region``, else why not."""
    n = region.sizes.N
    if schedule == "tile":
        return "tiles are independent: no tile can finish a reduction" if region.reductions() else ""
    if schedule == "row_in_cta":
        width = max(16, _pow2(n))
        if width * 16 > settings.row_budget:
            return (f"a row of N={n} (padded to {width}) is wider than one program holds "
                    f"(row-in-CTA budget {settings.row_budget} accumulator elements, >= 16 rows)")
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
        bn = _blocks(region, schedule, target, settings.row_budget)[1]
        tiles = _cdiv(n, bn)
        if target != "interpreter" and tiles > sm_count:
            return (f"a row of N={n} needs {tiles} tiles of {bn} at once, more than the "
                    f"{sm_count} programs that are sure to be resident together")
        return ""
    return f"unknown schedule {schedule!r} ({', '.join(SCHEDULES)})"


def _choose(region: Region, target: str, settings, sm_count: int) -> tuple[str, str]:
    """(schedule, '') or ('', why none fits). Rows that fit a 256-wide tile stay in one
    program; wider rows go to the cooperative strip; the interpreter prefers the
    cooperative strip already past 64 columns, so tests exercise it at small sizes."""
    if not region.reductions():
        return "tile", ""
    limit = 64 if target == "interpreter" else 256
    order = ("row_in_cta", "cooperative") if region.sizes.N <= limit else ("cooperative", "row_in_cta")
    if target != "interpreter" and region.sizes.N > limit:
        order = ("split",) + order  # per-row outputs (losses): no strip needs to wait
    reasons = []
    for schedule in order:
        why = _feasible(schedule, region, target, settings, sm_count)
        if not why:
            return schedule, ""
        reasons.append(f"{schedule}: {why}")
    return "", "; ".join(reasons)


def plan(region: Region, target: str = "cuda", settings=None, sm_count: int = 132) -> Plan | NotFused:
    """Run the passes in order; choose a schedule for ``target`` ("cuda" or "interpreter");
    ``sm_count`` bounds how many programs a cooperative strip may need at once."""
    settings = settings or settings_mod.get()
    forms = [("found", verify(region))]
    region = verify(passes.dce(region))           # drop what no output needs
    region = verify(passes.cse(region))           # merge identical nodes
    region = verify(passes.one_hot_counts(region))  # "is x a column?" without tile work
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
    forced = settings.schedule                     # the schedule: forced, or the first that fits
    if forced == "ws_split":
        return lse_template_plan(region, transposed, stages, tuple(forms), target)
    if forced == "ws_stages":
        return stages_template_plan(region, transposed, stages, tuple(forms), target, sm_count,
                                    **stages_options(settings))
    if forced in TEMPLATE_SCHEDULES:
        return strip_template_plan(region, transposed, stages, tuple(forms), target, sm_count,
                                   prefetch=settings.prefetch)
    if forced:
        why = _feasible(forced, region, target, settings, sm_count)
        if why:
            return NotFused(f"forced schedule {forced!r}: {why}", tuple(forms))
        schedule = forced
    else:
        schedule, why = _choose(region, target, settings, sm_count)
        if why:
            return NotFused(f"no schedule fits: {why}", tuple(forms))
    split = {}
    if schedule == "split":
        split = _split_shape(region, target, settings, sm_count)
    mainloop = settings.mainloop or "pointer"
    if mainloop not in ("pointer", "tma"):
        return NotFused(f"COMFUSE_MAINLOOP={mainloop!r}: choose tma or pointer", tuple(forms))
    if mainloop == "tma" and tma_blocker(region):
        return NotFused(f"forced TMA mainloop: {tma_blocker(region)}", tuple(forms))
    bm, bn, bk, warps, pipe = _blocks(region, schedule, target, settings.row_budget)
    extra = dict(split)
    if schedule == "cooperative":
        pairs = moment_pairs(region)
        exchanges, width = _exchange_shape(stages, pairs)
        extra = dict(tiles_n=_cdiv(region.sizes.N, bn), exchanges=exchanges, exchange_width=width,
                     moments=pairs)
    overlap = settings.overlap and schedule == "cooperative"
    prefetch = settings.prefetch and schedule != "split" and not overlap
    persistent = settings.persistent and schedule == "tile"
    return Plan(region, transposed, schedule, stages, bm, bn, bk, 8, warps, pipe, tuple(forms),
                mainloop=mainloop, prefetch=prefetch, overlap=overlap, persistent=persistent, **extra)


def _template_match(match, region: Region, transposed: bool, target: str, terminal: bool) -> tuple:
    """(template, '') when ``match`` reads ``region`` as one of the Gluon template's forms at
    sizes it takes, else (None, why not)."""
    from .template import fits
    if target != "cuda":
        return None, "Gluon templates do not run in Triton's interpreter (sm_90 GPUs only)"
    if transposed:
        return None, "the template reduces along N only"
    template, why = match(region)
    s = region.sizes
    why = why or fits(s.M, s.N, s.K, terminal=terminal)
    return (None, why) if why else (template, "")


def strip_template_plan(region: Region, transposed: bool, stages, forms: tuple, target: str,
                        sm_count: int, prefetch: bool = False) -> Plan | NotFused:
    """The ws_strip plan for ``region`` (row form), or why the template does not apply;
    ``prefetch``: the residual TMA-loaded into the hand-off buffer during the mainloop."""
    from .template import match

    def no(why):
        return NotFused(f"ws_strip: {why}", forms)
    template, why = _template_match(match, region, transposed, target, terminal=False)
    if why:
        return no(why)
    tiles = region.sizes.N // 256
    if tiles > sm_count:
        return no(f"a strip of {tiles} tiles cannot be resident at once on {sm_count} SMs")
    return Plan(region, False, "ws_strip", stages, 128, 256, 64, 8, 8, 3, forms, tiles_n=tiles, mainloop="tma",
                persistent=True, template=template, prefetch=prefetch and template.residual is not None)


def lse_template_plan(region: Region, transposed: bool, stages, forms: tuple, target: str) -> Plan | NotFused:
    """The ws_split plan for ``region`` (row form), or why the template's terminal kind does
    not apply."""
    from .template import match_lse
    template, why = _template_match(match_lse, region, transposed, target, terminal=True)
    if why:
        return NotFused(f"ws_split: {why}", forms)
    tiles = region.sizes.N // 256
    return Plan(region, False, "ws_split", stages, 128, 256, 64, 8, 8, 3, forms, tiles_n=tiles, mainloop="tma",
                persistent=True, template=template, chunks=tiles, tiles_per_chunk=1, onepass=one_pass(region),
                grouped=True)


def stages_options(settings) -> dict:
    """stages_template_plan's options from the settings (COMFUSE_WS_*); 8 lanes a row unless
    COMFUSE_WS_LANES names one."""
    return dict(merge=settings.ws_merge, lanes=settings.ws_lanes or 8, tma_store=settings.ws_tma_store,
                tail=settings.ws_tail, res_tma=settings.ws_res_tma, lookahead=settings.ws_lookahead,
                keep=settings.ws_keep, row_outputs=settings.ws_row_outputs,
                vec=settings.ws_vec, narrow=settings.ws_narrow, exp_fma=settings.ws_exp_fma, tile_n=settings.ws_tile_n,
                roll=settings.ws_roll, last_in_ring=settings.ws_last_in_ring, chunk=settings.ws_chunk)


def stages_template_plan(region: Region, transposed: bool, stages, forms: tuple, target: str,
                         sm_count: int, merge: bool = False, lanes: int = 32,
                         tma_store: bool = False, tail: int = 0, res_tma: bool = False,
                         lookahead: bool = False, keep: bool = True, row_outputs: bool = False,
                         vec: int = 0, narrow: bool = False,
                         exp_fma: bool = False, tile_n: int = 256, roll: bool = False,
                         last_in_ring: bool = False, chunk: int = 0) -> Plan | NotFused:
    """The ws_stages plan for ``region`` (row form), or why the generated Gluon kernel does
    not apply; ``merge``: moment and online-softmax pairs share an exchange (COMFUSE_WS_MERGE, on
    by default)."""
    from ..codegen.gluon.stages import blocker, layout_of, merge_pairs, narrow_nodes, tma_residual, tma_storable
    from .template import MAX_TILES_N, fits

    def no(why):
        return NotFused(f"ws_stages: {why}", forms)
    if target != "cuda":
        return no("Gluon kernels do not run in Triton's interpreter (sm_90 GPUs only)")
    if lanes not in (32, 8):
        return no(f"COMFUSE_WS_LANES={lanes}: the epilogue lays a row over 32 or 8 lanes")
    if tail % 32 or not 0 <= tail <= 128:
        return no(f"COMFUSE_WS_TAIL={tail}: rows of the last tile, a multiple of 32 up to 128")
    if chunk not in (0, 16, 32):
        return no(f"COMFUSE_WS_CHUNK={chunk}: an epilogue chunk is 16 or 32 rows")
    if chunk == 32 and tail % 64:
        return no(f"COMFUSE_WS_CHUNK=32 with COMFUSE_WS_TAIL={tail}: the mainloop warps' chunks are then "
                  "64 rows, so the tail must be 64 or 128")
    if vec not in (0, 8):
        return no(f"COMFUSE_WS_VEC={vec}: 8 adjacent columns a lane at a time, or 0 (all of a lane's)")
    if tile_n not in (256, 128):
        return no(f"COMFUSE_WS_TILE_N={tile_n}: tiles 256 columns wide (8 + 4 warps) or 128 (4 + 8)")
    if tile_n == 128 and lanes != 8:
        return no("COMFUSE_WS_TILE_N=128 lays a row over 8 lanes (32 would leave a lane 4 columns)")
    if transposed:
        return no("the kernel reduces along N only")
    g, s = region.gemm, region.sizes
    if g.a.dtype != torch.bfloat16 or g.b.dtype != torch.bfloat16:
        return no("the kernel multiplies bf16 operands")
    if g.a.major != "K" or g.b.major not in ("N", "K"):
        return no("the kernel loads A row-major and B with a unit-stride dimension (TMA)")
    why = fits(s.M, s.N, s.K) or blocker(region, stages, row_outputs)
    if why:
        return no(why)
    tiles = s.N // tile_n
    if tiles > sm_count:
        return no(f"a strip of {tiles} tiles cannot be resident at once on {sm_count} SMs")
    if tiles > MAX_TILES_N:
        return no(f"a strip of {tiles} tiles {tile_n} wide is more than the combine holds ({MAX_TILES_N})")
    pairs = merge_pairs(region) if merge else ()
    residual = tma_residual(region)
    res_tma = res_tma and residual is not None
    in_buffer = residual if res_tma else None
    # (strip.chunk_load joins a chunk's 64-column pieces in registers: a row's lanes must span
    # exactly one piece)
    roll = roll and rollable(lanes, vec or tile_n // lanes)
    # (128-wide tiles: a 4-slot ring, 160 KB of shared memory; one warpgroup's K step is half
    # the 128x256 form's, so a load has less time to land: a guess, not yet timed against 3)
    return Plan(region, False, "ws_stages", stages, 128, tile_n, 64, 8, 8 if tile_n == 256 else 4,
                3 if tile_n == 256 else 4, forms, tiles_n=tiles, mainloop="tma",
                persistent=True, exchanges=len(layout_of(stages, pairs).exchanges), moments=pairs, lanes=lanes,
                tma_store=tma_store and not tma_storable(region) and not tail, tail=tail,
                res_tma=res_tma, lookahead=lookahead, keep=keep,
                vec=0 if vec == tile_n // lanes else vec,
                narrow=narrow and bool(narrow_nodes(region, in_buffer)),
                exp_fma=exp_fma and any(n.op is Op.EXP for n in region.nodes),
                roll=roll,
                # (an unrolled lookahead's chunk ranges are constexpr: one call a range)
                last_in_ring=last_in_ring and bool(tail) and not res_tma and not (lookahead and not roll),
                chunk=0 if chunk == 16 else chunk)


def rollable(lanes: int, vec: int) -> bool:
    """Whether a ws_stages epilogue's passes can loop over their chunks at run time
    (``Plan.roll``): strip.chunk_load joins a chunk's 64-column pieces in registers, so a row's
    lanes must span one piece."""
    return lanes * vec == 64


def template_offers(region: Region, sm_count: int = 132) -> list:
    """[(schedule, '' when an sm_90 GPU would be offered it, else why not)] for each Gluon
    schedule (TEMPLATE_SCHEDULES), whatever the machine: ``explain`` lists them, so that what
    the warp-specialised kernels would take is visible on a CPU too."""
    out = []
    for schedule in TEMPLATE_SCHEDULES:
        with settings_mod.override(schedule=schedule):
            p = plan(region, "cuda", settings_mod.get(), sm_count)
        why = p.reason if isinstance(p, NotFused) else ""
        out.append((schedule, why.removeprefix(f"{schedule}: ")))
    return out


def candidates(region: Region, target: str = "cuda", settings=None, sm_count: int = 132) -> list:
    """The plans worth timing for ``region``: the planner's choice first, then every other
    feasible schedule and a few tile shapes. Empty when nothing fits (``plan`` says why)."""
    settings = settings or settings_mod.get()
    first = plan(region, target, settings, sm_count)
    if isinstance(first, NotFused):
        return []
    out = [first]
    if first.schedule in TEMPLATE_SCHEDULES:
        return out
    schedules = [settings.schedule] if settings.schedule else list(SCHEDULES)
    for schedule in schedules:
        if _feasible(schedule, first.region, target, settings, sm_count):
            continue
        base = first if schedule == first.schedule else None
        if base is None:
            with settings_mod.override(schedule=schedule):
                base = plan(region, target, settings_mod.get(), sm_count)
            if isinstance(base, NotFused):
                continue
            out.append(base)
        if target == "interpreter":
            continue
        # split: smaller tiles too: the statistics' tile values (several [BM, BN] tensors
        # besides the accumulator) spill at 128x256 (scripts/sm90_report.py)
        variants = {"tile": [(128, 256, 64, 8), (64, 128, 64, 4), (128, 64, 64, 4)],
                    # 128x128 with 3 stages (98 KB): two programs per SM, so one's epilogue
                    # can run while the other's mainloop does (the planner's 4 stages fit one)
                    "cooperative": [(64, 128, 64, 4), (128, 256, 64, 8), (128, 128, 64, 8)],
                    "row_in_cta": [],
                    # split: 128x256 with 3 stages is the plain GEMM's best tile at 8192x4096x32768
                    "split": [(128, 256, 64, 8), (128, 128, 64, 4), (64, 128, 64, 4), (128, 64, 64, 4)]}[schedule]
        for bm, bn, bk, warps in variants:
            if schedule == "cooperative":
                tiles = _cdiv(base.region.sizes.N, bn)
                if tiles > sm_count:
                    continue
                extra = dict(tiles_n=tiles)
            elif schedule == "split":
                extra = _split_shape(base.region, target, settings, sm_count, (bm, bn))
                del extra["onepass"]  # the base plan's, unchanged
            else:
                extra = {}
            variant = dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                          num_stages=3, **extra)
            if variant not in out:
                out.append(variant)
    if target != "interpreter" and not settings.mainloop and not tma_blocker(first.region):
        out += [dataclasses.replace(p, mainloop="tma", num_stages=max(p.num_stages, 3))
                for p in list(out) if p.schedule != "row_in_cta"]
    if target != "interpreter":
        # a persistent grid over the tiles with the tile and K loops fused, so that the next
        # tile's loads are in flight during this tile's epilogue (H200, ninth session, a
        # hand-written probe of it at 128x256x64: 1.007x / 0.959x cuBLAS at 8192x4096x4096 /
        # 8192x1024x1024 where one program per tile ran 0.980x / 0.912x)
        out += [dataclasses.replace(p, persistent=True) for p in list(out)
                if p.schedule == "tile" and p.mainloop == "tma" and not p.prefetch and not p.persistent]
    # (The split plan with the slice and K loops fused by Triton, ``flatten=True``, is not a
    # candidate: on the H200 it ran 1.43x / 1.18x cuBLAS's GEMM at 8192x4096x32768 / 128256
    # where the same plan with the loops apart ran 1.10x / 1.04x; ninth session.)
    if any({"M", "N"} <= set(i.axes) for i in first.region.inputs) and target != "interpreter" \
            and not settings.prefetch:
        # a residual read after the mainloop waits on DRAM with the SM otherwise idle (H200,
        # 2026-11-30: the epilogue after a cooperative strip's mainloop cost 3-12 us per strip)
        out += [dataclasses.replace(p, prefetch=True) for p in list(out)
                if p.schedule in ("cooperative", "row_in_cta", "tile") and p.block_m * p.block_n <= 128 * 128
                and not p.overlap and not p.persistent]
    if target == "cuda" and not settings.schedule and not settings.mainloop:
        # the warp-specialised template, where it applies (H200, 2026-12-01: LayerNorm at
        # 8192x4096x4096 1.11x cuBLAS's GEMM against torch.compile's 1.39x; at 8192x1024x1024
        # its last tile's epilogue is exposed and Inductor's two kernels win)
        ws = strip_template_plan(first.region, first.transposed, first.stages, first.forms, target, sm_count)
        if isinstance(ws, Plan):
            out.append(ws)
            if ws.template.residual is not None:  # residual by TMA during the mainloop, or after it
                out.append(dataclasses.replace(ws, prefetch=True))
        # the generated warp-specialised kernel, its exchanges merged unless COMFUSE_WS_MERGE=0
        # (H200, 2026-12-01: LayerNorm 8192x4096x4096 1.049x cuBLAS's GEMM merged, 1.112x not)
        gen = stages_template_plan(first.region, first.transposed, first.stages, first.forms, target, sm_count,
                                   **stages_options(settings))
        if isinstance(gen, Plan):  # both row layouts of its epilogue, unless COMFUSE_WS_LANES names one
            # (without COMFUSE_WS_LANES gen has 8 lanes; at 32 a thread's 8 columns are all its own)
            # (and 128-wide tiles take 8 lanes only)
            out += [gen] if settings.ws_lanes or gen.block_n != 256 else [gen, dataclasses.replace(gen, lanes=32, vec=0,
                                                                                                    roll=False)]
            # (on 128-wide tiles 64 rows, not 96: 4 mainloop warps beside 8 epilogue warps; a
            # guess from the warps' ratio, not yet timed)
            shared = 96 if gen.block_n == 256 else 64
            if not settings.ws_tail and not gen.tma_store and gen.lanes == 8:
                # and the last 96 rows of each program's last tile by its mainloop warps (H200,
                # seventeenth session, sustained, x cuBLAS's GEMM: at 8192x1024x1024 LayerNorm
                # 2.149x -> 1.937x, softmax 1.578x -> 1.472x, multi-stage 2.332x -> 2.304x,
                # RMSNorm 1.364x -> 1.372x; LayerNorm 16384x2048x8192 1.332x -> 1.260x; at
                # 8192x4096x4096 0.5-1.2 % slower: a candidate, not the default)
                out.append(dataclasses.replace(gen, tail=shared))
                # and, with a residual, that with the residual by TMA into the hand-off buffer and
                # nothing kept in it (H200, eighteenth session, sustained, x cuBLAS's GEMM:
                # LayerNorm 8192x1024x1024 1.939x -> 1.810x, 16384x2048x8192 1.255x -> 1.200x;
                # 8192x4096x4096 1.092x -> 1.135x, where the plain kernel's 1.068x wins); planned
                # as any ws_stages plan, so that its fields agree with the residual's form
                residual_form = None
                if not settings.ws_res_tma and gen.moments:
                    alt = stages_template_plan(first.region, first.transposed, first.stages, first.forms, target,
                                               sm_count, **dict(stages_options(settings), tail=shared, res_tma=True,
                                                                keep=False))
                    if isinstance(alt, Plan) and alt.res_tma:
                        out.append(alt)
                        residual_form = alt
                # and the first and third with each pass a loop over its chunks, not unrolled
                # (H200, twenty-first session, sustained, x cuBLAS's GEMM, with the shared tile:
                # at 8192x1024x1024 multi-stage 1.871x -> 1.587x, RMSNorm 1.152x -> 1.089x,
                # softmax and LayerNorm within 1 %; at 8192x4096x4096 0.4-4 % slower; autotuned
                # at 8192x1024x1024 the shared tile with loops won on all five row reductions;
                # on 128-wide tiles, correct on the H200 and no faster: 1.797x -> 1.872x,
                # twenty-second session)
                if gen.block_n == 256 and gen.rollable:
                    if not gen.roll:
                        out += [dataclasses.replace(gen, roll=True), dataclasses.replace(gen, tail=shared, roll=True)]
                        # (and the residual's form with loops: correct on the H200, twenty-first
                        # session, not yet timed; its output pass recomputes the value, more code)
                        if residual_form is not None:
                            out.append(dataclasses.replace(residual_form, roll=True))
                    # and, with loops, each program's last tile all its mainloop warps', handed
                    # off in the B ring (H200, twenty-second session, sustained, x cuBLAS's
                    # GEMM at 8192x1024x1024, against the shared tile with loops: multi-stage
                    # 1.604x -> 1.464x, LayerNorm 1.462x -> 1.378x)
                    # With an [M, N] input (a residual) its loops load each chunk's a chunk ahead
                    # (H200, twenty-third session, sustained, x cuBLAS's GEMM, LayerNorm
                    # 8192x1024x1024: 1.387x -> 1.347x, its first pass 12.8 -> 9.7 us a tile;
                    # without such an input the loops carry nothing and the form is the same)
                    if not gen.res_tma and not gen.lookahead:
                        ahead = any(inp.axes == frozenset("MN") for inp in first.region.inputs)
                        out.append(dataclasses.replace(gen, tail=128, roll=True, last_in_ring=True, lookahead=ahead))
        if first.schedule == "split":  # a loss over wide rows: the template's terminal kind
            lse = lse_template_plan(first.region, first.transposed, first.stages, first.forms, target)
            if isinstance(lse, Plan):
                out.append(lse)
    return out
