"""``torch.compile(model, backend="comfuse")``.

Dynamo hands the backend a graph of torch calls; the backend hands it to Inductor
(``compile_fx``) as Inductor's own backend would, with one addition: comfuse's post-grad pass
(inductor_pass.py), which Inductor runs on every graph it lowers (the forward, the backward
at the first backward, or the inference graph) and which replaces each region that fuses with
one call of the ``comfuse::region`` operator (region_op.py). The backward is Inductor's, and
Inductor fuses everything around a region. On a GPU a graph that keeps fused regions is timed
against Inductor's compilation without them at its first call, and the faster is kept
(graph_check.py); any failure in comfuse's part leaves Inductor's code running.

``mode`` (``torch.compile(..., mode=...)``, or the option ``mode`` beside others: torch.compile
takes a mode or options, not both) is Inductor's for the code around the regions: "default",
"reduce-overhead" (CUDA graphs), "max-autotune" (with CUDA graphs) or
"max-autotune-no-cudagraphs". Where a mode runs the graph as CUDA-graph replays, comfuse's
autotuning times its candidates as graph replays too (COMFUSE_TUNE_TIMING=graph, unless that
variable is set).

Options (``torch.compile(..., options={...})``): ``mode`` (above), ``disable`` ("gemm_epilogue",
"b2b" or both, comma-separated), and the settings ``schedule``, ``fuel``, ``autotune``,
``graph_check`` (the same values as their ``COMFUSE_*`` variables).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.fx as fx

from . import settings as settings_mod
from . import verdicts
from .attention_masks import dense_masks_pay, with_dense_attention_masks
from .errors import fallback, notice_once
from .report import Report
from .graph_check import (GRAPH_CHECKS, backward_checked, checks_graph, faster_graph,  # noqa: F401  (GRAPH_CHECKS:
                          later_compilation, standalone_margin, training_call)  # for inspection)
from .inductor_pass import REPORTS, RegionPass, settings_text, symbolic  # noqa: F401  (REPORTS: for inspection)

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
SETTINGS = ("schedule", "fuel", "autotune", "graph_check")  # the settings a backend option may set


def _inductor_config(mode: str | None) -> dict:
    """Inductor's configuration for a torch.compile ``mode`` (what its own backend applies)."""
    mode = mode or "default"
    if mode not in MODES:
        raise ValueError(f"comfuse backend: unknown mode {mode!r}; modes are {', '.join(MODES)}")
    from torch._inductor import list_mode_options
    return dict(list_mode_options(mode))


def _options(options: dict | None, mode: str | None = None) -> dict:
    options = dict(options or {})
    if mode is not None and options.get("mode", mode) != mode:
        raise ValueError(f"comfuse backend: mode {mode!r} and the option mode={options['mode']!r} disagree")
    mode = options.pop("mode", mode)
    inductor = _inductor_config(mode)
    known = {"disable"} | set(SETTINGS)  # (mode: taken above)
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"comfuse backend: unknown options {sorted(unknown)}; known: {sorted(known)}")
    kinds = options.get("disable", "")
    if isinstance(kinds, str):
        kinds = [k for k in kinds.split(",") if k]
    bad = set(kinds) - {"gemm_epilogue", "b2b"}
    if bad:
        raise ValueError(f"comfuse backend: cannot disable {sorted(bad)}; kinds are gemm_epilogue, b2b")
    overrides = {name: settings_mod.coerce(name, options[name]) for name in SETTINGS if name in options}
    cudagraphs = bool(inductor.get("triton.cudagraphs"))  # (the regions will run as graph replays)
    if cudagraphs and not settings_mod.chosen("tune_timing"):
        overrides["tune_timing"] = "graph"
    return {"kinds": set(kinds), "settings": overrides, "inductor": inductor, "cudagraphs": cudagraphs}


def _inductor(gm: fx.GraphModule, example_inputs, opts: dict):
    """Inductor's compilation of ``gm`` in the backend's mode."""
    from torch._inductor.compile_fx import compile_fx
    patches = opts.get("inductor")
    return compile_fx(gm, example_inputs, config_patches=patches) if patches else compile_fx(gm, example_inputs)


