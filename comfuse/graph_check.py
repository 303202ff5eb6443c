"""The backend's whole-graph check: a graph that keeps fused regions is timed at its first
call against Inductor's compilation of the same graph without them, and the faster is kept
for good (``GraphChoice``). A region that wins its own timing can still cost the model: its
calls add host time, and Inductor can no longer fuse across it. Where the regions' own
timings leave no doubt (``predicted``: a GPU-bound graph whose regions saved, alone, far more
than crossing their boundaries could cost), the fused graph is kept without compiling
Inductor's for the comparison. A training graph whose
forward fused nothing is checked the same way once its backward, lowered at the first
backward, turns out to fuse a region (``BackwardChoice``). Each decision is logged
(``COMFUSE_LOG=info``) and the last ones are in ``GRAPH_CHECKS``.
"""
from __future__ import annotations

import copy
import logging
import statistics
import time

import torch
import torch.fx as fx

from . import settings as settings_mod
from .errors import fallback
from .runtime import tuning
from .verdicts import FUSED, INDUCTOR, UNFUSED

log = logging.getLogger("comfuse.backend")


GRAPH_MARGIN = 0.99  # the graph with fused regions must run at least 1 % faster than Inductor's
GRAPH_CHECKS: list = []  # the last few whole-graph comparisons (dicts), newest last, for inspection


def later_compilation(compile_fn):
    """``compile_fn`` (Inductor's compilation of a graph Dynamo is handing over now), made
    to run later (at the graph's first call, or now) as if Dynamo's compilation were still
    under way: in a copy of Dynamo's tracing context, as AOTAutograd compiles a backward
    lazily, holding each input's symbolic context as Dynamo recorded it (Dynamo clears its
    own when its compilation ends). Without those, AOTAutograd gives the inputs sizes of
    its own, symbolic ones under Dynamo's shape environment, and Inductor's ``pad_mm`` pads
    no GEMM on them: BERT's vocabulary-wide decoder GEMM then ran as an unaligned cuBLAS
    kernel, 3.24 ms against Inductor alone's 1.11 ms (H200, 2026-12-05;
    ``scripts/standin_check.py``). The copy leaves Dynamo's own context as the fused graph's
    backward will find it. Outside Dynamo's compilation, ``compile_fn`` runs with none."""
    context = torch._guards.TracingContext.try_get()
    recorded = context.tensor_to_context.copy() if context is not None else None

    def compile_later():
        if context is None:
            with torch._guards.tracing(None):
                return compile_fn()
        later = copy.copy(context)
        later.tensor_to_context = recorded
        with torch._guards.tracing(later):
            return compile_fn()
    return compile_later


def _told_no_one(kept: str) -> None:
    """The default ``on_choice``: nobody is told what was kept."""


def checks_graph(gm: fx.GraphModule, example_inputs) -> bool:
    """Whether to time the fused graph against Inductor's (COMFUSE_GRAPH_CHECK): graphs on
    real tensors that write to none of their inputs (running them again repeats no write)."""
    from torch._subclasses.fake_tensor import FakeTensor
    s = settings_mod.get()
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if not tensors or s.graph_check == "0" or any(isinstance(t, FakeTensor) for t in tensors):
        return False
    if s.graph_check != "1" and not (tensors[0].device.type == "cuda" and tuning.enabled(tensors[0].device)):
        return False
    return not mutates(gm)


def training_call(example_inputs) -> bool:
    """Whether a call on ``example_inputs`` trains: grad on, and an input that requires it."""
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


def mutates(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and getattr(n.target, "_schema", None) is not None
               and n.target._schema.is_mutable for n in gm.graph.nodes)


GRAPH_TIMING_S = 0.3  # about how long each form is timed per round (3 rounds of 3-20 calls)

# The prediction that spares a check (``GraphChoice.predicted``): of what the regions saved
# alone, this share is counted on in the graph; a tensor crossing a region's boundary is
# charged one write and one read more than Inductor's fused code might have needed, at this
# many bytes a second (about half an H100's HBM3 rate, well under what Inductor's kernels
# reach: the charge errs high); and a graph whose call spends more than this share of its
# wall time on the host is host-bound, where a region's call costs what its launches cost.
PREDICTION_SHARE = 0.5
BOUNDARY_BYTES_PER_S = 2e12
HOST_BOUND_SHARE = 0.7


