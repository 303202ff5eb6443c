"""A fused region as a kernel Inductor launches itself.

In a graph Inductor lowers, a ``comfuse::region`` call is an extern kernel: Inductor's wrapper
calls the operator through the dispatcher, and comfuse's Python launches the kernel. Where the
region's kernel is a plain Triton kernel of one launch, ``launch_from_inductor`` replaces the
call by Inductor's own node for a user-defined Triton kernel
(``triton_kernel_wrapper_functional``): its outputs are ``empty_strided`` buffers, its
tensor arguments the region's inputs, its sizes, strides and compile-time arguments constants.
Inductor copies the kernel's source into the module it generates and launches it as it
launches its own kernels, so a fused region costs one kernel launch of host time, and CUDA
graphs capture it.

A cooperative strip's scratch becomes buffers of the graph, fresh each call: its workspace
uninitialised, its arrival counters zero (the strip barrier counts generations, so zero is a
start like any multiple of the members); its grid, capped at the strips that can be resident
at once, is fixed when the region is tuned.

A split plan is two kernel nodes: the slices' kernel, writing the outputs over the whole
width and per-slice statistics into a buffer of the graph, then the combine kernel, which
reads them (each node's written tensors are the next one's inputs).

Not launched this way (``why_not_launched`` says why; the region op runs them): the Gluon
kernels (Inductor compiles user kernels as Triton), plans on persistent grids, TMA plans,
chains, COMFUSE_CHECK (every launch compared in Python), and regions not yet checked on the
GPU.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
import triton

from . import settings as settings_mod
from .planner.cost import gemm_ms
from .planner.gluon import GLUON_SCHEDULES
from .runtime import tuning
from .runtime.operands import operand3, prepare
from .runtime.region import FusedRegion

# the Triton schedules Inductor's wrapper launches: one kernel, or (split) the slices' kernel
# then the combine kernel, each a kernel node of the graph, the second reading what the first
# wrote
LAUNCHED = ("tile", "row_in_cta", "cooperative", "split")


def why_plan_not_launched(plan) -> str:
    """'' where Inductor's wrapper could launch ``plan``'s kernel (known before it is built),
    else the reason it could not."""
    if plan.schedule in GLUON_SCHEDULES:
        return "a Gluon kernel (Inductor compiles user kernels as Triton)"
    if plan.schedule not in LAUNCHED or getattr(plan.form, "persistent", False):
        return f"a {plan.schedule} plan runs on a persistent grid"
    if plan.mainloop == "tma":
        return "the plan's kernel takes TMA descriptors"
    return ""


# a region whose GEMM alone takes at least this long (at the H200's measured rate) keeps every
# candidate inside Inductor's compilation: the operator's host time (tens of microseconds a
# call) is then a few percent of the kernel's and overlaps it, while the warp-specialised and
# TMA plans it would drop are the fast ones at such sizes (an LM head with its loss: the
# pointer-loaded split plans ran 2.63 ms where the unfused ops took 1.76, H100, 2026-12-05)
HEAVY_MS = 0.5


def heavy(region) -> bool:
    """Whether ``region``'s GEMM is long enough that how its kernel is launched does not matter."""
    return gemm_ms(region) >= HEAVY_MS


def launchable(plans: list, region) -> list:
    """``plans`` (a fused region's candidates) narrowed to those Inductor's wrapper can launch,
    for autotuning inside Inductor's compilation: a plan launched through the
    ``comfuse::region`` operator costs Python and dispatcher time at each call, which a
    region's saving (microseconds) does not pay for, and the Gluon plans take the longest to
    compile. All of ``plans`` where none is launchable, for a region that saves a
    vocabulary-sized intermediate (kept fused for memory, where the fastest plan matters more
    than its launch), and for a ``heavy`` one."""
    if tuning.saves_memory(region) or heavy(region):
        return list(plans)
    kept = [p for p in plans if not why_plan_not_launched(p)]
    return kept or list(plans)


