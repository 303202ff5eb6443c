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
"""
from __future__ import annotations

import copy
import logging

import torch
import torch.fx as fx

log = logging.getLogger("comfuse.backend")
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


def with_dense_attention_masks(gm: fx.GraphModule):
    """(``gm``, []) where no mask needs it; else (a copy of ``gm`` whose SDPA masks have a dense
    last dimension, a note per rewritten call). ``gm`` itself is left as Dynamo gave it:
    Inductor's compilation of it is what the copy is timed against."""
    if not _found(gm):
        return gm, []
    copy_ = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # (nodes' meta shared, not copied)
    return copy_, dense_attention_masks(copy_)


def dense_attention_masks(gm: fx.GraphModule) -> list:
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
        for note in notes:
            log.info("backend: %s", note)
    return notes
