"""``torch.compile(model, backend="comfuse")``.

Dynamo hands the backend a graph of torch calls. comfuse captures it as an aten graph
(``frontend.capture``), finds its GEMM + epilogue regions and back-to-back chains,
plans and builds them, and replaces each with one call of the custom operator
``comfuse::region`` (registered through ``torch.library``, with a fake implementation so
the graph stays traceable and an autograd formula so training works). Everything else
goes to Inductor (``compile_fx``), which sees the fused regions as opaque kernels. A
graph in which nothing fuses is handed to Inductor untouched, so a model is never
compiled worse than by Inductor alone.

``mode`` (``torch.compile(..., mode=...)``, or the option ``mode`` beside others: torch.compile
takes a mode or options, not both) is Inductor's for the code around the regions:
"default", "reduce-overhead" (CUDA graphs), "max-autotune" (with CUDA graphs) or
"max-autotune-no-cudagraphs". Where a mode runs the graph as CUDA-graph replays, comfuse's
autotuning times its candidates as graph replays too (COMFUSE_TUNE_TIMING=graph, unless
that variable is set): a replay pays no host time a launch, so the fused kernels that lose
to Inductor's code on launches (a ws_stages launch takes 40-100 us of host time on the H200)
can win there.

Options (``torch.compile(..., options={...})`` or ``COMFUSE_*`` variables):
``mode`` (above), ``disable`` ("gemm_epilogue", "b2b" or both, comma-separated), ``schedule`` (force one),
``fuel`` (fuse at most this many regions per graph), ``autotune`` ("0", "1", "auto"),
``graph_check`` ("0", "1", "auto": time a graph that keeps fused regions against Inductor's
compilation without them at its first call and keep the faster; "auto" on GPUs), and each
code-generation setting by its field name (``settings.CODEGEN_SETTINGS``: ``row_budget``,
``mainloop``, ``prefetch``, ``overlap``, ``persistent``, ``ws_merge``, ``ws_lanes``,
``ws_tma_store``, ``ws_tail``, ``ws_res_tma``, ``ws_lookahead``, ``ws_keep``,
``ws_vec``, ``ws_narrow``, ``ws_exp_fma``, ``ws_row_outputs``, ``ws_tile_n``, ``ws_roll``, ``ws_last_in_ring``; the same values as their
``COMFUSE_*`` variables).

The backward of a fused region recomputes it unfused under autograd (its original
ops), so gradients match eager; the forward stays fused.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import operator
import os
import threading
import warnings

import torch
import torch.fx as fx

from . import settings as settings_mod
from .runtime.kernel import ComfuseWarning

log = logging.getLogger("comfuse.backend")
_REGISTRY: dict = {}  # id -> (module that runs the region, which arguments are tensors, statistic rows carried)
_ids = itertools.count()
_lock = threading.Lock()


def _register(module, is_tensor: list) -> int:
    """A new id for ``module``, derived from what it computes. The id is all a compiled graph
    records of its region (``comfuse::region(id, ...)``), and Inductor caches compiled graphs
    on disk by their text: with ids 0, 1, 2... per process, another process's region 0 (another
    version's statistics, another region) would reuse code built for this one's output shapes."""
    rows = module.carries_statistics() if hasattr(module, "carries_statistics") else 0
    from .runtime.kernel import CODEGEN_VERSION
    what = repr((getattr(module, "plan", None), getattr(module, "output_specs", None), tuple(is_tensor), rows,
                 CODEGEN_VERSION, torch.__version__))
    with _lock:
        i = int(hashlib.sha256(f"{what}#{next(_ids)}".encode()).hexdigest()[:15], 16)
        _REGISTRY[i] = (module, tuple(is_tensor), rows)
        return i


def _arguments(region_id: int, tensors, scalars) -> list:
    """The region's arguments in their original order (tensors and sizes interleaved)."""
    is_tensor = _REGISTRY[region_id][1]
    t, s = iter(tensors), iter(scalars)
    return [next(t) if flag else next(s) for flag in is_tensor]