def boundary_bytes(region) -> int:
    """Bytes of the tensors crossing ``region``'s boundary, its GEMM's weight aside: the
    activation A, the side inputs and the outputs, each of which Inductor's code for the same
    ops might have kept inside a fused kernel of its own (with a neighbour's work)."""
    s = region.sizes

    def size(axes, dtype) -> int:
        count = 1
        for axis in axes:
            count *= s.of(axis)
        return count * dtype.itemsize
    a = s.B * s.M * s.K * region.gemm.a.dtype.itemsize
    return a + sum(size(i.axes, i.dtype) for i in region.inputs) + sum(size(o.axes, o.dtype) for o in region.outputs)


def standalone_margin(modules) -> tuple | None:
    """(ms the kept regions ``modules`` saved in their own timings against their ops'
    Inductor code, the most ms crossing their boundaries could cost in the graph: each
    boundary tensor written and read once more at ``BOUNDARY_BYTES_PER_S``), or None where a
    region's timing is not known (autotuning off) or it is not a single region (a GEMM chain)."""
    saved = lost = 0.0
    for module in modules:
        region, tuned = getattr(module, "region", None), getattr(getattr(module, "report", None), "tuned_ms", ())
        if region is None or len(tuned) != 2:
            return None
        saved += tuned[1] - tuned[0]
        lost += 2 * boundary_bytes(region) / BOUNDARY_BYTES_PER_S * 1e3
    return (saved, lost) if modules else None


def _synchronizer(device):
    """A function that waits for ``device``'s work (nothing to wait for off a GPU)."""
    if torch.device(device).type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def host_ms(call, device, calls: int = 3) -> float:
    """Median host ms of ``calls`` calls of ``call``, each started with the device idle and
    timed until it returns (what the host spends queueing its work)."""
    sync = _synchronizer(device)
    times = []
    for _ in range(calls):
        sync()
        began = time.perf_counter()
        call()
        times.append((time.perf_counter() - began) * 1e3)
        sync()
    return statistics.median(times)


def _time_graphs(calls: dict, device) -> dict:
    """name -> ms per call of ``calls``, each timed as Python calls queued back to back with
    one synchronisation at the end (what a model's caller waits for, host time included, as
    in a training or serving loop), in three interleaved rounds with a rotating order: the
    median of the rounds. 3 to 20 calls a round, fewer the slower a call (a one-second
    training step costs ~20 s here, not minutes). The rounds' times are kept too, under
    "<name> rounds"."""
    rounds = time_rounds(calls, device, 3)
    return {**{n: statistics.median(t) for n, t in rounds.items()},
            **{f"{n} rounds": [round(x, 4) for x in t] for n, t in rounds.items()}}


def time_rounds(calls: dict, device, rounds: int) -> dict:
    """name -> [ms per call in each round]: ``rounds`` interleaved rounds of back-to-back calls
    of each of ``calls`` (the order rotating each round, so a drift of the GPU's speed falls on
    every call alike), one synchronisation per round; 3 to 20 calls a round, fewer the slower
    a call, after a first untimed call and one timed call of each."""
    sync = _synchronizer(device)
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
    times = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                calls[name]()
            sync()
            times[name].append((time.perf_counter() - t0) / reps * 1e3)
    return times


