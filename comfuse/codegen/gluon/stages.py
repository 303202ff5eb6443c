"""A warp-specialised Gluon kernel generated from a region's stages (the ``ws_stages`` plan).

The hand-written template (strip.py) computes a fixed family of epilogues (LayerNorm, RMSNorm,
softmax, cross-entropy's statistics). This generator takes any row-form region whose
reductions run along N and whose ops it can write in Gluon, and emits a kernel with the
template's mainloop (``strip._mma_partition``: persistent grid, TMA ring, WGMMA in 8 warps,
the finished tile handed through 64 KB of shared memory as bf16, which rounds it as eager's
bf16 GEMM rounds its output) and an epilogue partition of its own, generated from the IR:

- one pass over the tile (4 chunks of 32 rows) per stage that ends in reductions: the stage's
  values, recomputed from the hand-off buffer and the statistics so far, reduced over the
  tile's 256 columns to per-row partials in a workspace [strips, exchanges, width, TILES_N, BM];
- one arrival on the strip's counter per such stage, a wait for the strip's other tiles, and
  the partials of all TILES_N tiles combined (sum, max or min) into per-row statistics kept in
  shared memory for the later passes;
- a last pass computing and storing every output once ([M, N] outputs by every tile; per-row
  outputs would go from the strip's first tile, but ``blocker`` refuses them until that path
  has run on a GPU).

Each stage's values are recomputed in every later pass rather than kept (the tile does not
fit in the epilogue warps' registers). The exchanges are plain reductions, so LayerNorm takes
two (the mean, then the squared deviations) where the template's Welford merge takes one.
The co-residency argument is the template's (strip.py): every exchange waits only on tiles
of the same strip, which run in the same round of the persistent grid, and the counters (int64)
only grow: each exchange counts 2 TILES_N arrivals a strip, 2 from a whole tile, 1 from each
part of a shared one (below); all members make them in the same order, so the target
``(old // (2 TILES_N) + 1) * 2 TILES_N`` names the right exchange.

With ``tail`` (``Plan.tail``) the mainloop's 8 warps, idle once the program's last tile is
handed off, run that tile's last ``tail`` rows through the same per-tile function while the
epilogue partition runs its first rows. No wait is added: the mainloop warps' part needs
nothing from the epilogue partition but its arrivals, and those come after its earlier tiles.
Both parts write the same per-row statistics of that tile to ``stat_smem``, the same values
to the same places (each combines all partials of the strip, each thread a column's partials
in its own registers, so that 4 warps and 8 round alike), and neither reads a statistic
before its own write and barrier, so the shared writes are benign.
"""
from __future__ import annotations

import dataclasses

import torch

from ...ir import REDUCE, Op, Region, format_region
from ..triton.emit import _INFIX, _literal

# one source: the Gluon text of each op, "{0}" its operand (binary ops: emit.py's _INFIX)
_UNARY = {Op.ABS: "gl.abs({0})", Op.EXP: "exp_fast({0})", Op.LOG: "gl.log({0})", Op.SQRT: "gl.sqrt({0})",
          Op.LOG1P: "log1p({0})", Op.EXPM1: "expm1({0})",
          Op.RSQRT: "gl.rsqrt({0})", Op.ERF: "gl.erf({0})", Op.SIN: "gl.sin({0})", Op.COS: "gl.cos({0})",
          Op.TANH: "tanh_fast({0})", Op.NEG: "-{0}", Op.RECIPROCAL: "1.0 / {0}", Op.RELU: "gl.maximum({0}, 0.0)",
          Op.SIGMOID: "1.0 / (1.0 + exp_fast(-{0}))", Op.NOT: "{0} == 0"}
_OTHER = {Op.CAST, Op.POW, Op.MAX, Op.MIN, Op.WHERE, Op.ACC, Op.INPUT, Op.CONST, Op.IOTA}
SUPPORTED = frozenset(_INFIX) | frozenset(_UNARY) | _OTHER | REDUCE
MAX_EXCHANGES = 6
NEG_INF = 'float("-inf")'
MAX_STATS = 16


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the region's reductions go: one exchange per stage that ends in reductions, less
    the merged ones; ``slot[r]`` is reduction node r's (exchange, index within it, index among
    all statistics); ``second[r]``: (kind, first) where r is merged into its first's exchange."""
    exchanges: tuple  # per exchange: its reduction nodes
    slot: dict
    second: dict = dataclasses.field(default_factory=dict)
    first: dict = dataclasses.field(default_factory=dict)  # first -> (kind, second)

    @property
    def width(self) -> int:
        return max((len(e) for e in self.exchanges), default=1)


