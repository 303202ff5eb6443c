"""The Triton text of a region's values: ``Exprs`` writes each node as an expression over the
tile (the accumulator, side inputs with their masks, per-row statistics), its reductions, and
the stored value of each output.

Values keep the Triton shape their axes imply: [BLOCK_M, BLOCK_N] for a full tile,
[BLOCK_M, 1] for per-row values, [1, BLOCK_N] for row vectors, a scalar for scalars.
Floating-point values are fp32; a cast between floating-point types changes none of them, so
such a node is its source's variable (``ref``) and gets no line of its own (``aliased``).
"""
from __future__ import annotations

import torch

from ...ir import Op, Region
from ..source import INFIX, literal

TL_DTYPE = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.bool: "tl.int1", torch.int64: "tl.int64", torch.int32: "tl.int32",
    torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
}
CALL = {Op.ABS: "tl.abs", Op.EXP: "tl.exp", Op.LOG: "tl.log", Op.SQRT: "tl.sqrt",
        Op.RSQRT: "tl.rsqrt", Op.SIGMOID: "tl.sigmoid", Op.ERF: "tl.erf", Op.SIN: "tl.sin",
        Op.COS: "tl.cos", Op.TANH: "tanh", Op.LOG1P: "log1p", Op.EXPM1: "expm1"}


def shape_of(axes) -> str:
    if "M" in axes and "N" in axes:
        return "(BLOCK_M, BLOCK_N)"
    if "M" in axes:
        return "(BLOCK_M, 1)"
    if "N" in axes:
        return "(1, BLOCK_N)"
    return "(1, 1)"


