"""Graph surgery on a captured graph: a region's ops cut out as a graph of their own
(``extract``), every fused region replaced by one call of its module (``rewrite``), a region's
module replaced by its ops again (``inline``), views that change nothing removed."""
from __future__ import annotations

import heapq
import operator

import torch
import torch.fx as fx


def extract(gm: fx.GraphModule, cand) -> fx.GraphModule:
    """The region's original ops as a graph of their own: the unfused path."""
    members = set(cand.members)
    for m in cand.members:  # every outside value the ops read becomes an argument
        for i in m.all_input_nodes:
            if i not in members and i not in cand.externals:
                cand.externals.append(i)
    g = fx.Graph()
    env = {ext: g.placeholder(f"ext{i}") for i, ext in enumerate(cand.externals)}
    for m in cand.members:
        env[m] = g.node_copy(m, lambda n: env[n])
    g.output(tuple(env[ob.node] for ob in cand.outputs))
    return fx.GraphModule(gm, g)


def toposort(graph: fx.Graph) -> None:
    """Reorder ``graph``'s nodes so that each follows its inputs, otherwise keeping their order."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    pending = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(index[n], n) for n in nodes if pending[n] == 0 and n.op != "output"]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            pending[u] -= 1
            if pending[u] == 0 and u.op != "output":
                heapq.heappush(ready, (index[u], u))
    if len(order) != len(nodes) - 1:
        raise RuntimeError("graph has a cycle after fusion")  # a bug in region finding
    prev = order[0]
    for n in order[1:]:
        if prev.next is not n:
            prev.append(n)
        prev = n


def rewrite(gm: fx.GraphModule, fused: list) -> None:
    """Replace each (candidate, module) of ``fused`` in ``gm`` by one call of the module."""
    graph = gm.graph
    replaced: dict = {}  # outputs of regions already rewritten -> the getitem that replaced them
    for i, (cand, module) in enumerate(fused):
        name = f"comfuse_region{i}"
        gm.add_submodule(name, module)
        members = set(cand.members)
        with graph.inserting_before(cand.anchor):
            call = graph.call_module(name, tuple(replaced.get(e, e) for e in cand.externals))
            outs = [graph.call_function(operator.getitem, (call, k)) for k in range(len(cand.outputs))]
        for ob, new in zip(cand.outputs, outs):  # (shapes for whoever reads the graph next)
            if "val" in ob.node.meta:
                new.meta["val"] = ob.node.meta["val"]
        for ob, new in zip(cand.outputs, outs):
            ob.node.replace_all_uses_with(new, delete_user_cb=lambda u: u not in members)
            replaced[ob.node] = new
        for m in reversed(cand.members):
            graph.erase_node(m)
    toposort(graph)
    drop_identity_views(graph)
    graph.lint()
    gm.recompile()


def inline(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule) -> None:
    """Replace ``node`` (a call of a region module whose outputs are read by getitem) with the
    nodes of ``sub``, the region's own ops."""
    graph = gm.graph
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env = dict(zip(placeholders, node.args))
    result = None
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = fx.map_arg(n.args[0], lambda x: env[x])
                break
            if n.op == "get_attr" and not hasattr(gm, n.target):
                setattr(gm, n.target, getattr(sub, n.target))
            env[n] = graph.node_copy(n, lambda x: env[x])
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    if node.users:
        raise RuntimeError("a region's outputs are read other than by index")
    graph.erase_node(node)
    gm.delete_submodule(node.target)


_VIEWS = (torch.ops.aten.expand.default, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default)


def drop_identity_views(graph: fx.Graph) -> int:
    """Remove views that change nothing (``expand`` or ``view`` of a tensor to its own sizes,
    with its own strides), which the capture leaves around batched matmuls: each costs a
    dispatch a call. Views the graph returns stay (a caller may rely on getting a new tensor
    object). Returns how many were removed."""
    returned: set = set()
    for n in graph.nodes:
        if n.op == "output":
            fx.node.map_arg(n.args, returned.add)
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _VIEWS or node in returned:
            continue
        src = node.args[0]
        before = src.meta.get("val") if isinstance(src, fx.Node) else None
        after = node.meta.get("val")
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
            continue
        if before.shape == after.shape and before.stride() == after.stride() and before.dtype == after.dtype:
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            removed += 1
    return removed


def views_as_reshapes(graph: fx.Graph) -> int:
    """Turn every ``view`` and ``_unsafe_view`` into ``reshape``: the capture chose a view where
    its strides allowed one, and Inductor, tracing the graph again with its own decompositions,
    may give the same tensor other strides (a ``cat`` with an empty cache tensor returns the
    other input's layout), where a view fails. A reshape is a view wherever one is possible,
    and the graph is functional: nothing writes through the view. Returns how many changed."""
    changed = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (torch.ops.aten.view.default,
                                                          torch.ops.aten._unsafe_view.default):
            node.target = torch.ops.aten.reshape.default
            changed += 1
    return changed
