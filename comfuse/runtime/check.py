"""Comparing results with a reference: the tolerances every check in comfuse uses.

The error is norm-wise, ||out - ref|| / ||ref|| over the finite elements, and
NaN and infinities must sit in the same places (with the same sign) in both.
Tolerances by output dtype, against a float64 reference:
fp32 1e-4 (3e-3 when TF32 matmuls are allowed), fp16 2e-3, bf16 2e-2.
"""
from __future__ import annotations

import dataclasses

import torch

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
TF32_TOLERANCE = 3e-3


def tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return TF32_TOLERANCE
    return TOLERANCE.get(dtype, 0.0)


@dataclasses.dataclass(frozen=True)
class Comparison:
    ok: bool
    error: float  # norm-wise relative error over finite elements
    tolerance: float
    detail: str = ""

    def __str__(self) -> str:
        status = "ok" if self.ok else "MISMATCH"
        extra = f" ({self.detail})" if self.detail else ""
        return f"{status}: rel err {self.error:.2e} (tol {self.tolerance:.0e}){extra}"


# elements compared at a time: a float64 check of an LM head's [8192, 128256] logits made
# whole needs some 30 GiB of the GPU's memory (the output, the reference and their masks in
# float64), which an 80 GB GPU training the model did not have (every candidate plan of the
# 8B block's head was rejected for it on an H100, 2026-12-06); in pieces of at most this many
# elements its float64 temporaries hold a few hundred MB
PIECE = 1 << 23


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None,
            scale: torch.Tensor | None = None, floor: float = 0.0) -> Comparison:
    """Compare ``out`` with ``ref`` (any float dtypes; bool/int compared exactly).

    With ``scale`` (the reference interpreter's error scale), the error is measured
    against it instead of |ref|: ||out - ref|| / ||max(scale, |ref|)||, so results that
    cancel to near zero, or ill-conditioned ones, are judged by the magnitudes that
    produced them. Elements whose scale is not finite cannot be judged and are skipped.
    Large tensors are compared a block of rows at a time (``PIECE`` elements).
    """
    if tol is None:
        tol = tolerance(out.dtype)
    if out.shape != ref.shape:
        return Comparison(False, float("inf"), tol, f"shape {list(out.shape)} != {list(ref.shape)}")
    if not out.dtype.is_floating_point or not ref.dtype.is_floating_point:
        bad = int((out.to(ref.dtype) != ref).sum())
        return Comparison(bad == 0, float(bad), 0.0, f"{bad} elements differ" if bad else "")
    if scale is not None:
        scale = scale.detach().expand(ref.shape)
    diff2 = denom2 = 0.0
    for o, r, sc in _pieces(out.detach(), ref.detach(), scale):
        # in float64 on the output's device: on the CPU a check of a [8192, 5632] output makes
        # some fifteen passes over 370 MB (about a second, estimated), which autotuning paid
        # for every candidate plan of a model's region
        r = r.to(out.device)
        # round the reference to the output's dtype first, so overflow to inf agrees
        r = (r.to(out.dtype) if out.dtype != ref.dtype else r).double()
        o = o.double()
        nan_o, nan_r = o.isnan(), r.isnan()
        if not torch.equal(nan_o, nan_r):
            n = int((nan_o != nan_r).sum())
            return Comparison(False, float("inf"), tol, f"NaN in different places ({n} elements)")
        inf_o, inf_r = o.isinf(), r.isinf()
        if not torch.equal(inf_o, inf_r) or not torch.equal(o[inf_o], r[inf_r]):
            return Comparison(False, float("inf"), tol, "infinities in different places")
        finite = ~(nan_r | inf_r)
        magnitude = r.abs().clamp_min(floor)
        if sc is not None:
            sc = sc.to(out.device).double()
            finite &= torch.isfinite(sc)
            magnitude = torch.maximum(magnitude, sc)
        # (summed on the device: one synchronisation at the end, not two a piece)
        diff2 = diff2 + (o[finite] - r[finite]).square().sum()
        denom2 = denom2 + magnitude[finite].square().sum()
    diff, denom = float(diff2) ** 0.5, float(denom2) ** 0.5
    err = diff / denom if denom > 0 else diff
    return Comparison(err <= tol, err, tol)


def _pieces(out: torch.Tensor, ref: torch.Tensor, scale):
    """(out, ref, scale) in pieces of at most ``PIECE`` elements: blocks of rows along the
    last dimension, or of the elements in order where a row is longer; whole where the
    tensors are small, or where a scale broadcast to them could only be cut by copying it."""
    if out.numel() <= PIECE:
        yield out, ref, scale
        return
    width = out.shape[-1] if out.dim() >= 2 and out.shape[-1] <= PIECE else 1
    flat = lambda t: t.reshape(-1, width)  # noqa: E731  (a view where the strides allow)
    if scale is not None:
        try:
            scale = scale.view(-1, width)
        except RuntimeError:  # (broadcast: as a whole, as before pieces)
            yield out, ref, scale
            return
    out, ref = flat(out), flat(ref)
    step = max(1, PIECE // width)
    for i in range(0, out.shape[0], step):
        yield out[i:i + step], ref[i:i + step], None if scale is None else scale[i:i + step]


def region_tolerance(region) -> float:
    """The loosest tolerance among the region's outputs (kernels compute in fp32 and
    round only when they store)."""
    return max((tolerance(o.dtype) for o in region.outputs if o.dtype.is_floating_point),
               default=0.0)



def agreement_tolerance(region) -> float:
    """How far a fused result may sit from the same region run unfused: the unfused ops
    round the GEMM's product to its dtype before the epilogue, so the operands' precision
    bounds the difference too (a float32 loss over bf16 logits agrees to bf16 accuracy)."""
    operands = (region.gemm.a.dtype, region.gemm.b.dtype, region.gemm.out_dtype)
    return max([region_tolerance(region)] + [tolerance(d) for d in operands if d.is_floating_point])
