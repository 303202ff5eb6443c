"""The Gluon text of a region's values, for the kernel generated from its stages (stages.py).

``Writer`` holds the generated lines and writes each node of the region as a Gluon expression
over one chunk of the tile: the tile itself (``acc``, read from the hand-off buffer), side
inputs (loaded per chunk, or once per tile for [N] vectors), the statistics of earlier
exchanges (read from shared memory), and the elementwise ops over them. All values are fp32.
"""
from __future__ import annotations

from ...ir import REDUCE, Op, Region
from ...planner.reductions import Layout
from ..source import INFIX, flat_index, literal

# the Gluon text of each unary op, "{0}" its operand (binary ops: codegen.text.INFIX)
UNARY = {Op.ABS: "gl.abs({0})", Op.EXP: "exp_fast({0})", Op.LOG: "gl.log({0})", Op.SQRT: "gl.sqrt({0})",
         Op.LOG1P: "log1p({0})", Op.EXPM1: "expm1({0})",
         Op.RSQRT: "gl.rsqrt({0})", Op.ERF: "gl.erf({0})", Op.SIN: "gl.sin({0})", Op.COS: "gl.cos({0})",
         Op.TANH: "tanh_fast({0})", Op.NEG: "-{0}", Op.RECIPROCAL: "1.0 / {0}", Op.RELU: "gl.maximum({0}, 0.0)",
         Op.SIGMOID: "1.0 / (1.0 + exp_fast(-{0}))", Op.NOT: "{0} == 0"}
# written by Writer.expr itself
OTHER = frozenset({Op.CAST, Op.POW, Op.MAX, Op.MIN, Op.WHERE, Op.ACC, Op.INPUT, Op.CONST, Op.IOTA}) | REDUCE
WRITTEN = frozenset(INFIX) | frozenset(UNARY) | OTHER


def uncast(region: Region, i: int, same_dtype: bool = False) -> int:
    """The node under node i's floating-point casts (``same_dtype``: only casts to i's own
    dtype, which change no value)."""
    dtype = region.nodes[i].dtype
    while region.nodes[i].op is Op.CAST and region.nodes[i].arg.is_floating_point and \
            (not same_dtype or region.nodes[i].arg == dtype):
        i = region.nodes[i].src[0]
    return i


def is_tile(region: Region, i: int) -> bool:
    """Whether node i is the GEMM's tile itself (through floating-point casts)."""
    return region.nodes[uncast(region, i)].op is Op.ACC


class Writer:
    def __init__(self, region: Region, lay: Layout, roll: bool = False, in_buffer=None):
        self.region, self.lay = region, lay
        self.lines: list[str] = []
        self.roll = roll  # passes loop over their chunks at run time (stat_rows by a run-time index)
        self.in_buffer = in_buffer  # the [M, N] input the mainloop adds into the tile (``tma_residual``), if any
        self.rolled = False  # emitting a pass's loop body, not unrolled: one level in
        self.stored = None  # the node the hand-off buffer holds in place of the GEMM's tile, if any
        self.loaded: dict = {}  # [M, N] input -> the variable holding this chunk's values, loaded ahead
        # casts between floating-point types change no fp32 value: such a node is its source's
        # variable, unless it has one of its own (``own``: a value kept in the buffer)
        self.alias = {i: node.src[0] for i, node in enumerate(region.nodes)
                      if node.op is Op.CAST and node.arg.is_floating_point
                      and region.nodes[node.src[0]].dtype.is_floating_point}
        self.own: set = set()

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

    def expr(self, i: int) -> str:
        node = self.region.nodes[i]
        op, x = node.op, [self.ref(s) for s in node.src]
        if op in REDUCE:  # a statistic of an earlier exchange
            if self.roll:
                index = flat_index(str(self.lay.slot[i][2]), ("c", "(BM // CHUNK)"))
                return f"stat_rows.index({index}).load(row_l)[:, None]"
            return f"stat_smem.index({self.lay.slot[i][2]}).slice(c * CHUNK, CHUNK).load(row_l)[:, None]"
        if op is Op.ACC:
            return "acc"
        if op is Op.INPUT:
            return self.input(node.arg)
        if op is Op.CONST:
            return literal(node.arg)
        if op is Op.IOTA:
            return "col[None, :]" if node.arg == "N" else "row[:, None]"
        divisor = self.region.nodes[node.src[1]] if op is Op.DIV else None
        if divisor is not None and node.axes == frozenset("MN") and divisor.axes != node.axes \
                and not (divisor.op is Op.CONST and divisor.arg == 0):
            # a tile over a per-row (or per-column, or constant) value: its reciprocal once per
            # row, then one multiply per element, where a division is five instructions
            return f"{x[0]} * (1.0 / {x[1]})"
        if op in INFIX:
            return f"{x[0]} {INFIX[op]} {x[1]}"
        if op in UNARY:
            return UNARY[op].format(x[0])
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
        raise NotImplementedError(op)  # pragma: no cover  (planner.gluon.why_not_stages refuses it)

    def input(self, j: int) -> str:
        """Side input j's values over this chunk, in fp32."""
        if j == self.in_buffer:  # already added into the tile by the mainloop partition
            return "0.0"
        axes = self.region.inputs[j].axes
        if axes == frozenset("N"):
            return f"vec{j}[None, :]"
        if axes == frozenset("M"):
            return f"gl.load(in{j}_ptr + row).to(gl.float32)[:, None]"
        if axes == frozenset("MN"):
            if j in self.loaded:
                return f"{self.loaded[j]}.to(gl.float32)"
            return f"gl.load(in{j}_ptr + row[:, None] * N + col[None, :]).to(gl.float32)"
        return f"gl.load(in{j}_ptr).to(gl.float32)"

    def values(self, nodes, indent: int) -> None:
        for i in nodes:
            node = self.region.nodes[i]
            if i == self.stored:
                self.line(f"v{i} = acc  # %{i} {node.op.value}, kept in the hand-off buffer", indent)
            elif node.op is not Op.CONST and not (i in self.alias and i not in self.own):
                self.line(f"v{i} = {self.expr(i)}  # %{i} {node.op.value}", indent)

    def ref(self, i: int) -> str:
        node = self.region.nodes[i]
        if node.op is Op.CONST:
            return literal(node.arg)
        while i in self.alias and i not in self.own:
            i = self.alias[i]
        return self.ref(i) if self.region.nodes[i].op is Op.CONST else f"v{i}"