def faster_graph(gm: fx.GraphModule, example_inputs, fused, regions: int, saves_memory: bool, compile_plain,
                 plain=None, on_choice=None, fused_so_far=None, kept_now=None, cudagraphs: bool = False,
                 standalone=None):
    """``fused`` (Inductor's compilation of the graph with comfuse's regions in it) or, when
    the graph is checked (COMFUSE_GRAPH_CHECK), a ``GraphChoice`` between it and Inductor's
    compilation of ``gm`` as Dynamo gave it (``plain``, or ``compile_plain()`` when not given).
    ``regions``: how many regions the fused graph keeps; ``saves_memory``: one of them avoids a
    huge intermediate. ``on_choice(kept)``: told what was kept, when it is known (verdicts.py:
    FUSED, UNFUSED or INDUCTOR). ``fused_so_far()``: the regions the graph's pass has kept so
    far, its backward's included once lowered, or None where the pass has not seen a backward
    (the two forms' backward graphs are the same until the pass fuses in one: see
    ``GraphChoice``). ``kept_now()``: the regions the pass has kept so far, for the log (a
    backward lowered during the check counted). ``cudagraphs``: the graph runs as CUDA-graph
    replays (a training graph is then timed by its steps alone: see ``GraphChoice``).
    ``standalone()``: the kept regions' ``standalone_margin``, for a prediction that may
    spare the check (``GraphChoice.predicted``); Inductor's compilation is then left to the
    first call, which builds it only where the prediction does not hold."""
    on_choice = on_choice or _told_no_one
    if not checks_graph(gm, example_inputs):
        on_choice(FUSED)
        return fused
    if saves_memory:  # Inductor's graph would hold (and, timed, allocate) that tensor
        log.info("backend: a fused region saves a large intermediate (a loss over a vocabulary): "
                 "the graph keeps it without timing Inductor's")
        on_choice(FUSED)
        return fused
    standalone = standalone if predicts(cudagraphs) else None  # (the settings in force now: a backend option's)
    if plain is None and standalone is not None:
        return GraphChoice(fused, None, regions, on_choice, fused_so_far, kept_now=kept_now, cudagraphs=cudagraphs,
                           compile_plain=compile_plain, standalone=standalone)
    try:
        if plain is None:
            began = time.perf_counter()
            plain = compile_plain()
            log.info("backend: Inductor's compilation of the graph without regions, for the check: %.1f s",
                     time.perf_counter() - began)
    except Exception as e:  # keep the fused graph: each of its regions won its own timing
        fallback("compiling the graph without fused regions, to time it, failed", e, "the fused graph runs")
        on_choice(FUSED)
        return fused
    return GraphChoice(fused, plain, regions, on_choice, fused_so_far, kept_now=kept_now, cudagraphs=cudagraphs,
                       standalone=standalone)


def predicts(cudagraphs: bool) -> bool:
    """Whether a prediction may spare a graph's check: not under COMFUSE_GRAPH_CHECK=1 (every
    graph timed), nor where the graph runs as CUDA-graph replays (its training forward alone
    runs no replay, so its times are not taken alone)."""
    return not cudagraphs and settings_mod.get().graph_check != "1"


