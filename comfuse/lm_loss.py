"""A language model's head and its loss in a training graph: the logits never exist whole.

A graph Dynamo hands the backend computes ``cross_entropy(linear(h, W, b) ..., target)`` where
the logits feed nothing but the loss (a training step that returns the loss: Hugging Face's
causal-LM and masked-LM losses, or a hand-written one). Left as it is, AOTAutograd saves the
[rows, vocabulary] logits for the backward, which computes their gradient, another tensor
of that size: at a vocabulary of 128256 and 8192 rows, 2.1 GB each in bf16. Where the
logits would be large (``MEMORY_FIRST_BYTES`` as an fp32 tensor, as for the fused loss
regions of an inference graph) and a gradient is wanted, the backend replaces the head and
the loss, before AOTAutograd sees the graph, by one call of
``comfuse::linear_cross_entropy``, which computes the loss and its gradients together over
chunks of rows (runtime/linear_ce.py); its autograd formula scales those gradients by the
loss's upstream gradient. The ops between the head and the loss may be casts, ``contiguous``,
slices that keep the vocabulary whole (a causal LM's shift) and reshapes to [rows,
vocabulary]; the slices move onto ``h``. The loss's other arguments must be the defaults
but ``ignore_index`` and ``reduction`` ("mean" or "sum").
"""
from __future__ import annotations

import inspect
import logging
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .errors import notice_once
from .runtime import linear_ce, tuning

log = logging.getLogger("comfuse.backend")

LINEARS = (torch._C._nn.linear, F.linear)
CASTS = ("float", "to", "type_as", "half", "bfloat16")
RESHAPES = ("view", "reshape")
_CE_SIGNATURE = inspect.signature(F.cross_entropy)


@torch.library.custom_op("comfuse::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, t: torch.Tensor,
                            ignore_index: int, reduction: str, out_dtype: torch.dtype,
                            need: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dL/dh, dL/dw, dL/db) of ``cross_entropy(linear(h, w, b), t)``; an empty tensor
    for each gradient ``need`` leaves out."""
    return linear_ce.linear_cross_entropy(h, w, b, t, ignore_index, reduction, out_dtype, tuple(need))


@linear_cross_entropy_op.register_fake
def _fake(h, w, b, t, ignore_index, reduction, out_dtype, need):
    bias = b if b is not None else h
    return (h.new_empty((), dtype=out_dtype), h.new_empty(h.shape) if need[0] else h.new_empty(0),
            w.new_empty(w.shape) if need[1] else w.new_empty(0),
            bias.new_empty(w.shape[0]) if need[2] else bias.new_empty(0))


def _keep(ctx, inputs, output) -> None:
    ctx.need = inputs[-1]
    ctx.save_for_backward(*output[1:])


def _backward(ctx, g, *unused):
    dh, dw, db = ctx.saved_tensors
    need = ctx.need
    grads = [(x * g).to(x.dtype) if wanted else None for x, wanted in zip((dh, dw, db), need)]
    return (*grads, None, None, None, None, None)


linear_cross_entropy_op.register_autograd(_backward, setup_context=_keep)


def _size(x) -> int:
    """A size as an int: a symbolic size's value at the example inputs."""
    if isinstance(x, torch.SymInt):
        return x.node.hint if x.node.hint is not None else x.node.require_hint()
    return int(x)


def _value(node):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _keeps_last_dim(index, ndim: int) -> bool:
    """Whether indexing with ``index`` (a getitem's argument) leaves the last dimension whole
    and selects along the others with constants only."""
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, (fx.Node, torch.Tensor, list)) or i is None for i in index):
        return False
    if Ellipsis in index:
        return index[-1] == slice(None) and index.count(Ellipsis) == 1
    return len(index) < ndim or index[-1] == slice(None)


def _head(ce: fx.Node, shared: bool = False):
    """(linear node, the getitem indices to move onto h, the nodes from the loss's input back
    to the linear one) where ``ce``'s input is a linear layer's output through casts,
    contiguous, slices keeping the vocabulary and reshapes to [rows, vocabulary], each value
    used once (``shared``: or more); else None."""
    x = ce.args[0] if ce.args else ce.kwargs.get("input")
    indices, chain = [], []  # (walking from the loss back: a slice seen here comes after what follows)
    while isinstance(x, fx.Node) and (len(x.users) == 1 or shared):
        chain.append(x)
        if x.op == "call_function" and x.target in LINEARS:
            return x, indices[::-1], chain
        src = x.args[0] if x.args else None
        if x.op == "call_method" and x.target in CASTS + ("contiguous",):
            pass
        elif x.op == "call_method" and x.target in RESHAPES or x.op == "call_function" and x.target is torch.reshape:
            before, after = _value(src), _value(x)
            if indices or before is None or after is None or before.shape[-1] != after.shape[-1]:
                return None  # (a slice after a reshape would index the reshaped rows)
        elif x.op == "call_function" and x.target is operator.getitem:
            value = _value(src)
            if value is None or not _keeps_last_dim(x.args[1], value.dim()):
                return None
            indices.append(x.args[1])
        else:
            return None
        x = src
    return None