def _dense_masks(gm: fx.GraphModule, example_inputs):
    """(the graph Inductor compiles with comfuse's pass, the notes of its masks given a dense
    last dimension, the graph Inductor compiles without comfuse's changes: the baseline of
    the whole-graph check and of a verdict for Inductor's code). Where the dense masks were
    timed alone (``dense_masks_pay``), the graph keeps them only where they paid and the
    baseline has them too, so the whole-graph check judges the regions alone; where they
    could not be, the baseline is ``gm`` as given and the whole graph is timed."""
    try:  # (masks laid out so that PyTorch's fused attention kernels may take them)
        dense, masks = with_dense_attention_masks(gm)
    except Exception as e:
        fallback("backend: giving an attention mask a dense last dimension", e, "the mask is passed as it was")
        return gm, [], gm
    if not masks or not checks_graph(gm, example_inputs):
        return dense, masks, gm
    try:
        pays = dense_masks_pay(gm, training_call(example_inputs))
    except Exception as e:
        fallback("backend: timing the attention with dense masks alone", e, "the whole graph is timed instead")
        return dense, masks, gm
    if pays is None:
        return dense, masks, gm
    return (dense, masks, with_dense_attention_masks(gm, quiet=True)[0]) if pays else (gm, [], gm)


def _fused_so_far(regions: RegionPass):
    """For the whole-graph check: the regions ``regions`` has kept fused so far, or None
    while the pass has lowered no graph after the forward (a backward from Inductor's cache)."""
    forward_calls = regions.calls
    return lambda: regions.fused if regions.calls > forward_calls else None


def _standalone(regions: RegionPass):
    """For the whole-graph check's prediction: the ``standalone_margin`` of the regions the
    graphs lowered so far (the forward, or the inference graph) keep fused."""
    kept = [m for lowered in regions.lowered if lowered.gm is not None for m in lowered.modules]
    return lambda: standalone_margin(kept)


def comfuse_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None,
                    passes: list | None = None):
    """The torch.compile backend: Inductor compiles the graph (in ``mode``, torch.compile's),
    with comfuse's pass fusing regions in each graph it lowers. ``passes``: a list that gets
    the graph's RegionPass, whose reports grow as Inductor lowers the forward and, at the
    first backward, the backward (comfuse.compile and explain read them; a graph with
    dynamic shapes adds none)."""
    opts = _options(options, mode)
    quiet_library_logging()  # (for the graphs Dynamo traces from now on)
    given = gm  # (Dynamo's graph as given)
    with settings_mod.override(**opts["settings"]):
        gm, masks, baseline = _dense_masks(gm, example_inputs)
    if passes is not None and masks:  # (explain lists them)
        passes.append(GraphRewrites([Report(function="Dynamo's graph", regions=[], notes=masks)]))
    key = _graph_key(gm, opts)
    if symbolic(example_inputs):  # (where the frame's static graph kept Inductor's code: the graph as given)
        settled = VERDICTS.get(key) is False
        return PerShape(baseline if settled else gm, example_inputs, opts, settled=settled)
    # (a caller that reads the regions' reports gets every graph lowered: no stored verdict)
    stored = _stored_key(gm, example_inputs, opts) if passes is None else None
    record = verdicts.load(stored)
    if record is not None and record["kept"] == verdicts.INDUCTOR:
        _remember(key, verdicts.INDUCTOR)
        return _inductor(baseline, example_inputs, opts)  # (as the first call's check compiled it: caches answer)
    compiled, regions = _compile_with_regions(gm, example_inputs, opts, passes=passes, cacheable=passes is None)
    if compiled is None:
        return _inductor(baseline, example_inputs, opts)
    if record is not None and (not regions.calls or regions.fused == record.get("forward_fused")):
        # as decided before, in this process or an earlier one (Inductor's caches may have
        # answered for the graph: the pass then lowered nothing)
        _remember(key, record["kept"])
        return compiled
    on_choice = functools.partial(_decided, key, stored, regions.fused)
    # Inductor's compilation of the graph without regions, to time against the fused one
    plain = later_compilation(lambda: _inductor(baseline, list(example_inputs), opts))
    if not regions.calls and passes is None:
        # Inductor's caches answered for a graph whose verdict is not stored (lost, or
        # written by no process): what it fuses is not known here, so it is checked whole
        with settings_mod.override(**opts["settings"]):
            return faster_graph(gm, example_inputs, compiled, 1, False, plain, on_choice=on_choice,
                                cudagraphs=opts["cudagraphs"])
    if masks and baseline is given and not regions.fused:  # (differs from Dynamo's in masks not timed alone)
        with settings_mod.override(**opts["settings"]):
            return faster_graph(gm, example_inputs, compiled, 0, False, plain, on_choice=on_choice,
                                kept_now=lambda: regions.fused, cudagraphs=opts["cudagraphs"])
    if not regions.fused:  # (nothing fused in the forward: the graph is Inductor's, its backward aside)
        with settings_mod.override(**opts["settings"]):
            return backward_checked(gm, example_inputs, compiled, regions, plain, on_choice=on_choice)
    with settings_mod.override(**opts["settings"]):
        return faster_graph(gm, example_inputs, compiled, regions.fused, regions.saves_memory, plain,
                            on_choice=on_choice, fused_so_far=_fused_so_far(regions), cudagraphs=opts["cudagraphs"],
                            standalone=_standalone(regions))


