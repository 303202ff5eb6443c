"""Which regions the warp-specialised Gluon template (codegen/gluon/strip.py) computes.

The template is hand-written, not generated: it computes LayerNorm or RMSNorm of
``x @ W (+ bias) (+ residual)`` with optional gamma, beta and ReLU, or the softmax along N of
``x @ W (+ bias) (+ residual)``. A region is matched in two
steps: its shape must allow such a reading (one [M, N] bf16 output; side inputs of axes [N] or
[M, N]; a reduction along N), then each assignment of its side inputs to the template's roles
is tried by evaluating the region's float64 reference interpreter and the template's formula
on random data at the region's N. The first assignment that agrees to 1e-9 is the match, so
any decomposition of the same math matches (mean of squares or of deviations, casts between
floating-point types, which the interpreter ignores as the kernel's bf16 rounding follows
eager's) and anything else does not.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from ..ir import Op, Region
from ..ir.interpret import evaluate
from .onepass import NotOnePass, evaluate_combine, one_pass

KINDS = ("layernorm", "rmsnorm", "softmax")
ROLES = {"layernorm": ("bias", "gamma", "beta"), "rmsnorm": ("bias", "gamma"), "softmax": ("bias",)}
TILE = (128, 256, 64)  # the template's BM, BN, BK
MAX_TILES_N = 64  # the combine loads [next_pow2(TILES_N), 128] partials at once


def fits(M: int, N: int, K: int, terminal: bool = False) -> str:
    """'' when the template takes these sizes (whole tiles, a strip the combine holds), else why
    not. ``terminal``: the log-sum-exp kind, whose rows may span any number of tiles."""
    bm, bn, bk = TILE
    if M % bm or (N % bn and not terminal) or K % bk:
        return f"the template takes whole {bm}x{bn}x{bk} tiles (M={M}, N={N}, K={K})"
    if not terminal and N // bn > MAX_TILES_N:
        return f"a strip of {N // bn} tiles is more than the template's combine holds ({MAX_TILES_N})"
    return ""


@dataclasses.dataclass(frozen=True)
class StripTemplate:
    kind: str  # one of KINDS
    bias: int | None  # indices into Region.inputs
    residual: int | None
    gamma: int | None
    beta: int | None
    relu: bool
    eps: float

    def describe(self) -> str:
        v = "x @ W" + (" + bias" if self.bias is not None else "") + \
            (" + residual" if self.residual is not None else "")
        if self.kind == "softmax":
            return f"softmax({v}, dim=N)"
        out = f"{'LayerNorm' if self.kind == 'layernorm' else 'RMSNorm'}({v}, eps={self.eps:g})"
        out += " * gamma" if self.gamma is not None else ""
        out += " + beta" if self.beta is not None else ""
        return f"relu({out})" if self.relu else out


def formula(t: StripTemplate, a: torch.Tensor, b: torch.Tensor, ins: list) -> torch.Tensor:
    """The template's math in the inputs' dtype (float64 for matching): a [M, K], b [K, N]."""
    def vec(i):
        return ins[i].reshape(-1)
    v = a @ b
    if t.bias is not None:
        v = v + vec(t.bias)
    if t.residual is not None:
        v = v + ins[t.residual].reshape(v.shape)
    if t.kind == "softmax":
        return torch.softmax(v, -1)
    if t.kind == "layernorm":
        mean = v.mean(-1, keepdim=True)
        out = (v - mean) * torch.rsqrt(((v - mean) ** 2).mean(-1, keepdim=True) + t.eps)
    else:
        out = v * torch.rsqrt((v * v).mean(-1, keepdim=True) + t.eps)
    if t.gamma is not None:
        out = out * vec(t.gamma)
    if t.beta is not None:
        out = out + vec(t.beta)
    return out.clamp_min(0) if t.relu else out


def shape_blocker(region: Region) -> str:
    """'' when the region could be one of the template's forms, else why not."""
    g = region.gemm
    if region.kind != "gemm_epilogue" or g.batched:
        return "the template takes one unbatched GEMM and its epilogue"
    if len(region.outputs) != 1:
        return f"the template writes one output; this region writes {len(region.outputs)}"
    out = region.outputs[0]
    if out.axes != frozenset("MN") or out.dtype != torch.bfloat16:
        return "the template writes one bf16 [M, N] output"
    if g.a.dtype != torch.bfloat16 or g.b.dtype != torch.bfloat16:
        return "the template multiplies bf16 operands"
    if g.a.major != "K" or g.b.major not in ("N", "K"):
        return "the template loads A row-major and B with a unit-stride dimension (TMA)"
    full = [i for i in region.inputs if i.axes == frozenset("MN")]
    rows = [i for i in region.inputs if i.axes == frozenset("N")]
    if len(full) > 1 or len(rows) > 3 or len(full) + len(rows) != len(region.inputs):
        return "side inputs other than one [M, N] residual and up to three [N] vectors"
    if any(i.dtype != torch.bfloat16 for i in region.inputs):
        return "the template reads bf16 side inputs"
    if not any(n.op is Op.SUM for n in region.nodes):
        return "no sum along N to normalise by"
    return ""


