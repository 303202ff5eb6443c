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

KINDS = ("layernorm", "rmsnorm", "softmax")
ROLES = {"layernorm": ("bias", "gamma", "beta"), "rmsnorm": ("bias", "gamma"), "softmax": ("bias",)}
TILE = (128, 256, 64)  # the template's BM, BN, BK
MAX_TILES_N = 64  # the combine loads [next_pow2(TILES_N), 128] partials at once


def fits(M: int, N: int, K: int) -> str:
    """'' when the template takes these sizes (whole tiles, a strip the combine holds), else why not."""
    bm, bn, bk = TILE
    if M % bm or N % bn or K % bk:
        return f"the template takes whole {bm}x{bn}x{bk} tiles (M={M}, N={N}, K={K})"
    if N // bn > MAX_TILES_N:
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
