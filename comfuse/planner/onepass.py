"""One-pass form: a region whose outputs are per-row values, rewritten so that every
reduction along N becomes a mergeable statistic of values that need no earlier reduction.
An output may also be a full tile that needs no reduction (the logits a language model
returns beside its loss): the slices write it as they pass, and the combine step never
sees it.

This is what lets a loss over a vocabulary-wide row (cross-entropy at N = 128k) run
without the row ever being resident at once: each program reduces its slice of N to a
few numbers per row (sum, max, min, or an online log-sum-exp pair), and a small combine
step merges the slices and computes the outputs. The rewrite is algebra over "row
constants" (values that depend on reductions but not on N):

- a full-tile value is kept as an affine form ``sum_k c_k * t_k + c_0``: ``t_k`` need no
  reduction ("tile values"), the coefficients ``c`` are row constants;
- ``sum_N(affine) = sum_k c_k * sum_N(t_k) + N * c_0``;
  ``where(mask, affine, affine)`` distributes over the terms when the mask is a tile value;
  ``max_N(t + c) = max_N(t) + c``;
- ``sum_N(exp(t + c)) = exp(lse_N(t) + c)`` with ``lse`` merged online (running max and a
  rescaled sum), so nothing overflows;
- ``sum_N((t + c)^2) = M2(t) + N * (mean(t) + c)^2``, exactly, with the moments (mean,
  M2 = sum of squared deviations) merged by Chan's formula: variance stays two-pass in
  effect and is never expanded into E[x^2] - E[x]^2.
"""
from __future__ import annotations

import dataclasses

import torch

from ..ir import ELEMENTWISE, LEAF, REDUCE, Node, Op, Output, Region
from ..ir.interpret import BINARY_FNS, UNARY_FNS, run_nodes
from .passes import one_hot

F32 = torch.float32


@dataclasses.dataclass(frozen=True, slots=True)
class Statistic:
    kind: str  # "sum" | "max" | "min" | "lse" | "moments" (mean and M2) | "shift" (see below)
    node: int  # the tile value reduced along N (index into OnePass.tile.nodes)


PARTS = {"lse": ("m", "s"), "moments": ("n", "mean", "m2")}


def parts(stat: Statistic) -> tuple:
    """The numbers a statistic keeps per row: one, except lse (max, sum) and moments
    (count, mean, M2). Kernels lay their workspaces out by these."""
    return PARTS.get(stat.kind, ("",))


@dataclasses.dataclass(frozen=True, slots=True)
class OnePass:
    tile: Region  # the row-form region, extended with the tile values the statistics reduce
    stats: tuple[Statistic, ...]
    combine: tuple[Node, ...]  # per-row SSA: leaves are STAT (arg: statistic), INPUT, CONST
    outputs: tuple[Output, ...]  # nodes of ``combine``, except those of ``tile_outputs``
    link: object = None  # back-to-back chains: the form of the value the next GEMM reads
    tile_outputs: tuple[int, ...] = ()  # indices into outputs whose node is in ``tile`` (full tiles)


@dataclasses.dataclass(frozen=True, slots=True)
class AffineLink:
    """The next GEMM's A operand as sum_k coef_k * t_k + const (t_k tile values, the
    coefficients per-row combine nodes): its product with W distributes over the terms."""
    terms: tuple  # ((tile node, combine node), ...)
    const: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class ExpLink:
    """The next GEMM's A operand as scale * exp(t + shift): accumulated with online
    rescaling (a running max of t), as flash attention does."""
    base: int
    shift: int | None
    scale: int | None