class Exprs:
    """Expressions of ``region``'s nodes; ``vp`` / ``pp``: prefixes of the values and the
    parameters (several regions share one kernel in a back-to-back chain), ``acc``: the
    accumulator's name, ``keepdims``: reductions keep their reduced axis (a tile schedule;
    a cooperative strip's partials do not)."""

    def __init__(self, region: Region, vp: str = "v", pp: str = "", acc: str = "acc", keepdims: bool = True):
        self.region, self.vp, self.pp, self.acc, self.keepdims = region, vp, pp, acc, keepdims

    # ---- addressing --------------------------------------------------------------------
    def offsets(self, prefix: str, axes) -> str:
        terms = []
        if "B" in axes:
            terms.append(f"pid_b * stride_{prefix}_b")
        if "M" in axes:
            terms.append(f"offs_m[:, None] * stride_{prefix}_m")
        if "N" in axes:
            terms.append(f"offs_n[None, :] * stride_{prefix}_n")
        return " + ".join([f"{prefix}_ptr"] + terms)

    @staticmethod
    def mask(axes) -> str | None:
        if "M" in axes and "N" in axes:
            return "mask_m[:, None] & mask_n[None, :]"
        if "M" in axes:
            return "mask_m[:, None]"
        if "N" in axes:
            return "mask_n[None, :]"
        return None

    # ---- values ------------------------------------------------------------------------
    def aliased(self, i: int) -> bool:
        """Whether node i is a cast between floating-point types of a variable (no line: ``ref``
        names its source). A constant's cast rounds the literal, so it keeps its own line."""
        node, nodes = self.region.nodes[i], self.region.nodes
        return (node.op is Op.CAST and node.arg.is_floating_point and nodes[node.src[0]].dtype.is_floating_point
                and nodes[node.src[0]].op is not Op.CONST)

    def ref(self, i: int) -> str:
        while self.aliased(i):
            i = self.region.nodes[i].src[0]
        node = self.region.nodes[i]
        return literal(node.arg) if node.op is Op.CONST else f"{self.vp}{i}"

    def row_column(self, node) -> str:
        """For ``offs_n == t`` (or !=) with ``t`` an int64 value without an N axis
        (cross-entropy's target): ``t`` narrowed to 32 bits once per row, the column test's
        other side; else "". 64-bit, the test was widened and compared per element. Column
        indices are >= 0 and below 2^31, so a ``t`` outside that range becomes -1, which
        equals no column: equality is exact."""
        nodes = [self.region.nodes[s] for s in node.src]
        is_col = [n.op is Op.IOTA and n.arg == "N" for n in nodes]
        if len(nodes) != 2 or is_col.count(True) != 1:
            return ""
        other = node.src[is_col.index(False)]
        o = self.region.nodes[other]
        if o.op is Op.CONST or o.dtype not in (torch.int64, torch.int32) or "N" in o.axes:
            return ""
        t = self.ref(other)
        return f"tl.where(({t} >= 0) & ({t} <= 2147483647), {t}, -1).to(tl.int32)"

    def column_picks(self, stats, needed) -> dict:
        """Sum statistics of ``where(offs_n == t, x, 0)`` with ``t`` an index per row (a
        target column): {stat: (the nodes only the pick uses, x node, the row's column as
        int32)}, when neither the where nor the compare feeds anything else."""
        nodes = self.region.nodes
        users = {}
        for i in needed:
            for s in nodes[i].src:
                users[s] = users.get(s, 0) + 1
        for st in stats:
            users[st.node] = users.get(st.node, 0) + 1
        out = {}
        for k, st in enumerate(stats):
            node = nodes[st.node]
            if st.kind != "sum" or node.op is not Op.WHERE or users.get(st.node) != 1:
                continue
            cond, value, zero = node.src
            if not (nodes[zero].op is Op.CONST and nodes[zero].arg == 0.0) or users.get(cond) != 1:
                continue
            column = self.row_column(nodes[cond]) if nodes[cond].op is Op.EQ else ""
            if column:
                iota = {s for s in nodes[cond].src if nodes[s].op is Op.IOTA and users.get(s) == 1}
                out[k] = ({st.node, cond} | iota, value, column)
        return out

    def load_input(self, j: int) -> str:
        inp = self.region.inputs[j]
        prefix = f"{self.pp}in{j}"
        mask = self.mask(inp.axes)
        other = "0.0" if inp.dtype.is_floating_point else "0"
        if mask is None:
            load = f"tl.load({self.offsets(prefix, inp.axes)})"
        elif "M" in inp.axes and "N" not in inp.axes:
            # a row vector loads as [BLOCK_M] and then gains its N axis: loaded as [BLOCK_M, 1],
            # Triton gave it the accumulator's layout and issued one load per tile element
            rows = self.offsets(prefix, inp.axes).replace("offs_m[:, None]", "offs_m")
            load = f"tl.load({rows}, mask=mask_m, other={other})[:, None]"
        else:
            load = f"tl.load({self.offsets(prefix, inp.axes)}, mask={mask}, other={other})"
        return load + (".to(tl.float32)" if inp.dtype.is_floating_point else "")

    def expr(self, i: int) -> str:
        node = self.region.nodes[i]
        op = node.op
        x = [self.ref(s) for s in node.src]
        if op is Op.ACC:
            return f"{self.acc}2" if node.arg == 1 else self.acc
        if op is Op.INPUT:
            return self.load_input(node.arg)
        if op is Op.IOTA:
            return "offs_m[:, None]" if node.arg == "M" else "offs_n[None, :]"
        if op is Op.SHIFT:
            return f"stat{node.arg}[:, None]"
        if op is Op.STAT:
            index, part = node.arg
            return f"stat{index}{'_' + part if part else ''}[:, None]"
        if op in (Op.EQ, Op.NE) and (column := self.row_column(node)):
            return f"offs_n[None, :] {INFIX[op]} {column}"
        if op in INFIX:
            return f"{x[0]} {INFIX[op]} {x[1]}"
        if op in CALL:
            return f"{CALL[op]}({x[0]})"
        if op is Op.NEG:
            return f"-{x[0]}"
        if op is Op.RECIPROCAL:
            return f"1.0 / {x[0]}"
        if op is Op.RELU:
            return f"tl.maximum({x[0]}, 0.0, propagate_nan=tl.PropagateNan.ALL)"
        if op is Op.NOT:
            return f"{x[0]} == 0"
        if op in (Op.MAX, Op.MIN):
            fn = "tl.maximum" if op is Op.MAX else "tl.minimum"
            return f"{fn}({x[0]}, {x[1]}, propagate_nan=tl.PropagateNan.ALL)"
        if op is Op.WHERE:
            return f"tl.where({x[0]}, {x[1]}, {x[2]})"
        if op is Op.POW:
            return self.power(x[0], node.arg)
        if op is Op.CAST:
            return self.cast(node.src[0], node.arg)
        if op in (Op.SUM, Op.RMAX, Op.RMIN):
            return self.reduction(node, x[0], axis=1, keep=self.keepdims, mask="mask_n[None, :]")
        raise NotImplementedError(f"no Triton rule for {op}")  # pragma: no cover

    @staticmethod
    def reduction(node, x: str, axis: int, keep: bool, mask: str) -> str:
        """Reduce ``x`` along ``axis`` with the masked-out lanes set to the identity."""
        kd = ", keep_dims=True" if keep else ""
        if node.op is Op.SUM:
            if node.dtype.is_floating_point:
                return f"tl.sum(tl.where({mask}, {x}, 0.0), axis={axis}{kd})"
            return f"tl.sum(tl.where({mask}, {x}.to(tl.int64), 0), axis={axis}{kd})"
        fill, combine = ('float("-inf")', "max_propagate_nan") if node.op is Op.RMAX else \
            ('float("inf")', "min_propagate_nan")
        return f"tl.reduce(tl.where({mask}, {x}, {fill}), {axis}, {combine}{kd})"

    @staticmethod
    def power(x: str, c: float) -> str:
        if c == 1:
            return x
        if c == 0.5:
            return f"tl.sqrt({x})"
        if c == -0.5:
            return f"tl.rsqrt({x})"
        if float(c).is_integer() and abs(c) <= 4:
            prod = " * ".join([x] * int(abs(c)))
            return prod if c > 0 else f"1.0 / ({prod})"
        if float(c).is_integer():
            odd = "True" if int(c) % 2 else "False"
            return f"pow_int({x}, {float(c)!r}, {odd})"
        return f"pow_real({x}, {float(c)!r})"

    def cast(self, src: int, target: torch.dtype) -> str:
        node = self.region.nodes[src]
        x = self.ref(src)
        if node.op is Op.CONST:
            value = node.arg
            if target.is_floating_point:
                value = float(torch.tensor(float(value)).to(target).item())
            elif target == torch.bool:
                value = bool(value)
            else:
                value = int(value)
            return f"tl.full((1, 1), {literal(value)}, {TL_DTYPE.get(target, 'tl.float32')})"
        if target.is_floating_point:
            # float -> float casts keep fp32 (``aliased``): rounding only some values would make
            # the rest inconsistent with them (x - mean(x) != 0); outputs round once when stored
            return f"{x}.to(tl.float32)" if not node.dtype.is_floating_point else x
        if target == torch.bool:
            return f"{x} != 0"
        return f"{x}.to({TL_DTYPE[target]})"

    def store_value(self, out) -> str:
        node = self.region.nodes[out.node]
        dtype = TL_DTYPE[out.dtype]
        shape = shape_of(out.axes)
        if node.op is Op.CONST:
            return f"tl.full({shape}, {literal(node.arg)}, {dtype})"
        value = self.ref(out.node)
        if {a for a in node.axes if a != "B"} != {a for a in out.axes if a != "B"}:
            value = f"tl.broadcast_to({value}, {shape})"
        return f"{value}.to({dtype})"

    def comment(self, i: int) -> str:
        node = self.region.nodes[i]
        if node.op is Op.INPUT:
            return f"load {self.region.inputs[node.arg].name}"
        if node.op is Op.ACC:
            return "the second GEMM's result" if node.arg == 1 else "GEMM result"
        if node.op is Op.STAT:
            return f"statistic {node.arg}"
        return node.op.value + (f" {node.arg}" if node.arg is not None else "")

    def value_line(self, i: int) -> str | None:
        """``v{i} = ...  # what`` for node i, or None where it needs no line (a constant, an alias)."""
        if self.region.nodes[i].op is Op.CONST or self.aliased(i):
            return None
        return f"{self.vp}{i} = {self.expr(i)}  # {self.comment(i)}"
