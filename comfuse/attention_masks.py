"""Attention masks laid out so that PyTorch's fused attention kernels may take them.

``F.scaled_dot_product_attention`` runs a fused kernel (flash or memory-efficient attention)
only where the mask's last dimension has stride 1; any other mask sends it to the math path,
which on a GPU upcasts bf16 / fp16 queries, keys and values to fp32 and runs the attention
as fp32 GEMMs on CUDA cores, with the [batch, heads, queries, keys] scores and
probabilities written and read in fp32, in both passes. A padding mask that a model builds
by broadcasting (transformers 5.17 under torch.compile gives BERT a boolean mask of strides
(0, S, 1, 0)) has stride 0 there, so a compiled BERT ran its attention that way.

This pass, on the graph Dynamo hands the backend (before AOTAutograd), gives such a mask a
dense last dimension: its broadcast leading dimensions stay broadcast (stride 0), the last
two are copied, so the copy holds at most one [queries, keys] block per distinct leading
index (for BERT's mask, one 512 x 512 block of booleans). The values are the same; which
kernel then runs is PyTorch's choice, as in eager mode with a dense mask.

Where the backend times graphs (a GPU with autotuning on), the rewrite is kept only where
the attention calls it touches run faster with the dense masks, timed alone on the graph's
sizes (``dense_masks_pay``): a few milliseconds, against compiling the whole graph a second
time to time it whole (BERT-base's first training step spent 12.3 s compiling the forward
again and 16 s on the backward and the timing, H200, 2026-12-07).
"""
from __future__ import annotations

import copy
import logging
import statistics

import torch
import torch.fx as fx

from .graph_check import time_rounds

log = logging.getLogger("comfuse.backend")
MASK_MARGIN = 0.99  # dense masks are kept where their attention runs at least 1 % faster
# (SDPA, its arguments' layouts, training, device) -> {"given": ms, "dense": ms}: a call timed
# once in a process, for every graph that makes it (a model's training, inference and
# loss-only graphs make the same calls)
MASK_TIMES: dict = {}
_SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)


def _mask(node: fx.Node):
    """(where the mask is passed, the mask's node) of an SDPA call, or None."""
    if "attn_mask" in node.kwargs:
        return "attn_mask", node.kwargs["attn_mask"]
    if len(node.args) > 3:
        return 3, node.args[3]
    return None