def launched_by_inductor(module) -> bool:
    """Whether every candidate plan of ``module`` is one Inductor's wrapper would launch: its
    call then costs one launch of host time whichever plan wins, so autotuning compares the
    plans' and the unfused ops' GPU time (CUDA-graph replays), not comfuse's Python launch
    path, which the graph never takes."""
    return isinstance(module, FusedRegion) and bool(module.alternatives) and not any(
        why_plan_not_launched(p) for p in module.alternatives)


def keep_launchable(module) -> None:
    """A fused region's candidates narrowed by ``launchable``, in place."""
    if not isinstance(module, FusedRegion):
        return
    plans = launchable(module.alternatives, module.region)
    if len(plans) < len(module.alternatives):
        tuning.log.info("region at %s: %d of %d candidate plans are launched by Inductor; only those are timed",
                        module.report.anchor, len(plans), len(module.alternatives))
        module.alternatives = plans


def why_not_launched(module, device: torch.device) -> str:
    """'' where Inductor can launch ``module``'s kernel itself, else the reason it cannot."""
    if not isinstance(module, FusedRegion):
        return "a chain runs through the region operator"
    if device.type != "cuda":
        return "Inductor launches Triton kernels on CUDA tensors only"
    settings = settings_mod.get()
    if settings.disable:
        return "COMFUSE_DISABLE runs regions unfused"
    if settings.check:
        return "COMFUSE_CHECK compares every launch with the reference in Python"
    if module.failed or module.prefer_unfused:
        return "the region runs its ops"
    why = why_plan_not_launched(module.plan)  # (module.kernel is the plan's)
    if why:
        return why
    if device not in module.tuned and device not in module.validated:
        return "the region was not yet run on this GPU (its first call checks it)"
    return ""


@functools.cache
def _with_launch_options(fn, num_warps: int, num_stages: int):
    """``fn`` with its warps and pipeline stages fixed: Inductor takes them from a kernel's
    autotuning configurations only (one configuration: nothing is timed)."""
    return triton.autotune(configs=[triton.Config({}, num_warps=num_warps, num_stages=num_stages)], key=[])(fn)