def _assignments(region: Region):
    full = [j for j, i in enumerate(region.inputs) if i.axes == frozenset("MN")]
    rows = [j for j, i in enumerate(region.inputs) if i.axes == frozenset("N")]
    residual = full[0] if full else None
    eps_values = sorted({float(n.arg) for n in region.nodes
                         if n.op is Op.CONST and isinstance(n.arg, (int, float)) and 0 < n.arg < 1e-2}) or [0.0]
    for kind in KINDS:
        roles = ROLES[kind]
        for chosen in itertools.permutations(roles, len(rows)):
            which = dict(zip(chosen, rows))
            for relu in ((False, True) if kind == "layernorm" else (False,)):
                for eps in (eps_values if kind != "softmax" else [0.0]):
                    yield StripTemplate(kind, which.get("bias"), residual, which.get("gamma"), which.get("beta"),
                                        relu, eps)


def match(region: Region, trials: int = 2) -> tuple[StripTemplate | None, str]:
    """(template, '') when the template computes ``region``, else (None, why not)."""
    why = shape_blocker(region)
    if why:
        return None, why
    N = region.sizes.N
    small = region.replace(sizes=dataclasses.replace(region.sizes, M=4, K=16))
    gen = torch.Generator().manual_seed(0)
    draws = []
    for _ in range(trials):
        a = torch.randn(1, 4, 16, generator=gen, dtype=torch.float64)
        b = torch.randn(1, 16, N, generator=gen, dtype=torch.float64)
        ins = [torch.randn((1, 4, N) if i.axes == frozenset("MN") else (1, 1, N), generator=gen,
                           dtype=torch.float64) + 0.5 for i in region.inputs]
        draws.append((a, b, ins, evaluate(small, a, b, ins)[0].reshape(4, N)))
    for t in _assignments(region):
        if all(torch.allclose(formula(t, a[0], b[0], [x.reshape(-1) if x.shape[1] == 1 else x[0] for x in ins]),
                              ref, rtol=1e-9, atol=1e-9) for a, b, ins, ref in draws):
            return t, ""
    return None, ("the epilogue is not LayerNorm or RMSNorm (with affine / ReLU) or softmax of "
                  "x @ W (+ bias) (+ residual)")


# ---- the terminal kind: per-row log-sum-exp and a target's logit (cross-entropy) ------------

@dataclasses.dataclass(frozen=True)
class LseTemplate:
    """The template's KIND_LSE reading of a region's one-pass form (planner/onepass.py): every
    statistic is the log-sum-exp of the GEMM's value, its max, or the sum of
    ``where(column == target, value, 0)``, the value at the row's target column (the pick). A
    max used only as a shift has the log-sum-exp stand in for it; one the outputs need exactly
    (a training forward saves the row max for its backward) makes the template store each
    tile's row max too (``exact_max``)."""
    lse: tuple  # indices into OnePass.stats
    shifts: tuple  # the max statistics
    pick: int | None
    target: int | None  # index into Region.inputs: the int64 [M] targets
    logits: int | None = None  # index into Region.outputs: x @ W in bf16, written by the template too
    exact_max: bool = False  # the max statistics are the row max itself (per-tile maxima stored)

    def describe(self) -> str:
        return ("per-row log-sum-exp of x @ W" + (" and its max" if self.exact_max else "") +
                (" and its value at a target column" if self.pick is not None else "") +
                (" (a loss's statistics), and x @ W itself" if self.logits is not None else
                 " (a loss's statistics; no [M, N] output)"))


def _value(nodes, i: int) -> bool:
    """Whether tile node i is the GEMM's value itself (through floating-point casts)."""
    while nodes[i].op is Op.CAST and nodes[i].arg.is_floating_point:
        i = nodes[i].src[0]
    return nodes[i].op is Op.ACC


def _pick_target(region: Region, nodes, i: int) -> int | None:
    """The input index of t when tile node i is ``where(column == t, value, 0)``, else None."""
    n = nodes[i]
    if n.op is not Op.WHERE or not _value(nodes, n.src[1]):
        return None
    zero = nodes[n.src[2]]
    cond = nodes[n.src[0]]
    if zero.op is not Op.CONST or zero.arg != 0.0 or cond.op is not Op.EQ:
        return None
    a, b = (nodes[s] for s in cond.src)
    if a.op is not Op.IOTA:
        a, b = b, a
    if a.op is not Op.IOTA or a.arg != "N" or b.op is not Op.INPUT:
        return None
    inp = region.inputs[b.arg]
    return b.arg if inp.axes == frozenset("M") and inp.dtype == torch.int64 else None