def needs_dense_last_dim(value) -> bool:
    """A mask a fused attention kernel refuses for its layout: last dimension longer than 1
    and not of stride 1. Decided on plain integers only, since a comparison of symbolic
    sizes would add guards after Dynamo's tracing: a symbolic last stride is left as it is,
    and a symbolic last size counts as longer than 1 (Dynamo gives sizes 0 and 1 their own
    graphs)."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    size, stride = value.shape[-1], value.stride(-1)
    return isinstance(stride, int) and stride != 1 and (not isinstance(size, int) or size > 1)


def _text(values) -> str:
    return "(" + ", ".join(str(v) for v in values) + ")"


def _found(gm: fx.GraphModule) -> list:
    """(SDPA node, where its mask is passed, the mask's node, its value) for each call whose
    mask ``needs_dense_last_dim``."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        passed = _mask(node)
        if passed is None or not isinstance(passed[1], fx.Node):
            continue
        value = passed[1].meta.get("example_value")
        if needs_dense_last_dim(value):
            found.append((node, *passed, value))
    return found


def with_dense_attention_masks(gm: fx.GraphModule, quiet: bool = False):
    """(``gm``, []) where no mask needs it; else (a copy of ``gm`` whose SDPA masks have a dense
    last dimension, a note per rewritten call, logged unless ``quiet``). ``gm`` itself is left
    as Dynamo gave it: Inductor's compilation of it is what the copy may be timed against."""
    if not _found(gm):
        return gm, []
    copy_ = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # (nodes' meta shared, not copied)
    return copy_, dense_attention_masks(copy_, quiet)


def dense_attention_masks(gm: fx.GraphModule, quiet: bool = False) -> list:
    """Rewrite ``gm`` in place: each SDPA call whose mask ``needs_dense_last_dim`` gets the
    mask with its broadcast leading dimensions narrowed to one index, made contiguous and
    broadcast back. Returns a note per rewritten call."""
    notes = []
    graph = gm.graph
    for node, where, mask, value in _found(gm):
        with graph.inserting_before(node):
            dense = mask
            for dim in range(value.dim() - 2):  # (a broadcast dimension: one index copied)
                if isinstance(value.stride(dim), int) and value.stride(dim) == 0:
                    dense = graph.call_method("narrow", (dense, dim, 0, 1))
            dense = graph.call_method("contiguous", (dense,))
            dense = graph.call_method("expand_as", (dense, mask))
        if where == "attn_mask":
            node.update_kwarg("attn_mask", dense)
        else:
            node.update_arg(where, dense)
        notes.append(f"{node.name}: the attention mask {_text(value.shape)} of strides {_text(value.stride())} "
                     "given a dense last dimension, so a fused attention kernel may take it")
    if notes:
        graph.lint()
        gm.recompile()
        for note in notes if not quiet else ():
            log.info("backend: %s", note)
    return notes


def dense_like(mask: torch.Tensor) -> torch.Tensor:
    """``mask``'s values laid out as ``dense_attention_masks`` lays them out in the graph."""
    dense = mask
    for dim in range(mask.dim() - 2):
        if mask.stride(dim) == 0:
            dense = dense.narrow(dim, 0, 1)
    return dense.contiguous().expand_as(mask)


def _real(value, mask: bool = False) -> torch.Tensor:
    """A tensor of ``value``'s sizes, strides, dtype and device (its storage only as long as
    the strides reach): random values, or for a mask, every key attended."""
    size, stride = tuple(value.shape), tuple(value.stride())
    extent = 1 + sum((n - 1) * st for n, st in zip(size, stride) if n > 0)
    if not mask:
        base = torch.randn(extent, device=value.device, dtype=value.dtype)
    else:
        attend = True if value.dtype == torch.bool else 0.0  # (a boolean mask's True, an additive one's 0)
        base = torch.full((extent,), attend, device=value.device, dtype=value.dtype)
    return base.as_strided(size, stride).requires_grad_(value.requires_grad and not mask)


def _concrete(value) -> bool:
    return isinstance(value, torch.Tensor) and all(isinstance(n, int) for n in (*value.shape, *value.stride()))


def _signature(node, mask: fx.Node) -> tuple | None:
    """The call's arguments as (tensor layouts, constants), or None where one is symbolic or
    not known."""
    parts = []
    for key, a in [(None, a) for a in node.args] + list(node.kwargs.items()):
        if isinstance(a, fx.Node):
            value = a.meta.get("example_value")
            if not _concrete(value):
                return None
            parts.append((key, a is mask, tuple(value.shape), tuple(value.stride()), value.dtype, value.requires_grad))
        elif isinstance(a, (int, float, bool, type(None))):
            parts.append((key, a))
        else:
            return None
    return tuple(parts)


def _timed_call(node, mask: fx.Node, dense: bool, training: bool):
    """A call of ``node``'s attention on tensors laid out as its arguments (the mask as given,
    or ``dense_like`` it), with the backward of its output where ``training``."""
    def real(a):
        if not isinstance(a, fx.Node):
            return a
        value = _real(a.meta["example_value"], mask=a is mask)
        return dense_like(value) if a is mask and dense else value
    args = [real(a) for a in node.args]
    kwargs = {k: real(a) for k, a in node.kwargs.items()}
    leaves = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
    training = training and bool(leaves)
    with torch.enable_grad() if training else torch.no_grad():
        grad = torch.randn_like(node.target(*args, **kwargs)) if training else None

    def call():
        with torch.enable_grad() if training else torch.no_grad():
            out = node.target(*args, **kwargs)
            if training:
                torch.autograd.grad(out, leaves, grad)
    return call


def dense_masks_pay(gm: fx.GraphModule, training: bool) -> bool | None:
    """Whether the SDPA calls of ``gm`` (Dynamo's graph as given) whose masks
    ``needs_dense_last_dim`` run at least 1 % faster (``MASK_MARGIN``) with dense masks, in
    all: each distinct call timed alone (forward, and its backward where ``training``) on
    tensors of its arguments' layouts, both forms in interleaved rounds (once a process:
    ``MASK_TIMES``), weighed by how many calls share it. None where a call cannot be timed so (a symbolic size, an argument that
    is not a tensor or a constant)."""
    counts: dict = {}
    for node, _, mask, value in _found(gm):
        signature = _signature(node, mask)
        if signature is None:
            return None
        counts.setdefault(signature, [node, mask, 0])[2] += 1
    if not counts:
        return None
    totals = {"given": 0.0, "dense": 0.0}
    device = next(iter(counts.values()))[1].meta["example_value"].device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for signature, (node, mask, count) in counts.items():
            timed = MASK_TIMES.get((node.target, signature, training, str(device)))
            if timed is None:
                calls = {form: _timed_call(node, mask, form == "dense", training) for form in totals}
                timed = {form: statistics.median(ms) for form, ms in time_rounds(calls, device, 3).items()}
                MASK_TIMES[(node.target, signature, training, str(device))] = timed
            for form in totals:
                totals[form] += timed[form] * count
    pays = totals["dense"] <= totals["given"] * MASK_MARGIN
    log.info("backend: the attention calls with dense masks ran %.4f ms against %.4f ms with the masks as given "
             "(%d call(s), timed alone%s): %s", totals["dense"], totals["given"], sum(c for *_, c in counts.values()),
             ", with their backward" if training else "", "dense masks kept" if pays else "the masks kept as given")
    return pays