class NotOnePass(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class _Affine:
    terms: tuple  # ((tile node, combine coefficient node), ...)
    const: int | None  # combine node, or None for 0


@dataclasses.dataclass(frozen=True)
class _Square:
    base: int  # tile node t
    shift: int | None  # combine node c: the value is (t + c)^2


@dataclasses.dataclass(frozen=True)
class _ExpShift:
    base: int  # tile node t
    shift: int | None  # combine node c: the value is scale * exp(t + c)
    scale: int | None = None  # combine node (None: 1)


class _Rewriter:
    def __init__(self, region: Region, shift: bool = False):
        self.region = region
        # Deferred chains round the link's terms to the next GEMM's operand dtype. A term like
        # y (LayerNorm's input) far from zero would lose its deviations in that rounding, so
        # each row's values are shifted by a per-row constant near them first (a "shift"
        # statistic: the mean of the row's first chunk) and the shift is added back exactly
        # through the constant term.
        self.shift = shift
        self._shifted: dict = {}
        self.tile = list(region.nodes)
        self.combine: list[Node] = []
        self.stats: list[Statistic] = []
        self._memo: dict = {}
        self.depends: list[bool] = []  # does node i depend on a reduction?
        for n in region.nodes:
            self.depends.append(n.op in REDUCE or any(self.depends[s] for s in n.src))

    # ---- building blocks -------------------------------------------------------------
    def c(self, op: Op, src=(), arg=None, dtype=F32) -> int:
        key = (op, tuple(src), arg if not isinstance(arg, float) else float.hex(arg), dtype)
        if key not in self._memo:
            axes = frozenset().union(*(self.combine[s].axes for s in src)) if src else frozenset()
            if op in (Op.STAT, Op.INPUT):
                axes = frozenset({"M"}) if op is Op.STAT else self.region.inputs[arg].axes
            self.combine.append(Node(op, tuple(src), dtype, axes, arg))
            self._memo[key] = len(self.combine) - 1
        return self._memo[key]

    def const(self, value: float) -> int:
        return self.c(Op.CONST, (), float(value))

    def stat(self, kind: str, node: int, part: str = "") -> int:
        s = Statistic(kind, node)
        if s not in self.stats:
            self.stats.append(s)
        return self.c(Op.STAT, (), (self.stats.index(s), part))

    def add_tile(self, op: Op, src, dtype=F32, arg=None) -> int:
        """A tile value: an existing identical node when there is one (fewer tile values
        means fewer [BLOCK_M, BLOCK_N] tensors live in the kernel and fewer statistics)."""
        axes = frozenset().union(*(self.tile[s].axes for s in src))
        node = Node(op, tuple(src), dtype, axes, arg)
        for j, existing in enumerate(self.tile):
            if existing == node:
                return j
        self.tile.append(node)
        return len(self.tile) - 1

    def indicator(self, cond: int) -> int:
        """The tile value 1.0 where ``cond`` holds, else 0.0: the region's own float cast of
        the condition when it has one (cross-entropy counts its targets that way), else a new
        where(cond, 1, 0)."""
        for j, n in enumerate(self.tile):
            if n.op is Op.CAST and n.src == (cond,) and n.dtype == F32 and n.arg == F32:
                return j
        return self.add_tile(Op.WHERE, (cond, self.tile_const(1.0), self.tile_const(0.0)))

    def mul(self, a: int | None, b: int | None) -> int | None:
        if a is None or b is None:
            return None
        return self.c(Op.MUL, (a, b))

    def add(self, a: int | None, b: int | None) -> int | None:
        if a is None:
            return b
        if b is None:
            return a
        return self.c(Op.ADD, (a, b))

    # ---- forms -------------------------------------------------------------------------
    def affine(self, form) -> _Affine:
        if isinstance(form, _Affine):
            return form
        if isinstance(form, tuple) and form[0] == "tile":
            i = form[1]
            if "N" not in self.tile[i].axes:  # a constant or an [M] input: a row constant
                return _Affine((), self.row_of_tile(i))
            if self.shift and "M" in self.tile[i].axes:
                if i not in self._shifted:
                    k = self.stat("shift", i)
                    leaf = len(self.tile)
                    self.tile.append(Node(Op.SHIFT, (), F32, frozenset({"M"}), self.combine[k].arg[0]))
                    self._shifted[i] = (self.add_tile(Op.SUB, (i, leaf)), k)
                base, k = self._shifted[i]
                return _Affine(((base, self.const(1.0)),), k)
            return _Affine(((i, self.const(1.0)),), None)
        if isinstance(form, tuple) and form[0] == "row":
            return _Affine((), form[1])
        raise NotOnePass("exp(t + c) or (t + c)^2 is used other than in a sum over N")

    def scale(self, form: _Affine, k: int) -> _Affine:
        return _Affine(tuple((t, self.mul(c, k)) for t, c in form.terms), self.mul(form.const, k))

    def plus(self, x: _Affine, y: _Affine) -> _Affine:
        terms = dict()
        for t, c in x.terms + y.terms:
            terms[t] = self.add(terms.get(t), c)
        return _Affine(tuple(terms.items()), self.add(x.const, y.const))

    def row_of_tile(self, i: int) -> int:
        """A tile value without an N axis (an [M] input, a constant) used in the combine."""
        node = self.tile[i]
        if node.op is Op.CONST:
            return self.c(Op.CONST, (), node.arg, node.dtype)
        if node.op is Op.INPUT:
            return self.c(Op.INPUT, (), node.arg, node.dtype)
        if node.op in ELEMENTWISE:
            return self.c(node.op, [self.row_of_tile(s) for s in node.src], node.arg, node.dtype)
        raise NotOnePass(f"%{i} ({node.op.value}) is needed per row but varies along N")

    def row_sum(self, t: int) -> int:
        """The combine node of sum over N of tile value t: a statistic, except for the indicator
        of iota(N) == x (an [M] integer; cross-entropy's target), whose sum is 0 <= x < N: a
        per-row value, so the kernels reduce nothing for it (passes.one_hot_counts)."""
        found = one_hot(self.tile, t)
        if found is None or self.tile[found[0]].arg != "N":
            return self.stat("sum", t)
        x = self.row_of_tile(found[1])
        dt = self.tile[found[1]].dtype
        inside = self.c(Op.AND, (self.c(Op.GE, (x, self.c(Op.CONST, (), 0, dt)), dtype=torch.bool),
                                 self.c(Op.LT, (x, self.c(Op.CONST, (), self.region.sizes.N, dt)),
                                        dtype=torch.bool)), dtype=torch.bool)
        return self.c(Op.CAST, (inside,), F32, F32)

    # ---- the walk ----------------------------------------------------------------------
    def run(self, link: int | None = None) -> OnePass:
        r = self.region
        forms: list = []
        for i, node in enumerate(r.nodes):
            if not self.depends[i]:
                forms.append(("tile", i))
                continue
            forms.append(self.rewrite(i, node, [forms[s] for s in node.src]))
        link_form = None
        if link is not None:
            form = forms[r.outputs[link].node]
            if isinstance(form, _ExpShift):
                link_form = ExpLink(form.base, form.shift, form.scale)
            else:
                a = self.affine(form)
                link_form = AffineLink(a.terms, a.const)
        outputs, tile_outputs = [], []
        for k, out in enumerate(r.outputs):
            if k == link:
                outputs.append(out)  # read by the next GEMM, never stored
                continue
            form = forms[out.node]
            full = "N" in out.axes or (isinstance(form, tuple) and form[0] == "tile" and "N" in r.nodes[out.node].axes)
            if full and link is None and form == ("tile", out.node) and {"M", "N"} <= set(r.nodes[out.node].axes):
                tile_outputs.append(k)  # needs no reduction: the slices store it as they pass
                outputs.append(out)
                continue
            if full:
                raise NotOnePass(f"output {out.name or out.node} is a full tile that needs a reduction, "
                                 "not a per-row value")
            if isinstance(form, tuple) and form[0] == "row":
                node = form[1]
            elif isinstance(form, tuple) and form[0] == "tile":
                node = self.row_of_tile(form[1])
            else:
                raise NotOnePass(f"output {out.name or out.node} is a full tile, not a per-row value")
            outputs.append(dataclasses.replace(out, node=node))
        tile = r.replace(nodes=tuple(self.tile))
        return OnePass(tile, tuple(self.stats), tuple(self.combine), tuple(outputs), link_form,
                       tuple(tile_outputs))

    def rewrite(self, i: int, node: Node, src: list):
        op = node.op
        has_n = "N" in node.axes
        if op in REDUCE:
            return ("row", self.reduce(node, src[0]))
        if op in LEAF:  # pragma: no cover - leaves never depend on reductions
            raise NotOnePass("leaf depends on a reduction")
        if not has_n:  # a per-row value: computed in the combine step
            rows = []
            for s, f in zip(node.src, src):
                if isinstance(f, tuple) and f[0] == "row":
                    rows.append(f[1])
                elif isinstance(f, tuple) and f[0] == "tile" and "N" not in self.tile[s].axes:
                    rows.append(self.row_of_tile(s))
                else:
                    raise NotOnePass(f"%{i} ({op.value}) mixes a full tile into a per-row value")
            return ("row", self.c(op, rows, node.arg, node.dtype))
        if op in (Op.ADD, Op.SUB):
            x, y = self.affine(src[0]), self.affine(src[1])
            if op is Op.SUB:
                y = self.scale(y, self.const(-1.0))
            return self.plus(x, y)
        if op is Op.NEG:
            return self.scale(self.affine(src[0]), self.const(-1.0))
        if op is Op.CAST and node.dtype.is_floating_point:
            return src[0]  # casts between floats do not round in kernels
        if op is Op.MUL and node.src[0] == node.src[1] or op is Op.POW and node.arg == 2.0:
            a = self.affine(src[0])
            if len(a.terms) == 1 and self.is_one(a.terms[0][1]):
                return _Square(a.terms[0][0], a.const)
            raise NotOnePass(f"%{i}: square of a combination that is not t + c")
        if op in (Op.MUL, Op.DIV):
            rows = [self.rowish(f) for f in src]
            if op is Op.MUL and rows[0] is not None:
                src, rows = src[::-1], rows[::-1]
            if rows[1] is not None:
                k = rows[1] if op is Op.MUL else self.c(Op.DIV, (self.const(1.0), rows[1]))
                if isinstance(src[0], _ExpShift):
                    e = src[0]
                    return _ExpShift(e.base, e.shift, k if e.scale is None else self.mul(e.scale, k))
                return self.scale(self.affine(src[0]), k)
            tiles = [f[1] if isinstance(f, tuple) and f[0] == "tile" else None for f in src]
            if op is Op.MUL and (tiles[0] is not None or tiles[1] is not None):
                # affine * tile value (a gamma, a mask): distribute over the terms
                t, a = (tiles[0], self.affine(src[1])) if tiles[0] is not None else (tiles[1], self.affine(src[0]))
                terms = tuple((self.add_tile(Op.MUL, (b, t)), c) for b, c in a.terms)
                if a.const is not None:
                    terms += ((t, a.const),)
                return _Affine(terms, None)
            raise NotOnePass(f"%{i}: {op.value} of two values that vary along N, one after a reduction")
        if op is Op.WHERE:
            cond = src[0]
            if not (isinstance(cond, tuple) and cond[0] == "tile"):
                raise NotOnePass(f"%{i}: where() with a condition that needs a reduction")
            x, y = self.affine(src[1]), self.affine(src[2])
            zero = self.tile_const(0.0)
            terms = []
            for t, c in x.terms:
                terms.append((self.add_tile(Op.WHERE, (cond[1], t, zero), self.tile[t].dtype), c))
            for t, c in y.terms:
                terms.append((self.add_tile(Op.WHERE, (cond[1], zero, t), self.tile[t].dtype), c))
            form = _Affine(tuple(terms), y.const)
            diff = self.add(x.const, self.mul(y.const, self.const(-1.0)) if y.const is not None else None)
            if diff is not None:  # where(m, cx, cy) = cy + (cx - cy) * where(m, 1, 0)
                ones = self.indicator(cond[1])
                form = self.plus(form, _Affine(((ones, diff),), None))
            return form
        if op is Op.EXP:
            a = self.affine(src[0])
            if len(a.terms) == 1 and self.is_one(a.terms[0][1]):
                return _ExpShift(a.terms[0][0], a.const)
            raise NotOnePass(f"%{i}: exp of a combination that is not t + c")
        raise NotOnePass(f"%{i}: {op.value} of a value that varies along N after a reduction")

    def rowish(self, form) -> int | None:
        """The combine node of a per-row value (a row constant, or a tile value without N)."""
        if isinstance(form, tuple) and form[0] == "row":
            return form[1]
        if isinstance(form, tuple) and form[0] == "tile" and "N" not in self.tile[form[1]].axes:
            return self.row_of_tile(form[1])
        return None

    def tile_const(self, value: float) -> int:
        for j, n in enumerate(self.tile):
            if n.op is Op.CONST and n.arg == value and n.dtype == F32:
                return j
        self.tile.append(Node(Op.CONST, (), F32, frozenset(), float(value)))
        return len(self.tile) - 1

    def is_one(self, c: int) -> bool:
        n = self.combine[c]
        return n.op is Op.CONST and n.arg == 1.0

    def reduce(self, node: Node, form) -> int:
        n_cols = self.region.sizes.N
        if node.op is Op.SUM:
            if isinstance(form, _Square):  # sum (t + c)^2 = M2 + N (mean + c)^2, exactly
                mean = self.stat("moments", form.base, "mean")
                m2 = self.stat("moments", form.base, "m2")
                d = self.add(mean, form.shift)
                return self.c(Op.ADD, (m2, self.mul(self.const(float(n_cols)), self.mul(d, d))))
            if isinstance(form, _ExpShift):
                lse = self.stat("lse", form.base)
                arg = lse if form.shift is None else self.c(Op.ADD, (lse, form.shift))
                total = self.c(Op.EXP, (arg,))
                return total if form.scale is None else self.mul(total, form.scale)
            if isinstance(form, tuple) and form[0] == "tile":
                return self.row_sum(form[1])
            a = self.affine(form)
            total = self.mul(a.const, self.const(float(n_cols)))
            for t, c in a.terms:
                total = self.add(total, self.mul(c, self.row_sum(t)))
            return total if total is not None else self.const(0.0)
        kind = "max" if node.op is Op.RMAX else "min"
        if isinstance(form, tuple) and form[0] == "tile":
            return self.stat(kind, form[1])
        a = self.affine(form)
        if len(a.terms) == 1 and self.is_one(a.terms[0][1]):
            return self.add(self.stat(kind, a.terms[0][0]), a.const)
        raise NotOnePass(f"{kind} over N of a combination that is not t + c")


def one_pass(region: Region, link: int | None = None) -> OnePass:
    """The one-pass form of a row-form region, or NotOnePass with the reason. With
    ``link``, that output is the next GEMM's A operand: its form is returned (``link``
    field) instead of requiring it to be a per-row value."""
    if region.gemm.batched and link is None:
        raise NotOnePass("batched GEMMs are not split")
    if region.dual:
        raise NotOnePass("the split kernels compute one product (this region has a second one)")
    if not region.reductions():
        raise NotOnePass("no reduction")
    if any(n.op in REDUCE and n.arg != "N" for n in region.nodes):
        raise NotOnePass("reductions must run along N (row form)")
    return _Rewriter(region, shift=link is not None).run(link)


def evaluate_one_pass(op: OnePass, a, b, inputs) -> list:
    """Reference semantics of the one-pass form, in float64: the statistics as whole-row
    reductions, then the combine step. Equal to evaluating the original region."""
    tile = op.tile.replace(outputs=tuple(Output(st.node, torch.float64, op.tile.nodes[st.node].axes)
                                         for st in op.stats) or op.tile.outputs)
    shifts = {i: st.node for i, st in enumerate(op.stats) if st.kind == "shift"}
    values = run_nodes(tile, a, b, inputs, torch.float64, shifts=shifts)[0] if op.stats else []
    merged = {}
    for i, (st, v) in enumerate(zip(op.stats, values)):
        v = v.double()
        if st.kind == "sum":
            merged[(i, "")] = v.sum(2, keepdim=True)
        elif st.kind == "max":
            merged[(i, "")] = v.amax(2, keepdim=True)
        elif st.kind == "min":
            merged[(i, "")] = v.amin(2, keepdim=True)
        elif st.kind == "shift":  # any per-row constant will do; the answer does not depend on it
            merged[(i, "")] = v.mean(2, keepdim=True)
        elif st.kind == "moments":
            mean = v.mean(2, keepdim=True)
            merged[(i, "mean")], merged[(i, "m2")] = mean, ((v - mean) ** 2).sum(2, keepdim=True)
        else:
            merged[(i, "")] = torch.logsumexp(v, 2, keepdim=True)
    doubled = [t.double() if t.dtype.is_floating_point else t for t in inputs]
    outs = evaluate_combine(op, merged, doubled, a.device)
    if op.tile_outputs:
        full = op.tile.replace(outputs=tuple(op.outputs[k] for k in op.tile_outputs))
        for k, v in zip(op.tile_outputs, run_nodes(full, a, b, inputs, torch.float64)[0]):
            outs[k] = v
    return outs


def evaluate_combine(op: OnePass, merged: dict, inputs, device) -> list:
    """The combine step on merged statistics ({(index, part): [B, M, 1] tensor}); plain torch
    ops. None in the places of ``op.tile_outputs`` (the slices write those)."""
    vals = []
    for node in op.combine:
        x = [vals[s] for s in node.src]
        if node.op is Op.STAT:
            v = merged[node.arg]
        elif node.op is Op.CONST:
            v = torch.tensor(node.arg, device=device)
        elif node.op is Op.INPUT:
            v = inputs[node.arg]
        elif node.op in UNARY_FNS:
            v = UNARY_FNS[node.op](x[0])
        elif node.op in BINARY_FNS:
            v = BINARY_FNS[node.op](x[0], x[1])
        elif node.op is Op.WHERE:
            v = torch.where(x[0], x[1], x[2])
        elif node.op is Op.POW:
            v = torch.pow(x[0], node.arg)
        elif node.op is Op.CAST:
            v = x[0] if node.arg.is_floating_point else x[0].to(node.arg)
        else:  # pragma: no cover
            raise NotImplementedError(f"the combine step cannot evaluate {node.op}")
        vals.append(v)
    return [None if k in op.tile_outputs else vals[o.node] for k, o in enumerate(op.outputs)]