def match_lse(region: Region) -> tuple[LseTemplate | None, str]:
    """(template, '') when KIND_LSE computes ``region``'s statistics, else (None, why not). The
    shape is read from the one-pass form; whether each max statistic only shifts (the outputs do
    not change when the log-sum-exp replaces it) is checked by evaluating the combine step in
    float64 on random statistics, to 1e-9; where one does more, the template stores the row
    maxima (``exact_max``)."""
    g = region.gemm
    if region.kind != "gemm_epilogue" or g.batched:
        return None, "the template takes one unbatched GEMM and its epilogue"
    if g.a.dtype != torch.bfloat16 or g.b.dtype != torch.bfloat16:
        return None, "the template multiplies bf16 operands"
    if g.a.major != "K" or g.b.major not in ("N", "K"):
        return None, "the template loads A row-major and B with a unit-stride dimension (TMA)"
    if any("N" in i.axes for i in region.inputs):
        return None, "the log-sum-exp kind takes no side inputs along N (bias, residual)"
    try:
        op = one_pass(region)
    except NotOnePass as e:
        return None, f"not a terminal reduction (one pass: {e})"
    nodes = op.tile.nodes
    logits = None
    if op.tile_outputs:  # the one full tile it writes: x @ W rounded to bf16 (the model's logits)
        k = op.tile_outputs[0]
        out = region.outputs[k]
        if len(op.tile_outputs) > 1 or out.dtype != torch.bfloat16 or not _value(nodes, out.node):
            return None, "the log-sum-exp kind writes no [M, N] output but x @ W itself, in bf16"
        logits = k
    lse, shifts, picks = [], [], []
    for k, st in enumerate(op.stats):
        if st.kind in ("lse", "max") and _value(nodes, st.node):
            (lse if st.kind == "lse" else shifts).append(k)
        elif st.kind == "sum" and _pick_target(region, nodes, st.node) is not None:
            picks.append((k, _pick_target(region, nodes, st.node)))
        else:
            return None, (f"statistic {k} ({st.kind} of %{st.node}) is not the log-sum-exp, max or target pick "
                          "of x @ W")
    if not lse or len(picks) > 1:
        return None, "the log-sum-exp kind needs a log-sum-exp of x @ W and at most one target pick"
    pick, target = picks[0] if picks else (None, None)
    exact_max = bool(shifts) and not _lse_stands_in(region, op, picks)
    return LseTemplate(tuple(lse), tuple(shifts), pick, target, logits, exact_max), ""


def _lse_stands_in(region: Region, op, picks: list) -> bool:
    """Whether the outputs stay the same when the log-sum-exp replaces each max statistic (the
    combine step evaluated in float64 on random statistics, to 1e-9)."""
    gen = torch.Generator().manual_seed(0)
    M, N = 6, 8
    v = torch.randn(1, M, N, generator=gen, dtype=torch.float64) * 3
    inputs = []
    for inp in region.inputs:
        if inp.dtype == torch.bool:
            inputs.append(torch.rand(1, M, 1, generator=gen) > 0.3)
        elif not inp.dtype.is_floating_point:
            t = torch.randint(0, N, (1, M, 1), generator=gen)
            t[0, 0, 0] = -100  # an ignored row
            inputs.append(t)
        else:
            inputs.append(torch.rand(1, M, 1, generator=gen, dtype=torch.float64) + 0.5)
    exact, standin = {}, {}
    for k, st in enumerate(op.stats):
        if st.kind == "lse":
            exact[(k, "")] = standin[(k, "")] = torch.logsumexp(v, 2, keepdim=True)
        elif st.kind == "max":
            exact[(k, "")], standin[(k, "")] = v.amax(2, keepdim=True), torch.logsumexp(v, 2, keepdim=True)
        else:
            t = inputs[picks[0][1]]
            inside = (t >= 0) & (t < N)
            exact[(k, "")] = standin[(k, "")] = torch.where(
                inside, v.gather(2, t.clamp(0, N - 1)), torch.zeros((), dtype=torch.float64))
    return all(a is None or torch.allclose(a.double(), b.double(), rtol=1e-9, atol=1e-9, equal_nan=True)
               for a, b in zip(evaluate_combine(op, exact, inputs, v.device),
                               evaluate_combine(op, standin, inputs, v.device)))