class GraphChoice:
    """A graph with fused regions and Inductor's compilation of it without them; the first
    call times both on its arguments and keeps, for good, the fused one only where it is at
    least 1 % faster (``GRAPH_MARGIN``). With grad on, the forward alone and the training
    step (forward and backward, gradients returned rather than accumulated) must both win.
    A region that wins its own timing can still cost the model: its calls add host time,
    and Inductor can no longer fuse across it. (Timed at the first call, not at compile
    time: a backward compiled inside Dynamo's compilation fails.) Given ``standalone``, the
    first call may keep the fused graph without the comparison (``predicted``); given
    ``compile_plain`` in place of ``plain``, Inductor's compilation is built only where it
    does not.

    The training step is timed only where it can differ from the forward: where the forward
    wins, and (given ``fused_so_far``) where the fused graph's backward, lowered by one step,
    kept a fused region. comfuse's pass runs after AOTAutograd has split the joint graph, so
    the two forms' backward graphs are the same graph until the pass fuses in one; timing
    both steps compiled that backward twice (the 8B block's first step spent 10 s there).

    Where the graphs run as CUDA-graph replays (``cudagraphs``), a training graph is timed
    by its steps alone, always: its forward called again and again without its backward
    does not run as a replay, and its times say nothing of a training loop's (H200,
    2026-12-07, BERT-base under reduce-overhead: 65.1 ms a call against 49.4 for Inductor's,
    where the steps ran 33.3 against 57.9 ms; the forward alone had kept Inductor's code).
    Marking a new step before each forward would make them replays, but would also end the
    CUDA-graph generation whose outputs an earlier graph of the caller's step (before a
    graph break) still holds for its backward."""

    def __init__(self, fused, plain, regions: int, on_choice=None, fused_so_far=None, forward_differs: bool = True,
                 kept_now=None, cudagraphs: bool = False, compile_plain=None, standalone=None):
        self.fused, self.plain, self.regions = fused, plain, regions
        self.compile_plain, self.standalone = compile_plain, standalone  # (plain None: built when needed)
        self.cudagraphs = cudagraphs
        self.kept_now = kept_now or fused_so_far or (lambda: regions)
        self.on_choice = on_choice or _told_no_one
        self.fused_so_far = fused_so_far
        self.backward_kept = None  # the fused backward's regions kept, where the check lowered it
        self.forward_differs = forward_differs  # (False: the two differ in their backward alone)
        self.chosen = None

    def __call__(self, *args):
        if self.chosen is None:
            self.chosen = self.decide(list(args))
            self.fused = self.plain = self.compile_plain = None  # (the other form's code and buffers go)
        return self.chosen(*args)

    def decide(self, args: list):
        """The form to keep, timed on ``args`` (``on_choice`` is told)."""
        chosen = self._choose(args)
        self.on_choice(FUSED if chosen is self.fused else INDUCTOR)
        return chosen

    def _choose(self, args):
        device = next(t for t in args if isinstance(t, torch.Tensor)).device
        training = training_call(args)
        if self.standalone is not None and self.predicted(args, device, training):
            return self.fused
        if self.plain is None:
            began = time.perf_counter()
            try:
                self.plain = self.compile_plain()
                log.info("backend: Inductor's compilation of the graph without regions, for the check: %.1f s",
                         time.perf_counter() - began)
            except Exception as e:  # keep the fused graph: each of its regions won its own timing
                fallback("compiling the graph without fused regions, to time it, failed", e, "the fused graph runs")
                return self.fused
        began = time.perf_counter()
        try:
            # the random state is put back afterwards: the caller's first call draws the same
            # numbers (dropout, say) as it would have without the timing
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                times = {}
                steps_alone = training and (self.cudagraphs or not self.forward_differs)
                if not steps_alone:
                    times = _time_graphs({"fused": lambda: self.fused(*args), "inductor": lambda: self.plain(*args)},
                                         device)
                if training and (steps_alone or self._steps_may_differ(times, args)):
                    steps = _time_graphs({"fused": _step(self.fused, args), "inductor": _step(self.plain, args)},
                                         device)
                    times.update({f"{n} step": t for n, t in steps.items()})
        except Exception as e:  # (Inductor's own graph compiled: it runs)
            fallback("timing the fused graph against Inductor's failed", e, "Inductor's graph runs")
            return self.plain
        keep = all(times[f"fused{w}"] <= times[f"inductor{w}"] * GRAPH_MARGIN for w in ("", " step")
                   if f"fused{w}" in times)
        GRAPH_CHECKS.append({"regions": self.regions, "training": training, "backward_regions": self.backward_kept,
                             **{f"{n.replace(' ', '_')}_ms": t for n, t in times.items()},
                             "kept": "fused" if keep else "inductor"})
        del GRAPH_CHECKS[:-16]
        log.info("backend: the graph with %d fused region(s) ran %s; Inductor's alone %s; keeping %s "
                 "(checked in %.1f s)", self.kept_now() or self.regions, _times_text(times, "fused"),
                 _times_text(times, "inductor"), "the fused graph" if keep else "Inductor's", time.perf_counter() - began)
        return self.fused if keep else self.plain

    def _steps_may_differ(self, times: dict, args) -> bool:
        """Whether the training step must be timed too (the class docstring): not where the
        forward lost (Inductor's graph is kept), nor where the fused graph's backward, lowered
        now by one step of it, kept no fused region (its backward is Inductor's, as in the
        other form)."""
        if not times["fused"] <= times["inductor"] * GRAPH_MARGIN:
            return False
        kept = self._backward_kept(args)
        if kept is not None and kept <= 0:
            log.info("backend: the fused graph's backward kept no fused region: the two training steps "
                     "differ in the forward alone, not timed")
            return False
        return True

    def _backward_kept(self, args):
        """The regions the fused graph's backward keeps, lowered now by one step of it (once),
        or None where that is not known (the pass did not see the backward: a cache gave it)."""
        if self.backward_kept is None and self.fused_so_far is not None:
            _step(self.fused, args)()
            so_far = self.fused_so_far()
            self.backward_kept = None if so_far is None else so_far - self.regions
        return self.backward_kept

    def predicted(self, args, device, training: bool) -> bool:
        """Whether the fused graph is kept without a comparison (recorded in ``GRAPH_CHECKS``
        and the log): where it is GPU-bound (a call's host time at most
        ``HOST_BOUND_SHARE`` of its wall time, timed now on ``args``: a region's call then
        costs no time of the graph's), ``PREDICTION_SHARE`` of what its regions saved alone,
        less the most that crossing their boundaries can cost (``standalone_margin``), is
        still at least the check's 1 % of the call, and, training, its backward (lowered by
        one step) keeps no fused region. Otherwise the check times both forms."""
        if not self.forward_differs or self.cudagraphs:
            return False
        margin = self.standalone()
        if margin is None:
            return False
        saved, lost = margin
        call = lambda: self.fused(*args)  # noqa: E731
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            wall = statistics.median(time_rounds({"fused": call}, device, 1)["fused"])
            host = host_ms(call, device)
            why = ""
            if host > HOST_BOUND_SHARE * wall:
                why = f"a call spends {host:.4f} of its {wall:.4f} ms on the host"
            elif PREDICTION_SHARE * saved - lost < (1 - GRAPH_MARGIN) * wall:
                why = (f"its regions saved {saved:.4f} ms alone, at most {lost:.4f} ms lost at their boundaries, "
                       f"in a {wall:.4f} ms call: too close to tell")
            elif training and (self._backward_kept(args) is None or self.backward_kept > 0):
                why = "its backward keeps fused regions" if self.backward_kept else "its backward was not lowered here"
        prediction = {"fused_ms": round(wall, 4), "host_ms": round(host, 4), "alone_saved_ms": round(saved, 4),
                      "boundary_ms": round(lost, 4)}
        if why:
            log.info("backend: the graph with %d fused region(s) is timed against Inductor's: %s",
                     self.kept_now() or self.regions, why)
            return False
        GRAPH_CHECKS.append({"regions": self.regions, "training": training, "backward_regions": self.backward_kept,
                             "predicted": prediction, "kept": "fused"})
        del GRAPH_CHECKS[:-16]
        log.info("backend: the graph with %d fused region(s) is kept without timing Inductor's: its regions saved "
                 "%.4f ms alone, at most %.4f ms lost at their boundaries, in a %.4f ms call (%.4f ms of it on the "
                 "host)", self.regions, saved, lost, wall, host)
        return True


