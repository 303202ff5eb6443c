"""The workloads of the paper's evaluation, as plain PyTorch functions.

The GEMM + epilogue programs mirror ``shared/baselines/measure_baselines.py`` so
comfuse is measured on the same programs as eager PyTorch and torch.compile.
Each is written as ``epilogue(x @ w, *side)`` so the harness can also time the
GEMM alone (the floor) and the epilogue alone on a precomputed GEMM output.
Back-to-back GEMM and attention workloads follow the same baselines file.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F


def layer_norm(y, w, b):
    return F.layer_norm(y, (y.shape[-1],), w, b, 1e-5)


def rms_norm(y, w):
    return y * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(y.dtype) * w


# ---- epilogues (y is the GEMM output) -----------------------------------------------------

def ep_ln_postnorm(y, b, r, g, be):
    return layer_norm(y + b + r, g, be)


def ep_rmsnorm(y, g):
    return rms_norm(y, g)


def ep_softmax(y):
    return torch.softmax(y, dim=-1)


def ep_mblr(y, b, g, be):
    return torch.relu(layer_norm(y + b, g, be))


def ep_multi_stage(y, g, be):
    p = torch.softmax(y, dim=-1)
    return layer_norm(torch.tanh(y) * p * y.shape[-1], g, be)


def ep_cross_entropy(y, t):
    return F.cross_entropy(y.float(), t)


# ---- whole programs ---------------------------------------------------------------------

def ln_postnorm(x, w, b, r, g, be):
    """LayerNorm(x @ W + b + residual): a BERT-style post-norm block."""
    return ep_ln_postnorm(x @ w, b, r, g, be)


def gemm_rmsnorm(x, w, g):
    return ep_rmsnorm(x @ w, g)


def gemm_softmax(x, w):
    return ep_softmax(x @ w)


def mblr(x, w, b, g, be):
    """relu(LayerNorm(x @ W + b))."""
    return ep_mblr(x @ w, b, g, be)


def multi_stage(x, w, g, be):
    """softmax, then a scale by tanh, then LayerNorm: two chained reductions."""
    return ep_multi_stage(x @ w, g, be)


def linear_cross_entropy(x, w, t):
    """LM head + cross-entropy: the loss without keeping the logits."""
    return ep_cross_entropy(x @ w, t)


def lm_head_loss(x, w, t):
    """LM head + cross-entropy as a language model computes them, with nn.Linear's [N, K]
    weight: the logits, which it returns, and the loss."""
    y = F.linear(x, w)
    return y, ep_cross_entropy(y, t)


def ep_lm_head_loss(y, t):
    return y, ep_cross_entropy(y, t)


def dlrm_bottom_mlp(x, w1, w2, w3):
    return torch.relu(torch.relu(torch.relu(x @ w1) @ w2) @ w3)


def target_attention(q, k, v):
    return torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v


def self_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1) @ v


def transformer_mlp(x, w1, w2):
    return F.gelu(x @ w1) @ w2


@dataclasses.dataclass(frozen=True)
class Workload:
    """A GEMM + epilogue program: ``fn(x, w, *side) == epilogue(x @ w, *side)``."""
    name: str
    fn: Callable
    side: tuple  # side inputs after x and w: "row" [N], "full" [M, N], "target" [M] ints
    gpu_shapes: tuple
    epilogue: Callable | None = None
    cpu_shape: tuple = (96, 64, 96)
    sweep: tuple = ()  # extra (M, K, N) shapes for `comfuse bench --suite paper`
    paper: bool = True  # one of the paper's programs (else a model's, measured beside them)
    linear: bool = False  # w is nn.Linear's [N, K] weight: fn(x, w, *side) == epilogue(F.linear(x, w), *side)

    def inputs(self, M: int, K: int, N: int, dtype=torch.bfloat16, device="cpu", seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)
        x = randn(M, K)
        w = (torch.randn(K, N, generator=g) / math.sqrt(K)).to(dtype=dtype, device=device)
        if self.linear:
            w = w.t().contiguous()
        side = []
        for kind in self.side:
            if kind == "row":
                side.append(randn(N))
            elif kind == "full":
                side.append(randn(M, N))
            elif kind == "target":
                side.append(torch.randint(0, N, (M,), generator=g).to(device))
        return (x, w, *side)


SWEEP = ((2048, 1024, 1024), (16384, 1024, 1024), (8192, 512, 1024), (8192, 1024, 768),
         (8192, 1024, 3072), (8192, 1024, 5120), (8192, 1024, 12288), (8191, 1024, 1024))

SUITE = {
    "ln_postnorm": Workload("ln_postnorm", ln_postnorm, ("row", "full", "row", "row"),
                            ((8192, 1024, 1024), (8192, 4096, 4096), (16384, 2048, 8192)),
                            ep_ln_postnorm, sweep=SWEEP),
    "rmsnorm": Workload("rmsnorm", gemm_rmsnorm, ("row",), ((8192, 1024, 1024), (8192, 4096, 4096)),
                        ep_rmsnorm),
    "softmax": Workload("softmax", gemm_softmax, (), ((8192, 1024, 1024), (8192, 4096, 4096)),
                        ep_softmax),
    "mblr": Workload("mblr", mblr, ("row", "row", "row"), ((8192, 2048, 2048),), ep_mblr),
    "multi_stage": Workload("multi_stage", multi_stage, ("row", "row"),
                            ((8192, 1024, 1024), (8192, 4096, 4096)), ep_multi_stage),
    "linear_ce": Workload("linear_ce", linear_cross_entropy, ("target",), ((8192, 4096, 32768),),
                          ep_cross_entropy),
    # GPT-2 small's head (vocabulary 50257) and a Llama head of width 2048 (vocabulary 32000)
    "lm_head_loss": Workload("lm_head_loss", lm_head_loss, ("target",), ((8192, 768, 50257), (8192, 2048, 32000)),
                             ep_lm_head_loss, paper=False, linear=True),
}


@dataclasses.dataclass
class Program:
    """One benchmark case, ready to run: the program, its inputs and its companions."""
    suite: str
    workload: str
    shape: tuple
    dtype: torch.dtype
    fn: Callable
    args: tuple
    flops: float
    min_bytes: float  # every input read once, every output written once
    gemm: Callable | None = None  # the GEMMs alone, on precomputed operands (the floor)
    epilogue: Callable | None = None  # the epilogue alone, on a precomputed GEMM output
    epilogue_args: tuple = ()
    sdpa: Callable | None = None  # scaled_dot_product_attention, where it computes the same
    reference: Callable | None = None  # float64 version, when fn holds weights of its own

    @property
    def label(self) -> str:
        return f"{self.workload} {'x'.join(map(str, self.shape))}"


def _bytes(tensors, out_numel: int, out_itemsize: int) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors) + out_numel * out_itemsize)


def paper_program(name: str, shape: tuple, dtype, device, seed=0) -> Program:
    wl = SUITE[name]
    M, K, N = shape
    args = wl.inputs(M, K, N, dtype=dtype, device=device, seed=seed)
    x, w, side = args[0], args[1], args[2:]
    y = F.linear(x, w) if wl.linear else x @ w
    out_numel = 1 if name == "linear_ce" else M * N  # (lm_head_loss: the logits; its loss is M floats)
    return Program("paper", name, shape, dtype, wl.fn, args, 2.0 * M * N * K,
                   _bytes(args, out_numel, dtype.itemsize if name != "linear_ce" else 4),
                   gemm=(lambda: F.linear(x, w)) if wl.linear else (lambda: x @ w), epilogue=wl.epilogue,
                   epilogue_args=(y, *side))


def b2b_program(name: str, dtype, device, seed=0) -> Program:
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)
    if name == "dlrm_bottom_mlp":
        M = 65536
        dims = [(512, 512), (512, 256), (256, 128)]
        x = randn(M, 512)
        ws = [randn(a, b, scale=1 / math.sqrt(a)) for a, b in dims]
        hs = [x, torch.relu(x @ ws[0])]
        hs.append(torch.relu(hs[1] @ ws[1]))
        flops = sum(2.0 * M * a * b for a, b in dims)
        return Program("b2b", name, (M, 512, 512, 256, 128), dtype, dlrm_bottom_mlp, (x, *ws), flops,
                       _bytes((x, *ws), M * 128, dtype.itemsize),
                       gemm=lambda: [h @ w for h, w in zip(hs, ws)])
    if name == "target_attention":
        B, Lq, Lk, d = 4096, 16, 256, 64
        q, k, v = randn(B, Lq, d), randn(B, Lk, d), randn(B, Lk, d)
        p = torch.softmax(q @ k.transpose(1, 2), -1)
        return Program("b2b", name, (B, Lq, Lk, d), dtype, target_attention, (q, k, v),
                       4.0 * B * Lq * Lk * d, _bytes((q, k, v), B * Lq * d, dtype.itemsize),
                       gemm=lambda: (q @ k.transpose(1, 2), p @ v),
                       sdpa=lambda: F.scaled_dot_product_attention(q, k, v, scale=1.0))
    if name == "transformer_mlp":
        M, H, F4 = 8192, 4096, 16384
        x, w1, w2 = randn(M, H), randn(H, F4, scale=1 / math.sqrt(H)), randn(F4, H, scale=1 / math.sqrt(F4))
        h = F.gelu(x @ w1)
        return Program("b2b", name, (M, H, F4, H), dtype, transformer_mlp, (x, w1, w2),
                       4.0 * M * H * F4, _bytes((x, w1, w2), M * H, dtype.itemsize),
                       gemm=lambda: (x @ w1, h @ w2))
    raise KeyError(name)


def attention_program(dtype, device, seed=0) -> Program:
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, H, L, d = 8, 16, 2048, 64
    q, k, v = (torch.randn(B, H, L, d, generator=g).to(dtype=dtype, device=device) for _ in range(3))
    p = torch.softmax(q @ k.transpose(-1, -2) / 8.0, -1)
    return Program("attention", "self_attention", (B, H, L, d), dtype, self_attention, (q, k, v),
                   4.0 * B * H * L * L * d, _bytes((q, k, v), B * H * L * d, dtype.itemsize),
                   gemm=lambda: (q @ k.transpose(-1, -2), p @ v),
                   sdpa=lambda: F.scaled_dot_product_attention(q, k, v, scale=1 / 8.0))


def _double_module(module, run):
    """A float64 copy of ``module`` and a function running ``run`` on it (the reference)."""
    twin = copy.deepcopy(module).double()
    return lambda x: run(twin, x.double())


def model_program(name: str, dtype, device, seed=0, small: bool = False) -> Program:
    """Whole blocks from Hugging Face transformers, random weights (no download): a
    BERT-base encoder layer (batch 32, seq 512) and a Llama-style MLP (hidden 4096)."""
    torch.manual_seed(seed)
    if name == "bert_layer":
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertLayer
        h, heads, inter, batch, seq = (64, 4, 128, 2, 16) if small else (768, 12, 3072, 32, 512)
        cfg = BertConfig(hidden_size=h, num_attention_heads=heads, intermediate_size=inter,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        cfg._attn_implementation = "sdpa"
        layer = BertLayer(cfg).eval().to(device=device, dtype=dtype)
        x = torch.randn(batch, seq, h, device=device, dtype=dtype)

        def run(module, x):
            out = module(x)
            return out[0] if isinstance(out, tuple) else out
        fn = functools.partial(run, layer)
        ref = _double_module(layer, run)
        tokens = batch * seq
        flops = 2.0 * tokens * (4 * h * h + 2 * h * inter) + 4.0 * batch * seq * seq * h
        return Program("blocks", name, (batch, seq, h), dtype, fn, (x,), flops,
                       float(x.numel() * x.element_size() * 2 + sum(p.numel() * p.element_size()
                                                                     for p in layer.parameters())),
                       reference=ref)
    if name == "llama_mlp":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP
        h, inter, tokens = (64, 128, 32) if small else (4096, 11008, 4096)
        cfg = LlamaConfig(hidden_size=h, intermediate_size=inter)
        mlp = LlamaMLP(cfg).eval().to(device=device, dtype=dtype)
        x = torch.randn(tokens, h, device=device, dtype=dtype)
        return Program("blocks", name, (tokens, h, inter), dtype, lambda x: mlp(x), (x,),
                       6.0 * tokens * h * inter,
                       float(x.numel() * x.element_size() * 2 + sum(p.numel() * p.element_size()
                                                                     for p in mlp.parameters())),
                       reference=_double_module(mlp, lambda m, x: m(x)))
    raise KeyError(name)


MODELS = ("bert_layer", "llama_mlp")
SUITES = ("paper", "b2b", "attention", "blocks")  # (whole models: bench/models.py)
B2B = ("dlrm_bottom_mlp", "target_attention", "transformer_mlp")


def cases(suite: str, quick: bool = False, sweep: bool = True) -> list[tuple]:
    """(suite, workload, shape or None) for ``suite`` ("paper", "b2b", "attention", "all");
    ``sweep=False``: the paper suite at each workload's own shapes, without the extra ones."""
    if suite == "all":
        return [c for s in SUITES if s != "blocks" for c in cases(s, quick, sweep)]
    if suite == "paper":
        out = []
        for name, wl in SUITE.items():
            shapes = wl.gpu_shapes[:1] if quick else wl.gpu_shapes + (wl.sweep if sweep else ())
            out += [("paper", name, s) for s in shapes]
        return out
    if suite == "b2b":
        return [("b2b", n, None) for n in (B2B[:2] if quick else B2B)]
    if suite == "attention":
        return [("attention", "self_attention", None)]
    if suite == "blocks":
        return [("blocks", n, None) for n in MODELS]
    raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES + ('all',))}")


def build(case: tuple, dtype, device, cpu_scale: bool = False) -> Program:
    """The Program for a case; on the CPU (interpreter) paper shapes shrink to small ones."""
    suite, name, shape = case
    if suite == "paper":
        return paper_program(name, SUITE[name].cpu_shape if cpu_scale else shape, dtype, device)
    if suite == "b2b":
        return b2b_program(name, dtype, device)
    if suite == "blocks":
        return model_program(name, dtype, device, small=cpu_scale)
    return attention_program(dtype, device)
