"""A warp-specialised Gluon kernel generated from a region's stages (the ``ws_stages`` plan).

The hand-written template (strip.py) computes a fixed family of epilogues. This generator
takes any row-form region whose reductions run along N and whose ops it writes
(``planner.gluon.STAGES_OPS``), and emits a kernel with the shared mainloop
(``parts.mma_partition``: persistent grid, TMA ring, WGMMA in 8 warps, the finished tile
handed through 64 KB of shared memory as bf16) and an epilogue partition of its own in 4
warps, generated from the IR:

- one pass over the tile (chunks of 16 rows) per exchange: the exchange's values, recomputed
  from the hand-off buffer and the statistics so far, reduced over the tile's 256 columns to
  per-row partials in a workspace [strips, exchanges, width, TILES_N, BM];
- one arrival on the strip's counter per exchange, a wait for the strip's other tiles, and
  the partials of all TILES_N tiles combined (sum, max, min; a merged pair by Chan's formula
  or online) into per-row statistics kept in shared memory for the later passes;
- a last pass computing and storing every output once ([M, N] outputs by every tile, per-row
  outputs by the strip's first tile).

The form (``planner.records.StagesForm``) chooses: ``lanes`` of a warp along a row (8 or 32),
``keep`` an exchange's value in the buffer when it is all the later passes need, ``tail`` rows
of each program's last tile run by the mainloop's warps once idle, ``res_tma`` (the residual
TMA-loaded into the buffer and added by the mainloop), ``roll`` (each pass a run-time loop over
its chunks), ``lookahead`` (with roll, [M, N] inputs loaded a chunk ahead), ``last_in_ring``
(the last tile handed off in the B ring, free by then).

The co-residency argument is the template's: every exchange waits only on tiles of the same
strip, which run in the same round of the persistent grid, and the counters (int64) only grow:
each exchange counts 2 TILES_N arrivals a strip, 2 from a whole tile, 1 from each part of a
shared one; all members make them in the same order, so the target
``(old // (2 TILES_N) + 1) * 2 TILES_N`` names the right exchange. With ``tail`` both parts of
the last tile write the same per-row statistics to ``stat_smem``, the same values to the same
places (each thread sums a column's partials in its own registers, so 4 warps and 8 round
alike), and neither reads a statistic before its own write and barrier.
"""
from __future__ import annotations

import dataclasses

import torch

from ...ir import Op, Region, format_region
from ...planner.gluon import tma_residual
from ...planner.reductions import Layout, layout_of
from ..source import docstring, flat_index, import_line, paren, times
from .values import Writer, is_tile

NEG_INF = 'float("-inf")'
CHUNK = 16  # rows of an epilogue chunk: several [16, 256] values live together (32 rows spilled)
EPI_WARPS = 4  # the epilogue partition's warps beside the mainloop's 8
EPI_REGS = 152  # its registers a thread (12 warps at the kernel's 168)
VEC = 8  # adjacent columns a lane takes at a time: a row's 8 lanes cover 128 bytes (no bank conflicts)


def emit(region: Region, stages, name: str, describe: str, form) -> str:
    """The generated module's source: ``{name}`` (the kernel), ``{name}_epilogue`` (its
    partition), ``{name}_tile`` (one tile's epilogue, by a group of warps over some of its
    chunks) and, with a shared last tile, ``{name}_main`` (the mainloop partition, then its
    share of that tile)."""
    residual = tma_residual(region) if form.res_tma else None
    lay = layout_of(stages, form.moments)
    w = Writer(region, lay, roll=form.roll, in_buffer=residual)
    keep = bool(form.moments) and form.keep and all(o.dtype in (torch.bfloat16, torch.float16)
                                                     for o in region.outputs)
    ptrs = ", ".join([f"in{j}_ptr" for j in range(len(region.inputs))] +
                     [f"out{k}_ptr" for k in range(len(region.outputs))] + (["r_desc"] if residual is not None else []))
    m = _Module(region, lay, w, name, ptrs, keep, form.tail, residual, form.lookahead, form.roll, form.last_in_ring)
    m.tile()
    m.epilogue()
    if form.tail:
        m.main()
    m.kernel(describe)
    return m.header(describe) + "\n".join(w.lines) + "\n"


