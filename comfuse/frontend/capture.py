"""Capture a PyTorch function as an aten graph (torch.fx) with shapes on every node.

``make_fx`` traces with fake tensors (nothing is computed), after
functionalisation (in-place ops become out-of-place). Composite ops (layer_norm,
softmax, gelu, ...) are then decomposed only where a GEMM feeds them, so the
region finder sees primitives there while the rest of the program keeps its
composite ops and runs as fast as eager. Dead code is dropped and duplicate pure
ops are merged, so that ``softmax(x @ w)`` and ``log_softmax(x @ w)`` share one
GEMM.
"""
from __future__ import annotations

import contextlib

import operator
from typing import Callable, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..errors import CaptureError
from .decompositions import DECOMPOSITIONS


def _portable_attention():
    """scaled_dot_product_attention traced on CUDA may record the cuDNN kernel, whose
    optional outputs later passes cannot handle; trace with flash, memory-efficient or
    math attention instead (the same choices eager makes when cuDNN is off)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()


def _node_by_node(fn: Callable) -> Callable:
    """``fn``, run node by node where it is a graph, so that each node traced from one of its
    nodes takes that node's metadata (``preserve_node_meta``): the aten op it came from, its
    source line and module. Inductor names its kernels after those ops and profiles show
    them; a graph retraced without them would give its kernels bare names."""
    if not isinstance(fn, fx.GraphModule):
        return fn
    return lambda *args: fx.Interpreter(fn).run(*args)


def capture(fn: Callable, example_inputs: Sequence) -> fx.GraphModule:
    try:
        with _portable_attention(), fx_traceback.preserve_node_meta():
            gm = make_fx(torch.func.functionalize(_node_by_node(fn), remove="mutations"), tracing_mode="fake",
                         _allow_non_fake_inputs=True)(*example_inputs)
        decompose_after_gemms(gm)
    except Exception as e:  # tracing can fail in many ways: data-dependent control flow, ...
        raise CaptureError(f"could not trace {getattr(fn, '__name__', fn)!r}: "
                           f"{type(e).__name__}: {e}") from e
    gm.graph.eliminate_dead_code()
    merge_duplicates(gm.graph)
    gm.recompile()
    return gm


_GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
          torch.ops.aten.baddbmm.default)


def descendants(nodes) -> set:
    """Every node that (transitively) uses one of ``nodes``; the nodes themselves excluded
    unless reached again."""
    seen: set = set()
    todo = list(nodes)
    while todo:
        for user in todo.pop().users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def _downstream_of_gemms(graph: fx.Graph) -> set:
    gemms = [n for n in graph.nodes if n.op == "call_function" and n.target in _GEMMS]
    return descendants(gemms) | set(gemms)


def decompose_after_gemms(gm: fx.GraphModule) -> None:
    """Inline comfuse's decomposition of every composite op that a GEMM feeds (and of
    addmm/baddbmm themselves), repeating until none is left."""
    while True:
        downstream = _downstream_of_gemms(gm.graph)
        todo = [n for n in gm.graph.nodes
                if n in downstream and n.op == "call_function" and n.target in DECOMPOSITIONS]
        if not todo:
            return
        for node in todo:
            _inline_decomposition(gm.graph, node, DECOMPOSITIONS[node.target])


def _inline_decomposition(graph: fx.Graph, node: fx.Node, decomposition) -> None:
    flat, spec = tree_flatten((node.args, node.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]

    def call(*tensors):
        values = list(flat)
        for p, t in zip(positions, tensors):
            values[p] = t
        args, kwargs = tree_unflatten(values, spec)
        return decomposition(*args, **kwargs)

    sub = make_fx(call, decomposition_table=DECOMPOSITIONS, tracing_mode="fake")(
        *[flat[p].meta["val"] for p in positions])
    env = {}
    placeholders = iter(flat[p] for p in positions)
    with graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                env[sn] = next(placeholders)
            elif sn.op == "get_attr":
                raise RuntimeError(f"decomposition of {node.target} created a constant tensor")
            elif sn.op == "output":
                result = tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, sn.args[0])
            else:
                env[sn] = graph.node_copy(sn, lambda a: env[a])
                for field, value in node.meta.items():  # (the composite op's origin and source)
                    if field not in ("val", "tensor_meta"):
                        env[sn].meta.setdefault(field, value)
    if isinstance(result, (list, tuple)):
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
            else:
                raise RuntimeError(f"{node.target}'s tuple result is used whole by {user}")
    else:
        node.replace_all_uses_with(result)
        if node.target in _PRODUCT_OF and not node.kwargs and isinstance(result, fx.Node) \
                and result.target is torch.ops.aten.add.Tensor:
            result.meta[BIAS_OF] = node.target  # (``recompose_biased_gemms`` may put it back)
    graph.erase_node(node)


# a GEMM with a bias -> the product capture decomposes it into, beside a bias add
_PRODUCT_OF = {torch.ops.aten.addmm.default: torch.ops.aten.mm.default,
               torch.ops.aten.baddbmm.default: torch.ops.aten.bmm.default}
BIAS_OF = "comfuse_bias_of"  # meta of the add a GEMM with a bias was decomposed into: the GEMM's op


def recompose_biased_gemms(graph: fx.Graph) -> int:
    """Put back each ``addmm`` / ``baddbmm`` that capture decomposed into a product and a bias
    add and that no region took: cuBLAS adds the bias inside the GEMM, where the add alone is
    a kernel of its own (GPT-2's twelve layers lost about 0.5 ms of GPU time a training step
    that way, H100, 2026-12-07, ``bench/results/2026-12-07-h100-region-inputs-and-bias/``).
    Returns how many were put back."""
    count = 0
    for add in list(graph.nodes):
        target = add.meta.get(BIAS_OF) if add.op == "call_function" else None
        if target is None or add.target is not torch.ops.aten.add.Tensor or len(add.args) != 2:
            continue
        product, bias = add.args
        if not isinstance(product, fx.Node) or product.target is not _PRODUCT_OF[target] or len(product.users) != 1:
            continue
        with graph.inserting_before(add):
            gemm = graph.call_function(target, (bias, *product.args))
        gemm.meta = {k: v for k, v in add.meta.items() if k != BIAS_OF}
        add.replace_all_uses_with(gemm)
        graph.erase_node(add)
        graph.erase_node(product)
        count += 1
    return count


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
