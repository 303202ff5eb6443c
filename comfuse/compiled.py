"""``comfuse.compile(fn, example_inputs)`` and ``comfuse.explain``.

``comfuse.compile`` is ``torch.compile(fn, dynamic=False)`` with a backend of its own
(``CompiledFunction._backend``), so Dynamo captures the program and its guards decide when a
call needs a new graph: shapes, strides, dtypes and devices, the values of non-tensor
arguments and of defaults, a module's parameters, buffers and submodules and their training
flags, grad mode, and the Python state a branch reads (a global, an attribute). Each graph
Dynamo hands over (one per graph break and per specialisation) is built by one of two routes:

- no gradient needed (grad mode off, or no input or parameter of the graph requires grad:
  AOTAutograd's own test): comfuse's pipeline (pipeline.py) rewrites the graph, each fused
  region one call of its module; everything else runs as the eager aten ops it traced to;
- gradients needed: the torch.compile backend (backend.py): AOTAutograd differentiates the
  graph, Inductor compiles the forward and the backward, and comfuse's pass fuses regions
  in each.

The constructor calls the compiled function once on the example inputs, under the caller's
grad mode, so the first graphs are captured, built and (on a GPU) autotuned before
``comfuse.compile`` returns; that call's outputs are dropped and the random state is
restored after it (its other effects stand: a batch norm in training mode updates its
running statistics).

Dynamo caches compiled frames per code object, so torch.compile'ing ``fn`` twice would share
one cache and one recompile count (a benchmark compiles one workload many times). Dynamo
compiles instead a small function that calls ``fn`` (``_entry``), with a code object of its
own for each compiled function, and inlines ``fn`` into it (a module through its
``__call__``: no OptimizedModule wrapper either). Where torch.compile takes them (torch
2.13), COMFUSE_MAX_SPECIALIZATIONS is the function's recompile limit per frame and
``isolate_recompiles`` keeps the frames of ``fn``'s graph breaks its own too; with older
torch Dynamo's global ``recompile_limit`` applies, and Dynamo 2.11 does not guard the
defaults of the function it inlines (a call's own arguments it does guard). Beyond the limit
Dynamo runs the frame eagerly, as torch.compile does. The compiled graphs live in Dynamo's
caches until ``torch._dynamo.reset()``.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re

import torch
import torch.fx as fx

from . import settings as settings_mod
from .backend import comfuse_backend, quiet_library_logging
from .errors import notice_once, summary
from .pipeline import compile_graph, fake_inputs
from .report import Report
from .runtime.fused import Fused


@dataclasses.dataclass
class Built:
    """One graph Dynamo handed a compiled function's backend, as built: by comfuse's pipeline
    (``own``: its report; ``gm``: the rewritten graph, None where nothing fused) or inside
    Inductor (``passes``: the RegionPass of its compilation, whose reports grow as Inductor
    lowers the forward and, at the first backward, the backward)."""
    function: str
    own: Report | None = None
    gm: fx.GraphModule | None = None
    passes: list = dataclasses.field(default_factory=list)

    @property
    def report(self) -> Report:
        if self.own is not None:
            return self.own
        return merged_report(self.function, [r for p in self.passes for r in p.reports])

    def modules(self) -> list:
        """The fused modules (regions and chains) in graph order."""
        if self.gm is not None:
            found = self.gm.modules()
        else:
            found = (m for p in self.passes for lowered in p.lowered for m in lowered.modules)
        return [m for m in found if isinstance(m, Fused)]


class CompiledFunction:
    """``comfuse.compile(fn, example_inputs)``: call it like ``fn``."""

    def __init__(self, fn, example_inputs):
        if not callable(fn):
            raise TypeError(f"comfuse.compile expects a callable, got {type(fn).__name__}")
        if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
            raise TypeError("comfuse.compile: example_inputs must be a tuple or list of arguments")
        functools.update_wrapper(self, fn, updated=())
        self._fn = fn
        self._name = getattr(fn, "__qualname__", None) or type(fn).__name__
        self._graphs: list = []  # a Built record for each graph Dynamo handed over, newest last
        quiet_library_logging()
        self._compiled = torch.compile(_entry(fn, self._name), backend=self._backend, dynamic=False,
                                       **_cache_options(settings_mod.get().max_specializations))
        with torch.random.fork_rng(devices=_cuda_devices(fn, example_inputs)):
            self._compiled(*example_inputs)

    def __call__(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)

    def _backend(self, gm: fx.GraphModule, example_inputs):
        """Dynamo's backend for this function. ``example_inputs`` are the call's own tensors
        (real, not fake), parameters and buffers among them (Dynamo lifts them to inputs)."""
        tensors = [t for t in (*example_inputs, *gm.parameters()) if isinstance(t, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            notice_once(f"grad:{id(self)}", f"comfuse: inputs or parameters require grad; {self._name} trains "
                        "through torch.compile(backend=\"comfuse\") (forward and backward graphs)")
            built = Built(self._name)
            compiled = comfuse_backend(gm, example_inputs, passes=built.passes)
            self._graphs.append(built)
            return compiled
        fused, report = compile_graph(gm, fake_inputs(example_inputs))
        report.function = self._name
        self._graphs.append(Built(self._name, own=report, gm=fused))
        # (forward, not the module: nn.Module's call path costs ~1.6 us a call)
        return gm.forward if fused is None else fused.forward

    @property
    def report(self) -> Report:
        """The report of the most recently built graph (for a graph that trains: the regions
        of the graphs Inductor lowered for it, the backward's after the first backward)."""
        if not self._graphs:
            return Report(function=self._name, regions=[],
                          error="torch.compile captured no graph (no tensor operations, or Dynamo skipped it)")
        return self._graphs[-1].report

    @property
    def reports(self) -> list:
        """Every graph's report, in the order built (a function Dynamo splits at a graph break,
        or recompiles for new shapes, has several graphs)."""
        return [built.report for built in self._graphs]

    def fused_regions(self) -> list:
        """The fused modules (FusedRegion, FusedChain) of the most recently built graph, in
        graph order: each holds its plan, its alternatives and, once called, its kernel."""
        return self._graphs[-1].modules() if self._graphs else []


def _entry(fn, name: str):
    """A function that calls ``fn``, with a code object of its own (named after ``fn``)."""
    def entry(*args, **kwargs):
        return fn(*args, **kwargs)
    label = "comfuse_" + re.sub(r"\W", "_", name)
    names = {"co_name": label, **({"co_qualname": label} if hasattr(entry.__code__, "co_qualname") else {})}
    entry.__code__ = entry.__code__.replace(**names)  # (replace makes a new code object, whatever it renames)
    return entry


def _cache_options(limit: int) -> dict:
    """torch.compile's per-function cache options where it has them (torch 2.13)."""
    known = inspect.signature(torch.compile).parameters
    options = {"recompile_limit": limit} if "recompile_limit" in known else {}
    if "isolate_recompiles" in known:
        options["isolate_recompiles"] = True
    return options


def _cuda_devices(fn, args) -> list:
    """The CUDA devices whose random state a call of ``fn`` on ``args`` may draw from."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if isinstance(fn, torch.nn.Module):
        tensors += [*fn.parameters(), *fn.buffers()]
    return sorted({t.device.index for t in tensors if t.is_cuda})


def merged_report(name: str, reports: list) -> Report:
    """One report of several graphs' reports, each region's anchor prefixed by its graph
    ("forward graph 0: mm_3"); the regions are copies, numbered afresh."""
    merged = Report(function=name, regions=[], graph="\n\n".join(r.graph for r in reports if r.graph))
    for report in reports:
        for region in report.regions:
            merged.regions.append(dataclasses.replace(region, index=len(merged.regions),
                                                      anchor=f"{report.function}: {region.anchor}"))
    merged.error = "; ".join(r.error for r in reports if r.error)
    merged.notes = [f"{r.function}: {note}" for r in reports for note in r.notes]
    return merged


def explain(fn, example_inputs=(), kwargs: dict | None = None) -> Report:
    """Find, plan and generate without running a kernel; return the report. A program that
    trains (grad on, and an input or ``fn``'s parameter requires grad) is captured as the
    torch.compile backend compiles it, graph by graph, forward and backward (as
    ``comfuse.compile`` trains it), running ``fn`` once eagerly to do so; so is one that
    cannot be traced whole (keyword inputs, cache objects, Python that tracing cannot
    follow: most Hugging Face models). Any other is traced whole."""
    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        raise TypeError("comfuse.explain: example_inputs must be a tuple or list of arguments")
    args = tuple(example_inputs)
    if not kwargs and not _trains(fn, args):
        _, report = compile_graph(fn, args, execute=False)
        if not report.error:
            return report
    return _explain_graphs(fn, args, dict(kwargs or {}))


def _trains(fn, args: tuple) -> bool:
    """Whether a call of ``fn`` on ``args`` would have a backward: grad on, and an input or one
    of ``fn``'s parameters requires grad."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if isinstance(fn, torch.nn.Module):
        tensors += list(fn.parameters())
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _explain_graphs(fn, args: tuple, kwargs: dict) -> Report:
    """The regions of every graph Inductor lowers for ``fn(*args, **kwargs)`` under the
    torch.compile backend (graph breaks and all), each region's anchor prefixed by its graph
    ("forward graph 0: mm_3"). Where inputs or parameters require grad, the backward's graphs
    too: gradients are taken (and returned, not accumulated) so that AOTAutograd compiles the
    backward. Everything runs unfused (COMFUSE_DISABLE) and nothing is autotuned. The backend
    is a fresh one in cache entries of its own, so nothing compiled before is reused or
    dropped."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    passes: list = []
    backend = functools.partial(comfuse_backend, passes=passes)
    quiet_library_logging()
    try:
        with settings_mod.override(disable=True, autotune="0", graph_check="0"):
            isolated = {k: v for k, v in _cache_options(1).items() if k == "isolate_recompiles"}
            out = torch.compile(fn, backend=backend, dynamic=False, **isolated)(*args, **kwargs)
            _differentiate(out, fn, args, kwargs)
    except Exception as e:
        return Report(function=name, regions=[], error=f"torch.compile could not capture {name}: {summary(e)}")
    return merged_report(name, [r for p in passes for r in p.reports])


def _differentiate(out, fn, args: tuple, kwargs: dict) -> None:
    """Gradients of ``out``'s floating-point tensors that require grad with respect to what
    requires grad among the inputs and ``fn``'s parameters, taken and dropped."""
    leaves = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(fn, torch.nn.Module):
        leaves += [p for p in fn.parameters() if p.requires_grad]
    flat = []
    stack = [out]
    while stack:  # (model outputs: tensors, tuples, dicts, dataclass-like objects)
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            flat.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "to_tuple"):
            stack.extend(item.to_tuple())
    outs = [t for t in flat if t.requires_grad and t.is_floating_point()]
    leaves = leaves or _leaves_behind(outs)  # (a function that closes over a model's parameters)
    if torch.is_grad_enabled() and outs and leaves:
        torch.autograd.grad([t.float().sum() for t in outs], leaves, allow_unused=True)


def _leaves_behind(outs: list) -> list:
    """The tensors requiring grad that ``outs`` were computed from (the leaves of their
    autograd graph: parameters and inputs, however the function reached them)."""
    stack = [t.grad_fn for t in outs if t.grad_fn is not None]
    seen, leaves = set(), []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # (an AccumulateGrad: a leaf's)
        if variable is not None:
            leaves.append(variable)
        else:
            stack.extend(f for f, _ in fn.next_functions)
    return leaves
