"""The GEMM + epilogue workloads of the paper's evaluation, as plain PyTorch functions.

They mirror ``shared/baselines/measure_baselines.py`` so comfuse is measured on
the same programs as eager PyTorch and torch.compile.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F


def layer_norm(y, w, b):
    return F.layer_norm(y, (y.shape[-1],), w, b, 1e-5)


def rms_norm(y, w):
    return y * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(y.dtype) * w


def ln_postnorm(x, w, b, r, g, be):
    """LayerNorm(x @ W + b + residual): a BERT-style post-norm block."""
    return layer_norm(x @ w + b + r, g, be)


def gemm_rmsnorm(x, w, g):
    return rms_norm(x @ w, g)


def gemm_softmax(x, w):
    return torch.softmax(x @ w, dim=-1)


def mblr(x, w, b, g, be):
    """relu(LayerNorm(x @ W + b))."""
    return torch.relu(layer_norm(x @ w + b, g, be))


def multi_stage(x, w, g, be):
    """softmax, then a scale by tanh, then LayerNorm: two chained reductions."""
    y = x @ w
    p = torch.softmax(y, dim=-1)
    return layer_norm(torch.tanh(y) * p * y.shape[-1], g, be)


def linear_cross_entropy(x, w, t):
    """LM head + cross-entropy: the loss without keeping the logits."""
    return F.cross_entropy((x @ w).float(), t)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    fn: Callable
    side: tuple  # side inputs after x and w: "row" [N], "full" [M, N], "target" [M] ints
    gpu_shapes: tuple
    cpu_shape: tuple = (96, 64, 96)

    def inputs(self, M: int, K: int, N: int, dtype=torch.bfloat16, device="cpu", seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)
        x = randn(M, K)
        w = (torch.randn(K, N, generator=g) / math.sqrt(K)).to(dtype=dtype, device=device)
        side = []
        for kind in self.side:
            if kind == "row":
                side.append(randn(N))
            elif kind == "full":
                side.append(randn(M, N))
            elif kind == "target":
                side.append(torch.randint(0, N, (M,), generator=g).to(device))
        return (x, w, *side)


SUITE = {
    "ln_postnorm": Workload("ln_postnorm", ln_postnorm, ("row", "full", "row", "row"),
                            ((8192, 1024, 1024), (8192, 4096, 4096), (16384, 2048, 8192))),
    "rmsnorm": Workload("rmsnorm", gemm_rmsnorm, ("row",), ((8192, 1024, 1024), (8192, 4096, 4096))),
    "softmax": Workload("softmax", gemm_softmax, (), ((8192, 1024, 1024), (8192, 4096, 4096))),
    "mblr": Workload("mblr", mblr, ("row", "row", "row"), ((8192, 2048, 2048),)),
    "multi_stage": Workload("multi_stage", multi_stage, ("row", "row"),
                            ((8192, 1024, 1024), (8192, 4096, 4096))),
    "linear_ce": Workload("linear_ce", linear_cross_entropy, ("target",), ((8192, 4096, 32768),)),
}
