"""comfuse's own decompositions of composite aten ops into the primitives the region
finder knows.

They are ours rather than torch's so that captured graphs look the same on every
torch version we support, and so that numerics are chosen here: variance is
always two-pass over the values (mean first, then the mean of squared
deviations), never E[x^2] - E[x]^2; half-precision inputs are computed in fp32
and rounded once at the end, as eager PyTorch does.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

aten = torch.ops.aten
_LOW = (torch.float16, torch.bfloat16)

DECOMPOSITIONS: dict = {}


def _register(*names: str) -> Callable:
    """Register for each 'op.overload' name that exists in this torch build."""
    def deco(fn):
        for name in names:
            op_name, overload = name.split(".")
            packet = getattr(aten, op_name, None)
            if packet is not None and hasattr(packet, overload):
                DECOMPOSITIONS[getattr(packet, overload)] = fn
        return fn
    return deco


def _up(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in _LOW else x


def _dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    return sorted(d % max(x.dim(), 1) for d in dim)


def _count(x: torch.Tensor, dims: list[int]) -> int:
    return math.prod(x.shape[d] for d in dims) if x.dim() else 1


def _squeeze(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    for d in reversed(dims):
        x = x.squeeze(d)
    return x


# ---- GEMMs with a bias: the bias becomes part of the epilogue ----------------------------

@_register("addmm.default")
def addmm(bias, a, b, *, beta=1, alpha=1):
    out = torch.mm(a, b)
    if alpha != 1:
        out = out * alpha
    if beta == 0:  # torch ignores the bias entirely (NaN included) when beta == 0
        return out
    return out + (bias if beta == 1 else bias * beta)


@_register("baddbmm.default")
def baddbmm(bias, a, b, *, beta=1, alpha=1):
    out = torch.bmm(a, b)
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out
    return out + (bias if beta == 1 else bias * beta)


# ---- statistics --------------------------------------------------------------------------

def _var_mean(x, dim, correction, keepdim):
    dims = _dims(x, dim)
    n = _count(x, dims)
    mean = x.sum(dims, keepdim=True) / n
    dev = x - mean
    var = (dev * dev).sum(dims, keepdim=True) / max(n - correction, 0)
    if not keepdim:
        var, mean = _squeeze(var, dims), _squeeze(mean, dims)
    return var, mean


def _correction(correction, unbiased=True):
    return (1 if unbiased else 0) if correction is None else correction


@_register("var_mean.correction")
def var_mean(x, dim=None, *, correction=None, keepdim=False):
    var, mean = _var_mean(_up(x), dim, _correction(correction), keepdim)
    return var.to(x.dtype), mean.to(x.dtype)


@_register("var.correction")
def var(x, dim=None, *, correction=None, keepdim=False):
    return _var_mean(_up(x), dim, _correction(correction), keepdim)[0].to(x.dtype)


@_register("std.correction")
def std(x, dim=None, *, correction=None, keepdim=False):
    return _var_mean(_up(x), dim, _correction(correction), keepdim)[0].sqrt().to(x.dtype)


@_register("mean.dim")
def mean(x, dim, keepdim=False, *, dtype=None):
    dims = _dims(x, dim)
    out_dtype = dtype or x.dtype
    s = _up(x.to(out_dtype)).sum(dims, keepdim=keepdim)
    return (s / _count(x, dims)).to(out_dtype)


@_register("mean.default")
def mean_all(x, *, dtype=None):
    return mean(x, None, False, dtype=dtype)


@_register("logsumexp.default")
def logsumexp(x, dim, keepdim=False):
    dims = _dims(x, dim)
    xf = _up(x)
    m = xf.amax(dims, keepdim=True)
    m = torch.where(m.abs() == math.inf, torch.zeros_like(m), m)
    out = (xf - m).exp().sum(dims, keepdim=True).log() + m
    if not keepdim:
        out = _squeeze(out, dims)
    return out.to(x.dtype)


# ---- normalisations ----------------------------------------------------------------------

@_register("native_layer_norm.default")
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    xf = _up(x)
    var_, mean_ = _var_mean(xf, dims, 0, True)
    rstd = torch.rsqrt(var_ + eps)
    out = (xf - mean_) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.to(x.dtype), mean_, rstd


@_register("_softmax.default")
def softmax(x, dim, half_to_float):
    xf = _up(x)
    shifted = xf - xf.amax(dim, keepdim=True)
    e = shifted.exp()
    out = e / e.sum(dim, keepdim=True)
    return out.to(torch.float32 if half_to_float else x.dtype)


@_register("_log_softmax.default")
def log_softmax(x, dim, half_to_float):
    xf = _up(x)
    shifted = xf - xf.amax(dim, keepdim=True)
    out = shifted - shifted.exp().sum(dim, keepdim=True).log()
    return out.to(torch.float32 if half_to_float else x.dtype)


def _inductor_prim(name: str):
    """Inductor's prim ``name`` (its overload), or None where this torch has none."""
    try:
        import torch._inductor.inductor_prims  # noqa: F401  (registers Inductor's prims)
    except ImportError:
        return None
    packet = getattr(torch.ops.prims, name, None)
    return getattr(packet, "default", None)


