"""Emit the Triton source of a planned region.

One kernel shape serves both schedules. A program owns a BLOCK_M x BLOCK_N
output tile; under "row_in_cta" BLOCK_N covers the whole row (N), so each
program holds complete rows and every reduction along N finishes inside it.
The GEMM mainloop accumulates in fp32; then the epilogue streams stage by
stage over the tile that stays in registers, and every output is written once.

Values of the epilogue keep the Triton shape their axes imply: [BLOCK_M,
BLOCK_N] for a full tile, [BLOCK_M, 1] for per-row values, [1, BLOCK_N] for
row vectors, a scalar for scalars. Floating-point values are fp32.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ...ir import REDUCE, Op, Region, format_region
from ...planner import Plan
from ...planner.onepass import parts

TL_DTYPE = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.bool: "tl.int1", torch.int64: "tl.int64", torch.int32: "tl.int32",
    torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
}

_INFIX = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.DIV: "/", Op.EQ: "==", Op.NE: "!=",
          Op.LT: "<", Op.LE: "<=", Op.GT: ">", Op.GE: ">=", Op.AND: "&", Op.OR: "|"}
_CALL = {Op.ABS: "tl.abs", Op.EXP: "tl.exp", Op.LOG: "tl.log", Op.SQRT: "tl.sqrt",
         Op.RSQRT: "tl.rsqrt", Op.SIGMOID: "tl.sigmoid", Op.ERF: "tl.erf", Op.SIN: "tl.sin",
         Op.COS: "tl.cos", Op.TANH: "tanh", Op.LOG1P: "log1p", Op.EXPM1: "expm1"}


@dataclasses.dataclass(frozen=True, slots=True)
class Param:
    """One runtime argument: role is a, b, in, out, size or stride."""
    name: str
    role: str
    index: int | None = None  # which side input / output
    axis: str | None = None  # for strides: B, M, N or K; for sizes: M, N or K


@dataclasses.dataclass(frozen=True, slots=True)
class KernelSource:
    name: str
    text: str
    params: tuple[Param, ...]
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int


def _literal(value) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    return repr(int(value))


def module_header(title: str, region_text: str) -> str:
    """The top of a generated kernel file: what it is, the IR it came from, its imports."""
    return "\n".join([
        f'"""{title}', "",
        "Generated from this IR (do not edit; regenerated when anything below changes):", "",
        region_text, '"""',
        "import triton",
        "import triton.language as tl",
        "",
        "from comfuse.codegen.triton.helpers import (expm1, log1p, lse_merge, max_propagate_nan, "
        "min_propagate_nan,",
        "                                             moments_merge, pow_int, pow_real, strip_arrive,",
        "                                             strip_barrier, strip_wait, tanh)",
        "", "", ""])


LOG2E = 1.4426950408889634  # log2(e): exp(x) = 2^(x log2(e))


def stat_init(stats) -> list[str]:
    """Lines that start each statistic's per-row accumulators (BLOCK_M rows)."""
    lines = []
    init = {"sum": "tl.zeros((BLOCK_M,), dtype=tl.float32)",
            "shift": "tl.zeros((BLOCK_M,), dtype=tl.float32)",
            "max": 'tl.full((BLOCK_M,), float("-inf"), tl.float32)',
            "min": 'tl.full((BLOCK_M,), float("inf"), tl.float32)'}
    for i, st in enumerate(stats):
        if st.kind == "lse":
            lines.append(f'stat{i}_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max')
            lines.append(f"stat{i}_s = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum of exp(x - max)")
        elif st.kind == "moments":
            for part, what in (("n", "count"), ("mean", "mean"), ("m2", "sum of squared deviations")):
                lines.append(f"stat{i}_{part} = tl.zeros((BLOCK_M,), dtype=tl.float32)  # {what} of %{st.node}")
        else:
            lines.append(f"stat{i} = {init[st.kind]}  # {st.kind} of %{st.node}")
    return lines


def stat_update(stats, ref, skip=frozenset()) -> list[str]:
    """Lines that merge this tile's partials (columns mask_n) into the accumulators, but for
    the statistics in ``skip`` (merged by the caller). A max and a log-sum-exp of the same
    value (cross-entropy has both) share one tile maximum."""
    lines = []
    tile_max = {}  # node -> the name of its tile maximum, reduced once

    def maximum(st) -> str:
        if st.node not in tile_max:
            tile_max[st.node] = f"tile_max{st.node}"
            lines.append(f'tile_max{st.node} = tl.reduce(tl.where(mask_n[None, :], {ref(st.node)}.to(tl.float32), '
                         f'float("-inf")), 1, max_propagate_nan)')
        return tile_max[st.node]
    # plain sums first: each reduces a tile value to a row at once, so that its [BM, BN]
    # values are not live across the max and exp passes (cross-entropy's pick of the target
    # column, kept for after the log-sum-exp, spilled 184 bytes at 128x256, sm_90)
    for i, st in sorted(enumerate(stats), key=lambda e: e[1].kind != "sum"):
        if i in skip:
            continue
        v = f"{ref(st.node)}.to(tl.float32)"
        if st.kind == "shift":
            continue  # set on the first chunk, where its value is first needed (codegen/triton/chain.py)
        if st.kind == "sum":
            lines.append(f"stat{i} += tl.sum(tl.where(mask_n[None, :], {v}, 0.0), axis=1)")
        elif st.kind == "max":
            lines.append(f"stat{i} = tl.maximum(stat{i}, {maximum(st)}, propagate_nan=tl.PropagateNan.ALL)")
        elif st.kind == "min":
            lines.append(f'stat{i} = tl.minimum(stat{i}, tl.reduce(tl.where(mask_n[None, :], {v}, float("inf")), 1, '
                         f'min_propagate_nan), propagate_nan=tl.PropagateNan.ALL)')
        elif st.kind == "moments":
            lines.append("tile_n = tl.sum(mask_n.to(tl.float32), axis=0) + tl.zeros((BLOCK_M,), dtype=tl.float32)")
            lines.append(f"tile_mean = tl.sum(tl.where(mask_n[None, :], {v}, 0.0), axis=1) / tl.maximum(tile_n, 1.0)")
            lines.append(f"tile_dev = tl.where(mask_n[None, :], {v} - tile_mean[:, None], 0.0)")
            lines.append("tile_m2 = tl.sum(tile_dev * tile_dev, axis=1)")
            lines.append(f"stat{i}_n, stat{i}_mean, stat{i}_m2 = moments_merge(stat{i}_n, stat{i}_mean, "
                         f"stat{i}_m2, tile_n, tile_mean, tile_m2)")
        else:
            m = maximum(st)
            # exp(x - m) as 2^(x log2(e) - m log2(e)): one FMA per element where tl.exp's
            # lowering multiplies (x - m) by log2(e), a subtraction and a multiplication (sm_90
            # PTX). The rounding of m log2(e) is one factor common to the row's terms: it moves
            # the log-sum-exp by at most an ulp of m
            lines.append(f"tile_s = tl.sum(tl.where(mask_n[None, :], tl.exp2({v} * {LOG2E!r} - "
                         f"({m} * {LOG2E!r})[:, None]), 0.0), axis=1)")
            lines.append(f"stat{i}_m, stat{i}_s = lse_merge(stat{i}_m, stat{i}_s, {m}, tile_s)")
    return lines


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def _split_constexprs(p: Plan) -> tuple:
    """The constexprs of a split plan's kernels and of a ws_split plan's combine."""
    return (("BLOCK_M", p.block_m), ("BLOCK_N", p.block_n), ("BLOCK_K", p.block_k), ("GROUP_M", p.group_m),
            ("CHUNKS_POW2", _pow2(p.chunks)))