@torch.library.custom_op("comfuse::region", mutates_args=())
def region_op(region_id: int, tensors: list[torch.Tensor], scalars: list[int]) -> list[torch.Tensor]:
    """Run fused region ``region_id`` (its kernel, or its original ops on fallback). A split
    region (a loss over a wide row) returns one more tensor, last: its merged per-row
    statistics for the backward ([rows, M] fp32; NaN when this call ran something else)."""
    module = _REGISTRY[region_id][0]
    # (forward directly: region modules carry no hooks, and nn.Module's call path costs
    # microseconds on every call of a compiled graph)
    outs = module.forward(*_arguments(region_id, tensors, scalars))
    # a custom op's outputs must not alias its inputs (the fused path returns fresh tensors;
    # the unfused ops may return views)
    outs = [o.clone() if o._base is not None and any(o._base is x or o._base is x._base for x in tensors)
            else o for o in outs]
    rows = _statistic_rows(region_id)
    if rows:
        stats = module.take_statistics()
        outs.append(stats if stats is not None else
                    torch.full((rows, module.region.sizes.M), float("nan"), device=tensors[0].device))
    return outs


def _statistic_rows(region_id: int) -> int:
    return _REGISTRY[region_id][2]


@region_op.register_fake
def _region_fake(region_id: int, tensors: list[torch.Tensor], scalars: list[int]) -> list[torch.Tensor]:
    module = _REGISTRY[region_id][0]
    device = tensors[0].device
    outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in module.output_specs]
    rows = _statistic_rows(region_id)
    if rows:
        outs.append(torch.empty((rows, module.region.sizes.M), dtype=torch.float32, device=device))
    return outs


def _setup_context(ctx, inputs, output):
    region_id, tensors, scalars = inputs
    ctx.region_id, ctx.scalars = region_id, list(scalars)
    carried = list(output[-1:]) if _statistic_rows(region_id) else []
    ctx.save_for_backward(*tensors, *carried)


