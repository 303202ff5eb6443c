"""Capture a PyTorch function as an aten graph (torch.fx) with shapes on every node.

``make_fx`` traces with fake tensors (nothing is computed), after
functionalisation (in-place ops become out-of-place) and with comfuse's
decompositions. Dead code is dropped and duplicate pure ops are merged, so that
``softmax(x @ w)`` and ``log_softmax(x @ w)`` share one GEMM.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from .decompositions import DECOMPOSITIONS


class CaptureError(RuntimeError):
    """The function could not be traced into a graph."""


def capture(fn: Callable, example_inputs: Sequence) -> fx.GraphModule:
    try:
        gm = make_fx(torch.func.functionalize(fn, remove="mutations"),
                     decomposition_table=DECOMPOSITIONS, tracing_mode="fake",
                     _allow_non_fake_inputs=True)(*example_inputs)
    except Exception as e:  # tracing can fail in many ways: data-dependent control flow, ...
        raise CaptureError(f"could not trace {getattr(fn, '__name__', fn)!r}: "
                           f"{type(e).__name__}: {e}") from e
    gm.graph.eliminate_dead_code()
    merge_duplicates(gm.graph)
    gm.recompile()
    return gm


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return ("torch", str(value))
    if isinstance(value, float) and value != value:
        return ("nan",)
    return value


def _is_pure(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return True


def merge_duplicates(graph: fx.Graph) -> None:
    """Common-subexpression elimination over pure aten calls."""
    seen: dict = {}
    for node in list(graph.nodes):
        if not _is_pure(node):
            continue
        try:
            key = (node.target, _freeze(node.args), _freeze(node.kwargs))
            hash(key)
        except TypeError:
            continue
        first = seen.get(key)
        if first is None:
            seen[key] = node
        else:
            node.replace_all_uses_with(first)
            graph.erase_node(node)