@dataclasses.dataclass
class GraphRewrites:
    """What the backend changed in Dynamo's graph before Inductor (attention masks), as a
    report without regions, for the callers that collect the graphs' reports."""
    reports: list
    lowered: list = dataclasses.field(default_factory=list)  # (as a RegionPass's: no regions)


# What the backend kept for a graph at its first, static sizes, by the graph's frame and
# tensor ops: True, comfuse's fused code; False, Inductor's. When a size changes, Dynamo
# compiles the frame again with dynamic sizes; where Inductor's code was kept, the new graph
# runs Inductor's dynamic code (as under Inductor alone) rather than a compilation with
# regions, and then Inductor's, at each new size.
VERDICTS: dict = {}


def _remember(key, kept: str) -> None:
    if key is not None:
        VERDICTS[key] = kept == verdicts.FUSED


def _decided(key, stored, forward_fused: int, kept: str) -> None:
    """A graph's first call chose ``kept`` (verdicts.KINDS): remembered for this process's
    later sizes and, under ``stored``, for later processes."""
    _remember(key, kept)
    verdicts.store(stored, kept, forward_fused=forward_fused)


def _stored_key(gm: fx.GraphModule, example_inputs, opts: dict):
    """The key of the graph's verdict on disk (verdicts.py); None for a graph traced on fake
    tensors (no first call decides it, and its compilations belong to the tracer's fake mode)."""
    from torch._subclasses.fake_tensor import FakeTensor
    if any(isinstance(t, FakeTensor) for t in example_inputs):
        return None
    with settings_mod.override(**opts["settings"]):
        chosen = settings_text()
    return verdicts.key(gm, example_inputs, chosen, repr((sorted(opts["kinds"]), sorted(opts["inductor"].items()))))


def _graph_key(gm: fx.GraphModule, opts: dict):
    """(Dynamo's frame, grad mode, the graph's tensor ops, the settings): equal for a frame's
    graph at static and at dynamic sizes, which differ only in the size arithmetic between
    the ops; None outside a Dynamo compilation. (Grad mode: a frame's training and inference
    graphs have the same ops and fuse differently.)"""
    frame = getattr(torch._guards.CompileContext.current_compile_id(), "frame_id", None)
    if frame is None:
        return None
    ops = tuple((n.op, getattr(n.target, "__qualname__", str(n.target))) for n in gm.graph.nodes
                if n.op in ("call_function", "call_method", "call_module")
                and isinstance(n.meta.get("example_value"), torch.Tensor))
    with settings_mod.override(**opts["settings"]):
        chosen = settings_text()
    return (frame, torch.is_grad_enabled(), ops, chosen, repr(sorted(opts["kinds"])),
            repr(sorted(opts["inductor"].items())))


def _compile_with_regions(gm: fx.GraphModule, example_inputs, opts: dict, shapes: str = "", own: bool = False,
                          passes: list | None = None, cacheable: bool = False):
    """(Inductor's compilation of ``gm`` with comfuse's pass fusing regions in each graph it
    lowers, the pass), or (None, None) when Inductor fails with the pass in (with a warning;
    COMFUSE_STRICT=1 raises): the caller then compiles the graph without it. ``own``: a
    compilation of its own, not inside Dynamo's (PerShape, at a call); ``passes``: gets the
    pass; ``cacheable``: Inductor's disk caches may answer for the graph (the pass then
    lowers nothing: the caller must know what the graph keeps)."""
    regions = RegionPass(opts["kinds"], opts["settings"], cacheable=cacheable)
    if passes is not None:
        passes.append(regions)
    patches = dict(opts.get("inductor") or {}, post_grad_custom_post_pass=regions)
    if hasattr(torch._inductor.config, "static_launch_user_defined_triton_kernels"):
        # a region's kernel through Inductor's static launcher: 21.8 against 28.1 us of host time
        # a launch (H100, bench/results/2026-12-05-h100-lm-head-logits/launch.jsonl)
        patches["static_launch_user_defined_triton_kernels"] = True
    try:
        with (torch._guards.tracing(None) if own else contextlib.nullcontext()):
            from torch._inductor.compile_fx import compile_fx
            inputs = list(example_inputs) if own else example_inputs
            return compile_fx(gm, inputs, config_patches=patches), regions
    except torch._dynamo.exc.RestartAnalysis:
        raise  # (Dynamo's signal to trace the frame again, not a failure)
    except Exception as e:
        fallback(f"backend: Inductor could not compile the graph with comfuse's regions{shapes}", e,
                 "Inductor's code runs without fused regions", stacklevel=3)
        return None, None


