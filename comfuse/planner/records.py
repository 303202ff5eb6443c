"""The planner's results: a ``Plan`` (a schedule, its tile, its form) or ``NotFused`` (why not).

A plan's fields common to every schedule are the region in row form, the stages, the tile
and the mainloop's loads. What one schedule alone needs is its *form*, a record of its own
(``TileForm``, ``CooperativeForm``, ``SplitForm``, ``StripForm``, ``LseForm``,
``StagesForm``): its analysis results (exchanges, merged pairs, a matched template) and its
code-generation variants, the fields autotuning chooses among (``planner.candidates``).
"""
from __future__ import annotations

import dataclasses

from ..ir import Region
from .stages import Stage

# fields of a form that are derived from the region, not chosen: left out of a kernel's name
# (the region is hashed already) and refused by COMFUSE_PLAN
DERIVED = ("onepass", "template", "exchanges", "exchange_width", "moments")


@dataclasses.dataclass(frozen=True, slots=True)
class TileForm:
    """``tile`` (independent output tiles) and ``row_in_cta`` (a program owns whole rows)."""
    prefetch: bool = False  # whole-tile side inputs (a residual) loaded before the mainloop
    persistent: bool = False  # tile, TMA: one program per SM walks the tiles, tile and K loops fused

    def describe(self) -> str:
        return ("; side inputs loaded before the mainloop" if self.prefetch else "") + \
            ("; persistent grid, tile and K loops fused" if self.persistent else "")


@dataclasses.dataclass(frozen=True, slots=True)
class CooperativeForm:
    """``cooperative``: the TILES_N programs of a row strip exchange per-tile partials."""
    exchanges: int  # per strip: the stages that end in reductions, less the merged ones
    exchange_width: int  # most arrays published at one exchange
    moments: tuple = ()  # (sum, sum of squared deviations) node pairs exchanged at once (Chan)
    prefetch: bool = False

    def describe(self) -> str:
        return "; side inputs loaded before the mainloop" if self.prefetch else ""


@dataclasses.dataclass(frozen=True, slots=True)
class SplitForm:
    """``split``: per-row outputs only; programs reduce slices of N to mergeable statistics,
    in grouped order with the tile's work inlined in the slice loop, then a combine kernel."""
    chunks: int  # programs per row block, each reducing a slice of N
    tiles_per_chunk: int  # N tiles one program walks
    onepass: object  # the region's one-pass form (planner.onepass)

    def describe(self) -> str:
        stats = ", ".join(s.kind for s in self.onepass.stats)
        return (f", statistics ({stats}) over {self.chunks} slices of {self.tiles_per_chunk} tiles per row "
                "block in grouped order, then a combine")


@dataclasses.dataclass(frozen=True, slots=True)
class StripForm:
    """``ws_strip``: the warp-specialised Gluon template (LayerNorm, RMSNorm, softmax)."""
    template: object  # the planner.template.StripTemplate the region matched
    residual_tma: bool = False  # the residual TMA-loaded into the hand-off buffer during the mainloop

    def describe(self) -> str:
        return "; residual TMA-loaded during the mainloop" if self.residual_tma else ""


@dataclasses.dataclass(frozen=True, slots=True)
class LseForm:
    """``ws_split``: the template's terminal kind (per-row log-sum-exp and a target's logit)."""
    template: object
    onepass: object