def _pointer(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``view`` starts where ``base`` does in the same storage (the kernel then takes
    ``base``'s buffer with ``view``'s strides)."""
    return torch._C._is_alias_of(view, base) and view.storage_offset() == base.storage_offset()


def inductor_strides(value) -> tuple | None:
    """The strides Inductor gives a buffer computed inside a graph with ``value``'s shape,
    dtype and stride order, where its comprehensive padding changes them (on a GPU: each
    stride above ``padding_stride_threshold`` elements rounded up to a multiple of
    ``padding_alignment_bytes``); None where the buffer keeps ``value``'s strides."""
    from torch._inductor import config
    if not isinstance(value, torch.Tensor) or value.device.type != "cuda" or not config.comprehensive_padding \
            or any(not isinstance(x, int) or x == 0 for x in (*value.shape, *value.stride())) \
            or not _dense(tuple(value.shape), tuple(value.stride())):
        return None  # (symbolic, empty, broadcast or sliced: not a whole buffer's layout)
    strides = padded_strides(tuple(value.shape), tuple(value.stride()), value.element_size())
    return strides if strides != tuple(value.stride()) else None


def _dense(shape: tuple, strides: tuple) -> bool:
    """Whether the strides walk every element once, in some order, with no gap."""
    expected = 1
    for d in sorted(range(len(shape)), key=lambda d: (strides[d], shape[d])):
        if shape[d] != 1:
            if strides[d] != expected:
                return False
            expected *= shape[d]
    return True


def padded_strides(shape: tuple, strides: tuple, itemsize: int) -> tuple:
    """Dense strides in the order of ``strides`` (innermost first by size of stride), each
    above Inductor's ``padding_stride_threshold`` rounded up to ``padding_alignment_bytes``."""
    from torch._inductor import config
    if len(shape) < 2:
        return tuple(strides)
    align = config.padding_alignment_bytes // itemsize
    order = sorted(range(len(shape)), key=lambda d: (strides[d], shape[d]))
    out = [0] * len(shape)
    out[order[0]] = 1
    for prev, d in zip(order, order[1:]):
        stride = out[prev] * shape[prev]
        out[d] = -(-stride // align) * align if stride > config.padding_stride_threshold else stride
    return tuple(out)


VIEWS = ("permute", "t", "transpose", "view", "_unsafe_view", "reshape", "alias")  # (aten ops, by name)
FIXED_LAYOUTS = ("mm", "bmm", "addmm", "baddbmm")  # Inductor lays their outputs out itself, unpadded


def _op_name(node: fx.Node) -> str:
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet, "__name__", "") if node.op == "call_function" else ""


def padded_by_inductor(node) -> tuple | None:
    """The padded strides (``inductor_strides``) where ``node``'s value is (a view of) a buffer
    that Inductor computes in the graph and lays out with padded rows, else None. Not a graph
    input or output, which keep their strides (a conservative guess for a training forward's
    saved tensors, which Inductor may pad), nor a GEMM's output or a region's, whose layout is
    fixed."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return None
    base = node
    while _op_name(base) in VIEWS and isinstance(base.args[0], fx.Node):
        if any(u.op == "output" for u in base.users):
            return None
        base = base.args[0]
    if base.op != "call_function" or base.target is operator.getitem or _op_name(base) in FIXED_LAYOUTS \
            or any(u.op == "output" for u in base.users):
        return None
    return inductor_strides(node.meta.get("val"))


def launch_from_inductor(graph: fx.Graph, call: fx.Node, module, ext_nodes: list) -> str:
    """Replace the region call ``call`` (its outputs read by ``getitem``) by a user-defined
    Triton kernel node that Inductor launches; '' when done, else the reason it was not (the
    graph is then unchanged). ``ext_nodes``: the region's arguments in their own order.
    Not where an operand is a buffer Inductor pads for alignment: the kernel takes its
    strides as constants, so Inductor would copy the buffer to the strides the kernel was
    built for before each launch (BERT's decoder weight gradient: a 1.27 ms copy of its
    [16384, 30522] operand, on the H200, 2026-12-04, bench/results/2026-12-04-h200-models-profiles/),
    while the region operator takes it as laid out."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional
    if not isinstance(module, FusedRegion):
        return why_not_launched(module, torch.device("cpu"))
    if module.saves_padded:
        return "it saves a padded product whole, whose padded columns the operator zeroes with a launch of its own"
    padded = next((n for n in ext_nodes if padded_by_inductor(n) is not None), None)
    if padded is not None:
        return f"Inductor pads the rows of {padded.name} for alignment; the operator takes them as laid out"
    vals = [n.meta.get("val") if isinstance(n, fx.Node) else n for n in ext_nodes]
    a, b = vals[module.operands[0]], vals[module.operands[1]]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return "the operands carry no shapes"
    why = why_not_launched(module, a.device)
    if why:
        return why
    kernel, region, device = module.kernel, module.region, a.device
    # the graph tensors a launch argument may start at: (fake value, node)
    bases = [(vals[i], ext_nodes[i]) for i in range(len(vals)) if isinstance(vals[i], torch.Tensor)]
    a3, b3 = operand3(a, region.gemm.batched), operand3(b, region.gemm.batched)
    ins = [prepare(vals[bind.ext], bind, device) for bind in module.cand_inputs] + module.second_b(vals)
    with a.fake_mode:
        results = module.empty_outputs(device)
    outs = [r.view(canon) for r, (canon, _) in zip(results, module.canon_outs)]
    if kernel.plan.transposed:
        a3, b3, ins, outs = (b3.transpose(1, 2), a3.transpose(1, 2), [t.transpose(1, 2) for t in ins],
                             [t.transpose(1, 2) for t in outs])
    launches = kernel.launches(a3, b3, ins, outs)
    roles = {p.name: p.role for p in kernel.source.params}
    made = []  # every node added, erased (newest first) if a launch cannot be made

    def give_up(why: str) -> str:
        for node in reversed(made):
            graph.erase_node(node)
        return why
    with graph.inserting_before(call):
        empties = []
        for r in results:
            node = graph.call_function(torch.ops.aten.empty_strided.default, (list(r.shape), list(r.stride())),
                                       {"dtype": r.dtype, "device": device})
            node.meta["val"] = r
            empties.append(node)
            made.append(node)
        latest = {}  # a written argument's name -> the node holding its contents so far
        output_of = {}  # an output's index -> the name it is written under
        for fn, grid, args, options in launches:
            tensors, constants, written = {}, {}, []
            for name, value in zip(fn.arg_names, args):
                if not isinstance(value, torch.Tensor):
                    constants[name] = value
                    continue
                scratch = roles.get(name) in ("workspace", "counters")
                out = None if scratch else next((j for j, r in enumerate(results) if _pointer(value, r)), None)
                if scratch or out is not None:
                    if name not in latest:
                        # a cooperative strip's scratch, fresh each call: the workspace
                        # uninitialised, the arrival counters zero (its barrier counts
                        # generations, so any multiple of the members is a start, zero among
                        # them); a split plan's statistics, written by its first launch
                        latest[name] = _scratch_node(graph, value, roles[name] == "counters", a.fake_mode) \
                            if scratch else empties[out]
                        if scratch:
                            made.append(latest[name])
                    tensors[name] = latest[name]
                    written.append((name, out))
                    if out is not None:
                        output_of[out] = name
                    continue
                node = next((n for v, n in bases if _pointer(value, v)), None)
                if node is None:  # (a side input made anew, not a view: the region op passes it)
                    return give_up("a kernel argument is not a view of a graph tensor")
                tensors[name] = node
            constants.update({n: options[n] for n in fn.arg_names[len(args):]})
            launch = graph.call_function(triton_kernel_wrapper_functional, (), dict(
                kernel_idx=kernel_side_table.add_kernel(
                    _with_launch_options(fn, options["num_warps"], options["num_stages"])),
                constant_args_idx=kernel_side_table.add_constant_args(constants),
                grid=[tuple((*grid, 1, 1)[:3])], tma_descriptor_metadata={}, kwargs=tensors,
                tensors_to_clone=[name for name, _ in written]))
            made.append(launch)
            launch.meta["val"] = {name: (results[j] if j is not None else tensors[name].meta["val"])
                                  for name, j in written}
            # the kernel takes its tensors' strides as constants: Inductor must hand it buffers
            # with exactly these strides (copying one it laid out otherwise, rows padded for
            # alignment, say), not only in this order, as it does for a traced user kernel
            # (recorded as Dynamo records it for a traced kernel: the node's arguments, each node
            # its value and anything else None, in fx's immutable containers, which Inductor's
            # own rewrites of the node compare structure with; plain dicts there fail its lowering)
            launch.meta["eager_input_vals"] = fx.node.map_aggregate(
                (launch.args, launch.kwargs), lambda v: v.meta.get("val") if isinstance(v, fx.Node) else None)
            for name, _ in written:  # (what a later launch, or the region's reader, takes)
                got = graph.call_function(operator.getitem, (launch, name))
                got.meta["val"] = launch.meta["val"][name]
                made.append(got)
                latest[name] = got
        for user in list(call.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                return give_up("a region call's outputs are read other than by index")
        for user in list(call.users):
            user.replace_all_uses_with(latest[output_of[user.args[1]]])
            graph.erase_node(user)
    for node in reversed(made):  # (scratch read by no later launch)
        if node.target is operator.getitem and not node.users:
            graph.erase_node(node)
    graph.erase_node(call)
    return ""


def _scratch_node(graph: fx.Graph, value: torch.Tensor, zero: bool, fake_mode) -> fx.Node:
    """A graph buffer shaped like the scratch tensor ``value``: zeros (arrival counters) or
    uninitialised (a workspace)."""
    size, dtype, device = list(value.shape), value.dtype, value.device
    if zero:
        node = graph.call_function(torch.ops.aten.full.default, (size, 0),
                                   {"dtype": dtype, "layout": torch.strided, "device": device, "pin_memory": False})
    else:
        node = graph.call_function(torch.ops.aten.empty_strided.default, (size, list(value.stride())),
                                   {"dtype": dtype, "device": device})
    with fake_mode:
        node.meta["val"] = torch.zeros(size, dtype=dtype, device=device) if zero else \
            torch.empty_strided(size, value.stride(), dtype=dtype, device=device)
    return node