class PerShape:
    """A graph Dynamo hands over with dynamic shapes (a batch or sequence length changed
    once already), run as static graphs: comfuse's kernels are specialised to their sizes,
    so each distinct signature (shapes, strides, dtypes, the values of size arguments and
    of 0-d tensors read by ``.item()``, grad mode) is lowered and compiled by itself on its
    first call, and kept. Inductor's dynamic compilation of the whole graph, built once
    now, runs the signatures beyond COMFUSE_MAX_SPECIALIZATIONS and any that fail to lower:
    recompiles stay bounded and a new length never costs correctness. Where a signature
    fuses nothing (autotuning left every region to Inductor), later ones run that dynamic
    code too, as under Inductor alone, without a compilation each. (Where Inductor cannot
    compile the graph with symbolic sizes, every signature is compiled with concrete ones.)"""

    def __init__(self, gm: fx.GraphModule, example_inputs, opts: dict, settled: bool = False):
        self.gm, self.opts = gm, opts
        # inputs read by ``.item()``: their values join the signature
        self.scalars = frozenset(i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
                                 if any(u.op == "call_method" and u.target == "item" for u in n.users))
        self.dynamic = self._dynamic(example_inputs)
        self.compiled: dict = {}
        self.reports: dict = {}  # signature -> comfuse's report of its graph (None: nothing fused)
        self.regionless = False  # the graph has no GEMM regions at all: every shape runs Inductor's code
        # a shape fused nothing, or its graph kept Inductor's code (here or, at the frame's
        # static sizes, in VERDICTS): new shapes run Inductor's dynamic code
        self.settled = settled

    def _dynamic(self, example_inputs):
        """Inductor's dynamic compilation of the graph, or None where Inductor fails on its
        symbolic sizes (torch 2.11 asserts in its tiling analysis on a ViT whose position
        embeddings are interpolated to a new image size; Inductor alone crashes there):
        each signature is then compiled with its concrete sizes, and beyond the limit run
        eagerly."""
        try:
            return _inductor(self.gm, example_inputs, self.opts)
        except torch._dynamo.exc.RestartAnalysis:
            raise  # (Dynamo's signal to trace the frame again, not a failure)
        except Exception as e:
            fallback("backend: Inductor could not compile the graph with dynamic shapes", e,
                     "each new shape is compiled by itself", stacklevel=4)
            return None

    def __call__(self, *args):
        key = _shape_key(args, self.scalars)
        fn = self.compiled.get(key)
        if fn is None and (self.regionless or self.settled) and self.dynamic is not None:
            return self.dynamic(*args)
        if fn is None:
            limit = settings_mod.get().max_specializations
            if len(self.compiled) >= limit:
                instead = "Inductor's dynamic code" if self.dynamic is not None else "eagerly"
                notice_once(f"per-shape:{id(self)}", f"comfuse backend: more than {limit} input shapes "
                            f"(COMFUSE_MAX_SPECIALIZATIONS); further shapes run {instead}")
                return (self.dynamic or self.gm)(*args)
            fn = self.compiled[key] = self._build(key, args)
        return fn(*args)

    def _build(self, key, args):
        gm = _fix_scalars(self.gm, args, self.scalars)
        compiled, regions = (None, None) if self.regionless else \
            _compile_with_regions(gm, args, self.opts, " for its new shapes", own=True)
        if compiled is None:
            self.reports[key] = None
            return self.dynamic or self._static(gm, args)
        self.reports[key] = regions.reports[0] if regions.reports else None
        if not regions.found:
            self.regionless = True  # (no GEMM region in the forward: no shape will fuse one)
            return self.dynamic or compiled
        if not regions.fused:
            self.settled = True  # (found, none fused at this shape: the next shapes are not lowered)
            with settings_mod.override(**self.opts["settings"]):
                return backward_checked(self.gm, args, compiled, regions, lambda: self.dynamic or self._static(gm, args))
        with settings_mod.override(**self.opts["settings"]):
            return faster_graph(self.gm, args, compiled, regions.fused, regions.saves_memory,
                                lambda: self._static(gm, args), plain=self.dynamic, on_choice=self._chose,
                                fused_so_far=_fused_so_far(regions), cudagraphs=self.opts["cudagraphs"],
                                standalone=_standalone(regions))

    def _chose(self, kept: str) -> None:
        if kept != verdicts.FUSED:
            self.settled = True  # (Inductor's code won at this shape: the next are not lowered)

    def _static(self, gm: fx.GraphModule, args):
        """Inductor's compilation of ``gm`` at these sizes, without regions (or, where that
        fails too, the graph run eagerly, with a warning)."""
        try:
            with torch._guards.tracing(None):  # (a compilation of its own, as the regions')
                return _inductor(gm, list(args), self.opts)
        except Exception as e:
            fallback("backend: Inductor could not compile the graph for its new shapes", e,
                     "the graph runs eagerly", stacklevel=4)
            return gm