def _times_text(times: dict, form: str) -> str:
    parts = [f"{times[form]:.4f} ms a call"] if form in times else []
    parts += [f"{times[form + ' step']:.4f} ms a training step"] if form + " step" in times else []
    return ", ".join(parts)


def backward_checked(gm: fx.GraphModule, example_inputs, compiled, regions, compile_plain, on_choice=None):
    """``compiled`` (Inductor's compilation of a graph whose forward kept no fused region;
    ``regions``: its RegionPass) or, for a training graph that is checked
    (COMFUSE_GRAPH_CHECK) and has regions, a ``BackwardChoice``. ``on_choice`` as in
    ``faster_graph`` (a graph the pass failed to lower gets no verdict)."""
    on_choice = on_choice or _told_no_one
    if not regions.found or not (training_call(example_inputs) and checks_graph(gm, example_inputs)):
        if not regions.failed:  # (no region, no GEMM: its backward has none either)
            on_choice(UNFUSED)
        return compiled
    return BackwardChoice(compiled, regions, compile_plain, on_choice)


class BackwardChoice:
    """A training graph whose forward kept no fused region, while its backward, which
    Inductor lowers at the first backward, may keep some that no whole-graph timing would
    cover (a region that won its own timing can lose in the model). At the first call, one
    training step of the graph (gradients returned, not accumulated; the random state put
    back) lowers the backward. Where it kept a fused region, Inductor's compilation without
    regions is built and the two are timed as in ``GraphChoice``; otherwise the graph runs
    as compiled, with no compilation more."""

    def __init__(self, compiled, regions, compile_plain, on_choice):
        self.compiled, self.regions, self.compile_plain, self.on_choice = compiled, regions, compile_plain, on_choice
        self.chosen = None

    def __call__(self, *args):
        if self.chosen is None:
            self.chosen = self._choose(list(args))
            self.compiled = self.compile_plain = None
        return self.chosen(*args)

    def _choose(self, args):
        if not training_call(args):  # (a graph Dynamo compiled with grad on is called with grad on)
            self.on_choice(UNFUSED)
            return self.compiled
        device = next(t for t in args if isinstance(t, torch.Tensor)).device
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                _step(self.compiled, args)()
        except Exception as e:  # (its backward, lowered with the pass, failed: it would again)
            fallback("lowering the backward with comfuse's regions failed", e,
                     "Inductor's compilation of the graph without them runs")
            self.on_choice(INDUCTOR)
            return self.compile_plain()
        try:
            fused = self.regions.fused
            if not fused:
                self.on_choice(UNFUSED)
                return self.compiled
            log.info("backend: the backward kept %d fused region(s) where the forward kept none: "
                     "timing the graph against Inductor's", fused)
            plain = self.compile_plain()
        except Exception as e:
            fallback("checking the graph whose backward fused regions failed", e, "the graph runs as compiled")
            return self.compiled
        return GraphChoice(self.compiled, plain, fused, self.on_choice, forward_differs=False).decide(args)