def _backward(ctx, grads):
    """Recompute the region unfused under autograd and pull the gradients through it; a
    split region (a loss over a wide row) recomputes one slice of N at a time instead, so
    the backward never holds its full-width intermediate (runtime/onepass_grad.py)."""
    saved = list(ctx.saved_tensors)
    carried = saved.pop() if _statistic_rows(ctx.region_id) else None
    if carried is not None:
        grads = grads[:-1]  # (the statistics' own: nothing reads them)
    tensors = [t.detach().requires_grad_(t.is_floating_point()) for t in saved]
    module = _REGISTRY[ctx.region_id][0]
    plan = getattr(module, "plan", None)
    if getattr(plan, "schedule", "") in ("split", "ws_split") and not plan.transposed:
        got = split_backward(ctx.region_id, saved, ctx.scalars, list(grads), carried)
        return None, [g if t.is_floating_point() else None for t, g in zip(tensors, got)], \
            [None] * len(ctx.scalars)
    with torch.enable_grad():
        outs = module.unfused(*_arguments(ctx.region_id, tensors, ctx.scalars))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt = [t for t in tensors if t.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    it = iter(got)
    return None, [next(it) if t.requires_grad else None for t in tensors], [None] * len(ctx.scalars)


region_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("comfuse::split_backward", mutates_args=())
def split_backward(region_id: int, tensors: list[torch.Tensor], scalars: list[int],
                   grads: list[torch.Tensor | None], carried: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The gradients of a split region's inputs, a slice of N at a time
    (runtime/onepass_grad.py): one opaque operator, so that the compiled backward runs it
    with eager memory behaviour (each slice's gradient written into place) rather than
    as an unrolled graph whose slices the compiler may keep alive together. ``carried``:
    the forward's merged statistics (``region_op``'s last output), used unless NaN. Integer
    inputs get an empty tensor."""
    from .ir import canonical_shape
    from .runtime import onepass_grad
    module = _REGISTRY[region_id][0]
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    ext = _arguments(region_id, leaves, scalars)
    canon = [None if g is None else g.reshape(canonical_shape(module.region, o.axes))
             for g, o in zip(grads, module.region.outputs)]
    def statistics():
        """The forward's merged statistics, else the fused statistics kernel's, else None
        (the torch pass runs)."""
        from .runtime.kernel import can_run_on, notice_once
        if carried is not None and not bool(torch.isnan(carried[0, 0])):  # (one sync a backward)
            return onepass_grad.unpack_statistics(module.plan.onepass, carried)
        if module.failed or module.region.sizes.B != 1 or settings_mod.get().disable or \
                can_run_on(ext[module.operands[0]].device):
            return None
        try:
            return module.split_statistics(ext)
        except Exception as e:  # the backward still has its own first pass
            if settings_mod.get().strict:
                raise
            notice_once(f"split-stats:{region_id}", f"comfuse: the fused statistics kernel failed in a "
                        f"backward ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                        "recomputing the statistics in torch")
            return None
    with _autograd_below_dispatch():
        onepass_grad.backward(module.plan.onepass, lambda: module.canonical(ext), canon, statistics=statistics)
    return [(t.grad if t.grad is not None else torch.zeros_like(t)) if t.is_floating_point()
            else t.new_empty(0) for t in leaves]


@contextlib.contextmanager
def _autograd_below_dispatch():
    """Autograd inside a custom operator's implementation: the dispatcher runs it with the
    autograd keys excluded (nothing would record a graph); lift that exclusion here."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.ADInplaceOrView):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        yield


@split_backward.register_fake
def _split_backward_fake(region_id, tensors, scalars, grads, carried=None):
    return [torch.empty_like(t) if t.is_floating_point() else t.new_empty(0) for t in tensors]


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


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
    codegen = set(settings_mod.CODEGEN_SETTINGS) - {"schedule"}
    known = {"disable", "schedule", "fuel", "autotune", "graph_check"} | codegen  # (mode: taken above)
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"comfuse backend: unknown options {sorted(unknown)}; known: {sorted(known)}")
    kinds = options.get("disable", os.environ.get("COMFUSE_DISABLE_KINDS", ""))
    if isinstance(kinds, str):
        kinds = [k for k in kinds.split(",") if k]
    bad = set(kinds) - {"gemm_epilogue", "b2b"}
    if bad:
        raise ValueError(f"comfuse backend: cannot disable {sorted(bad)}; kinds are gemm_epilogue, b2b")
    overrides = {}
    if "schedule" in options:
        overrides["schedule"] = options["schedule"]
    if "fuel" in options:
        overrides["fuel"] = int(options["fuel"])
    if "autotune" in options:
        overrides["autotune"] = str(options["autotune"])
    if "graph_check" in options:
        overrides["graph_check"] = str(options["graph_check"])
    for name in sorted(codegen & set(options)):  # the code generator's settings, as their COMFUSE_* variables
        overrides[name] = settings_mod.coerce(name, options[name])
    cudagraphs = bool(inductor.get("triton.cudagraphs"))  # (the regions will run as graph replays)
    if cudagraphs and "COMFUSE_TUNE_TIMING" not in os.environ:
        overrides["tune_timing"] = "graph"
    return {"kinds": set(kinds), "settings": overrides, "inductor": inductor, "cudagraphs": cudagraphs}


def _inductor(gm: fx.GraphModule, example_inputs, opts: dict):
    """Inductor's compilation of ``gm`` in the backend's mode."""
    from torch._inductor.compile_fx import compile_fx
    patches = opts.get("inductor")
    return compile_fx(gm, example_inputs, config_patches=patches) if patches else compile_fx(gm, example_inputs)


def _symbolic(example_inputs) -> bool:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and any(not isinstance(s, int) for s in t.shape):
            return True
        if isinstance(t, torch.SymInt):
            return True
    return False


def comfuse_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    """The torch.compile backend: fuse what comfuse can, give the rest to Inductor (in
    ``mode``, torch.compile's)."""
    opts = _options(options, mode)
    if _symbolic(example_inputs):
        return PerShape(gm, example_inputs, opts)
    compiled = _compile_lowered(gm, example_inputs, opts)
    if compiled is None:
        return _inductor(gm, example_inputs, opts)
    with settings_mod.override(**opts["settings"]):
        return _faster_graph(gm, example_inputs, compiled, opts=opts)


GRAPH_MARGIN = 0.99  # the graph with fused regions must run at least 1 % faster than Inductor's
GRAPH_CHECKS: list = []  # the last few whole-graph comparisons (dicts), newest last, for inspection


def _checks_graph(gm: fx.GraphModule, example_inputs) -> bool:
    """Whether to time the fused graph against Inductor's (COMFUSE_GRAPH_CHECK): graphs on
    real tensors that write to none of their inputs (running them again repeats no write)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from .runtime import tuning
    s = settings_mod.get()
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if not tensors or s.graph_check == "0" or any(isinstance(t, FakeTensor) for t in tensors):
        return False
    if s.graph_check != "1" and not (tensors[0].device.type == "cuda" and tuning.enabled(tensors[0].device)):
        return False
    return not _mutates(gm)


def _training(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def _step(fn, args):
    """A call of ``fn`` and the backward of its differentiable outputs (gradients of ones)
    into the inputs that require them, returned rather than accumulated into ``.grad``."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = {}

    def run():
        outs = fn(*args)
        outs = [o for o in (outs if isinstance(outs, (list, tuple)) else [outs])
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs:
            return None
        key = tuple((o.shape, o.dtype) for o in outs)
        if key not in grads:
            grads[key] = [torch.ones_like(o) for o in outs]
        return torch.autograd.grad(outs, leaves, grads[key], allow_unused=True)
    return run


def _mutates(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and getattr(n.target, "_schema", None) is not None
               and n.target._schema.is_mutable for n in gm.graph.nodes)


GRAPH_TIMING_S = 0.3  # about how long each form is timed per round (3 rounds of 3-20 calls)


def _time_graphs(calls: dict, device) -> dict:
    """name -> ms per call of ``calls``, each timed as Python calls queued back to back with
    one synchronisation at the end (what a model's caller waits for, host time included, as
    in a training or serving loop), in three interleaved rounds with a rotating order: the
    median of the rounds. 3 to 20 calls a round, fewer the slower a call (a one-second
    training step costs ~20 s here, not minutes)."""
    import statistics
    import time

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = list(calls)
    slowest = 0.0
    for name in names:  # a first call each (its compilation and autotuning stay out), then one timed
        calls[name]()
        sync()
        t0 = time.perf_counter()
        calls[name]()
        sync()
        slowest = max(slowest, time.perf_counter() - t0)
    reps = max(3, min(20, int(GRAPH_TIMING_S / max(slowest, 1e-6))))
    rounds = {n: [] for n in names}
    for r in range(3):
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                calls[name]()
            sync()
            rounds[name].append((time.perf_counter() - t0) / reps * 1e3)
    return {n: statistics.median(t) for n, t in rounds.items()}


def _faster_graph(gm: fx.GraphModule, example_inputs, fused, plain=None, opts: dict | None = None):
    """``fused`` (Inductor's compilation of the graph with comfuse's regions in it) or, when
    the graph is checked (COMFUSE_GRAPH_CHECK), a ``GraphChoice`` between it and Inductor's
    compilation of ``gm`` as Dynamo gave it (``plain``, compiled here in the backend's mode
    (``opts``) when not given)."""
    if not _checks_graph(gm, example_inputs):
        return fused
    if lower.saves_memory:  # Inductor's graph would hold (and, timed, allocate) that tensor
        log.info("backend: a fused region saves a large intermediate (a loss over a vocabulary): "
                 "the graph keeps it without timing Inductor's")
        return fused
    regions = lower.last_report.regions if lower.last_report is not None else []
    try:
        if plain is None:
            with torch._guards.tracing(None):  # a compilation of its own, as PerShape's
                plain = _inductor(gm, list(example_inputs), opts or {})
    except Exception as e:  # keep the fused graph: each of its regions won its own timing
        _check_failed(e)
        return fused
    return GraphChoice(fused, plain, sum(bool(r.fused) for r in regions))


def _check_failed(e: Exception) -> None:
    if settings_mod.get().strict:
        raise e
    warnings.warn(f"comfuse backend: timing the fused graph against Inductor's failed ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''}); keeping the fused graph",
                  ComfuseWarning, stacklevel=4)


class GraphChoice:
    """A graph with fused regions and Inductor's compilation of it without them; the first
    call times both on its arguments and keeps, for good, the fused one only where it is at
    least 1 % faster (``GRAPH_MARGIN``). With grad on, the forward alone and the training
    step (forward and backward, gradients returned rather than accumulated) must both win.
    A region that wins its own timing can still cost the model: its calls add host time,
    and Inductor can no longer fuse across it. (Timed at the first call, not at compile
    time: a backward compiled inside Dynamo's compilation fails.)"""

    def __init__(self, fused, plain, regions: int):
        self.fused, self.plain, self.regions = fused, plain, regions
        self.chosen = None

    def __call__(self, *args):
        if self.chosen is None:
            self.chosen = self._choose(list(args))
            self.fused = self.plain = None  # (the other form's code and buffers go)
        return self.chosen(*args)

    def _choose(self, args):
        device = next(t for t in args if isinstance(t, torch.Tensor)).device
        training = _training(args)
        try:
            # the random state is put back afterwards: the caller's first call draws the same
            # numbers (dropout, say) as it would have without the timing
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                times = _time_graphs({"fused": lambda: self.fused(*args), "inductor": lambda: self.plain(*args)},
                                     device)
                if training:
                    steps = _time_graphs({"fused": _step(self.fused, args), "inductor": _step(self.plain, args)},
                                         device)
                    times.update({f"{n} step": t for n, t in steps.items()})
        except Exception as e:
            _check_failed(e)
            return self.fused
        keep = all(times[f"fused{w}"] <= times[f"inductor{w}"] * GRAPH_MARGIN for w in ("", " step")
                   if f"fused{w}" in times)
        GRAPH_CHECKS.append({"regions": self.regions, "training": training,
                             **{f"{n.replace(' ', '_')}_ms": t for n, t in times.items()},
                             "kept": "fused" if keep else "inductor"})
        del GRAPH_CHECKS[:-16]
        log.info("backend: the graph with %d fused region(s) ran %s; Inductor's alone %s; keeping %s",
                 self.regions, _times_text(times, "fused"), _times_text(times, "inductor"),
                 "the fused graph" if keep else "Inductor's")
        return self.fused if keep else self.plain


def _times_text(times: dict, form: str) -> str:
    text = f"{times[form]:.4f} ms a call"
    return text + (f", {times[form + ' step']:.4f} ms a training step" if form + " step" in times else "")


def _compile_lowered(gm: fx.GraphModule, example_inputs, opts: dict, shapes: str = "", own: bool = False):
    """Inductor's compilation of ``gm`` with comfuse's regions in it, or None when nothing
    fuses or lowering or compiling fails (with a warning; COMFUSE_STRICT=1 raises): the
    caller then runs Inductor's code without them. ``own``: a compilation of its own, not
    inside Dynamo's (PerShape, at a call)."""
    def failed(what: str, e: Exception) -> None:
        if settings_mod.get().strict:
            raise e
        warnings.warn(f"comfuse backend: {what}{shapes} ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200] if str(e) else ''}); Inductor's code runs without "
                      "fused regions (COMFUSE_STRICT=1 raises instead)", ComfuseWarning, stacklevel=4)
    with settings_mod.override(**opts["settings"]):
        try:
            rewritten = lower(gm, example_inputs, opts["kinds"], warm=opts.get("cudagraphs", False))
        except Exception as e:  # capture or planning failed: the graph is still Inductor's
            failed("could not lower this graph", e)
            return None
    if rewritten is None:
        return None
    try:
        with (torch._guards.tracing(None) if own else contextlib.nullcontext()):
            return _inductor(rewritten, list(example_inputs) if own else example_inputs, opts)
    except Exception as e:
        failed("Inductor could not compile the graph with fused regions", e)
        return None


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
                from .runtime.kernel import notice_once
                notice_once(f"per-shape:{id(self)}", f"comfuse backend: more than {limit} input shapes "
                            "(COMFUSE_MAX_SPECIALIZATIONS); further shapes run Inductor's dynamic code")
                return self.dynamic(*args)
            fn = self.compiled[key] = self._build(key, args)
        return fn(*args)

    def _build(self, key, args):
        lower.last_report = None
        compiled = _compile_lowered(_fix_scalars(self.gm, args, self.scalars), args, self.opts,
                                    " for its new shapes", own=True)
        report = lower.last_report
        self.reports[key] = report if compiled is not None else None
        if compiled is None:
            self.regionless = report is not None and not report.regions and not report.error
            return self.dynamic
        with settings_mod.override(**self.opts["settings"]):
            return _faster_graph(self.gm, args, compiled, plain=self.dynamic, opts=self.opts)


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


def _static(example_inputs) -> tuple:
    """Dynamo's example inputs as fake tensors of a fresh fake mode without a shape
    environment: capture then sees plain integer sizes (no sym_size nodes), so views
    between regions stay inside them. Nothing is allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    out = []
    with mode:
        for t in example_inputs:
            if isinstance(t, torch.Tensor):
                out.append(torch.empty_strided(tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()),
                                               dtype=t.dtype, device=t.device))
            else:
                out.append(t)
    return tuple(out)


def lower(gm: fx.GraphModule, example_inputs, disabled_kinds=frozenset(), warm: bool = False):
    """The aten graph of ``gm`` with every fused region replaced by a ``comfuse::region``
    call, or None when nothing fuses (or capture fails). ``warm``: run the regions once now
    even where autotuning is off (``_tune_now``)."""
    from .runtime.compiled import Specialization

    spec = Specialization(gm, _static(example_inputs), execute=False, disabled_kinds=disabled_kinds)
    lower.last_report = spec.report  # for tests and debugging
    lower.saves_memory = False
    if spec.gm is None:
        return None
    graph = spec.gm.graph
    _tune_now(spec.gm, example_inputs, warm)
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        module = spec.gm.get_submodule(node.target)
        if getattr(module, "prefer_unfused", False):  # autotuning: its ops are faster left to Inductor
            _inline(spec.gm, node, module.unfused)
            continue
        is_tensor = [isinstance(a, fx.Node) and not isinstance(a.meta.get("val"), (int, torch.SymInt))
                     for a in node.args]
        region_id = _register(module, is_tensor)
        tensors = [a for a, t in zip(node.args, is_tensor) if t]
        scalars = [a for a, t in zip(node.args, is_tensor) if not t]
        with graph.inserting_before(node):
            call = graph.call_function(torch.ops.comfuse.region.default, (region_id, tensors, scalars))
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        spec.gm.delete_submodule(node.target)  # the registry holds it; Inductor need not pickle it
    if not any(n.target is torch.ops.comfuse.region.default for n in graph.nodes):
        return None  # autotuning left every region unfused: Inductor gets the graph as Dynamo gave it
    from .runtime import tuning
    lower.saves_memory = any(tuning.saves_memory(m.region) for m, _, _ in
                             (_REGISTRY[n.args[0]] for n in graph.nodes
                              if n.target is torch.ops.comfuse.region.default)
                             if getattr(m, "region", None) is not None)
    graph.lint()
    spec.gm.recompile()
    return spec.gm


lower.last_report = None
lower.saves_memory = False  # the last graph lowered keeps a region whose unfused ops would hold a huge tensor


def _tune_now(gm: fx.GraphModule, example_inputs, warm: bool = False) -> None:
    """Autotune every fused region at compile time, on Dynamo's real example inputs: the
    regions whose unfused ops win are then left in the graph for Inductor, which fuses
    them with their neighbours (inside a comfuse::region call they could not be). Skipped
    for fake or CPU inputs and for graphs that write to their inputs (running the graph
    once more would repeat the writes); their regions tune on their first call instead.

    ``warm`` (torch.compile's CUDA-graph modes): the call runs on a GPU even with autotuning
    off, so that each kernel's first launch, which builds it and allocates the scratch it
    keeps for later launches (a strip's workspace and arrival counters), happens here and
    not inside Inductor's CUDA-graph warm-up, whose private memory pool must hold only the
    tensors it tracks."""
    from .runtime import tuning
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if not tensors:
        return
    if not tuning.enabled(tensors[0].device) and not (warm and tensors[0].device.type == "cuda"):  # "auto": GPUs only
        return
    from torch._subclasses.fake_tensor import FakeTensor
    if any(isinstance(t, FakeTensor) for t in tensors) or _mutates(gm):
        return
    try:
        with torch.no_grad():
            gm(*example_inputs)
    except Exception as e:  # the regions will tune on their first call
        if settings_mod.get().strict:
            raise
        warnings.warn(f"comfuse backend: autotuning at compile time failed ({type(e).__name__}); "
                      "regions tune on their first call", ComfuseWarning, stacklevel=3)


def _inline(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule) -> None:
    """Replace ``node`` (a call of a region module whose outputs are read by getitem) with
    the nodes of ``sub``, the region's own ops."""
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


def register() -> None:
    """Make ``torch.compile(..., backend="comfuse")`` find this backend."""
    from torch._dynamo import list_backends, register_backend
    if "comfuse" not in list_backends(exclude_tags=()):
        register_backend(name="comfuse")(comfuse_backend)