def _shape_of(axes) -> str:
    if "M" in axes and "N" in axes:
        return "(BLOCK_M, BLOCK_N)"
    if "M" in axes:
        return "(BLOCK_M, 1)"
    if "N" in axes:
        return "(1, BLOCK_N)"
    return "(1, 1)"


class _Emitter:
    def __init__(self, plan: Plan, name: str):
        self.plan = plan
        self.region: Region = plan.region
        self.name = name
        self.lines: list[str] = []
        self.params: list[Param] = []
        self.base = 0  # extra indentation: the cooperative schedule's loop over strips
        self.phase: int | None = None
        # names, so that several regions can share one kernel (back-to-back GEMM chains)
        self.vp, self.pp, self.acc = "v", "", "acc"
        self.cooperative = plan.schedule == "cooperative"
        self.prefetched: set = set()  # nodes loaded before the mainloop (prefetch_inputs)

    def line(self, text: str = "", indent: int = 1) -> None:
        self.lines.append("    " * (indent + self.base) + text if text else "")

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

    # ---- expressions -------------------------------------------------------------------
    def row_column(self, node) -> str:
        """For ``offs_n == t`` (or !=) with ``t`` an int64 value without an N axis
        (cross-entropy's target): ``t`` narrowed to 32 bits once per row, the column test's
        other side; else "". 64-bit, the test was widened and compared per element (129
        64-bit compares and 65 widenings per thread per tile at 128x256, sm_90 PTX). Column
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

    def ref(self, i: int) -> str:
        node = self.region.nodes[i]
        return _literal(node.arg) if node.op is Op.CONST else f"{self.vp}{i}"

    def expr(self, i: int) -> str:
        node = self.region.nodes[i]
        op = node.op
        x = [self.ref(s) for s in node.src]
        if op is Op.ACC:
            return self.acc
        if op is Op.INPUT:
            inp = self.region.inputs[node.arg]
            prefix = f"{self.pp}in{node.arg}"
            mask = self.mask(inp.axes)
            other = "0.0" if inp.dtype.is_floating_point else "0"
            if mask is None:
                load = f"tl.load({self.offsets(prefix, inp.axes)})"
            elif "M" in inp.axes and "N" not in inp.axes:
                # a row vector loads as [BLOCK_M] and then gains its N axis: loaded as
                # [BLOCK_M, 1], Triton gave it the accumulator's layout and issued one load
                # per tile element (128 per thread at 128x256, 8 warps: sm_90 PTX, 2026-11-30)
                rows = self.offsets(prefix, inp.axes).replace("offs_m[:, None]", "offs_m")
                load = f"tl.load({rows}, mask=mask_m, other={other})[:, None]"
            else:
                load = f"tl.load({self.offsets(prefix, inp.axes)}, mask={mask}, other={other})"
            return load + (".to(tl.float32)" if inp.dtype.is_floating_point else "")
        if op is Op.IOTA:
            return "offs_m[:, None]" if node.arg == "M" else "offs_n[None, :]"
        if op is Op.SHIFT:
            return f"stat{node.arg}[:, None]"
        if op is Op.STAT:
            index, part = node.arg
            return f"stat{index}{'_' + part if part else ''}[:, None]"
        if op in (Op.EQ, Op.NE) and (column := self.row_column(node)):
            return f"offs_n[None, :] {_INFIX[op]} {column}"
        if op in _INFIX:
            return f"{x[0]} {_INFIX[op]} {x[1]}"
        if op in _CALL:
            return f"{_CALL[op]}({x[0]})"
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
            return self.reduction(node, x[0], axis=1, keep=not self.cooperative, mask="mask_n[None, :]")
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

    def power(self, x: str, c: float) -> str:
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
            return f"tl.full((1, 1), {_literal(value)}, {TL_DTYPE.get(target, 'tl.float32')})"
        if target.is_floating_point:
            # float -> float casts keep fp32: rounding only some values would make the rest
            # inconsistent with them (x - mean(x) != 0); outputs round once when stored
            return f"{x}.to(tl.float32)" if not node.dtype.is_floating_point else x
        if target == torch.bool:
            return f"{x} != 0"
        return f"{x}.to({TL_DTYPE[target]})"

    def store_value(self, out) -> str:
        node = self.region.nodes[out.node]
        dtype = TL_DTYPE[out.dtype]
        shape = _shape_of(out.axes)
        if node.op is Op.CONST:
            return f"tl.full({shape}, {_literal(node.arg)}, {dtype})"
        value = f"{self.vp}{out.node}"
        if {a for a in node.axes if a != "B"} != {a for a in out.axes if a != "B"}:
            value = f"tl.broadcast_to({value}, {shape})"
        return f"{value}.to({dtype})"

    # ---- the kernel ----------------------------------------------------------------------
    def signature(self) -> list[str]:
        r = self.region
        batched = r.gemm.batched
        tma = self.plan.mainloop == "tma"
        if tma:
            args = [("a_desc", Param("a_desc", "a_desc"), f"{r.gemm.a.name}: A, {r.gemm.a.major}-major tensor descriptor"),
                    ("b_desc", Param("b_desc", "b_desc"), f"{r.gemm.b.name}: B, {r.gemm.b.major}-major tensor descriptor")]
        else:
            args = [("a_ptr", Param("a_ptr", "a"), f"{r.gemm.a.name}: the A operand"),
                    ("b_ptr", Param("b_ptr", "b"), f"{r.gemm.b.name}: the B operand")]
        for j, inp in enumerate(r.inputs):
            args.append((f"in{j}_ptr", Param(f"in{j}_ptr", "in", j), f"{inp.name}"))
        for k, out in enumerate(r.outputs):
            args.append((f"out{k}_ptr", Param(f"out{k}_ptr", "out", k), f"{out.name}"))
        if self.plan.schedule == "split":
            args.append(("ws_ptr", Param("ws_ptr", "workspace"),
                         "fp32 [statistic arrays, CHUNKS, M]: each slice's statistics"))
        if self.cooperative:
            args.append(("ws_ptr", Param("ws_ptr", "workspace"),
                         "fp32 [slots, 2, reductions, TILES_POW2, BLOCK_M]: per-tile partials"))
            args.append(("counter_ptr", Param("counter_ptr", "counters"),
                         "int32 [slots]: arrivals at each strip's exchanges"))
        for axis in ("M", "N", "K"):
            args.append((axis, Param(axis, "size", None, axis), None))
        if self.plan.persistent:
            args.append(("PROGRAMS", Param("PROGRAMS", "groups"), "programs of the persistent grid"))
        if self.plan.schedule == "split":
            args.append(("CHUNKS", Param("CHUNKS", "chunks"), "slices of N per row block"))
            args.append(("TILES_PER_CHUNK", Param("TILES_PER_CHUNK", "tiles_per_chunk"),
                         "N tiles per slice"))
        if self.cooperative:
            args.append(("NUM_B", Param("NUM_B", "size", None, "B"), "batches"))
            args.append(("TILES_N", Param("TILES_N", "tiles_n"), "tiles per row strip"))
            args.append(("GROUPS", Param("GROUPS", "groups"), "strips in flight at once"))
        for prefix, role, axes in ([] if tma else
                                   [("a", "a", ("B", "M", "K") if batched else ("M", "K")),
                                    ("b", "b", ("B", "K", "N") if batched else ("K", "N"))]):
            for axis in axes:
                name = f"stride_{prefix}_{axis.lower()}"
                args.append((name, Param(name, f"stride_{role}", None, axis), None))
        for j, inp in enumerate(r.inputs):
            for axis in ("B", "M", "N"):
                if axis in inp.axes:
                    name = f"stride_in{j}_{axis.lower()}"
                    args.append((name, Param(name, "stride_in", j, axis), None))
        for k, out in enumerate(r.outputs):
            for axis in ("B", "M", "N"):
                if axis in out.axes:
                    name = f"stride_out{k}_{axis.lower()}"
                    args.append((name, Param(name, "stride_out", k, axis), None))
        self.params = [p for _, p, _ in args]
        lines = []
        for name, _, comment in args:
            lines.append(f"    {name},{'  # ' + comment if comment else ''}")
        return lines

    def program_ids(self) -> None:
        p, batched = self.plan, self.region.gemm.batched
        self.line("# ---- which tile this program owns ----")
        if not p.persistent:
            self.line("pid = tl.program_id(0)")
        if self.cooperative:  # inside the strip function (see emit): strip, pid_n, slot given
            self.line(f"exchange = ((strip - slot) // GROUPS) * {self.plan.exchanges}  "
                      "# exchanges this program did before: picks the workspace buffer")
            if batched:
                self.line("pid_b = (strip // strips_per_batch).to(tl.int64)")
            self.line("pid_m = strip % strips_per_batch")
            return
        if batched:
            self.line("pid_b = tl.program_id(1).to(tl.int64)")
        if p.persistent:
            self.line("pid = tile")
        if p.schedule == "row_in_cta":
            self.line("pid_m = pid  # one program per strip of BLOCK_M whole rows")
            self.line("pid_n = 0")
        else:
            self.line("num_pid_m = tl.cdiv(M, BLOCK_M)")
            self.line("num_pid_n = tl.cdiv(N, BLOCK_N)")
            self.line("group = GROUP_M * num_pid_n  # grouped order: neighbours share operand tiles in L2")
            self.line("first_m = (pid // group) * GROUP_M")
            self.line("group_m = min(num_pid_m - first_m, GROUP_M)")
            self.line("pid_m = first_m + (pid % group) % group_m")
            self.line("pid_n = (pid % group) // group_m")

    def tile_offsets(self) -> None:
        """Rows and columns of the tile (pid_m, pid_n), and their masks."""
        self.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        self.line("offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
        self.line("if WIDE_INDEX:  # some tensor spans more than 2**31 elements")
        self.line("offs_m = offs_m.to(tl.int64)", 2)
        self.line("offs_n = offs_n.to(tl.int64)", 2)
        self.line("mask_m = offs_m < M")
        self.line("mask_n = (offs_n < N) | EVEN_N  # EVEN_N: N is a multiple of BLOCK_N, no column masks")

    def mainloop(self) -> None:
        batched = self.region.gemm.batched
        self.tile_offsets()
        self.line()
        self.prefetch_inputs()
        if self.plan.mainloop == "tma":
            self.tma_mainloop()
            return
        self.line("# ---- mainloop: acc = A[rows, :] @ B[:, cols] with fp32 accumulation ----")
        a_base = "a_ptr + pid_b * stride_a_b" if batched else "a_ptr"
        b_base = "b_ptr + pid_b * stride_b_b" if batched else "b_ptr"
        self.line(f"a_rows = {a_base} + offs_m[:, None] * stride_a_m")
        self.line(f"b_cols = {b_base} + offs_n[None, :] * stride_b_n")
        self.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        self.line("for k0 in range(0, K, BLOCK_K):")
        self.line("offs_k = k0 + tl.arange(0, BLOCK_K)", 2)
        self.line("if WIDE_INDEX:", 2)
        self.line("offs_k = offs_k.to(tl.int64)", 3)
        self.line("mask_k = offs_k < K", 2)
        self.line("a = tl.load(a_rows + offs_k[None, :] * stride_a_k, "
                  "mask=mask_m[:, None] & mask_k[None, :], other=0.0)", 2)
        self.line("b = tl.load(b_cols + offs_k[:, None] * stride_b_k, "
                  "mask=mask_k[:, None] & mask_n[None, :], other=0.0)", 2)
        self.line("if UPCAST_OPERANDS:  # Triton 3.6's interpreter multiplies bf16 bit patterns", 2)
        self.line("a = a.to(tl.float32)", 3)
        self.line("b = b.to(tl.float32)", 3)
        self.line("acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)", 2)

    def prefetch_inputs(self) -> None:
        """Plans with ``prefetch``: load the side inputs that span the whole tile (a residual)
        before the mainloop, so that their DRAM latency passes while the GEMM runs instead of
        after it (they stay in registers meanwhile: the autotuner weighs that)."""
        self.prefetched = set()
        if not getattr(self.plan, "prefetch", False) or getattr(self.plan, "overlap", False):
            return
        for i, node in enumerate(self.region.nodes):
            if node.op is Op.INPUT and {"M", "N"} <= set(self.region.inputs[node.arg].axes):
                self.line(f"{self.vp}{i} = {self.expr(i)}  # {self.comment(i)}, loaded before the mainloop")
                self.prefetched.add(i)
        if self.prefetched:
            self.line()

    def tma_mainloop(self) -> None:
        g = self.region.gemm
        self.line("# ---- mainloop: tensor-descriptor (TMA) tile loads, zero past the edges; "
                  "fp32 accumulation ----")
        self.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        self.line("for k0 in range(0, K, BLOCK_K):")
        if g.a.major == "K":
            self.line("a = a_desc.load([pid_m * BLOCK_M, k0])", 2)
        else:
            self.line("a = a_desc.load([k0, pid_m * BLOCK_M]).T  # A is stored M-major", 2)
        if g.b.major == "N":
            self.line("b = b_desc.load([k0, pid_n * BLOCK_N])", 2)
        else:
            self.line("b = b_desc.load([pid_n * BLOCK_N, k0]).T  # B is stored K-major", 2)
        self.line("if UPCAST_OPERANDS:  # Triton 3.6's interpreter multiplies bf16 bit patterns", 2)
        self.line("a = a.to(tl.float32)", 3)
        self.line("b = b.to(tl.float32)", 3)
        self.line("acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)", 2)

    def live_reductions(self, stage) -> list:
        """The reductions of ``stage`` that need an exchange: a sum of squared deviations
        paired with its row sum (plan.moments) arrives with the sum's exchange instead."""
        paired = {b for _, b in getattr(self.plan, "moments", ())}
        return [i for i in stage.reductions if i not in paired]

    def publish(self, stage) -> None:
        """Store this tile's partials of ``stage``'s exchange at ``ws_base``, one array each;
        a row sum paired with a sum of squared deviations also stores its tile's own centred
        sum of squares (the moments that Chan's formula merges)."""
        r, pairs = self.region, dict(getattr(self.plan, "moments", ()))
        k = 0
        for i in self.live_reductions(stage):
            node = r.nodes[i]
            x = self.ref(node.src[0])
            part = self.reduction(node, x, axis=1, keep=False, mask="mask_n[None, :]")
            self.line(f"part{i} = {part}")
            self.line(f"tl.store(ws_base + ({k} * TILES_POW2 + pid_n) * BLOCK_M + ws_rows, part{i})")
            k += 1
            if i in pairs:
                self.line("tile_cols = tl.maximum(tl.sum(mask_n.to(tl.float32), axis=0), 1.0)")
                self.line(f"tile_mean = part{i} / tile_cols")
                self.line(f"tile_dev = tl.where(mask_n[None, :], {x} - tile_mean[:, None], 0.0)")
                self.line(f"tl.store(ws_base + ({k} * TILES_POW2 + pid_n) * BLOCK_M + ws_rows, "
                          "tl.sum(tile_dev * tile_dev, axis=1))  # the tile's centred sum of squares")
                k += 1

    def combine(self, stage) -> None:
        """Read the strip's partials of ``stage``'s exchange from ``ws_base`` and reduce them."""
        r, pairs = self.region, dict(getattr(self.plan, "moments", ()))

        def load(k: int) -> str:
            return (f"tl.load(ws_base + ({k} * TILES_POW2 + tiles[:, None]) * BLOCK_M + ws_rows[None, :], "
                    f"mask=(tiles < TILES_N)[:, None], other=0.0, cache_modifier=\".cg\")")
        self.line("tiles = tl.arange(0, TILES_POW2)")
        k = 0
        for i in self.live_reductions(stage):
            node = r.nodes[i]
            if i in pairs:
                j = pairs[i]
                self.line(f"sums = {load(k)}")
                self.line(f"m2s = {load(k + 1)}")
                self.line("cols = tl.minimum(tl.maximum(N - tiles * BLOCK_N, 0), BLOCK_N).to(tl.float32)[:, None]")
                self.line("row_sum = tl.sum(sums, axis=0)")
                self.line("dev = tl.where(cols > 0, sums / tl.maximum(cols, 1.0) - (row_sum / N)[None, :], 0.0)")
                self.line(f"v{i} = row_sum[:, None]  # {self.comment(i)}, whole strip")
                self.line(f"v{j} = tl.sum(m2s + cols * dev * dev, axis=0)[:, None]  # {self.comment(j)}: the "
                          f"squared deviations from the row mean, the tiles' moments merged (Chan)")
                k += 2
                continue
            total = self.reduction(node, load(k), axis=0, keep=False, mask="(tiles < TILES_N)[:, None]")
            self.line(f"v{i} = {total}[:, None]  # {self.comment(i)}, whole strip")
            k += 1

    def exchange(self, stage, index: int) -> bool:
        """The cooperative strip's exchange at the end of ``stage``: publish this tile's
        partials, wait for the strip, combine. Returns False where an interpreter-form
        kernel ends (its phase is this exchange)."""
        self.line(f"# exchange {index}: publish this tile's partials, wait for the strip's "
                  f"{len(self.live_reductions(stage))} x TILES_N, combine")
        # GPU: a slot's two buffers alternate between consecutive exchanges, so a fast tile
        # can publish exchange e+1 while a slow one still reads e. Interpreter form: each
        # phase re-publishes the exchanges before it, so every (strip, exchange) has its own.
        where = "(slot * 2 + exchange % 2)" if self.phase is None else \
            f"(strip * {max(self.plan.exchanges, 2)} + {index})"
        self.line(f"ws_base = ws_ptr + {where} * ({self.plan.exchange_width} * TILES_POW2 * BLOCK_M)")
        self.line("ws_rows = tl.arange(0, BLOCK_M)")
        self.publish(stage)
        if self.phase is not None and self.phase == index:
            self.line(f"# interpreter form, phase {index}: the strip's other tiles publish in this "
                      "launch; the next launch combines")
            return False
        if self.phase is None:
            self.line("strip_barrier(counter_ptr + slot, TILES_N)")
            self.line("exchange += 1")
        self.combine(stage)
        return True

    def emit(self) -> KernelSource:
        if self.plan.schedule == "split":
            return self.emit_split()
        p, r = self.plan, self.region
        sig = self.signature()
        consts = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "UPCAST_OPERANDS", "DOT_PRECISION",
                  "WIDE_INDEX", "EVEN_N"] + (["TILES_POW2"] if self.cooperative else [])
        self.lines = []
        if self.cooperative and p.overlap and self.phase is None:
            return self.emit_overlapped(sig, consts)
        if self.cooperative:
            # The work on one strip is a function of its own, called from the persistent
            # loop, so ptxas allocates its registers apart from the loop's (RMSNorm 128x128x64,
            # 8 warps: 116 registers, 194 inlined; neither spills). Whether that is faster is
            # not settled: timed through Python (H200, 2026-11-30) the order changed with the
            # plan; bench/results/h200-2026-11-30-session3.
            self.function(f"{self.name}_strip", sig, consts,
                          "One row strip: this program's tile, its stages and exchanges.",
                          "strip, pid_n, slot, strips_per_batch,", noinline=True)
        else:
            self.function(self.name, sig, consts, p.describe())
        if p.persistent:
            # one program per SM (PROGRAMS of them) walks the tiles; Triton fuses this loop
            # with the K loop, so the next tile's first loads are issued during this tile's
            # epilogue instead of after it
            self.line("for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), PROGRAMS, "
                      "flatten=True):")
            self.base += 1
        self.program_ids()
        self.mainloop()
        exchanges = 0
        for stage in p.stages:
            self.line()
            self.line(self.stage_title(stage))
            self.stage_values(stage)
            if self.cooperative and self.live_reductions(stage):
                if not self.exchange(stage, exchanges):
                    break
                exchanges += 1
            for k in stage.stores:
                out = r.outputs[k]
                mask = self.mask(out.axes)
                if self.cooperative and "N" not in out.axes:
                    mask = f"{mask} & (pid_n == 0)" if mask else "pid_n == 0"  # one tile writes row values
                mask_arg = f", mask={mask}" if mask else ""
                self.line(f"tl.store({self.offsets(f'out{k}', out.axes)}, "
                          f"{self.store_value(out)}{mask_arg})  # {out.name}")
        if p.persistent:
            self.base -= 1
        if self.cooperative:
            self.persistent_loop(sig, consts)
        body = "\n".join(self.lines)
        header = module_header(f"comfuse kernel {self.name}: {p.describe()}", format_region(r))
        constexprs = (("BLOCK_M", p.block_m), ("BLOCK_N", p.block_n), ("BLOCK_K", p.block_k),
                      ("GROUP_M", p.group_m))
        if self.cooperative:
            constexprs += (("TILES_POW2", _pow2(p.tiles_n)),)
        return KernelSource(self.name, header + body + "\n", tuple(self.params), constexprs,
                            p.num_warps, p.num_stages)

    # ---- the cooperative strip with its exchange overlapped by the next strip's mainloop ----
    def emit_overlapped(self, sig: list, consts: list) -> KernelSource:
        """One persistent loop, one iteration per strip of the slot plus one: iteration j
        runs strip j's mainloop and first stage and publishes its partials (no wait), then
        finishes strip j-1 (waits for its first exchange, which the strip's programs
        published an entire mainloop earlier, combines, runs the later stages and their
        exchanges, stores). The finished tile of strip j-1 is the only value carried across
        an iteration; its first stage is recomputed from it.

        Why it cannot deadlock or read a buffer being rewritten (the programs of a slot are
        co-resident, as in the plain schedule):
        - every program of a slot runs the same sequence of arrivals and waits; a wait in
          iteration j needs only arrivals the others make earlier in their own sequence
          (strip j-1's first exchange, in their iteration j-1, or the same later exchange
          of strip j-1, reached without waiting on anything of strip j), so no cycle forms;
        - the first exchange alternates two counters by strip parity: a program arrives at
          strip j+2 only after waiting for strip j, so no generation of a counter starts
          before the previous one is complete, and ``old // members`` names it;
        - the first exchange's partials rotate over four buffers: strip j's overwrite strip
          j-4's, which every program finished reading in iteration j-3, before arriving at
          strip j-2, for which this program waited in iteration j-1;
        - later exchanges (2nd, 3rd ...) publish, wait and combine at once, in their own
          counter and buffers."""
        p, r = self.plan, self.region
        width = self.plan.exchange_width
        counters = p.exchanges + 1
        self.function(self.name, sig, consts, p.describe() + "; exchange overlapped with the next strip's mainloop")
        self.line("pid = tl.program_id(0)")
        self.line("pid_n = pid % TILES_N  # this program's tile in every strip it works on")
        self.line("slot = pid // TILES_N  # the programs of one slot share strips and exchanges")
        self.line("strips_per_batch = tl.cdiv(M, BLOCK_M)")
        self.line("mine = tl.cdiv(strips_per_batch * NUM_B - slot, GROUPS)  # strips of this slot")
        self.line(f"buffer = {width} * TILES_POW2 * BLOCK_M  # one exchange's partials")
        self.line(f"counters = counter_ptr + slot * {counters}  # [first exchange, even strips; odd strips; "
                  "later exchanges]")
        self.line("ws_rows = tl.arange(0, BLOCK_M)")
        self.line("prev_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the tile of the strip to finish")
        self.line("prev_target = (pid * 0).to(tl.int64)  # the count that completes its first exchange (counters: int64)")
        self.line("for it in range(0, mine + 1):")
        self.line("cur_acc = prev_acc", 2)
        self.line("cur_target = prev_target", 2)
        self.line("if it < mine:  # ---- strip it: mainloop, first stage, publish (no wait) ----", 2)
        self.base = 2
        self.strip_ids("slot + it * GROUPS")
        self.mainloop()
        first = p.stages[0]
        self.stage_values(first)
        self.line(f"ws_base = ws_ptr + ((slot * {p.exchanges} + 0) * 4 + it % 4) * buffer")
        self.publish(first)
        self.line("cur_target = strip_arrive(counters + it % 2, TILES_N)")
        self.line("cur_acc = acc")
        self.base = 0
        self.line("if it > 0:  # ---- strip it - 1: wait for its first exchange, finish, store ----", 2)
        self.base = 2
        self.strip_ids("slot + (it - 1) * GROUPS")
        self.tile_offsets()
        self.line("acc = prev_acc")
        exchanges = 0
        for stage in p.stages:
            self.line()
            self.line(self.stage_title(stage))
            self.stage_values(stage)
            if self.live_reductions(stage):
                self.overlapped_exchange(stage, exchanges)
                exchanges += 1
            for k in stage.stores:
                out = r.outputs[k]
                mask = self.mask(out.axes)
                if "N" not in out.axes:
                    mask = f"{mask} & (pid_n == 0)" if mask else "pid_n == 0"  # one tile writes row values
                self.line(f"tl.store({self.offsets(f'out{k}', out.axes)}, {self.store_value(out)}, "
                          f"mask={mask})  # {out.name}")
        self.base = 0
        self.line("prev_acc = cur_acc", 2)
        self.line("prev_target = cur_target", 2)
        body = "\n".join(self.lines)
        header = module_header(f"comfuse kernel {self.name}: {p.describe()}", format_region(r))
        constexprs = (("BLOCK_M", p.block_m), ("BLOCK_N", p.block_n), ("BLOCK_K", p.block_k),
                      ("GROUP_M", p.group_m), ("TILES_POW2", _pow2(p.tiles_n)))
        return KernelSource(self.name, header + body + "\n", tuple(self.params), constexprs,
                            p.num_warps, p.num_stages)

    def strip_ids(self, strip: str) -> None:
        self.line(f"strip = {strip}")
        if self.region.gemm.batched:
            self.line("pid_b = (strip // strips_per_batch).to(tl.int64)")
        self.line("pid_m = strip % strips_per_batch")

    def stage_values(self, stage) -> None:
        """``stage``'s values over the tile; a cooperative strip's reductions come from its
        exchange instead, and prefetched inputs were loaded before the mainloop."""
        for i in stage.nodes:
            node = self.region.nodes[i]
            if node.op is Op.CONST or (self.cooperative and node.op in REDUCE) or i in self.prefetched:
                continue
            self.line(f"v{i} = {self.expr(i)}  # {self.comment(i)}")

    def overlapped_exchange(self, stage, index: int) -> None:
        """Exchange ``index`` of the strip being finished: the first waits for partials
        published an iteration ago; later ones publish, wait and combine at once."""
        p = self.plan
        self.line(f"ws_base = ws_ptr + ((slot * {p.exchanges} + {index}) * 4 + (it - 1) % 4) * buffer")
        if index == 0:
            self.line("strip_wait(counters + (it - 1) % 2, prev_target)  # published a mainloop ago")
        else:
            self.publish(stage)
            self.line(f"strip_barrier(counters + {1 + index}, TILES_N)")
        self.combine(stage)

    def function(self, name: str, sig: list, consts: list, doc: str, extra: str = "",
                 noinline: bool = False) -> None:
        """A @triton.jit function's header: the kernel's parameters, ``extra`` ones, the
        constexprs and a docstring. ``noinline``: a function of its own in the PTX, so that
        ptxas allocates its registers apart from the caller's loop."""
        self.line("@triton.jit(noinline=True)" if noinline else "@triton.jit", -1)
        self.line(f"def {name}(", -1)
        self.lines += sig
        if extra:
            self.line(extra)
        self.line(", ".join(f"{c}: tl.constexpr" for c in consts) + ",")
        self.line("):", -1)
        self.line(f'"""{doc}"""')

    def call(self, name: str, extra: str, consts: list, indent: int) -> None:
        """A call of ``name`` with every kernel parameter, ``extra`` ones and the constexprs."""
        self.line(f"{name}(", indent)
        self.line(", ".join(p.name for p in self.params) + ",", indent + 1)
        self.line(extra, indent + 1)
        self.line(", ".join(consts) + ",", indent + 1)
        self.line(")", indent)

    def persistent_loop(self, sig: list, consts: list) -> None:
        """The cooperative kernel proper: a persistent grid whose programs walk the strips
        of their slot, calling the strip function for each."""
        self.line()
        self.line()
        self.function(self.name, sig, consts, self.plan.describe())
        self.line("pid = tl.program_id(0)")
        self.line("pid_n = pid % TILES_N  # this program's tile in every strip it works on")
        self.line("slot = pid // TILES_N  # the programs of one slot share strips and exchanges")
        self.line("strips_per_batch = tl.cdiv(M, BLOCK_M)")
        self.line("for strip in range(slot, strips_per_batch * NUM_B, GROUPS):")
        self.call(f"{self.name}_strip", "strip, pid_n, slot, strips_per_batch,", consts, 2)

    # ---- the split schedule: statistics over slices of N, then a combine kernel -------------
    def stat_slots(self) -> list:
        """(statistic, part) per workspace array: lse keeps a running max and a sum."""
        slots = []
        for i, st in enumerate(self.plan.onepass.stats):
            slots += [(i, part) for part in parts(st)]
        return slots

    def emit_split(self) -> KernelSource:
        p = self.plan
        op = p.onepass
        original = self.region
        self.region = op.tile  # tile values: the region plus what the statistics reduce
        sig = self.signature()
        consts = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "UPCAST_OPERANDS", "DOT_PRECISION",
                  "WIDE_INDEX", "EVEN_N", "CHUNKS_POW2"]
        slots = self.stat_slots()
        slot_of = {key: j for j, key in enumerate(slots)}

        def head(name: str, doc: str) -> None:
            self.function(name, sig, consts, doc)

        # kernel 1: each program reduces a slice of N for a block of rows to statistics. One
        # tile's work is a function called from the loop over the slice's tiles: inlined
        # (``inline_tile``, the planner's choice) or a noinline function of its own. Noinline,
        # ptxas allocates the tile's registers apart from the loop (cross-entropy, TMA
        # 128x256x64, 8 warps: 255 registers, no spills; inlined: 296 bytes of spills then,
        # none since the targets load per row), yet the inlined form ran 12 % faster on the
        # H200 (3.29 vs 3.74 ms, 2026-11-30). The noinline function takes scalars only: the
        # running statistics live in the program's own rows of the workspace between tiles
        # (a few KB, in L2), behind a barrier. Inlined, the tile takes the statistics and
        # returns them, so they stay in registers and are stored once per slice; without the
        # barrier Triton can also fuse the slice and K loops (``flatten``, pipelined across
        # tiles; with the barrier the fused loop was single-buffered, sm_90 TTGIR).
        def fill(i: int, part: str) -> str:
            kind = op.stats[i].kind
            if kind == "max" or (kind == "lse" and part == "m"):
                return 'float("-inf")'
            return 'float("inf")' if kind == "min" else "0.0"

        def ws_at(j: int) -> str:
            return f"ws_ptr + ({j} * CHUNKS + chunk) * M + offs_m"
        names = [f"stat{i}_{part}" if part else f"stat{i}" for i, part in slots]
        carried = p.inline_tile  # statistics in registers across the slice's tiles
        self.lines = []
        self.function(f"{self.name}_tile", sig, consts,
                      "Tile t of the slice: its GEMM and tile values, merged into the slice's statistics"
                      + (" (passed in and returned)." if carried else " (kept in the workspace)."),
                      "pid_m, chunk, t," + (" " + ", ".join(names) + "," if carried else ""),
                      noinline=not p.inline_tile)
        self.line("pid_n = chunk * TILES_PER_CHUNK + t")
        self.mainloop()
        needed = set()
        todo = [st.node for st in op.stats]
        while todo:
            i = todo.pop()
            if i not in needed:
                needed.add(i)
                todo += list(self.region.nodes[i].src)
        self.line()
        if not carried:
            self.line("# ---- the slice's statistics so far: fresh on its first tile, else from the workspace ----")
            self.line("tl.debug_barrier()  # the previous tile's stores, by other threads of this program")
            for line in stat_init(op.stats):
                self.line(line)
            self.line("if t > 0:")
            for j, name in enumerate(names):
                self.line(f"{name} = tl.load({ws_at(j)}, mask=mask_m, other={fill(*slots[j])})", 2)
            self.line()
        picks = self.column_picks(op.stats, needed)
        inside = set().union(*(pick[0] for pick in picks.values()))  # computed in the pick's branch only
        self.line("# ---- tile values the statistics reduce ----")
        for i in sorted(needed - inside):
            node = self.region.nodes[i]
            if node.op is not Op.CONST and i not in self.prefetched:
                self.line(f"v{i} = {self.expr(i)}  # {self.comment(i)}")
        self.line("# ---- this tile's partials, merged into the slice's statistics"
                  + (" ----" if carried else ", stored ----"))
        for i, (_, value, column) in picks.items():
            self.line(f"# stat{i} picks one column per row (cross-entropy's target): only a tile holding")
            self.line("# some row's column adds to it, the others skip the compare and select per element")
            self.line(f"pick{i} = {column}")
            self.line(f"if tl.max(((pick{i} >= pid_n * BLOCK_N) & (pick{i} < pid_n * BLOCK_N + BLOCK_N)).to(tl.int32)) > 0:")
            self.line(f"stat{i} += tl.sum(tl.where(mask_n[None, :] & (offs_n[None, :] == pick{i}), "
                      f"{self.ref(value)}.to(tl.float32), 0.0), axis=1)", 2)
        for line in stat_update(op.stats, self.ref, skip=set(picks)):
            self.line(line)
        if carried:
            self.line(f"return {', '.join(names)}")
        else:
            for j, name in enumerate(names):
                self.line(f"tl.store({ws_at(j)}, {name}, mask=mask_m)")
        self.line()
        self.line()
        head(self.name, f"{p.describe()}: statistics of one slice of N")
        self.line("pid = tl.program_id(0)")
        if p.grouped:
            self.line("# grouped order, as a plain GEMM takes its tiles: GROUP_M row blocks at a time, each")
            self.line("# slice's B columns shared by the GROUP_M programs in flight beside each other")
            self.line("num_pid_m = tl.cdiv(M, BLOCK_M)")
            self.line("group = GROUP_M * CHUNKS")
            self.line("first_m = (pid // group) * GROUP_M")
            self.line("group_m = min(num_pid_m - first_m, GROUP_M)")
            self.line("pid_m = first_m + (pid % group) % group_m")
            self.line("chunk = (pid % group) // group_m")
        else:
            self.line("# the slices of one row block vary fastest: the programs in flight hold a few row")
            self.line("# blocks of A, which stay in L2 while each program walks its tiles (row blocks fastest")
            self.line("# put every row block of A in flight and re-read it from DRAM for every tile)")
            self.line("chunk = pid % CHUNKS")
            self.line("pid_m = pid // CHUNKS")
        self.line("# the last slice may hold fewer tiles (CHUNKS * TILES_PER_CHUNK can exceed the tiles)")
        self.line("tiles = tl.minimum(TILES_PER_CHUNK, tl.cdiv(N, BLOCK_N) - chunk * TILES_PER_CHUNK)")
        if carried:
            for line in stat_init(op.stats):
                self.line(line)
        if p.flatten and carried:
            self.line("# one loop over (tile, K step) pairs after Triton fuses the two: the next tile's first")
            self.line("# loads are issued while this tile's epilogue runs, rather than after it")
            self.line("for t in tl.range(0, tiles, flatten=True):")
        else:
            self.line("for t in range(0, tiles):")
        if carried:
            self.line(f"{', '.join(names)} = {self.name}_tile(", 2)
            self.line(", ".join(q.name for q in self.params) + ",", 3)
            self.line("pid_m, chunk, t, " + ", ".join(names) + ",", 3)
            self.line(", ".join(consts) + ",", 3)
            self.line(")", 2)
            self.line("# the slice's statistics, stored once")
            self.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
            self.line("if WIDE_INDEX:")
            self.line("offs_m = offs_m.to(tl.int64)", 2)
            self.line("mask_m = offs_m < M")
            for j, name in enumerate(names):
                self.line(f"tl.store({ws_at(j)}, {name}, mask=mask_m)")
        else:
            self.call(f"{self.name}_tile", "pid_m, chunk, t,", consts, 2)
        first = "\n".join(self.lines)

        # kernel 2: merge the slices' statistics per row, then the per-row combine step
        self.lines = []
        head(f"{self.name}_combine", "merge each row's statistics over the slices of N; compute the outputs")
        self.line("pid_m = tl.program_id(0)")
        self.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        self.line("mask_m = offs_m < M")
        self.line("chunks = tl.arange(0, CHUNKS_POW2)")
        self.line("both = (chunks < CHUNKS)[:, None] & mask_m[None, :]")

        def slice_load(j: int, other: str) -> str:
            return (f"tl.load(ws_ptr + ({j} * CHUNKS + chunks[:, None]) * M + offs_m[None, :], "
                    f"mask=both, other={other})")
        for i, st in enumerate(op.stats):
            if st.kind == "sum":
                self.line(f"stat{i} = tl.sum({slice_load(slot_of[(i, '')], '0.0')}, axis=0)  # sum of %{st.node}")
            elif st.kind in ("max", "min"):
                fill, combine = ('float("-inf")', "max_propagate_nan") if st.kind == "max" else \
                    ('float("inf")', "min_propagate_nan")
                self.line(f"stat{i} = tl.reduce({slice_load(slot_of[(i, '')], fill)}, 0, {combine})  "
                          f"# {st.kind} of %{st.node}")
            elif st.kind == "moments":  # Chan: mean = sum n_c mean_c / n; M2 = sum M2_c + n_c (mean_c - mean)^2
                self.line(f"slice_n = {slice_load(slot_of[(i, 'n')], '0.0')}")
                self.line(f"slice_mean = {slice_load(slot_of[(i, 'mean')], '0.0')}")
                self.line(f"slice_m2 = {slice_load(slot_of[(i, 'm2')], '0.0')}")
                self.line("row_n = tl.sum(slice_n, axis=0)")
                self.line(f"stat{i}_mean = tl.sum(slice_n * slice_mean, axis=0) / tl.maximum(row_n, 1.0)")
                self.line(f"stat{i}_m2 = tl.sum(slice_m2 + slice_n * (slice_mean - stat{i}_mean[None, :]) * "
                          f"(slice_mean - stat{i}_mean[None, :]), axis=0)")
            else:
                neg_inf = 'float("-inf")'
                self.line(f"slice_m = {slice_load(slot_of[(i, 'm')], neg_inf)}")
                self.line(f"slice_s = {slice_load(slot_of[(i, 's')], '0.0')}")
                self.line("row_m = tl.reduce(slice_m, 0, max_propagate_nan)")
                self.line("scaled = tl.where(slice_m > float(\"-inf\"), slice_s * tl.exp(slice_m - row_m[None, :]), 0.0)")
                self.line(f"stat{i} = row_m + tl.log(tl.sum(scaled, axis=0))  # log-sum-exp of %{st.node}")
        return self.combine_source(original, op, f"comfuse kernels {self.name} and {self.name}_combine: "
                                   f"{p.describe()}", first + "\n\n\n", p.num_warps, p.num_stages)

    def combine_source(self, original: Region, op, title: str, before: str, num_warps: int,
                       num_stages: int) -> KernelSource:
        """The module of a split plan's kernels: the combine kernel (its lines so far, then the
        IR's combine step) after ``before``, under a header naming ``title`` and the region."""
        self.combine_step(original, op)
        text = "\n".join(self.lines)
        self.region = original
        header = module_header(title, format_region(original))
        return KernelSource(self.name, header + before + text + "\n", tuple(self.params),
                            _split_constexprs(self.plan), num_warps, num_stages)

    def combine_step(self, original: Region, op) -> None:
        """The per-row combine step on the merged statistics (``stat{i}``, [BLOCK_M] each) and
        the stores of the outputs."""
        self.region = original.replace(nodes=op.combine, outputs=op.outputs)
        self.line("# ---- per-row combine step ----")
        for i, node in enumerate(op.combine):
            if node.op is not Op.CONST:
                self.line(f"v{i} = {self.expr(i)}  # {self.comment(i)}")
        for k, out in enumerate(op.outputs):
            mask = self.mask(out.axes)
            mask_arg = f", mask={mask}" if mask else ""
            self.line(f"tl.store({self.offsets(f'out{k}', out.axes)}, {self.store_value(out)}{mask_arg})"
                      f"  # {out.name}")
        self.region = original

    def emit_lse_combine(self, title: str) -> KernelSource:
        """The combine kernel of a ws_split plan (the Gluon template's KIND_LSE, codegen/gluon/
        strip.py): its workspace holds [CHUNKS = tiles per row, M] per-tile log-sum-exps, then
        [M] target logits, written only where a row's target is a column. Merged per row, they
        stand in for the one-pass form's statistics (planner/template.py, ``match_lse``: the
        log-sum-exp for itself and for a max that only shifts; the pick for the sum of
        where(column == target, x, 0), 0 for a target outside [0, N)); then the combine step."""
        p = self.plan
        t = p.template
        op = p.onepass
        original = self.region
        self.region = op.tile
        sig = self.signature()
        consts = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "UPCAST_OPERANDS", "DOT_PRECISION",
                  "WIDE_INDEX", "EVEN_N", "CHUNKS_POW2"]
        self.lines = []
        self.function(f"{self.name}_combine", sig, consts,
                      "merge each row's per-tile log-sum-exps and its target logit; compute the outputs")
        self.line("pid_m = tl.program_id(0)")
        self.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        self.line("mask_m = offs_m < M")
        self.line("# log-sum-exp over the row's tiles, 32 tiles at a time (a running max and a rescaled sum)")
        self.line('run_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)')
        self.line("run_s = tl.zeros((BLOCK_M,), dtype=tl.float32)")
        self.line("for j0 in range(0, CHUNKS, 32):")
        self.line("jj = j0 + tl.arange(0, 32)", 2)
        self.line("part = tl.load(ws_ptr + jj[:, None] * M + offs_m[None, :], "
                  'mask=(jj < CHUNKS)[:, None] & mask_m[None, :], other=float("-inf"))', 2)
        self.line("new_m = tl.maximum(run_m, tl.max(part, 0))", 2)
        self.line("run_s = run_s * tl.exp(run_m - new_m) + tl.sum(tl.exp(part - new_m[None, :]), 0)", 2)
        self.line("run_m = new_m", 2)
        self.line("lse = run_m + tl.log(run_s)")
        for k in t.lse:
            self.line(f"stat{k} = lse  # log-sum-exp of %{op.stats[k].node}")
        for k in t.shifts:
            self.line(f"stat{k} = lse  # max of %{op.stats[k].node}: only a shift, the log-sum-exp stands in")
        if t.pick is not None:
            inp = op.tile.inputs[t.target]
            rows = self.offsets(f"in{t.target}", inp.axes).replace("offs_m[:, None]", "offs_m")
            self.line(f"target = tl.load({rows}, mask=mask_m, other=-1)")
            self.line(f"stat{t.pick} = tl.load(ws_ptr + CHUNKS * M + offs_m, mask=mask_m & (target >= 0) & "
                      f"(target < N), other=0.0)  # the logit at the target column")
        return self.combine_source(original, op, f"comfuse kernel {self.name}_combine, the combine of {title}",
                                   "", 4, 1)

    def stage_title(self, stage) -> str:
        reds = [self.region.nodes[i] for i in stage.reductions]
        what = ", ".join(f"{n.op.value} over {n.arg}" for n in reds)
        tail = f"; ends with {what}" if what else ""
        head = "over the resident tile" if stage.index == 0 else "resumes on the resident tile"
        return f"# ---- stage {stage.index}: elementwise {head}{tail} ----"

    def comment(self, i: int) -> str:
        node = self.region.nodes[i]
        if node.op is Op.INPUT:
            return f"load {self.region.inputs[node.arg].name}"
        if node.op is Op.ACC:
            return "GEMM result"
        if node.op is Op.STAT:
            return f"statistic {node.arg}"
        return node.op.value + (f" {node.arg}" if node.arg is not None else "")


def emit(plan: Plan, name: str, phase: int | None = None) -> KernelSource:
    """The source text of ``plan``'s kernel, named ``name``, and its parameter list.

    ``phase`` (cooperative plans only) emits the interpreter form: the kernel runs up to
    exchange ``phase`` and publishes its partials there, with no waiting; launching phases
    0..E in order computes what the single GPU launch computes, without a spin-wait that
    Triton's interpreter (one program after another) could never leave."""
    if plan.schedule == "ws_split":  # the template's combine kernel only (the template is Gluon)
        as_split = dataclasses.replace(plan, schedule="split", mainloop="pointer")  # (its parameters)
        return _Emitter(as_split, name).emit_lse_combine(plan.describe())
    e = _Emitter(plan, name)
    e.phase = phase
    return e.emit()