def _short(dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


NARROW_OPS = (Op.ADD, Op.SUB, Op.MUL)


def narrow_nodes(region: Region, in_buffer=None) -> frozenset:
    """The nodes the generated kernel can compute in their own 16-bit type (bf16, fp16) rather
    than in fp32: adds, subtractions and products typed bf16 / fp16 whose operands all come in
    that type, the GEMM's tile as the buffer holds it (bf16), inputs of that type (not one the
    mainloop adds into the tile, ``in_buffer``), or such nodes. Eager rounds each of them to
    that type; computed there (add.bf16 etc., paired by ptxas into HADD2 / HFMA2) they skip the
    unpacking into fp32 and the repacking, one rounding a node as eager's (fp32 arithmetic of
    the 16-bit operands, then rounded) up to its rare double roundings."""
    out = set()
    for i, node in enumerate(region.nodes):
        if node.op not in NARROW_OPS or node.dtype not in (torch.bfloat16, torch.float16):
            continue

        def comes_narrow(s: int) -> bool:
            src = region.nodes[s]
            if src.op is Op.ACC:
                return node.dtype == torch.bfloat16
            if src.op is Op.INPUT:
                return region.inputs[src.arg].dtype == node.dtype and src.arg != in_buffer
            return s in out and src.dtype == node.dtype
        if all(comes_narrow(s) for s in node.src):
            out.add(i)
    return frozenset(out)


def _uncast(region: Region, i: int, same_dtype: bool = False) -> int:
    """The node under node i's floating-point casts (``same_dtype``: only casts to i's own
    dtype, which change no value)."""
    dtype = region.nodes[i].dtype
    while region.nodes[i].op is Op.CAST and region.nodes[i].arg.is_floating_point and \
            (not same_dtype or region.nodes[i].arg == dtype):
        i = region.nodes[i].src[0]
    return i


def _is_tile(region: Region, i: int) -> bool:
    """Whether node i is the GEMM's tile itself (through floating-point casts)."""
    return region.nodes[_uncast(region, i)].op is Op.ACC


def merge_pairs(region: Region) -> tuple:
    """((kind, first, second), ...): reductions whose second can join the first's exchange.

    - "moments": a row's sum R1 of x and R2 = sum((x - R1 / N)^2) (planner.plan.moment_pairs):
      each tile publishes its sum and its own centred sum of squares, merged by Chan's
      formula (exact: no E[x^2] - E[x]^2);
    - "lse": a max R1 of x and R2 = sum(exp(x - R1)): each tile publishes its max and its sum
      of exp(x - its max), rescaled to the row's max when merged."""
    from ...planner.plan import moment_pairs
    nodes = region.nodes
    out = [("moments", r1, r2) for r1, r2 in moment_pairs(region)
           if nodes[nodes[r1].src[0]].axes == frozenset("MN")]
    for j, node in enumerate(nodes):
        if node.op is not Op.SUM or nodes[node.src[0]].op is not Op.EXP:
            continue
        sub = nodes[nodes[node.src[0]].src[0]]
        if sub.op is Op.SUB and nodes[sub.src[1]].op is Op.RMAX and nodes[sub.src[1]].src[0] == sub.src[0] \
                and nodes[sub.src[0]].axes == frozenset("MN"):
            out.append(("lse", sub.src[1], j))
    return tuple(out)


def blocker(region: Region, stages, row_outputs: bool = False) -> str:
    """'' when the generator can write this region, else why not; ``row_outputs``: per-row [M]
    outputs too (COMFUSE_WS_ROW_OUTPUTS, experimental)."""
    g = region.gemm
    if region.kind != "gemm_epilogue" or g.batched:
        return "one unbatched GEMM and its epilogue"
    if g.out_dtype != region.gemm.a.dtype:
        return "the GEMM's product must be rounded as its operands' dtype (the hand-off buffer is bf16)"
    for i, node in enumerate(region.nodes):
        if node.op not in SUPPORTED:
            return f"no Gluon form for {node.op.value} (%{i})"
        if node.op in REDUCE and node.arg != "N":
            return "reductions must run along N"
        if node.op is Op.POW and node.arg not in (2, 2.0, 0.5, -0.5, 1, 1.0, -1, -1.0):
            return f"pow with exponent {node.arg}"
        if node.op is Op.CAST:
            src = region.nodes[node.src[0]].dtype
            if not node.arg.is_floating_point or not (src.is_floating_point or src == torch.bool):
                return f"cast from {src} to {node.arg}"
    for inp in region.inputs:
        if not inp.dtype.is_floating_point or "B" in inp.axes:
            return f"side input {inp.name}: floating point, axes within [M, N]"
    for out in region.outputs:
        # (per-row outputs are generated, written by each strip's first tile, checked on the CPU
        # (emulate.py) and on the H200, but not yet timed: refused unless asked for)
        if not out.dtype.is_floating_point or out.axes not in (frozenset("MN"), frozenset("M")):
            return f"output {out.name}: floating point, [M, N] or [M]"
        if out.axes == frozenset("M") and not row_outputs:
            return (f"output {out.name}: floating point [M, N] only (per-row outputs not yet timed; "
                    "COMFUSE_WS_ROW_OUTPUTS=1 takes them)")
    if not region.reductions():
        return "no reduction (the tile schedules need no exchange)"
    reds = [len(s.reductions) for s in stages if s.reductions]
    if len(reds) > MAX_EXCHANGES or sum(reds) > MAX_STATS:
        return f"{len(reds)} exchanges / {sum(reds)} statistics: more than the kernel keeps"
    return ""


def layout_of(stages, pairs=()) -> Layout:
    """The exchanges of ``stages``; with ``pairs`` (``merge_pairs``), each pair's second joins
    its first's exchange."""
    second = {r2: (kind, r1) for kind, r1, r2 in pairs}
    first = {r1: (kind, r2) for kind, r1, r2 in pairs}
    groups = []
    for s in stages:
        own = [r for r in s.reductions if r not in second]
        if own:
            groups.append(own)
    for g in groups:
        g += [first[r][1] for r in list(g) if r in first]
    slot, k = {}, 0
    for e, g in enumerate(groups):
        for w, r in enumerate(g):
            slot[r] = (e, w, k)
            k += 1
    return Layout(tuple(tuple(g) for g in groups), slot, second, first)


class _Writer:
    def __init__(self, region: Region, lay: Layout):
        self.region, self.lay = region, lay
        self.lines: list[str] = []
        self.roll = False  # passes loop over their chunks at run time (``emit``'s roll)
        self.rolled = False  # emitting a pass's loop body, not unrolled (``_Module.roll``): one level in
        self.stored = None  # the node the hand-off buffer holds in place of the GEMM's tile, if any
        self.in_buffer = None  # the [M, N] input the mainloop adds into the tile (``tma_residual``), if any
        self.loaded: dict = {}  # [M, N] input -> the variable holding this chunk's values, loaded ahead
        self.narrow: frozenset = frozenset()  # nodes computed in their own 16-bit type (``narrow_nodes``)
        self.narrow_operands: frozenset = frozenset()  # their operands (loaded as stored where inputs)
        self.exp_fma = False  # exp(x - row value) as one FFMA and an ex2 (``exp_of``)

    def line(self, text: str, indent: int) -> None:
        if self.rolled:  # (the unrolled body sits under its ``if`` at 3; a line at 2 or less ends it)
            if indent <= 2:
                self.rolled = False
            else:
                indent -= 1
        self.lines.append("    " * indent + text)

    def closure(self, targets) -> list[int]:
        """The nodes a pass computes for ``targets``: their sources up to the reductions, which
        are statistics then (loaded from shared memory), in index (topological) order."""
        seen, todo = set(), list(targets)
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            if self.region.nodes[i].op not in REDUCE and i != self.stored:
                todo += list(self.region.nodes[i].src)
        return sorted(seen)

    def keepable(self, x: int, later) -> bool:
        """Whether every value the later passes need (``later``: their targets) can come from
        node x kept in the buffer, the statistics and per-column / per-row inputs: no path to
        the GEMM's tile or an [M, N] input avoids x."""
        saved, self.stored = self.stored, x
        try:
            for i in self.closure(later):
                node = self.region.nodes[i]
                if i != x and (node.op is Op.ACC or (node.op is Op.INPUT and
                                                      self.region.inputs[node.arg].axes == frozenset("MN"))):
                    return False
            return True
        finally:
            self.stored = saved

    def exp_of(self, a: str, b: str) -> str:
        """exp(a - b), where b is a per-row (or constant) value: with ``exp_fma``, 2^(a log2(e) -
        b log2(e)), the row's product once and one FFMA an element (an FADD and an FMUL
        otherwise); the same up to the rounding of b log2(e)."""
        if self.exp_fma:
            return f"exp2_fast({a} * 1.4426950408889634 - {b} * 1.4426950408889634)"
        return f"exp_fast({a} - {b})"

    def expr(self, i: int) -> str:
        node = self.region.nodes[i]
        op, x = node.op, [self.ref(s) for s in node.src]
        if self.exp_fma and op is Op.EXP and self.region.nodes[node.src[0]].op is Op.SUB \
                and node.axes == frozenset("MN"):
            a, b = self.region.nodes[node.src[0]].src
            if self.region.nodes[b].axes <= frozenset("M") and i not in self.narrow:
                return self.exp_of(self.ref(a), self.ref(b))
        if op in REDUCE:  # a statistic of an earlier exchange
            if self.roll:
                return f"stat_rows.index({self.lay.slot[i][2]} * (BM // CHUNK) + c).load(row_l)[:, None]"
            return f"stat_smem.index({self.lay.slot[i][2]}).slice(c * CHUNK, CHUNK).load(row_l)[:, None]"
        if op is Op.ACC:
            return "acc"
        if op is Op.INPUT:
            if node.arg == self.in_buffer:  # already added into the tile by the mainloop partition
                return "0.0"
            inp = self.region.inputs[node.arg]
            axes = inp.axes
            if axes == frozenset("N"):
                return f"vec{node.arg}[None, :]"
            if axes == frozenset("M"):
                return f"gl.load(in{node.arg}_ptr + row).to(gl.float32)[:, None]"
            if axes == frozenset("MN"):
                if node.arg in self.loaded:
                    return f"{self.loaded[node.arg]}.to(gl.float32)"
                return f"gl.load(in{node.arg}_ptr + row[:, None] * N + col[None, :]).to(gl.float32)"
            return f"gl.load(in{node.arg}_ptr).to(gl.float32)"
        if op is Op.CONST:
            return _literal(node.arg)
        if op is Op.IOTA:
            return "col[None, :]" if node.arg == "N" else "row[:, None]"
        divisor = self.region.nodes[node.src[1]] if op is Op.DIV else None
        if divisor is not None and node.axes == frozenset("MN") and divisor.axes != node.axes \
                and not (divisor.op is Op.CONST and divisor.arg == 0):
            # a tile over a per-row (or per-column, or constant) value: its reciprocal once per
            # row, then one multiply per element, where a division is five instructions
            return f"{x[0]} * (1.0 / {x[1]})"
        if op in _INFIX:
            return f"{x[0]} {_INFIX[op]} {x[1]}"
        if op in _UNARY:
            return _UNARY[op].format(x[0])
        if op is Op.CAST:
            src = self.region.nodes[node.src[0]]
            return x[0] if src.dtype.is_floating_point else f"{x[0]}.to(gl.float32)"
        if op is Op.POW:
            e = float(node.arg)
            return {2.0: f"{x[0]} * {x[0]}", 0.5: f"gl.sqrt({x[0]})", -0.5: f"gl.rsqrt({x[0]})", 1.0: x[0],
                    -1.0: f"1.0 / {x[0]}"}[e]
        if op in (Op.MAX, Op.MIN):
            return f"gl.{'maximum' if op is Op.MAX else 'minimum'}({x[0]}, {x[1]})"
        if op is Op.WHERE:
            return f"gl.where({x[0]}, {x[1]}, {x[2]})"
        raise NotImplementedError(op)  # pragma: no cover  (blocker refuses it)

    def raw(self, i: int) -> str:
        """Node i's value in its own 16-bit type, for a narrow node's operand: the tile as the
        buffer holds it (bf16), an input as loaded, a narrow node's ``h`` variable."""
        node = self.region.nodes[i]
        if i == self.stored or node.op is Op.ACC:
            return "acc_h"
        if node.op is Op.INPUT and self.region.inputs[node.arg].axes == frozenset("N"):
            return f"vh{node.arg}[None, :]"  # (loaded once a tile)
        return f"h{i}"

    def _raw_load(self, i: int) -> str:
        """A scalar, [M] or [M, N] input's chunk as loaded (a narrow node's operand)."""
        arg = self.region.nodes[i].arg
        axes = self.region.inputs[arg].axes
        if axes == frozenset("M"):
            return f"gl.load(in{arg}_ptr + row)[:, None]"
        if not axes:
            return f"gl.load(in{arg}_ptr)"
        return self.loaded.get(arg) or f"gl.load(in{arg}_ptr + row[:, None] * N + col[None, :])"

    def values(self, nodes, indent: int) -> None:
        for i in nodes:
            node = self.region.nodes[i]
            if node.op is Op.CONST:
                continue
            if i == self.stored:
                self.line(f"v{i} = acc  # %{i} {node.op.value}, kept in the hand-off buffer", indent)
                continue
            if node.op is Op.INPUT and self.region.inputs[node.arg].axes != frozenset("N") and \
                    i in self.narrow_operands:
                self.line(f"h{i} = {self._raw_load(i)}  # %{i} input, as stored", indent)
                self.line(f"v{i} = h{i}.to(gl.float32)", indent)
                continue
            if i in self.narrow:  # in bf16 (or fp16) as eager rounds it; fp32 for what else reads it
                a, b = (self.raw(s) for s in node.src)
                self.line(f"h{i} = {a} {_INFIX[node.op]} {b}  # %{i} {node.op.value}, in {_short(node.dtype)}",
                          indent)
                self.line(f"v{i} = h{i}.to(gl.float32)", indent)
                continue
            self.line(f"v{i} = {self.expr(i)}  # %{i} {node.op.value}", indent)

    def ref(self, i: int) -> str:
        node = self.region.nodes[i]
        return _literal(node.arg) if node.op is Op.CONST else f"v{i}"


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


def tma_storable(region: Region) -> str:
    """Why the output pass cannot write the tile by one TMA bulk store ('' when it can): one
    [M, N] bf16 output and nothing per row."""
    full = [o for o in region.outputs if o.axes == frozenset("MN")]
    if len(full) != 1 or len(region.outputs) != 1 or full[0].dtype != torch.bfloat16:
        return "a TMA store writes one bf16 [M, N] output, the region's only one"
    return ""


def emit(region: Region, stages, name: str, describe: str, pairs=(), keep: bool = False,
         tma_store: bool = False, tail: int = 0, residual=None, lookahead: bool = False,
         narrow: bool = False, exp_fma: bool = False, tile_n: int = 256,
         roll: bool = False, last_in_ring: bool = False) -> str:
    """The generated module's source: ``{name}`` (the kernel), ``{name}_epilogue`` (its
    partition) and ``{name}_tile`` (one tile's epilogue, by a group of warps over some of its
    chunks); ``pairs``: the merged exchanges (``merge_pairs``); ``keep``: an exchange's value,
    when it is all the later passes need of the tile (``_Writer.keepable``), is written over the
    buffer (rounded to bf16, as eager's bf16 ops round it) and the later passes start from it
    rather than recompute it (only where every output is bf16 or fp16); ``tail``: rows of each
    program's last tile whose epilogue the mainloop's warps run (``{name}_main``), idle once
    their last tile is handed off (0: none; a multiple of their chunk, 32 rows); ``residual``:
    the index of the [M, N] input (``tma_residual``) that the epilogue partition TMA-loads into
    the buffer as soon as it frees it, and the mainloop adds into the next tile (None: none);
    ``lookahead``: each chunk of a pass issues the next chunk's loads before its own work
    (``_Module.chunk_head``); ``narrow``: the 16-bit-typed adds and products whose operands come in
    that type computed in it (``narrow_nodes``), not in fp32; ``exp_fma``: exp(x - a row's
    value) as one FFMA and an ex2 an element (``_Writer.exp_of``); ``tile_n``: the tiles' width
    (the kernel takes BN as a constexpr; only the hand-off buffer's layout, imported, differs);
    ``roll``: each pass a loop over its chunks at run time, not unrolled (the kernel's epilogue
    then takes an eighth of the instructions: unrolled, multi-stage's was 7 740 SASS instructions,
    and a third of its warps' stall samples on the H200 were for instructions not yet fetched);
    it needs a row's lanes to span 64 columns (VEC * LANES_N == 64); with ``lookahead`` the loop
    carries the next chunk's [M, N] inputs from global memory (the tile's rows, in shared memory,
    are read in their own iteration); ``last_in_ring``: with ``tail``, the program's last tile is
    handed off into the B operand's ring, free once its last K step is done, so the mainloop's
    warps need not wait for the epilogue to free the buffer from the tile before (with its own
    statistics; not with ``residual``, nor with an unrolled ``lookahead``)."""
    if last_in_ring and (not tail or residual is not None or (lookahead and not roll)):
        raise ValueError("ws_stages: the last tile in the ring is a shared last tile's form (tail), without the "
                         "residual by TMA or an unrolled lookahead")
    if tile_n not in (256, 128):
        raise ValueError(f"ws_stages: tiles {tile_n} columns wide: 256 or 128")
    if tail and tma_store:
        raise ValueError("ws_stages: a shared last tile is written by each thread, not by one TMA store")
    if tail % 32 or not 0 <= tail <= 128:
        raise ValueError(f"ws_stages: tail {tail}: a multiple of 32 rows, at most the tile's 128")
    lay = layout_of(stages, pairs)
    w = _Writer(region, lay)
    if residual is not None:
        if tma_residual(region) != residual:
            raise ValueError(f"ws_stages: input {residual} cannot be added into the tile before the hand-off")
        w.in_buffer = residual
    if narrow:
        w.narrow = narrow_nodes(region, w.in_buffer)
        w.narrow_operands = frozenset(s for i in w.narrow for s in region.nodes[i].src)
    w.exp_fma = exp_fma
    keep = keep and all(o.dtype in (torch.bfloat16, torch.float16) for o in region.outputs)
    tma_store = tma_store and not tma_storable(region)
    ins = [f"in{j}_ptr" for j in range(len(region.inputs))]
    outs = [f"out{k}_ptr" for k in range(len(region.outputs))]
    ptrs = ", ".join(ins + outs + (["r_desc"] if residual is not None else []) + (["o_desc"] if tma_store else []))
    m = _Module(region, lay, w, name, ptrs, keep, tma_store, tail, residual, lookahead, roll, last_in_ring)
    w.roll = roll
    m.tile()
    m.epilogue()
    if tail:
        m.main()
    m.kernel(describe)
    return m.header(describe, tile_n) + "\n".join(w.lines) + "\n"


@dataclasses.dataclass
class _Module:
    """The functions of a generated module (``emit``), written in order into one _Writer."""
    region: Region
    lay: Layout
    w: _Writer
    name: str
    ptrs: str  # the kernel's per-call arguments after A and B: pointers, then descriptors
    keep: bool
    tma_store: bool
    tail: int
    residual: object  # the [M, N] input the mainloop adds into the tile (tma_residual), or None
    lookahead: bool = False  # each chunk issues the next one's loads first (chunk_head)
    roll: bool = False  # each pass a run-time loop over its chunks (strip.chunk_view), not unrolled
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
    def static_ranges(self) -> bool:
        """Whether the per-tile function's chunk range is constexpr: an unrolled pass that loads
        a chunk ahead (its branches on the chunk index then static)."""
        return self.lookahead and not self.roll

    @property
    def whole_tail(self) -> bool:
        """Whether the mainloop warps take all of each program's last tile (a tail of BM rows):
        the epilogue partition's loop stops a tile early, so the last tile's exchanges need not
        wait for it to finish the tile before (H200, twenty-second session: with 128 rows
        shared, the epilogue partition still arrived at the last tile's exchanges, after its
        previous tile, up to 7.7 us after the hand-off)."""
        return self.tail == 128

    @property
    def stat_slots(self) -> int:  # (stat_smem's rows: one per statistic)
        return max(len(self.lay.slot), 1)

    @property
    def RES(self) -> int:  # (strip._mma_partition: 2, the buffer holds the tile's residual)
        return 0 if self.residual is None else 2

    def partials(self, e: int, wi: int, fill: str) -> str:
        """A load of exchange e's partials [TILES_P2, BM] of its wi-th reduction, all tiles of the strip."""
        return (f"gl.load(ws_ptr + (((strip * {self.E} + {e}) * {self.lay.width} + {wi}) * TILES_N + prow[:, None]) "
                f"* BM + pcol[None, :], mask=pmask, other={fill}, cache_modifier=\".cg\")")

    def tile(self) -> None:
        """``{name}_tile``: one tile's epilogue over a range of its chunks, by a group of warps."""
        region, lay, L, E, name, ptrs = self.region, self.lay, self.w.line, self.E, self.name, self.ptrs
        L("@gluon.jit", 0)
        if self.static_ranges:  # (the chunk range constexpr: chunk_head's static branches)
            L(f"def {name}_tile(tile_smem, stat_smem, {ptrs}, ws_ptr, counter_ptr, trace_ptr, t, n, "
              "c_lo: gl.constexpr,", 0)
            L("c_hi: gl.constexpr, share: gl.constexpr, TRACE: gl.constexpr, M, N, TILES_N: gl.constexpr,", 8)
            L("TILES_P2: gl.constexpr, BM: gl.constexpr,", 8)
        else:  # (a runtime range: as constexpr, a shared tile's two epilogue calls ran 8 % slower)
            L(f"def {name}_tile(tile_smem, stat_smem, {ptrs}, ws_ptr, counter_ptr, trace_ptr, t, n, c_lo, c_hi, share,",
              0)
            L("TRACE: gl.constexpr, M, N, TILES_N: gl.constexpr, TILES_P2: gl.constexpr, BM: gl.constexpr,", 8)
        L("BN: gl.constexpr, CHUNK: gl.constexpr, WARPS: gl.constexpr, LANES_N: gl.constexpr, VEC: gl.constexpr):", 8)
        L(f'"""Tile t\'s epilogue over its chunks [c_lo, c_hi) by WARPS warps: {E} exchange(s), then the outputs '
          '(see the', 1)
        L("module docstring); ``share``: this group's arrivals at each exchange (2 for the whole tile, 1 for a", 1)
        L('part of the program\'s last tile)."""', 1)
        # LANES_N lanes of a warp share a row (a row's reduction takes log2(LANES_N) shuffles), each
        # with VEC adjacent columns at a time (BN // LANES_N: a thread's columns all adjacent)
        L("layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES_N, LANES_N], [WARPS, 1], [1, 0])", 1)
        L("row_l: gl.constexpr = gl.SliceLayout(1, layout)", 1)
        L("rows = gl.arange(0, CHUNK, layout=row_l)", 1)
        L("cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))", 1)
        if self.roll:
            # (VEC * LANES_N == 64: a row's lanes span one 64-column block of the buffer)
            L("PIECES: gl.constexpr = BN // 64", 1)
            L("view = chunk_view(tile_smem, CHUNK)  # chunk c by a run-time index", 1)
            L(f"stat_rows = stat_smem._reinterpret(gl.float32, [{self.stat_slots} * (BM // CHUNK), CHUNK], "
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
        narrow_reads = {region.nodes[s].arg for s in self.w.narrow_operands if region.nodes[s].op is Op.INPUT}
        for j, inp in enumerate(region.inputs):
            if inp.axes == frozenset("N"):
                if j in narrow_reads:
                    L(f"vh{j} = gl.load(in{j}_ptr + col)  # {inp.name}, as stored", 1)
                    L(f"vec{j} = vh{j}.to(gl.float32)", 1)
                else:
                    L(f"vec{j} = gl.load(in{j}_ptr + col).to(gl.float32)  # {inp.name}", 1)
        for e, reds in enumerate(lay.exchanges):
            self.exchange(e, reds)
        self.outputs()

    def chunk_head(self, nodes) -> None:
        """A pass's loop over the chunks [c_lo, c_hi), to each chunk's rows and its tile values
        ``acc``. With ``lookahead`` (the range constexpr then: the loop unrolled without
        branches) each chunk first issues the next chunk's loads (``nxt*``: the tile's rows, the
        [M, N] inputs among ``nodes`` read from global memory), so that their latency passes under
        this chunk's work rather than at the start of the next; with ``roll`` as well, the loop
        carries the [M, N] inputs only (``carried``), the range staying a run-time one."""
        L, w = self.w.line, self.w
        reads = sorted({self.region.nodes[i].arg for i in nodes if self.region.nodes[i].op is Op.INPUT
                        and self.region.inputs[self.region.nodes[i].arg].axes == frozenset("MN")
                        and self.region.nodes[i].arg != w.in_buffer})
        # (with loops, lookahead carries only the [M, N] inputs: the first chunk's before the loop)
        carried = reads if self.roll and self.lookahead else []
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
        if not self.lookahead or self.roll:
            w.loaded = {}
            if carried:  # this chunk's, then the next one's (the last chunk loads itself again)
                L("ahead = strip * BM + gl.minimum(c + 1, c_hi - 1) * CHUNK + rows", 3)
                for j in carried:
                    L(f"cur{j} = nxt{j}", 3)
                    L(f"nxt{j} = gl.load(in{j}_ptr + ahead[:, None] * N + col[None, :])  "
                      f"# {self.region.inputs[j].name}, a chunk ahead", 3)
                w.loaded = {j: f"cur{j}" for j in carried}
            if w.narrow:  # (the tile as the buffer holds it, for the narrow nodes; fp32 for the rest)
                L(f"acc_h = {self.read()}", 3)
                L("acc = acc_h.to(gl.float32)", 3)
            else:
                L(f"acc = {self.read()}.to(gl.float32)", 3)
            return

        def issue(at: str, rows: str, indent: int) -> None:
            L(f"nxt = tile_smem.slice({at}, CHUNK, dim=0).load(layout)", indent)
            for j in reads:
                L(f"nxt{j} = gl.load(in{j}_ptr + ({rows})[:, None] * N + col[None, :])  "
                  f"# {self.region.inputs[j].name}", indent)
        L("if c == c_lo:  # (the first chunk's loads)", 3)
        issue("c * CHUNK", "row", 4)
        L("acc = nxt.to(gl.float32)", 3)
        if w.narrow:
            L("acc_h = nxt", 3)
        for j in reads:
            L(f"cur{j} = nxt{j}", 3)
        L("if c + 1 < c_hi:  # the next chunk's loads, under this chunk's work", 3)
        issue("(c + 1) * CHUNK", "row + CHUNK", 4)
        w.loaded = {j: f"cur{j}" for j in reads}

    def exchange(self, e: int, reds) -> None:
        """Exchange e of a tile: its pass over the chunks, the strip's partials published and
        waited for, and combined into statistics."""
        region, lay, w, L, E, keep, partials = self.region, self.lay, self.w, self.w.line, self.E, self.keep, \
            self.partials
        L(f"# ---- exchange {e}: {', '.join(f'%{r} {region.nodes[r].op.value}' for r in reds)} ----", 1)
        # (a merged second is computed from its first's value: its own source needs the first)
        sources = sorted({region.nodes[lay.second[r][1] if r in lay.second else r].src[0] for r in reds})
        self.chunk_head(w.closure(sources))
        w.values(w.closure(sources), 3)
        later = [region.nodes[r].src[0] for g in lay.exchanges[e + 1:] for r in g] + [o.node for o in region.outputs]
        keep_now = None
        if keep and len(sources) == 1 and sources[0] != w.stored and not _is_tile(region, sources[0]) \
                and region.nodes[sources[0]].axes == frozenset("MN") and w.keepable(sources[0], later):
            keep_now = x = sources[0]
            exact = _uncast(region, x, same_dtype=True)
            if exact in w.narrow and region.nodes[exact].dtype == torch.bfloat16:  # computed in bf16 already
                L(f"{self.write(f'h{exact}')}  # %{x}, kept for the later passes", 3)
            else:
                L(f"v{x} = bf16_pairs(v{x})  # %{x}, rounded as eager's bf16 op rounds it, and kept for the later "
                  "passes", 3)
                L(self.write(f"v{x}"), 3)
                L(f"v{x} = v{x}.to(gl.float32)", 3)
        for wi, r in enumerate(reds):
            slot = f"ws_ptr + (((strip * {E} + {e}) * {lay.width} + {wi}) * TILES_N + tn) * BM + c * CHUNK + rows"
            if r in lay.second:  # the tile's own moment about its max / mean (see merge_pairs)
                kind, r1 = lay.second[r]
                x = w.ref(region.nodes[r1].src[0])
                if kind == "lse":
                    L(f"gl.store({slot}, gl.sum({w.exp_of(x, f'gl.max({x}, axis=1)[:, None]')}, axis=1))  # %{r} "
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
        L(f"_mark(trace_ptr, n, {5 + 2 * e}, TRACE)", 1)
        # 2 TILES_N arrivals an exchange: a whole tile makes 2, each part of a shared one 1
        L("old = gl.atomic_add(counter_ptr + strip, share, sem=\"acq_rel\", scope=\"gpu\")", 1)
        L("target = (old // (2 * TILES_N) + 1) * (2 * TILES_N)", 1)
        L("seen = gl.atomic_add(counter_ptr + strip, 0, sem=\"acquire\", scope=\"gpu\")", 1)
        L("while seen < target:", 1)
        L("seen = gl.atomic_add(counter_ptr + strip, 0, sem=\"acquire\", scope=\"gpu\")", 2)
        L(f"_mark(trace_ptr, n, {6 + 2 * e}, TRACE)", 1)
        L("gl.thread_barrier()", 1)
        for wi, r in enumerate(reds):
            op = region.nodes[r].op
            fill = {Op.SUM: "0.0", Op.RMAX: 'float("-inf")', Op.RMIN: 'float("inf")'}[op]
            red = {Op.SUM: "gl.sum", Op.RMAX: "gl.max", Op.RMIN: "gl.min"}[op]
            if r in lay.second:
                kind, r1 = lay.second[r]
                w1 = reds.index(r1)
                if kind == "lse":  # sum_t s_t exp(m_t - m)
                    L(f"tile_m = {partials(e, w1, NEG_INF)}", 1)
                    L("row_m = gl.max(tile_m, axis=0)", 1)
                    L(f"scaled = gl.where(pmask, {partials(e, wi, '0.0')} * exp_fast(tile_m - row_m[None, :]), 0.0)", 1)
                else:  # Chan: sum_t M2_t + BN (mean_t - mean)^2
                    L(f"tile_sum = {partials(e, w1, '0.0')}", 1)
                    L("dm = gl.where(pmask, tile_sum / BN - (gl.sum(tile_sum, axis=0) / N)[None, :], 0.0)", 1)
                    L(f"scaled = {partials(e, wi, '0.0')} + BN * dm * dm", 1)
                L(f"stat_smem.index({lay.slot[r][2]}).store(gl.sum(scaled, axis=0))  # %{r} (merged with %{r1})", 1)
                continue
            L(f"part = {partials(e, wi, fill)}", 1)
            L(f"stat_smem.index({lay.slot[r][2]}).store({red}(part, axis=0))  # %{r}", 1)
        L("gl.thread_barrier()", 1)
        if keep_now is not None:
            w.stored = keep_now

    def outputs(self) -> None:
        """The last pass: every output written once."""
        region, w, L, tma_store = self.region, self.w, self.w.line, self.tma_store
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
                if tma_store:  # over the rows just read (each thread its own elements)
                    L(f"{self.write(f'({val}).to(gl.bfloat16)')}  # {o.name}", 3)
                else:
                    L(f"gl.store(out{k}_ptr + row[:, None] * N + col[None, :], ({val}).to(out{k}_ptr.dtype.element_ty))"
                      f"  # {o.name}", 3)
        if per_row:
            L("if tn == 0:  # per-row outputs, by the strip's first tile", 3)
            done = set(w.closure([o.node for o in full]))
            w.values([i for i in w.closure([o.node for o in per_row]) if i not in done], 4)
            for k, o in enumerate(region.outputs):
                if o in per_row:
                    L(f"gl.store(out{k}_ptr + row, gl.max(gl.full([CHUNK, BN], 0.0, gl.float32, layout) + "
                      f"{w.ref(o.node)}, "
                      f"axis=1).to(out{k}_ptr.dtype.element_ty))  # {o.name}", 4)
        if tma_store:  # the output tile from the buffer by one bulk copy, read before the buffer is freed
            L("fence_async_shared()  # the buffer's generic writes, before the TMA engine reads it", 1)
            L("gl.thread_barrier()  # every warp has written its rows", 1)
            L("tma.async_copy_shared_to_global(o_desc, [strip * BM, tn * BN], tile_smem)", 1)
            L("tma.store_wait(0)", 1)
        L("gl.thread_barrier()  # every warp has read the tile", 1)

    def epilogue(self) -> None:
        """``{name}_epilogue``: the epilogue partition's loop over its program's tiles."""
        region, L, E, name, ptrs, tail, residual = self.region, self.w.line, self.E, self.name, self.ptrs, self.tail, \
            self.residual
        L("", 0)
        L("", 0)
        L("@gluon.jit", 0)
        spare = "spare_smem, spare_stat, spare_ready, " if self.last_in_ring else ""
        L(f"def {name}_epilogue(tile_smem, stat_smem, tile_ready, tile_free, {spare}{ptrs}, ws_ptr, counter_ptr, "
          "trace_ptr,", 0)
        L("num_tiles, TRACE: gl.constexpr,", 8)
        L("M, N, TILES_N: gl.constexpr, TILES_P2: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,", 8)
        L("CHUNK: gl.constexpr, EPI_WARPS: gl.constexpr, LANES_N: gl.constexpr, VEC: gl.constexpr):", 8)
        L('"""The epilogue partition: each of the program\'s tiles as it is handed off."""', 1)
        if residual is not None:
            L(f"# the first tile's {region.inputs[residual].name} into the buffer; the mainloop adds it to its tile", 1)
            L("_load_residual(r_desc, tile_smem, tile_free, gl.program_id(0), num_tiles, TILES_N, BM, BN)", 1)
        L("n = 0", 1)
        if self.whole_tail:  # the last tile's rows all the mainloop warps': its exchanges too
            L("# the program's last tile is the mainloop warps' alone, rows, arrivals and all", 1)
            L("for t in range(gl.program_id(0), num_tiles - gl.num_programs(0), gl.num_programs(0)):", 1)
        else:
            L("for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):", 1)
        if not self.last_in_ring or self.whole_tail:  # (in the ring, each branch waits for its own buffer)
            L("mbarrier.wait(tile_ready, n & 1)", 2)
            L("_mark(trace_ptr, n, 4, TRACE)", 2)
        if tail and not self.whole_tail:
            L(f"# the program's last tile: its last {tail} rows go to the mainloop's warps, idle by then", 2)
            if self.static_ranges:  # (one call for each constexpr range)
                L("if t + gl.num_programs(0) >= num_tiles:", 2)
                L(f"{name}_tile(tile_smem, stat_smem, {ptrs}, ws_ptr, counter_ptr, trace_ptr, t, n, 0,", 3)
                L(f"BM // CHUNK - {tail} // CHUNK, 1, TRACE, M, N, TILES_N, TILES_P2, BM, BN, CHUNK, EPI_WARPS, "
                  "LANES_N,", 7)
                L("VEC)", 7)
                L("else:", 2)
                L(f"{name}_tile(tile_smem, stat_smem, {ptrs}, ws_ptr, counter_ptr, trace_ptr, t, n, 0, BM // CHUNK, 2,",
                  3)
                L("TRACE, M, N, TILES_N, TILES_P2, BM, BN, CHUNK, EPI_WARPS, LANES_N, VEC)", 7)
            elif self.last_in_ring:  # (the last tile in the ring, its statistics apart: this tile's still in use)
                L("if t + gl.num_programs(0) >= num_tiles:", 2)
                L("mbarrier.wait(spare_ready, 0)", 3)
                L("_mark(trace_ptr, n, 4, TRACE)", 3)
                L(f"{name}_tile(spare_smem, spare_stat, {ptrs}, ws_ptr, counter_ptr, trace_ptr, t, n, 0,", 3)
                L(f"BM // CHUNK - {tail} // CHUNK, 1, TRACE, M, N, TILES_N, TILES_P2, BM, BN, CHUNK, EPI_WARPS, "
                  "LANES_N, VEC)", 7)
                L("else:", 2)
                L("mbarrier.wait(tile_ready, n & 1)", 3)
                L("_mark(trace_ptr, n, 4, TRACE)", 3)
                L(f"{name}_tile(tile_smem, stat_smem, {ptrs}, ws_ptr, counter_ptr, trace_ptr, t, n, 0, BM // CHUNK, 2,",
                  3)
                L("TRACE, M, N, TILES_N, TILES_P2, BM, BN, CHUNK, EPI_WARPS, LANES_N, VEC)", 7)
            else:
                L("last = (t + gl.num_programs(0) >= num_tiles).to(gl.int32)", 2)
                L(f"{name}_tile(tile_smem, stat_smem, {ptrs}, ws_ptr, counter_ptr, trace_ptr, t, n, 0,", 2)
                L(f"BM // CHUNK - last * ({tail} // CHUNK), 2 - last, TRACE, M, N, TILES_N, TILES_P2, BM, BN,", 6)
                L("CHUNK, EPI_WARPS, LANES_N, VEC)", 6)
        else:
            L(f"{name}_tile(tile_smem, stat_smem, {ptrs}, ws_ptr, counter_ptr, trace_ptr, t, n, 0, BM // CHUNK, 2,", 2)
            L("TRACE, M, N, TILES_N, TILES_P2, BM, BN, CHUNK, EPI_WARPS, LANES_N, VEC)", 6)
        L(f"_mark(trace_ptr, n, {5 + 2 * E}, TRACE)", 2)
        if residual is not None:  # the buffer is free: the next tile's residual into it, which frees it
            L("fence_async_shared()  # the buffer's generic reads and writes, before the TMA engine writes it", 2)
            L("_load_residual(r_desc, tile_smem, tile_free, t + gl.num_programs(0), num_tiles, TILES_N, BM, BN)", 2)
        else:
            L("mbarrier.arrive(tile_free)", 2)
        L("n += 1", 2)

    def main(self) -> None:
        """``{name}_main``: the mainloop partition, then its share of the program's last tile."""
        L, name, ptrs, tail, RES = self.w.line, self.name, self.ptrs, self.tail, self.RES
        L("", 0)
        L("", 0)
        L("@gluon.jit", 0)
        spare = "spare_smem, spare_stat, spare_ready, " if self.last_in_ring else ""
        L(f"def {name}_main(a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, stat_smem, tile_ready, tile_free, "
          f"{spare}{ptrs},",
          0)
        L("ws_ptr, counter_ptr, trace_ptr, num_tiles, k_steps, M, N, TRACE: gl.constexpr, B_KMAJOR: gl.constexpr,", 8)
        L("TILES_N: gl.constexpr, TILES_P2: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,", 8)
        L("CHUNK: gl.constexpr, EPI_WARPS: gl.constexpr, LANES_N: gl.constexpr, VEC: gl.constexpr,", 8)
        L("num_warps: gl.constexpr):", 8)
        L(f'"""The mainloop partition; then, its warps idle, the last {tail} rows of the program\'s last tile\'s', 1)
        L('epilogue (its first rows are the epilogue partition\'s)."""', 1)
        L("_mma_partition(a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, tile_ready, tile_free, num_tiles, k_steps,",
          1)
        if self.last_in_ring:
            L(f"trace_ptr, TRACE, {RES}, B_KMAJOR, TILES_N, 0, BM, BN, BK, num_warps, spare_smem, spare_ready, "
              "True)", 6)
        else:
            L(f"trace_ptr, TRACE, {RES}, B_KMAJOR, TILES_N, 0, BM, BN, BK, num_warps, tile_smem, tile_ready, False)", 6)
        L("my_tiles = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0))", 1)
        # (the buffer holds the tile: _mma_partition's last barrier follows its store.) Chunks of
        # MC rows: each thread holds as many of a chunk's values as an epilogue warp's thread, in
        # the same layout (VEC adjacent columns at a time: until the nineteenth session these
        # rows kept all of a thread's columns adjacent, the layout with 4x the shared-memory
        # wavefronts, whatever COMFUSE_WS_VEC), and a row lies within one warp (no reduction
        # across warps)
        L("MC: gl.constexpr = CHUNK * num_warps // EPI_WARPS", 1)
        here = "spare_smem, spare_stat" if self.last_in_ring else "tile_smem, stat_smem"
        L(f"{name}_tile({here}, {ptrs}, ws_ptr, counter_ptr, trace_ptr,", 1)
        L(f"gl.program_id(0) + (my_tiles - 1) * gl.num_programs(0), my_tiles - 1, (BM - {tail}) // MC, BM // MC,", 6)
        # (a part of the tile makes 1 arrival at each exchange, the whole tile 2)
        L(f"{2 if self.whole_tail else 1}, False, M, N, TILES_N, TILES_P2, BM, BN, MC, num_warps, LANES_N, VEC)", 6)
        L("_mark(trace_ptr, my_tiles - 1, 15, TRACE)  # (the trace's slot 15: these rows written)", 1)

    def kernel(self, describe: str) -> None:
        """``{name}``: the kernel, its shared memory and barriers, and the two partitions."""
        lay, L, name, ptrs, tail, RES = self.lay, self.w.line, self.name, self.ptrs, self.tail, self.RES
        L("", 0)
        L("", 0)
        L("@gluon.jit", 0)
        L(f"def {name}(a_desc, b_desc, {ptrs}, ws_ptr, counter_ptr, M, N, K, trace_ptr,", 0)
        L("B_KMAJOR: gl.constexpr, BN: gl.constexpr, TILES_N: gl.constexpr, TILES_P2: gl.constexpr,", 4)
        L("STAGES: gl.constexpr, CHUNK: gl.constexpr, EPI_WARPS: gl.constexpr, EPI_REGS: gl.constexpr,", 4)
        L("num_warps: gl.constexpr, LANES_N: gl.constexpr = 32, VEC: gl.constexpr = 8, TRACE: gl.constexpr = False):",
          4)
        L(f'"""{describe}"""', 1)
        L("BM: gl.constexpr = a_desc.block_type.shape[0]", 1)
        L("BK: gl.constexpr = a_desc.block_type.shape[1]", 1)
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
        L("_mark(trace_ptr, 63, 0, TRACE)  # (the trace's row 63: the program's start and end)", 1)
        L("gl.warp_specialize([", 1)
        spare = "spare_smem, spare_stat, spare_ready, " if self.last_in_ring else ""
        if tail:
            L(f"({name}_main, (a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, stat_smem, tile_ready, tile_free, "
              f"{spare}{ptrs},",
              2)
            L("ws_ptr, counter_ptr, trace_ptr, num_tiles, k_steps, M, N, TRACE, B_KMAJOR, TILES_N, TILES_P2, BM, BN, "
              "BK,", 5)
            L("CHUNK, EPI_WARPS, LANES_N, VEC, num_warps)),", 5)
        else:
            L("(_mma_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, tile_smem, tile_ready, tile_free, "
              "num_tiles,", 2)
            L(f"k_steps, trace_ptr, TRACE, {RES}, B_KMAJOR, TILES_N, 0, BM, BN, BK, num_warps, tile_smem, tile_ready, "
              "False)),", 5)
        L(f"({name}_epilogue, (tile_smem, stat_smem, tile_ready, tile_free, {spare}{ptrs}, ws_ptr, counter_ptr, "
          "trace_ptr,", 2)
        L("num_tiles, TRACE, M, N, TILES_N, TILES_P2, BM, BN, CHUNK, EPI_WARPS, LANES_N, VEC)),", 5)
        L("], [EPI_WARPS], [EPI_REGS])", 1)
        L("_mark(trace_ptr, 63, 1, TRACE)", 1)

    def header(self, describe: str, tile_n: int = 256) -> str:
        """The module's docstring (the region's IR) and imports (the hand-off buffer's layout
        for tiles ``tile_n`` wide as TILE_LAYOUT)."""
        name, region = self.name, self.region
        header = "\n".join([
            f'"""comfuse kernel {name}: {describe}', "",
            "Generated from this IR (do not edit; regenerated when anything below changes):", "",
            format_region(region), '"""',
            "from triton.experimental import gluon",
            "from triton.experimental.gluon import language as gl",
            "from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma",
            "",
            "from comfuse.codegen.gluon.strip import "
            + ("TILE_LAYOUT" if tile_n == 256 else "TILE_LAYOUT_N128 as TILE_LAYOUT")
            + ", _load_residual, _mark, _mma_partition, bf16_pairs, "
            + ("chunk_load, chunk_store, chunk_view, " if self.roll else "")
            + "exp2_fast, exp_fast, expm1, log1p, "
            "tanh_fast",
            "", "", ""])
        return header





def workspace_numel(M: int, N: int, stages, pairs=(), tile_n: int = 256) -> int:
    lay = layout_of(stages, pairs)
    return (M // 128) * max(len(lay.exchanges), 1) * lay.width * (N // tile_n) * 128