def prepare_softmax_online(x, dim):
    """Inductor's post-grad passes on a GPU rewrite softmax, log-softmax and cross-entropy into
    this prim (a row's max and its sum of exp(x - max), one pass); the backend's pass sees
    their graphs after that, so it is taken apart again into the ops the region finder knows,
    as Inductor's own eager form of it computes them (in the input's dtype)."""
    amax = x.amax(dim, keepdim=True)
    return amax, (x - amax).exp().sum(dim, keepdim=True)


_ONLINE = _inductor_prim("prepare_softmax_online")
if _ONLINE is not None:
    DECOMPOSITIONS[_ONLINE] = prepare_softmax_online


# ---- activations -------------------------------------------------------------------------

@_register("gelu.default")
def gelu(x, approximate="none"):
    xf = _up(x)
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (xf + 0.044715 * xf * xf * xf)
        out = 0.5 * xf * (1.0 + torch.tanh(inner))
    else:
        out = 0.5 * xf * (1.0 + torch.erf(xf * (1.0 / math.sqrt(2.0))))
    return out.to(x.dtype)


@_register("silu.default")
def silu(x):
    xf = _up(x)
    return (xf * torch.sigmoid(xf)).to(x.dtype)


@_register("mish.default")
def mish(x):
    xf = _up(x)
    return (xf * torch.tanh(_softplus(xf, 1.0, 20.0))).to(x.dtype)


def _softplus(x, beta, threshold):
    scaled = x * beta
    return torch.where(scaled > threshold, x, torch.log1p(scaled.exp()) / beta)


@_register("softplus.default")
def softplus(x, beta=1, threshold=20):
    return _softplus(_up(x), beta, threshold).to(x.dtype)


@_register("hardtanh.default")
def hardtanh(x, min_val=-1.0, max_val=1.0):
    return torch.clamp(x, min_val, max_val)


@_register("leaky_relu.default")
def leaky_relu(x, negative_slope=0.01):
    return torch.where(x > 0, x, x * negative_slope)


@_register("elu.default")
def elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    xf = _up(x)
    out = torch.where(xf > 0, xf * scale, torch.expm1(xf * input_scale) * (alpha * scale))
    return out.to(x.dtype)


@_register("hardsigmoid.default")
def hardsigmoid(x):
    return torch.clamp(x / 6.0 + 0.5, 0.0, 1.0)


@_register("hardswish.default")
def hardswish(x):
    return x * torch.clamp(x + 3.0, 0.0, 6.0) / 6.0


@_register("rsub.Scalar", "rsub.Tensor")
def rsub(x, other, alpha=1):
    return other - (x * alpha if alpha != 1 else x)


# ---- losses ------------------------------------------------------------------------------

@_register("nll_loss_forward.default")
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    """Negative log-likelihood over classes on the last dim: a gather of one column per row,
    which the region finder lowers to a compare-and-sum along N (no logits leave the kernel)."""
    batched = x.dim() == 2
    xs = x if batched else x.unsqueeze(0)
    ts = target if batched else target.unsqueeze(0)
    valid = ts != ignore_index
    safe = torch.where(valid, ts, torch.zeros_like(ts))
    picked = torch.gather(xs, 1, safe.unsqueeze(1)).squeeze(1)
    if weight is not None:
        w = torch.where(valid, weight[safe], torch.zeros_like(weight[safe]))
    else:
        w = valid.to(x.dtype)
    loss = torch.where(valid, -picked * w, torch.zeros_like(picked))
    total = w.sum()
    if reduction == 0:  # none
        out = loss if batched else loss.squeeze(0)
    elif reduction == 1:  # mean
        out = loss.sum() / total
    else:  # sum
        out = loss.sum()
    return out, total
