"""comfuse inside Inductor's compilation: a post-grad graph pass.

The backend lets Dynamo, AOTAutograd and Inductor run as they do; Inductor calls ``RegionPass``
on every graph it lowers, after AOTAutograd has split the joint graph into a forward and a
backward (or kept one inference graph). So the backward is Inductor's own, the tensors it
saves (a pre-norm sum, LayerNorm's mean and rstd) are outputs of the forward graph and
therefore extra outputs of the fused kernels, and the backward graph's own GEMMs followed by
row reductions are regions like any other.

On each graph the pass runs the pipeline (pipeline.py) on a copy, then, where regions fused,
puts the copy in the graph's place with each fused region as one ``comfuse::region`` call
(region_op.py) that Inductor schedules like any extern kernel, fusing everything around it.
Any failure leaves the graph exactly as Inductor gave it, with a warning naming the reason
(``COMFUSE_STRICT=1`` raises).
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import shutil

import torch
import torch.fx as fx
import triton
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import region_op, settings as settings_mod
from .errors import fallback
from .frontend.capture import recompose_biased_gemms
from .kernel_node import keep_launchable, launch_from_inductor, launched_by_inductor, padded_by_inductor
from .pipeline import compile_graph, fake_inputs
from .region_op import register as register_region
from .report import Report
from .rewrite import inline, views_as_reshapes
from .runtime import cache, tuning

log = logging.getLogger("comfuse.backend")
REPORTS: list = []  # the reports of the last graphs lowered, newest last (for inspection)
LAUNCH_FROM_INDUCTOR = True  # one-launch Triton kernels as Inductor's own kernel nodes (kernel_node.py)


@dataclasses.dataclass
class Lowered:
    """What ``lower`` made of a graph: ``gm``, the aten graph with every fused region replaced
    by a ``comfuse::region`` call (None when nothing fuses); ``report``, what comfuse found and
    decided; ``saves_memory``: a region kept fused avoids a huge intermediate (a loss over a
    vocabulary); ``modules``: the fused modules kept, launched by the region operator or by
    Inductor (kernel_node.py)."""
    gm: fx.GraphModule | None
    report: Report
    saves_memory: bool = False
    modules: list = dataclasses.field(default_factory=list)


def lower(gm: fx.GraphModule, example_inputs, disabled_kinds=frozenset(), tune=None, name: str = "") -> Lowered:
    """``gm`` through the pipeline, each fused region then replaced by a ``comfuse::region``
    call. ``tune(fused_gm)``: autotune the regions now (those whose unfused ops win are left
    in the graph, for Inductor to fuse with their neighbours)."""
    fused, report = compile_graph(gm, fake_inputs(example_inputs), execute=False, disabled_kinds=disabled_kinds)
    if name:
        report.function = name
    REPORTS.append(report)
    del REPORTS[:-16]
    if fused is None:
        return Lowered(None, report)
    graph = fused.graph
    if LAUNCH_FROM_INDUCTOR:
        for node in graph.nodes:
            if node.op == "call_module":
                keep_launchable(fused.get_submodule(node.target))
    if tune is not None:
        tune(fused)
    kept = []
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        module = fused.get_submodule(node.target)
        if getattr(module, "prefer_unfused", False):  # autotuning: its ops are faster left to Inductor
            inline(fused, node, module.unfused)
            continue
        kept.append(module)
        why = launch_from_inductor(graph, node, module, list(node.args)) if LAUNCH_FROM_INDUCTOR else "off"
        module.report.launch = "Inductor's wrapper launches the kernel" if not why else \
            f"through the comfuse::region operator ({why})"
        if not why:
            fused.delete_submodule(node.target)
            continue
        is_tensor = [isinstance(a, fx.Node) and not isinstance(a.meta.get("val"), (int, torch.SymInt))
                     for a in node.args]
        region_id = register_region(module, is_tensor)
        tensors = [a for a, t in zip(node.args, is_tensor) if t]
        scalars = [a for a, t in zip(node.args, is_tensor) if not t]
        with graph.inserting_before(node):
            call = graph.call_function(torch.ops.comfuse.region.default, (region_id, tensors, scalars))
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        fused.delete_submodule(node.target)  # the registry holds it; Inductor need not pickle it
    if not kept:
        return Lowered(None, report)  # autotuning left every region unfused
    recompose_biased_gemms(graph)  # (the graph goes back to Inductor: its addmm add the bias in cuBLAS)
    views_as_reshapes(graph)  # (Inductor lowers the graph with its own strides, where a view may fail)
    graph.lint()
    fused.recompile()
    return Lowered(fused, report, any(tuning.saves_memory(m.region) for m in kept if getattr(m, "region", None)), kept)


def random_like(value, strides=None):
    """A real tensor shaped like the fake ``value`` (with ``strides`` where given): normal
    floats, zero integers (valid as indices anywhere), booleans true and false at random (all
    false, a mask such as cross-entropy's ``target != ignore_index`` would zero the loss in both
    the kernel and the ops, and their comparison would check nothing), or ``value`` itself
    when it is not a tensor."""
    if not isinstance(value, torch.Tensor):
        return value
    out = torch.empty_strided(tuple(value.shape), tuple(strides or value.stride()), dtype=value.dtype,
                              device=value.device)
    if out.is_floating_point():
        out.normal_()
    elif out.dtype == torch.bool:
        out.random_(0, 2)
    else:
        out.zero_()
    return out


def tune_on_random_inputs(fused: fx.GraphModule) -> None:
    """Make each fused region of ``fused`` choose now, on random inputs of its shapes (the
    graph's own tensors are fake here): autotuned where autotuning is on (by default, on a
    GPU), else run once and checked against its own ops (COMFUSE_VALIDATE), before Inductor
    lowers the graph. A region whose ops win is inlined for Inductor to fuse with its
    neighbours (its ops are not compiled or run here), and a checked kernel can be launched
    by Inductor itself (kernel_node.py). On a GPU this also
    makes each kernel's first launch, which builds it and allocates the scratch it keeps
    (a strip's workspace and arrival counters), happen here and not inside Inductor's
    CUDA-graph warm-up, whose private memory pool must hold only the tensors it tracks.
    On a CPU only where autotuning is on (``COMFUSE_AUTOTUNE=1``); otherwise the regions
    decide at their first call. A region whose candidates Inductor's wrapper launches is
    timed by CUDA-graph replays (``launched_by_inductor``), unless COMFUSE_TUNE_TIMING says
    otherwise."""
    started = set()  # (devices whose compile workers were asked for)
    for node in fused.graph.nodes:
        if node.op != "call_module":
            continue
        vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        if not tensors or not (tensors[0].device.type == "cuda" or tuning.enabled(tensors[0].device)):
            continue
        if tensors[0].device.type == "cuda" and tuning.enabled(tensors[0].device) and tensors[0].device not in started:
            started.add(tensors[0].device)
            tuning.start_workers(tensors[0].device)  # (their start-up overlaps the unfused ops' compile)
        module = fused.get_submodule(node.target)
        timing = {"tune_timing": "graph"} if launched_by_inductor(module) and not settings_mod.chosen(
            "tune_timing") else {}
        try:
            with torch.no_grad(), settings_mod.override(**timing):
                # laid out as Inductor lays them out in the graph (rows padded for alignment):
                # the unfused ops' cuBLAS GEMMs were timed on unaligned rows otherwise, slower
                # than in the graph, and a region won alone that lost in the model
                args = draw_indices(module, [random_like(v, padded_by_inductor(a)) for a, v in zip(node.args, vals)])
                getattr(module, "choose", module)(*args)  # (the choice only: ops it prefers go back into the graph)
        except Exception as e:
            fallback(f"backend: autotuning the region at {module.report.anchor} failed", e,
                     "it decides at its first call")


def draw_indices(module, args: list) -> list:
    """``args`` with each integer input the region compares with a column or row index (its
    ``index_bounds``: a loss's targets) drawn uniformly below its bound, in place of zeros."""
    for position, bound in getattr(module, "index_bounds", {}).items():
        t = args[position]
        if isinstance(t, torch.Tensor) and bound > 0 and all(st or n < 2 for n, st in zip(t.shape, t.stride())):
            t.random_(0, bound)  # (not a broadcast view, whose elements share memory)
    return args


def symbolic(values) -> bool:
    """Whether some value is a symbolic size or a tensor with symbolic sizes or strides
    (dynamic shapes: comfuse's kernels are specialised to sizes)."""
    for v in values:
        if isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and any(
                not isinstance(s, int) for s in (*v.shape, *v.stride()))):
            return True
    return False


def _transplant(graph: fx.Graph, source: fx.GraphModule, owner: torch.nn.Module) -> None:
    """Replace ``graph``'s nodes (``owner``'s graph, which Inductor holds) by ``source``'s, in
    place; the placeholders stay, matched to ``source``'s by position, and the constants
    ``source`` reads become attributes of ``owner`` under fresh names."""
    old_inputs = [n for n in graph.nodes if n.op == "placeholder"]
    new_inputs = [n for n in source.graph.nodes if n.op == "placeholder"]
    if len(old_inputs) != len(new_inputs):
        raise RuntimeError(f"the lowered graph has {len(new_inputs)} inputs, the graph {len(old_inputs)}")
    names = {}
    for node in source.graph.nodes:
        if node.op == "get_attr" and node.target not in names:
            fresh = f"comfuse_constant{len(names)}"
            while hasattr(owner, fresh):
                fresh += "_"
            setattr(owner, fresh, getattr(source, node.target))
            names[node.target] = fresh
    for node in reversed(list(graph.nodes)):
        if node.op != "placeholder":
            graph.erase_node(node)
    env = dict(zip(new_inputs, old_inputs))
    for node in source.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            graph.output(fx.map_arg(node.args[0], lambda n: env[n]))
            break
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.op == "get_attr":
            env[node].target = names[node.target]


def _refresh_meta(gm: fx.GraphModule, values) -> None:
    """Every node's ``val`` again under the fake mode of the graph's inputs (Inductor's)."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*values)


def graph_kind(graph: fx.Graph) -> str:
    """"backward", "forward" (of a training graph) or "inference", by AOTAutograd's names
    for the inputs (torch 2.11 does not tell a post-grad pass which it is lowering)."""
    targets = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    if any(t.startswith("tangents") for t in targets):
        return "backward"
    return "forward" if any(t.startswith("primals") for t in targets) else "inference"


class RegionPass(CustomGraphPass):
    """The post-grad pass the backend hands Inductor (``post_grad_custom_post_pass``).
    ``kinds``: the kinds of fusion left out; ``settings``: comfuse settings in force while
    it runs. ``lowered`` collects each graph's Lowered record, in the order Inductor lowered
    them (the forward first; the backward at the first backward call)."""

    def __init__(self, kinds=frozenset(), settings: dict | None = None, cacheable: bool = True):
        self.kinds = frozenset(kinds)
        self.settings = dict(settings or {})
        self.cacheable = cacheable  # (False: every graph is lowered here, for its report)
        self.lowered: list = []
        self.calls = 0  # graphs Inductor handed the pass (none where its caches answered)
        self.failed = 0  # graphs it could not lower (Inductor's code runs for them)
        call_regions_directly()

    @property
    def reports(self) -> list:
        return [lowered.report for lowered in self.lowered]

    @property
    def found(self) -> int:
        """Regions found so far, fused or not."""
        return sum(len(r.regions) for r in self.reports)

    @property
    def fused(self) -> int:
        """Regions kept fused so far (in the graphs lowered until now)."""
        return sum(1 for lowered in self.lowered if lowered.gm is not None
                   for r in lowered.report.regions if r.fused)

    @property
    def saves_memory(self) -> bool:
        return any(lowered.saves_memory for lowered in self.lowered)

    def uuid(self):
        """What Inductor's FX graph and AOTAutograd caches key a graph compiled with this pass
        by: the code generator's and the libraries' versions, the pass's settings and kinds,
        and the generation of comfuse's disk cache, whose decisions it applies. None (no
        caching) where a graph holding a ``comfuse::region`` call could be stored anyway
        (``keep_region_calls_out_of_inductors_cache``)."""
        if not (self.cacheable and keep_region_calls_out_of_inductors_cache()):
            return None
        with settings_mod.override(**self.settings):
            chosen = settings_text()
            generation = cache.generation()
        return cache.digest("comfuse-region-pass", cache.CODEGEN_VERSION, cache.source_digest(), torch.__version__,
                            triton.__version__, chosen, repr(sorted(self.kinds)), str(LAUNCH_FROM_INDUCTOR),
                            generation, _gpu_text())

    def __call__(self, graph: fx.Graph) -> None:
        self.calls += 1
        owner = graph.owning_module
        values = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
        if owner is None or symbolic(values) or not any(isinstance(v, torch.Tensor) for v in values):
            return
        name = f"{graph_kind(graph)} graph {len(self.lowered)}"
        instead = "Inductor's code for this graph runs without fused regions"
        with settings_mod.override(**self.settings), tuning.inside_inductor():
            try:
                copy = fx.Graph()
                copy.output(copy.graph_copy(graph, {}))
                lowered = lower(fx.GraphModule(owner, copy), values, self.kinds, tune=tune_on_random_inputs,
                                name=name)
                self.lowered.append(lowered)
                if lowered.gm is None:
                    return
                _refresh_meta(lowered.gm, values)
                _transplant(graph, lowered.gm, owner)
                graph.lint()
            except Exception as e:
                self.failed += 1
                fallback(f"backend: comfuse could not lower {name}", e, instead, stacklevel=3)


REGION_CALL = "comfuse_region"  # how Inductor's generated code calls a region (region_op.call)
_OPERATOR = "torch.ops.comfuse.region.default"  # the operator's name in that code


def call_regions_directly() -> bool:
    """Have Inductor's generated Python call each region as ``comfuse_region(id, tensors,
    scalars)`` (region_op.call, imported in the code's header) instead of through the
    dispatcher as ``torch.ops.comfuse.region.default(...)``: the operator's layers cost 38-85
    us a call on the GPU machines' hosts, several Inductor launches (2026-12-06). False where
    this torch has no registry of custom code for extern kernels, or another registration
    holds the operator's name: the operator is called then."""
    try:
        from torch._inductor.codegen.custom_extern_kernel_codegen import CUSTOM_EXTERN_KERNEL_CODEGEN, CustomCodegen
    except ImportError:
        return False
    entry = CUSTOM_EXTERN_KERNEL_CODEGEN.setdefault(_OPERATOR, CustomCodegen(python=_direct_call))
    return getattr(entry, "python", None) is _direct_call


def _direct_call(node, writeline) -> None:
    from torch._inductor import config
    from torch._inductor.codegen.wrapper import ExternKernelAllocLine
    from torch._inductor.virtualized import V
    wrapper = getattr(writeline, "__self__", None) or V.graph.wrapper_code
    if getattr(config, "fx_wrapper", False) or getattr(config, "generate_intermediate_hooks", False):
        # (the FX wrapper converts line objects only, and the minifier's hooks follow the
        # operator's own line: the operator is called there)
        writeline(ExternKernelAllocLine(wrapper, node))
        return
    if not getattr(wrapper, "_comfuse_region_imported", False):
        wrapper.header.writeline(f"from comfuse.region_op import call as {REGION_CALL}")
        wrapper._comfuse_region_imported = True
    writeline(f"{node.get_name()} = {REGION_CALL}({', '.join(node.codegen_args())})")


def _gpu_text() -> str:
    """The current GPU and its multiprocessor count (Inductor keys its caches by the GPU's name
    only; a cooperative strip's grid is sized to the programs the GPU holds at once)."""
    if not torch.cuda.is_available():
        return "no GPU"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name}, {props.multi_processor_count} SMs"