@dataclasses.dataclass(frozen=True, slots=True)
class StagesForm:
    """``ws_stages``: the warp-specialised Gluon kernel generated from the region's stages."""
    exchanges: int  # strip exchanges, the merged pairs sharing one
    moments: tuple = ()  # the merged exchanges, ((kind, first, second), ...) (reductions.merge_pairs)
    lanes: int = 8  # lanes of a warp along a row of an epilogue chunk: 8 or 32
    tail: int = 0  # rows of each program's last tile whose epilogue the mainloop warps run (0-128, by 32)
    res_tma: bool = False  # the residual TMA-loaded into the hand-off buffer, added by the mainloop
    keep: bool = True  # an exchange's value kept in the hand-off buffer for the later passes
    roll: bool = False  # each epilogue pass a run-time loop over its chunks, not unrolled
    last_in_ring: bool = False  # with tail, the last tile handed off in the B operand's ring
    lookahead: bool = False  # with roll, each chunk's [M, N] inputs loaded a chunk ahead

    def describe(self) -> str:
        text = f"{self.lanes} lanes a row"
        if self.moments:
            text = f"{', '.join(k for k, _, _ in self.moments)} pairs merged; " + text
        extras = [(self.tail, f"the mainloop warps take the last {self.tail} rows of the last tile"),
                  (self.res_tma, "the residual by TMA into the hand-off buffer, added by the mainloop"),
                  (self.moments and not self.keep, "nothing kept in the buffer"),
                  (self.roll, "each pass a loop over its chunks, not unrolled"),
                  (self.lookahead, "each chunk's [M, N] inputs loaded a chunk ahead"),
                  (self.last_in_ring, "the last tile handed off in the B ring")]
        return "; ".join([text] + [words for on, words in extras if on])


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    region: Region  # the region in row form (reductions along N only)
    transposed: bool  # the source region reduced along M; operands and views are swapped
    schedule: str
    stages: tuple[Stage, ...]
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    ir_forms: tuple  # (pass name, region) for every intermediate form, for explain
    tiles_n: int = 1  # tiles per row strip
    mainloop: str = "pointer"  # "pointer": masked loads; "tma": tensor descriptors (Hopper)
    form: object = None  # the schedule's own record (above)

    def key_fields(self) -> tuple:
        """(name, value) of every choice the kernel's source depends on besides the region."""
        common = tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                       if f.name not in ("region", "stages", "ir_forms", "form"))
        form = () if self.form is None else tuple(
            (f.name, getattr(self.form, f.name)) for f in dataclasses.fields(self.form) if f.name not in DERIVED)
        return common + ((type(self.form).__name__, form),)

    def describe(self) -> str:
        f, tile = self.form, f"{self.block_m}x{self.block_n}x{self.block_k} tiles"
        if self.schedule == "ws_stages":
            return (f"ws_stages: warp-specialised Gluon kernel generated from the region's {len(self.stages)} "
                    f"stage(s); persistent grid of {tile}, TMA mainloop in {self.num_warps} warps, the epilogue in "
                    f"4 warps of its own beside the next tile's mainloop; {self.tiles_n} tiles per row strip "
                    f"exchange per-row partials {f.exchanges} time(s), then write each output once; "
                    f"{f.describe()}")
        if self.schedule == "ws_split":
            return (f"ws_split: warp-specialised Gluon template computing the {f.template.describe()}; "
                    f"persistent grid of {tile} in grouped order, TMA mainloop in 8 warps, the epilogue in 4 warps "
                    f"of its own beside the next tile's mainloop; one fp32 log-sum-exp per row and tile "
                    f"({self.tiles_n} per row), then a combine kernel")
        if self.schedule == "ws_strip":
            return (f"ws_strip: warp-specialised Gluon template computing {f.template.describe()}; persistent "
                    f"grid of {tile}, TMA mainloop in 8 warps, the epilogue in 4 warps of its own beside the next "
                    f"tile's mainloop; {self.tiles_n} tiles per row strip exchange per-row partials through "
                    f"global memory{f.describe()}")
        strip = "column strip (reductions along M, run transposed)" if self.transposed else \
            ("row strip (reductions along N)" if self.region.reductions() else "no reductions")
        middle = ""
        if self.schedule == "cooperative":
            middle = f", {self.tiles_n} tiles per strip exchange {f.exchanges} time(s)"
        elif self.schedule == "split":
            middle = f.describe()
        extra = "" if self.schedule == "split" else f.describe()
        return (f"{self.schedule}: {strip}; {len(self.stages)} stage(s){middle}; {self.mainloop} mainloop, tile "
                f"{self.block_m}x{self.block_n}x{self.block_k}, {self.num_warps} warps, {self.num_stages} pipeline "
                f"stages{extra}")


@dataclasses.dataclass(frozen=True, slots=True)
class NotFused:
    reason: str
    ir_forms: tuple = ()
