"""Helpers shared by the tests."""
import collections
import contextlib
import math
import os
import warnings

import torch
import torch.nn.functional as F

from comfuse.errors import ComfuseWarning, FallbackWarning
from comfuse.runtime.check import compare, tolerance

PROPERTY_COUNTS: collections.Counter = collections.Counter()

# Where the tests run their tensors: CUDA when present (the whole suite then runs on the
# GPU), else the CPU through Triton's interpreter. COMFUSE_TEST_DEVICE overrides.
DEVICE = os.environ.get("COMFUSE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


class PostNorm(torch.nn.Module):
    """A GEMM, a residual add and a LayerNorm: the backend's forward fuses all three."""
    def __init__(self, d=32, h=48):
        super().__init__()
        self.lin = torch.nn.Linear(d, h)
        self.ln = torch.nn.LayerNorm(h)

    def forward(self, x, r):
        return self.ln(self.lin(x) + r)


class NormPostNorm(PostNorm):
    """PostNorm after a LayerNorm of its input: the forward fuses the GEMM with the residual
    and the second norm, the backward the GEMM into the first norm's input gradient."""
    def forward(self, x, r):
        return super().forward(F.layer_norm(x, (x.shape[-1],)), r)


@contextlib.contextmanager
def quiet_notices():
    """comfuse's notices (the CPU interpreter's speed, a call run unfused for its layout)
    silenced; a fallback still fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ComfuseWarning)
        warnings.simplefilter("error", FallbackWarning)
        yield


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def double(args):
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def reference(fn, args):
    """fn evaluated in float64 on the same (rounded) inputs."""
    return as_tuple(fn(*double(args)))


def assert_matches_reference(fn, args, outs, tol=None):
    """Fused outputs against fn in float64 on the same inputs, norm-wise. Two allowances,
    both for ill-conditioned results (the kernels themselves are judged more finely by
    COMFUSE_CHECK's error scale): values below 1 in magnitude are judged absolutely (a sum
    of a normalised row cancels to ~0), and the result may be off by 10x the error that
    eager fp32 makes on the same program (LayerNorm of a nearly constant row)."""
    refs = reference(fn, args)
    refs32 = as_tuple(fn(*tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                 else a for a in args)))
    outs = as_tuple(outs)
    assert len(outs) == len(refs)
    for o, r, r32 in zip(outs, refs, refs32):
        t = tol if tol is not None else tolerance(o.dtype)
        scale = None
        if r.is_floating_point() and t > 0:
            scale = (r32.double() - r).abs().nan_to_num(0.0, 0.0, 0.0) * (10.0 / t)
        c = compare(o, r, t, scale=scale, floor=1.0)
        assert c.ok, f"fused result differs from the float64 reference: {c}"


def assert_grads_close(got, want, tol: float = 1e-5) -> None:
    """Gradients compared as one vector, norm-wise: fp32 sums reordered (a fused kernel's, or
    Inductor's own vectorised CPU code) move a small element by more than an elementwise
    tolerance allows."""
    g = torch.cat([t.detach().reshape(-1).double() for t in got])
    w = torch.cat([t.detach().reshape(-1).double() for t in want])
    err = ((g - w).norm() / w.norm().clamp_min(1e-30)).item()
    assert err <= tol, f"gradients differ: rel err {err:.3e} (tol {tol:.0e})"


def randn(*shape, dtype=torch.float32, device=None, scale=1.0, gen=None):
    device = device or DEVICE
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def weight(K, N, dtype=torch.float32, device=None, gen=None):
    device = device or DEVICE
    return (torch.randn(K, N, generator=gen) / math.sqrt(max(K, 1))).to(dtype=dtype, device=device)


def training_forward_head(logits, t):
    """An LM head's training forward as AOTAutograd's partition leaves it (Inductor's
    decomposition of log_softmax and nll_loss): the logits, the row max and the log-sum are
    saved for the backward beside the loss."""
    x = logits.float()
    row_max = x.amax(-1, keepdim=True)
    log_sum = torch.log(torch.exp(x - row_max).sum(-1, keepdim=True))
    logp = x - row_max - log_sum
    return logits, row_max, log_sum, -logp.gather(-1, t[:, None])[:, 0]