def settings_text() -> str:
    """The settings in force that change what the pass makes of a graph (all but the log level)."""
    current = settings_mod.get()
    return repr(dataclasses.replace(current, log=""))


_GUARDED: list = []  # [whether the guard is in place], once tried
_ENTRY_GRAPHS = ("compiled_fw_func", "compiled_bw_func")  # AOTAutograd's make_entry: its compiled graphs
_CALLED = re.compile(rf"(?:\b{REGION_CALL}|{re.escape(_OPERATOR)})\((\d+),")
# (calls; not a name in a message)
_MENTIONED = re.compile(rf"\b{REGION_CALL}\(|comfuse\.region\.default\(|comfuse::region")


def called_regions(source: str) -> list | None:
    """The ids of the regions a compiled graph's code calls; None where it names the operator
    in a way these ids do not account for (another wrapper's code: C++, a boxed call)."""
    ids = [int(i) for i in _CALLED.findall(source)]
    return ids if len(_MENTIONED.findall(source)) <= len(ids) else None


_UNLOADABLE: set = set()  # keys of cached graphs that called regions this process could not load


def _cacheable(ids) -> bool:
    """Whether a graph calling regions ``ids`` (None: calls not read) may go through Inductor's
    cache: not in the CUDA-graph modes, where a loaded region would build its kernel and
    allocate its scratch at its first call, inside the warm-up's memory pool (the pass makes
    that first call before Inductor lowers the graph)."""
    return ids is not None and not (ids and torch._inductor.config.triton.cudagraphs)