def _shape_key(args, scalars: frozenset) -> tuple:
    key = [torch.is_grad_enabled()]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad,
                        a.item() if i in scalars else None))
        else:
            key.append(a)
    return tuple(key)


def _fix_scalars(gm: fx.GraphModule, args, scalars: frozenset) -> fx.GraphModule:
    """``gm`` with every ``.item()`` of the inputs ``scalars`` (0-d tensors) replaced by its
    value in ``args`` (Dynamo passes a module's float attributes, LayerNorm's eps, that way
    under dynamic shapes; capture cannot trace a data-dependent scalar). The copy shares
    gm's parameters and buffers; the input stays, unused."""
    graph = fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, (node, value) in enumerate(zip(placeholders, args)):
        if i not in scalars or not (isinstance(value, torch.Tensor) and value.numel() == 1):
            continue
        for user in list(node.users):
            if user.op == "call_method" and user.target == "item":
                user.replace_all_uses_with(value.item())
                graph.erase_node(user)
    return fx.GraphModule(gm, graph)


# the logging helpers transformers adds to logging.Logger, which its models call from inside
# their forward (GPT-2's loss_function warns when the config names no loss type)
LIBRARY_LOGGING = ("warning_once", "info_once", "warning_advice")


def quiet_library_logging() -> None:
    """Make transformers' ``Logger.warning_once`` and kin no-ops inside code Dynamo traces
    (``torch._dynamo.config.ignore_logging_functions``). Dynamo splits the graph at any
    logging call; GPT-2's loss warns from inside the model's forward, so its loss landed in
    a graph of its own, apart from the LM head whose logits it reduces, and neither Inductor
    nor comfuse could fuse them. The helpers exist once transformers is imported: this runs
    when comfuse is imported, at each graph the backend compiles, and before
    ``comfuse.compile`` and ``explain`` trace (import transformers first for the first graph
    of ``torch.compile`` to see it)."""
    import logging
    ignored = torch._dynamo.config.ignore_logging_functions
    for name in LIBRARY_LOGGING:
        fn = getattr(logging.Logger, name, None)
        if fn is not None:
            ignored.add(fn)
    _keep_metrics_logging_working()


_METRICS_PROBED = False  # Dynamo's metrics record was seen to serialise the set of functions


def _keep_metrics_logging_working() -> None:
    """Dynamo records its configuration with every compilation's metrics, sorting and
    serialising each set; torch 2.11 does not leave ``ignore_logging_functions`` out, and a set
    of functions cannot be sorted, so every compilation logged a 13-line "Unexpected exception
    logging compilation metrics" error once the set was not empty. Where that happens the
    recorder sees the set as empty (only the recorder: the tracing reads the real one)."""
    global _METRICS_PROBED
    import torch._dynamo.utils as dynamo_utils
    record = dynamo_utils._get_dynamo_config_for_logging
    if _METRICS_PROBED or getattr(record, "_comfuse_wrapped", False) \
            or not torch._dynamo.config.ignore_logging_functions:
        return  # (probed once the set holds functions: serialising the config costs time)
    try:
        record()
        _METRICS_PROBED = True
        return  # (this torch leaves the set out of its record)
    except TypeError:
        pass

    @functools.wraps(record)
    def without_ignored_functions():
        with torch._dynamo.config.patch(ignore_logging_functions=set()):
            return record()
    without_ignored_functions._comfuse_wrapped = True
    dynamo_utils._get_dynamo_config_for_logging = without_ignored_functions


def register() -> None:
    """Make ``torch.compile(..., backend="comfuse")`` find this backend."""
    from torch._dynamo import list_backends, register_backend
    quiet_library_logging()
    if "comfuse" not in list_backends(exclude_tags=()):
        register_backend(name="comfuse")(comfuse_backend)