def _candidate(ce: fx.Node):
    """The rewrite's arguments for cross-entropy node ``ce``, or None where it does not apply."""
    if ce.op != "call_function" or ce.target is not F.cross_entropy:
        return None
    try:
        bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    except TypeError:
        return None
    args = bound.arguments
    if any(args.get(k) is not None for k in ("weight", "size_average", "reduce")) \
            or args.get("label_smoothing", 0.0) != 0.0 or args.get("reduction", "mean") not in ("mean", "sum") \
            or not isinstance(args.get("ignore_index", -100), int):
        return None
    found, shared = _head(ce), False
    if found is None:
        found, shared = _head(ce, shared=True), True
    if found is None:
        return None
    linear, indices, chain = found
    h, w = linear.args[0], linear.args[1]
    b = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    logits, target, hv, wv = _value(args["input"]), _value(args["target"]), _value(h), _value(w)
    if any(v is None for v in (logits, target, hv, wv)) or logits.dim() != 2 or target.dim() != 1 \
            or wv.dim() != 2 or target.dtype != torch.int64 or not logits.is_floating_point():
        return None
    if not torch.is_grad_enabled() or not any(getattr(_value(n), "requires_grad", False) for n in (h, w, b) if n is not None):
        return None  # (no gradient wanted: an inference graph's loss region fuses without the logits already)
    rows, vocab = _size(logits.shape[0]), _size(wv.shape[0])
    if rows * vocab * 4 < tuning.MEMORY_FIRST_BYTES:
        return None
    need = [bool(getattr(_value(n), "requires_grad", False)) if n is not None else False for n in (h, w, b)]
    computed = _value(linear).dtype  # (under autocast, not the inputs': they are cast to it, as autocast does)
    return {"shared": shared, "linear": linear, "indices": indices, "chain": chain, "h": h, "w": w, "b": b,
            "target": args["target"], "ignore_index": args.get("ignore_index", -100),
            "reduction": args.get("reduction", "mean"), "dtype": logits.dtype, "need": need, "rows": rows,
            "vocab": vocab, "hidden": _size(wv.shape[1]), "computed": computed, "itemsize": computed.itemsize,
            "cast": [n is not None and _value(n).dtype != computed for n in (h, w, b)]}


def _note(found: dict) -> str:
    head = f"the LM head at {found['linear'].name} and its cross-entropy ({found['rows']} rows, vocabulary {found['vocab']})"
    if found["shared"]:
        return (f"{head} keep their [{found['rows']}, {found['vocab']}] logits, which the compiled function also "
                f"uses or returns (a model's output holds them): compile a function that returns the loss alone "
                f"to train without them")
    return (f"{head} compute the loss and its gradients together, "
            f"{linear_ce.chunk_rows(found['rows'], found['vocab'], found['itemsize'])} rows at a time: "
            f"no [{found['rows']}, {found['vocab']}] logits in the forward or the backward")


def rewritten(gm: fx.GraphModule, apply: bool = True) -> tuple:
    """(a copy of ``gm`` with each LM head and loss that qualifies computed by
    ``comfuse::linear_cross_entropy``, one line per head found) or (``gm``, the lines) where
    none is rewritten: none qualifies, ``apply`` is False, or the logits are wanted elsewhere
    (a notice says so once). The copy shares ``gm``'s parameters and buffers."""
    found = [f for f in map(_candidate, gm.graph.nodes) if f is not None]
    notes = [_note(f) for f in found]
    for f in found:
        if f["shared"] and apply:
            notice_once("lm-logits-kept", f"comfuse: {_note(f)}")
    if not any(not f["shared"] for f in found) or not apply:
        return gm, notes
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for ce in list(graph.nodes):
        found = _candidate(ce)
        if found is None or found["shared"]:
            continue
        with graph.inserting_before(ce):
            h, w, b = (graph.call_method("to", (x, found["computed"])) if cast else x
                       for x, cast in zip((found["h"], found["w"], found["b"]), found["cast"]))
            for index in found["indices"]:
                h = graph.call_function(operator.getitem, (h, index))
            h = graph.call_method("reshape", (h, -1, found["hidden"]))
            call = graph.call_function(torch.ops.comfuse.linear_cross_entropy.default,
                                       (h, w, b, found["target"], found["ignore_index"], found["reduction"],
                                        found["dtype"], found["need"]))
            loss = graph.call_function(operator.getitem, (call, 0))
        ce.replace_all_uses_with(loss)
        for node in [ce] + found["chain"]:  # (each used only by the one before it)
            graph.erase_node(node)
    for note in notes:
        log.info("backend: %s", note)
    graph.lint()
    return fx.GraphModule(gm, graph), notes