def keep_region_calls_out_of_inductors_cache() -> bool:
    """Make Inductor's FX graph cache store a compiled graph whose code calls
    ``comfuse::region`` only where every region it calls is in comfuse's cache
    (region_op.STORED), and give one back only where a later process can load them all
    (otherwise it is a miss, and the graph is compiled again). The call names a region by an
    id that process's registry lacks until it loads the region. A graph kept out is left
    without a cache key, so AOTAutograd does not store an entry that points to it (where a
    torch version would make one anyway and assert on the missing key, no entry is made).
    False where this torch does not offer the hooks, or bundles compiled graphs into its
    AOTAutograd cache: the pass then asks for no caching at all."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import should_bundle_autograd_cache
        from torch._inductor.codecache import FxGraphCache
        if should_bundle_autograd_cache():
            return False
    except (ImportError, AttributeError):
        return False
    if not _GUARDED:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
        hooks = [(FxGraphCache, "_save_graph"), (AOTAutogradCache, "make_entry"), (AOTAutogradCache, "save"),
                 (FxGraphCache, "_lookup_graph")]
        entry_signature = inspect.signature(AOTAutogradCache.make_entry)
        if not all(isinstance(owner.__dict__.get(name), staticmethod) for owner, name in hooks) \
                or not set(_ENTRY_GRAPHS) <= set(entry_signature.parameters) \
                or not hasattr(FxGraphCache, "_get_tmp_dir_for_key"):
            _GUARDED.append(False)
        else:
            save_graph, make_entry, save_entry, lookup_graph = (getattr(owner, name) for owner, name in hooks)

            def _save_graph(key, compiled_graph, *args, **kwargs):
                source = getattr(compiled_graph, "source_code", None)
                ids = called_regions(source) if isinstance(source, str) else None
                if not _cacheable(ids) or not region_op.store(ids):
                    compiled_graph._fx_graph_cache_key = None  # (AOTAutograd: nothing to point to)
                    return None
                if key in _UNLOADABLE:  # (its old entry would be found first again, and missed)
                    shutil.rmtree(FxGraphCache._get_tmp_dir_for_key(key), ignore_errors=True)
                    _UNLOADABLE.discard(key)
                return save_graph(key, compiled_graph, *args, **kwargs)

            def _make_entry(*args, **kwargs):
                # Some torch versions (2.11) make an entry whether or not the compiled graphs
                # have a key, and assert that they do: no entry for a graph kept out above.
                given = entry_signature.bind_partial(*args, **kwargs).arguments
                if any(given.get(name) is not None and getattr(given[name], "_fx_graph_cache_key", None) is None
                       for name in _ENTRY_GRAPHS):
                    return None
                return make_entry(*args, **kwargs)

            def _save(key, entry, *args, **kwargs):
                return None if entry is None else save_entry(key, entry, *args, **kwargs)

            def _lookup_graph(key, *args, **kwargs):
                graph, info = lookup_graph(key, *args, **kwargs)
                if graph is None:
                    return graph, info
                try:
                    ids = called_regions(getattr(graph, "source_code", None) or "")
                    if not _cacheable(ids):
                        return None, info
                    if not region_op.loadable(ids):
                        _UNLOADABLE.add(key)
                        return None, info
                except Exception as e:  # (a miss: the graph is compiled again)
                    log.info("backend: a graph from Inductor's cache was not taken (%s)", e)
                    return None, info
                return graph, info

            FxGraphCache._save_graph = staticmethod(_save_graph)
            AOTAutogradCache.make_entry = staticmethod(_make_entry)
            AOTAutogradCache.save = staticmethod(_save)
            FxGraphCache._lookup_graph = staticmethod(_lookup_graph)
            _GUARDED.append(True)
    return _GUARDED[0]