@dataclasses.dataclass
class _Module:
    """The functions of a generated module (``emit``), written in order into one Writer."""
    region: Region
    lay: Layout
    w: Writer
    name: str
    ptrs: str  # the kernel's per-call arguments after A and B: pointers, then the residual's descriptor
    keep: bool
    tail: int
    residual: object  # the [M, N] input the mainloop adds into the tile (tma_residual), or None
    lookahead: bool = False  # with roll: each chunk's [M, N] inputs loaded a chunk ahead (chunk_head)
    roll: bool = False  # each pass a run-time loop over its chunks (parts.chunk_view), not unrolled
    last_in_ring: bool = False  # the program's last tile handed off in the B operand's ring, not the buffer

    def read(self) -> str:
        """Chunk c of the hand-off buffer, as it holds it (bf16)."""
        if self.roll:
            return "chunk_load(view, c, layout, PIECES)"
        return "tile_smem.slice(c * CHUNK, CHUNK, dim=0).load(layout)"

    def write(self, value: str) -> str:
        """A bf16 [CHUNK, BN] value written over chunk c of the hand-off buffer."""
        if self.roll:
            return f"chunk_store(view, c, {value}, layout, PIECES)"
        return f"tile_smem.slice(c * CHUNK, CHUNK, dim=0).store({value})"

    @property
    def E(self) -> int:
        return len(self.lay.exchanges)

    @property
    def whole_tail(self) -> bool:
        """Whether the mainloop warps take all of each program's last tile (a tail of BM rows):
        the epilogue partition's loop stops a tile early, so the last tile's exchanges need not
        wait for it to finish the tile before."""
        return self.tail == 128

    @property
    def stat_slots(self) -> int:  # (stat_smem's rows: one per statistic)
        return max(len(self.lay.slot), 1)

    @property
    def RES(self) -> int:  # (parts.mma_partition: 2, the buffer holds the tile's residual)
        return 0 if self.residual is None else 2

    def ws_slot(self, e: int, wi: int, tile: str) -> str:
        """The workspace row of exchange e's wi-th reduction for ``tile`` of the strip."""
        return flat_index("strip", (e, self.E), (wi, self.lay.width), (tile, "TILES_N"))

    def partials(self, e: int, wi: int, fill: str) -> str:
        """A load of exchange e's partials [TILES_P2, BM] of its wi-th reduction, all tiles of the strip."""
        return (f"gl.load(ws_ptr + {paren(self.ws_slot(e, wi, 'prow[:, None]'))} * BM + pcol[None, :], mask=pmask, "
                f"other={fill}, cache_modifier=\".cg\")")

    def tile_call(self, smem: str, stat: str, c_lo: str, c_hi: str, share: str, indent: int, rows: str = "CHUNK",
                  warps: str = "EPI_WARPS") -> None:
        """A call of ``{name}_tile`` on chunks [c_lo, c_hi) of tile t, its ``share`` of arrivals."""
        L = self.w.line
        L(f"{self.name}_tile({smem}, {stat}, {self.ptrs}, ws_ptr, counter_ptr, t, M, N,", indent)
        L(f"c_lo={c_lo}, c_hi={c_hi}, share={share}, TILES_N=TILES_N, TILES_P2=TILES_P2, BM=BM, BN=BN,", indent + 4)
        L(f"CHUNK={rows}, WARPS={warps}, LANES_N=LANES_N)", indent + 4)

    def tile(self) -> None:
        """``{name}_tile``: one tile's epilogue over a range of its chunks, by a group of warps."""
        region, lay, L, E, name, ptrs = self.region, self.lay, self.w.line, self.E, self.name, self.ptrs
        L("@gluon.jit", 0)
        # (a run-time chunk range: as constexpr, a shared tile's two epilogue calls ran 8 % slower)
        L(f"def {name}_tile(tile_smem, stat_smem, {ptrs}, ws_ptr, counter_ptr, t, M, N, c_lo, c_hi, share,", 0)
        L("TILES_N: gl.constexpr, TILES_P2: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,", 8)
        L("CHUNK: gl.constexpr, WARPS: gl.constexpr, LANES_N: gl.constexpr):", 8)
        L(f'"""Tile t\'s epilogue over its chunks [c_lo, c_hi) by WARPS warps: {E} exchange(s), then the outputs '
          '(see the', 1)
        L("module docstring); ``share``: this group's arrivals at each exchange (2 for the whole tile, 1 for a", 1)
        L('part of the program\'s last tile)."""', 1)
        # LANES_N lanes of a warp share a row (a row's reduction takes log2(LANES_N) shuffles), each
        # with VEC adjacent columns at a time
        L(f"layout: gl.constexpr = gl.BlockedLayout([1, {VEC}], [32 // LANES_N, LANES_N], [WARPS, 1], [1, 0])", 1)
        L("row_l: gl.constexpr = gl.SliceLayout(1, layout)", 1)
        L("rows = gl.arange(0, CHUNK, layout=row_l)", 1)
        L("cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))", 1)
        if self.roll:
            # (VEC * LANES_N == 64: a row's lanes span one 64-column block of the buffer)
            L("PIECES: gl.constexpr = BN // 64", 1)
            L("view = chunk_view(tile_smem, CHUNK)  # chunk c by a run-time index", 1)
            L(f"stat_rows = stat_smem._reinterpret(gl.float32, [{times('(BM // CHUNK)', self.stat_slots)}, CHUNK], "
              "gl.SwizzledSharedLayout(1, 1, 1, [0]))", 1)
        if self.tail:
            # both groups combine the strip's partials of the shared tile and write the same
            # stat_smem places, so the sums must agree to the bit whatever WARPS: each thread
            # sums its column's TILES_P2 partials itself (no reduction across warps)
            L("part_l: gl.constexpr = gl.BlockedLayout([TILES_P2, 1], [1, 32], [1, WARPS], [0, 1])", 1)
        else:
            L("part_l: gl.constexpr = gl.BlockedLayout([1, BM // 32], [1, 32], [WARPS, 1], [1, 0])", 1)
        L("prow = gl.arange(0, TILES_P2, layout=gl.SliceLayout(1, part_l))", 1)
        L("pcol = gl.arange(0, BM, layout=gl.SliceLayout(0, part_l))", 1)
        L("pmask = (prow < TILES_N)[:, None] & (pcol < BM)[None, :]", 1)
        L("strip = t // TILES_N", 1)
        L("tn = t % TILES_N", 1)
        L("col = tn * BN + cols", 1)
        for j, inp in enumerate(region.inputs):
            if inp.axes == frozenset("N"):
                L(f"vec{j} = gl.load(in{j}_ptr + col).to(gl.float32)  # {inp.name}", 1)
        for e, reds in enumerate(lay.exchanges):
            self.exchange(e, reds)
        self.outputs()

    def chunk_head(self, nodes) -> None:
        """A pass's loop over the chunks [c_lo, c_hi), to each chunk's rows and its tile values
        ``acc``. With ``lookahead`` (and ``roll``) the loop carries the [M, N] inputs among
        ``nodes`` a chunk ahead, so that their latency passes under this chunk's work."""
        L, w = self.w.line, self.w
        reads = sorted({self.region.nodes[i].arg for i in nodes if self.region.nodes[i].op is Op.INPUT
                        and self.region.inputs[self.region.nodes[i].arg].axes == frozenset("MN")
                        and self.region.nodes[i].arg != w.in_buffer})
        carried = reads if self.lookahead else []
        if self.roll:  # (the body at 3 as when unrolled: the writer puts it one level in)
            if carried:
                L("row = strip * BM + gl.minimum(c_lo, BM // CHUNK - 1) * CHUNK + rows  # (a row of the tile)", 1)
                for j in carried:
                    L(f"nxt{j} = gl.load(in{j}_ptr + row[:, None] * N + col[None, :])  "
                      f"# {self.region.inputs[j].name}", 1)
            L("for c in range(c_lo, c_hi):", 1)
            w.rolled = True
        else:
            L("for c in gl.static_range(BM // CHUNK):", 1)
            L("if (c_lo <= c) & (c < c_hi):", 2)
        L("row = strip * BM + c * CHUNK + rows", 3)
        w.loaded = {}
        if carried:  # this chunk's, then the next one's (the last chunk loads itself again)
            L("ahead = strip * BM + gl.minimum(c + 1, c_hi - 1) * CHUNK + rows", 3)
            for j in carried:
                L(f"cur{j} = nxt{j}", 3)
                L(f"nxt{j} = gl.load(in{j}_ptr + ahead[:, None] * N + col[None, :])  "
                  f"# {self.region.inputs[j].name}, a chunk ahead", 3)
            w.loaded = {j: f"cur{j}" for j in carried}
        L(f"acc = {self.read()}.to(gl.float32)", 3)

    def exchange(self, e: int, reds) -> None:
        """Exchange e of a tile: its pass over the chunks, the strip's partials published and
        waited for, and combined into statistics."""
        region, lay, w, L = self.region, self.lay, self.w, self.w.line
        L(f"# ---- exchange {e}: {', '.join(f'%{r} {region.nodes[r].op.value}' for r in reds)} ----", 1)
        # (a merged second is computed from its first's value: its own source needs the first)
        sources = sorted({region.nodes[lay.second[r][1] if r in lay.second else r].src[0] for r in reds})
        self.chunk_head(w.closure(sources))
        w.values(w.closure(sources), 3)
        later = [region.nodes[r].src[0] for g in lay.exchanges[e + 1:] for r in g] + [o.node for o in region.outputs]
        keep_now = None
        if self.keep and len(sources) == 1 and sources[0] != w.stored and not is_tile(region, sources[0]) \
                and region.nodes[sources[0]].axes == frozenset("MN") and w.keepable(sources[0], later):
            keep_now = x = sources[0]
            L(f"v{x} = bf16_pairs({w.ref(x)})  # %{x}, rounded as eager's bf16 op rounds it, and kept for the later "
              "passes", 3)
            w.own.add(x)
            L(self.write(f"v{x}"), 3)
            L(f"v{x} = v{x}.to(gl.float32)", 3)
        for wi, r in enumerate(reds):
            slot = f"ws_ptr + {paren(self.ws_slot(e, wi, 'tn'))} * BM + c * CHUNK + rows"
            if r in lay.second:  # the tile's own moment about its max / mean (see merge_pairs)
                kind, r1 = lay.second[r]
                x = w.ref(region.nodes[r1].src[0])
                if kind == "lse":
                    L(f"gl.store({slot}, gl.sum(exp_fast({x} - gl.max({x}, axis=1)[:, None]), axis=1))  # %{r} "
                      f"(online, with %{r1})", 3)
                else:
                    L(f"dev = {x} - (gl.sum({x}, axis=1) / BN)[:, None]", 3)
                    L(f"gl.store({slot}, gl.sum(dev * dev, axis=1))  # %{r} (the tile's M2, with %{r1})", 3)
                continue
            red = {Op.SUM: "gl.sum", Op.RMAX: "gl.max", Op.RMIN: "gl.min"}[region.nodes[r].op]
            src = w.ref(region.nodes[r].src[0])
            if region.nodes[region.nodes[r].src[0]].axes != frozenset("MN"):  # a broadcast value: over 256 columns
                src = f"(gl.full([CHUNK, BN], 0.0, gl.float32, layout) + {src})"
            L(f"gl.store({slot}, {red}({src}, axis=1))", 3)
        L("gl.thread_barrier()  # every warp has published its partials", 1)
        # 2 TILES_N arrivals an exchange: a whole tile makes 2, each part of a shared one 1
        L("old = gl.atomic_add(counter_ptr + strip, share, sem=\"acq_rel\", scope=\"gpu\")", 1)
        L("target = (old // (2 * TILES_N) + 1) * (2 * TILES_N)", 1)
        L("seen = gl.atomic_add(counter_ptr + strip, 0, sem=\"acquire\", scope=\"gpu\")", 1)
        L("while seen < target:", 1)
        L("seen = gl.atomic_add(counter_ptr + strip, 0, sem=\"acquire\", scope=\"gpu\")", 2)
        L("gl.thread_barrier()", 1)
        self.combine(e, reds)
        if keep_now is not None:
            w.stored = keep_now

    def combine(self, e: int, reds) -> None:
        """Exchange e's partials of every tile of the strip, each reduction's loaded once,
        combined into the statistics in ``stat_smem``."""
        region, lay, L = self.region, self.lay, self.w.line
        loaded = {}  # reduction index within the exchange -> the variable holding its partials

        def part(wi: int, fill: str) -> str:
            if wi not in loaded:
                loaded[wi] = f"part{wi}"
                L(f"part{wi} = {self.partials(e, wi, fill)}", 1)
            return loaded[wi]
        for wi, r in enumerate(reds):
            op = region.nodes[r].op
            if r in lay.second:
                kind, r1 = lay.second[r]
                w1 = reds.index(r1)
                if kind == "lse":  # sum_t s_t exp(m_t - m)
                    tile_m = part(w1, NEG_INF)
                    L(f"row_m = gl.max({tile_m}, axis=0)", 1)
                    L(f"scaled = gl.where(pmask, {part(wi, '0.0')} * exp_fast({tile_m} - row_m[None, :]), 0.0)", 1)
                else:  # Chan: sum_t M2_t + BN (mean_t - mean)^2
                    tile_sum = part(w1, "0.0")
                    L(f"dm = gl.where(pmask, {tile_sum} / BN - (gl.sum({tile_sum}, axis=0) / N)[None, :], 0.0)", 1)
                    L(f"scaled = {part(wi, '0.0')} + BN * dm * dm", 1)
                L(f"stat_smem.index({lay.slot[r][2]}).store(gl.sum(scaled, axis=0))  # %{r} (merged with %{r1})", 1)
                continue
            fill = {Op.SUM: "0.0", Op.RMAX: NEG_INF, Op.RMIN: 'float("inf")'}[op]
            red = {Op.SUM: "gl.sum", Op.RMAX: "gl.max", Op.RMIN: "gl.min"}[op]
            L(f"stat_smem.index({lay.slot[r][2]}).store({red}({part(wi, fill)}, axis=0))  # %{r}", 1)
        L("gl.thread_barrier()", 1)

    def outputs(self) -> None:
        """The last pass: every output written once."""
        region, w, L = self.region, self.w, self.w.line
        L("# ---- the outputs, each written once ----", 1)
        full = [o for o in region.outputs if o.axes == frozenset("MN")]
        per_row = [o for o in region.outputs if o.axes == frozenset("M")]
        self.chunk_head(w.closure([o.node for o in region.outputs]))
        w.values(w.closure([o.node for o in full]), 3)
        for k, o in enumerate(region.outputs):
            if o in full:
                val = w.ref(o.node)
                if region.nodes[o.node].axes != frozenset("MN"):
                    val = f"gl.full([CHUNK, BN], 0.0, gl.float32, layout) + {val}"
                L(f"gl.store(out{k}_ptr + row[:, None] * N + col[None, :], ({val}).to(out{k}_ptr.dtype.element_ty))"
                  f"  # {o.name}", 3)
        if per_row:
            L("if tn == 0:  # per-row outputs, by the strip's first tile", 3)
            done = set(w.closure([o.node for o in full]))
            w.values([i for i in w.closure([o.node for o in per_row]) if i not in done], 4)
            for k, o in enumerate(region.outputs):
                if o in per_row:
                    L(f"gl.store(out{k}_ptr + row, gl.max(gl.full([CHUNK, BN], 0.0, gl.float32, layout) + "
                      f"{w.ref(o.node)}, axis=1).to(out{k}_ptr.dtype.element_ty))  # {o.name}", 4)
        L("gl.thread_barrier()  # every warp has read the tile", 1)

    def epilogue(self) -> None:
        """``{name}_epilogue``: the epilogue partition's loop over its program's tiles."""
        region, L, name, ptrs, tail, residual = self.region, self.w.line, self.name, self.ptrs, self.tail, \
            self.residual
        L("", 0)
        L("", 0)
        L("@gluon.jit", 0)
        spare = "spare_smem, spare_stat, spare_ready, " if self.last_in_ring else ""
        L(f"def {name}_epilogue(tile_smem, stat_smem, tile_ready, tile_free, {spare}{ptrs}, ws_ptr, counter_ptr,", 0)
        L("num_tiles, M, N, TILES_N: gl.constexpr, TILES_P2: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,", 8)
        L("CHUNK: gl.constexpr, EPI_WARPS: gl.constexpr, LANES_N: gl.constexpr):", 8)
        L('"""The epilogue partition: each of the program\'s tiles as it is handed off."""', 1)
        if residual is not None:
            L(f"# the first tile's {region.inputs[residual].name} into the buffer; the mainloop adds it to its tile", 1)
            L("load_residual(r_desc, tile_smem, tile_free, gl.program_id(0), num_tiles, TILES_N, BM, BN)", 1)
        L("n = 0", 1)
        if self.whole_tail:  # the last tile's rows all the mainloop warps': its exchanges too
            L("# the program's last tile is the mainloop warps' alone, rows, arrivals and all", 1)
            L("for t in range(gl.program_id(0), num_tiles - gl.num_programs(0), gl.num_programs(0)):", 1)
        else:
            L("for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):", 1)
        if not self.last_in_ring or self.whole_tail:  # (in the ring, each branch waits for its own buffer)
            L("mbarrier.wait(tile_ready, n & 1)", 2)
        first_rows = f"BM // CHUNK - {tail} // CHUNK"
        if tail and not self.whole_tail and self.last_in_ring:
            # (the last tile in the ring, its statistics apart: this tile's still in use)
            L("if t + gl.num_programs(0) >= num_tiles:  # the last tile: its last rows are the mainloop warps'", 2)
            L("mbarrier.wait(spare_ready, 0)", 3)
            self.tile_call("spare_smem", "spare_stat", "0", first_rows, "1", 3)
            L("else:", 2)
            L("mbarrier.wait(tile_ready, n & 1)", 3)
            self.tile_call("tile_smem", "stat_smem", "0", "BM // CHUNK", "2", 3)
        elif tail and not self.whole_tail:
            L(f"# the program's last tile: its last {tail} rows go to the mainloop's warps, idle by then", 2)
            L("last = (t + gl.num_programs(0) >= num_tiles).to(gl.int32)", 2)
            self.tile_call("tile_smem", "stat_smem", "0", f"BM // CHUNK - last * ({tail} // CHUNK)", "2 - last", 2)
        else:
            self.tile_call("tile_smem", "stat_smem", "0", "BM // CHUNK", "2", 2)
        if residual is not None:  # the buffer is free: the next tile's residual into it, which frees it
            L("fence_async_shared()  # the buffer's generic reads and writes, before the TMA engine writes it", 2)
            L("load_residual(r_desc, tile_smem, tile_free, t + gl.num_programs(0), num_tiles, TILES_N, BM, BN)", 2)
        else:
            L("mbarrier.arrive(tile_free)", 2)
        L("n += 1", 2)

    def mma(self, indent: int, call: bool) -> None:
        """The shared mainloop: a call (``call``, from ``{name}_main``) or warp_specialize's entry."""
        L = self.w.line
        if call:
            smem, ready, ring = ("spare_smem", "spare_ready", "True") if self.last_in_ring else \
                ("tile_smem", "tile_ready", "False")
            L("mma_partition(a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, tile_ready, tile_free, num_tiles, "
              "k_steps,", indent)
            L(f"RES={self.RES}, B_KMAJOR=B_KMAJOR, TILES_N=TILES_N, GROUP_M=0, BM=BM, BN=BN, BK=BK,", indent + 5)
            L(f"num_warps=num_warps, spare_smem={smem}, spare_ready={ready}, SPARE={ring})", indent + 5)
            return
        L("(mma_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, tile_ready, tile_free, num_tiles,", indent)
        L("k_steps, RES, B_KMAJOR, TILES_N, GROUP_M, BM, BN, BK, num_warps, tile_smem, tile_ready, IN_RING)),",
          indent + 4)

    def main(self) -> None:
        """``{name}_main``: the mainloop partition, then its share of the program's last tile."""
        L, name, ptrs, tail = self.w.line, self.name, self.ptrs, self.tail
        L("", 0)
        L("", 0)
        L("@gluon.jit", 0)
        spare = "spare_smem, spare_stat, spare_ready, " if self.last_in_ring else ""
        L(f"def {name}_main(a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, stat_smem, tile_ready, tile_free, "
          f"{spare}{ptrs},", 0)
        L("ws_ptr, counter_ptr, num_tiles, k_steps, M, N, B_KMAJOR: gl.constexpr, TILES_N: gl.constexpr,", 8)
        L("TILES_P2: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, CHUNK: gl.constexpr,", 8)
        L("EPI_WARPS: gl.constexpr, LANES_N: gl.constexpr, num_warps: gl.constexpr):", 8)
        L(f'"""The mainloop partition; then, its warps idle, the last {tail} rows of the program\'s last tile\'s', 1)
        L('epilogue (its first rows are the epilogue partition\'s)."""', 1)
        self.mma(1, call=True)
        L("my_tiles = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0))", 1)
        L("t = gl.program_id(0) + (my_tiles - 1) * gl.num_programs(0)", 1)
        # (the buffer holds the tile: mma_partition's last barrier follows its store.) Chunks of
        # MC rows: each thread holds as many of a chunk's values as an epilogue warp's thread, in
        # the same layout, and a row lies within one warp (no reduction across warps)
        L("MC: gl.constexpr = CHUNK * num_warps // EPI_WARPS", 1)
        here = ("spare_smem", "spare_stat") if self.last_in_ring else ("tile_smem", "stat_smem")
        # (a part of the tile makes 1 arrival at each exchange, the whole tile 2)
        self.tile_call(*here, f"(BM - {tail}) // MC", "BM // MC", "2" if self.whole_tail else "1", 1, rows="MC",
                       warps="num_warps")

    def kernel(self, describe: str) -> None:
        """``{name}``: the kernel, its shared memory and barriers, and the two partitions."""
        L, name, ptrs, tail = self.w.line, self.name, self.ptrs, self.tail
        L("", 0)
        L("", 0)
        L("@gluon.jit", 0)
        L(f"def {name}(a_desc, b_desc, {ptrs}, ws_ptr, counter_ptr, M, N, K,", 0)
        L("B_KMAJOR: gl.constexpr, BN: gl.constexpr, TILES_N: gl.constexpr, TILES_P2: gl.constexpr,", 4)
        L("STAGES: gl.constexpr, CHUNK: gl.constexpr, EPI_WARPS: gl.constexpr, EPI_REGS: gl.constexpr,", 4)
        L("num_warps: gl.constexpr, LANES_N: gl.constexpr = 32):", 4)
        L(f'"""{describe}"""', 1)
        L("BM: gl.constexpr = a_desc.block_type.shape[0]", 1)
        L("BK: gl.constexpr = a_desc.block_type.shape[1]", 1)
        if not tail:
            L(f"RES: gl.constexpr = {self.RES}  # 2: the hand-off buffer holds the tile's residual first", 1)
            L("GROUP_M: gl.constexpr = 0  # the tiles in row-strip order", 1)
            L("IN_RING: gl.constexpr = False  # every tile handed off in the buffer", 1)
        L("a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)", 1)
        L("b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)", 1)
        L("tile_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], TILE_LAYOUT)", 1)
        L(f"stat_smem = gl.allocate_shared_memory(gl.float32, [{self.stat_slots}, BM], "
          "gl.SwizzledSharedLayout(1, 1, 1, [0]))", 1)
        L("ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())", 1)
        L("tile_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())", 1)
        L("tile_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())", 1)
        if self.last_in_ring:  # the last tile's hand-off in the B ring (free by then) and its own statistics
            L("spare_smem = b_bufs._reinterpret(gl.bfloat16, [BM, BN], TILE_LAYOUT)", 1)
            L(f"spare_stat = gl.allocate_shared_memory(gl.float32, [{self.stat_slots}, BM], "
              "gl.SwizzledSharedLayout(1, 1, 1, [0]))", 1)
            L("spare_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())", 1)
        L("for i in gl.static_range(STAGES):", 1)
        L("mbarrier.init(ready.index(i), count=1)", 2)
        L("mbarrier.init(tile_ready, count=1)", 1)
        L("mbarrier.init(tile_free, count=1)", 1)
        if self.last_in_ring:
            L("mbarrier.init(spare_ready, count=1)", 1)
        L("fence_async_shared()", 1)
        L("num_tiles = (M // BM) * TILES_N", 1)
        L("k_steps = gl.cdiv(K, BK)", 1)
        L("gl.warp_specialize([", 1)
        spare = "spare_smem, spare_stat, spare_ready, " if self.last_in_ring else ""
        if tail:
            L(f"({name}_main, (a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, stat_smem, tile_ready, tile_free, "
              f"{spare}{ptrs},", 2)
            L("ws_ptr, counter_ptr, num_tiles, k_steps, M, N, B_KMAJOR, TILES_N, TILES_P2, BM, BN, BK, CHUNK,", 5)
            L("EPI_WARPS, LANES_N, num_warps)),", 5)
        else:
            self.mma(2, call=False)
        L(f"({name}_epilogue, (tile_smem, stat_smem, tile_ready, tile_free, {spare}{ptrs}, ws_ptr, counter_ptr,", 2)
        L("num_tiles, M, N, TILES_N, TILES_P2, BM, BN, CHUNK, EPI_WARPS, LANES_N)),", 5)
        L("], [EPI_WARPS], [EPI_REGS])", 1)

    def header(self, describe: str) -> str:
        """The module's docstring (the region's IR) and imports."""
        helpers = ["TILE_LAYOUT", "bf16_pairs"] + (["chunk_load", "chunk_store", "chunk_view"] if self.roll else []) + \
            ["exp_fast", "expm1"] + (["load_residual"] if self.residual is not None else []) + \
            ["log1p", "mma_partition", "tanh_fast"]
        return "\n".join(docstring(self.name, describe, format_region(self.region)) + [
            "from triton.experimental import gluon",
            "from triton.experimental.gluon import language as gl",
            "from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier",
            "",
            *import_line("comfuse.codegen.gluon.parts", helpers),
            "", "", ""])


def workspace_numel(M: int, N: int, stages, pairs=()) -> int:
    lay = layout_of(stages, pairs)
    return (M // 128) * max(len(lay.exchanges), 1) * lay.width * (N // 256) * 128
