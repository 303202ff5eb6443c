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

import torch
import torch.fx as fx

from . import settings as settings_mod
from .errors import fallback, notice_once
from .graph_check import GRAPH_CHECKS, faster_graph  # noqa: F401  (GRAPH_CHECKS: for inspection)
from .inductor_pass import REPORTS, RegionPass, symbolic  # noqa: F401  (REPORTS: for inspection)

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


def comfuse_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None,
                    passes: list | None = None):
    """The torch.compile backend: Inductor compiles the graph (in ``mode``, torch.compile's),
    with comfuse's pass fusing regions in each graph it lowers. ``passes``: a list that gets
    the graph's RegionPass, whose reports grow as Inductor lowers the forward and, at the
    first backward, the backward (comfuse.compile and explain read them; a graph with
    dynamic shapes adds none)."""
    opts = _options(options, mode)
    quiet_library_logging()  # (for the graphs Dynamo traces from now on)
    if symbolic(example_inputs):
        return PerShape(gm, example_inputs, opts)
    compiled, regions = _compile_with_regions(gm, example_inputs, opts, passes=passes)
    if compiled is None:
        return _inductor(gm, example_inputs, opts)
    if not regions.fused:
        return compiled  # (nothing fused in the forward: the graph is Inductor's, the backward's regions aside)
    with settings_mod.override(**opts["settings"]):
        return faster_graph(gm, example_inputs, compiled, regions.fused, regions.saves_memory,
                            lambda: _inductor(gm, list(example_inputs), opts))


def _compile_with_regions(gm: fx.GraphModule, example_inputs, opts: dict, shapes: str = "", own: bool = False,
                          passes: list | None = None):
    """(Inductor's compilation of ``gm`` with comfuse's pass fusing regions in each graph it
    lowers, the pass), or (None, None) when Inductor fails with the pass in (with a warning;
    COMFUSE_STRICT=1 raises): the caller then compiles the graph without it. ``own``: a
    compilation of its own, not inside Dynamo's (PerShape, at a call); ``passes``: gets the pass."""
    regions = RegionPass(opts["kinds"], opts["settings"])
    if passes is not None:
        passes.append(regions)
    patches = dict(opts.get("inductor") or {}, post_grad_custom_post_pass=regions)
    try:
        with (torch._guards.tracing(None) if own else contextlib.nullcontext()):
            from torch._inductor.compile_fx import compile_fx
            inputs = list(example_inputs) if own else example_inputs
            return compile_fx(gm, inputs, config_patches=patches), regions
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
    recompiles stay bounded and a new length never costs correctness."""

    def __init__(self, gm: fx.GraphModule, example_inputs, opts: dict):
        self.gm, self.opts = gm, opts
        # inputs read by ``.item()``: their values join the signature
        self.scalars = frozenset(i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
                                 if any(u.op == "call_method" and u.target == "item" for u in n.users))
        self.dynamic = _inductor(gm, example_inputs, opts)
        self.compiled: dict = {}
        self.reports: dict = {}  # signature -> comfuse's report of its graph (None: nothing fused)
        self.regionless = False  # the graph has no GEMM regions at all: every shape runs Inductor's code

    def __call__(self, *args):
        if self.regionless:
            return self.dynamic(*args)
        key = _shape_key(args, self.scalars)
        fn = self.compiled.get(key)
        if fn is None:
            limit = settings_mod.get().max_specializations
            if len(self.compiled) >= limit:
                notice_once(f"per-shape:{id(self)}", f"comfuse backend: more than {limit} input shapes "
                            "(COMFUSE_MAX_SPECIALIZATIONS); further shapes run Inductor's dynamic code")
                return self.dynamic(*args)
            fn = self.compiled[key] = self._build(key, args)
        return fn(*args)

    def _build(self, key, args):
        compiled, regions = _compile_with_regions(_fix_scalars(self.gm, args, self.scalars), args, self.opts,
                                                  " for its new shapes", own=True)
        if compiled is None:
            self.reports[key] = None
            return self.dynamic
        self.reports[key] = regions.reports[0] if regions.reports else None
        if not regions.found:
            self.regionless = True  # (no GEMM region in the forward: no shape will fuse one)
            return self.dynamic
        if not regions.fused:
            return compiled
        with settings_mod.override(**self.opts["settings"]):
            return faster_graph(self.gm, args, compiled, regions.fused, regions.saves_memory, None,
                                plain=self.dynamic)


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


def register() -> None:
    """Make ``torch.compile(..., backend="comfuse")`` find this backend."""
    from torch._dynamo import list_backends, register_backend
    quiet_library_logging()
    if "comfuse" not in list_backends(exclude_tags=()):
        register_backend(name="comfuse")(comfuse_backend)

