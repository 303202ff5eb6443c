"""``comfuse.compile(fn, example_inputs)`` and ``comfuse.explain``.

``CompiledFunction`` keeps one specialisation per input signature (shapes, dtypes, devices,
the values of non-tensor arguments, defaults included) and, for a module, per state (which
parameter and buffer objects it holds, each submodule's training flag); a call with a new
signature or state captures again, so a call never reuses a kernel built for other shapes or
a graph traced with other weights or in another mode. Python state beyond these (a global a
branch reads) is traced as it was at capture; ``torch.compile(backend="comfuse")`` guards it. In each specialisation the captured graph
has every fused region replaced by its module (pipeline.py); everything else runs as eager
PyTorch ops.
"""
from __future__ import annotations

import collections
import functools
import inspect

import torch

from . import settings as settings_mod
from .errors import notice_once, summary
from .pipeline import compile_graph, fake_inputs
from .report import Report
from .runtime.region import FusedRegion


class Specialization:
    """The captured, rewritten graph for one input signature, and its report."""

    def __init__(self, fn, args: tuple, execute: bool = True):
        self.fn = fn
        self.gm, self.report = compile_graph(fn, args, execute=execute)

    def __call__(self, *args):
        if self.gm is None:
            return self.fn(*args)
        return self.gm.forward(*args)  # (not gm(...): nn.Module's call path costs ~1.6 us a call)


def _signature(args) -> tuple:
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            # which of the last two dims has unit stride: plans with TMA loads depend on it
            st = a.stride()
            unit = (st[-2] == 1, st[-1] == 1) if len(st) >= 2 else ()
            key.append(("T", a.shape, a.dtype, a.device, unit))
        else:
            try:
                hash(a)
            except TypeError:
                raise TypeError(f"comfuse.compile: argument of type {type(a).__name__} is neither a "
                                "tensor nor a hashable constant") from None
            key.append(("C", type(a), a))
    return tuple(key)


class _ModuleState:
    """What a module's captured graph depends on besides its arguments: the parameter, buffer
    and submodule objects (a replaced parameter must not run with the old one's values; values
    changed in place are read at each call) and every submodule's training flag (dropout, batch
    norm). ``key()`` is a small number per distinct state, read at each call from flat lists
    of the submodules' own dictionaries (cheaper than walking ``parameters()`` and
    ``modules()`` again)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.ids: dict = {}
        self.last = None
        self.key()

    def _fingerprint(self) -> list:
        out = []
        for m in self.mods:
            out.append(m.training)
            out.extend(map(id, m._parameters.values()))
            out.extend(map(id, m._buffers.values()))
            out.extend(map(id, m._modules.values()))
        return out

    def key(self) -> int:
        if self.last is None or self._fingerprint() != self.last:
            self.mods = list(self.module.modules())  # (a submodule may have been replaced)
            self.params = list(self.module.parameters())
            self.last = self._fingerprint()
            self.current = self.ids.setdefault(tuple(self.last), len(self.ids))
        return self.current

    def trains(self) -> bool:
        return any(p.requires_grad for p in self.params)


class CompiledFunction:
    """``comfuse.compile(fn, example_inputs)``: call it like ``fn``."""

    def __init__(self, fn, example_inputs):
        if not callable(fn):
            raise TypeError(f"comfuse.compile expects a callable, got {type(fn).__name__}")
        if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
            raise TypeError("comfuse.compile: example_inputs must be a tuple or list of arguments")
        functools.update_wrapper(self, fn, updated=())
        self._fn = fn
        try:
            self._sig = inspect.signature(fn)
        except (TypeError, ValueError):
            self._sig = None
        # arguments bound with their defaults where the signature is plain (no *args, **kwargs)
        plain = self._sig is not None and all(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in self._sig.parameters.values())
        self._sig = self._sig if plain else None
        self._state = _ModuleState(fn) if isinstance(fn, torch.nn.Module) else None
        self._specs: collections.OrderedDict = collections.OrderedDict()
        self._specialize(self._bind(tuple(example_inputs), {}), self._state_key())

    def _state_key(self) -> tuple:
        return (self._state.key(),) if self._state is not None else ()

    def _bind(self, args, kwargs) -> tuple:
        if self._sig is None or (not kwargs and len(args) == len(self._sig.parameters)):
            return args
        bound = self._sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def _specialize(self, args: tuple, state: tuple = ()) -> Specialization:
        key = _signature(args) + state
        spec = self._specs.get(key)
        if spec is None:
            limit = settings_mod.get().max_specializations
            if len(self._specs) >= limit:
                self._specs.popitem(last=False)
                notice_once(f"specs:{id(self)}", f"comfuse: more than {limit} input signatures for "
                            f"{getattr(self._fn, '__name__', self._fn)}; dropping the oldest")
            spec = Specialization(self._fn, args)
            self._specs[key] = spec
        return spec

    @property
    def report(self) -> Report:
        """The report of the most recently built specialisation."""
        return next(reversed(self._specs.values())).report

    def fused_regions(self) -> list:
        """The FusedRegion modules of the most recently built specialisation, in graph order
        (each holds its plan, its alternatives and, once called, its kernel)."""
        gm = next(reversed(self._specs.values())).gm
        return [] if gm is None else [m for m in gm.modules() if isinstance(m, FusedRegion)]

    def __call__(self, *args, **kwargs):
        args = self._bind(args, kwargs)
        state = self._state_key()  # (first: it notices replaced parameters)
        if torch.is_grad_enabled() and (any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
                                        or (self._state is not None and self._state.trains())):
            notice_once(f"grad:{id(self)}", "comfuse: inputs or parameters require grad and comfuse.compile's "
                        "kernels have no backward; running the function eagerly "
                        "(torch.compile(backend=\"comfuse\") trains)")
            return self._fn(*args)
        return self._specialize(args, state)(*args)


def explain(fn, example_inputs=(), kwargs: dict | None = None) -> Report:
    """Find, plan and generate without running a kernel; return the report. ``fn`` is traced
    whole where it can be; a program that cannot be (keyword inputs, cache objects, Python
    that tracing cannot follow: most Hugging Face models) is captured as the torch.compile
    backend sees it instead, graph by graph, running ``fn`` once eagerly to do so."""
    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        raise TypeError("comfuse.explain: example_inputs must be a tuple or list of arguments")
    args = tuple(example_inputs)
    if not kwargs:
        report = Specialization(fn, args, execute=False).report
        if not report.error:
            return report
    return _explain_graphs(fn, args, dict(kwargs or {}))


def _explain_graphs(fn, args: tuple, kwargs: dict) -> Report:
    """The regions of every graph Dynamo hands a backend for ``fn(*args, **kwargs)`` (graph
    breaks and all), each region's anchor prefixed by its graph's number."""
    reports = []

    def record(gm, example_inputs):
        reports.append(compile_graph(gm, fake_inputs(example_inputs), execute=False)[1])
        return gm.forward

    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    try:
        with torch.no_grad():
            torch.compile(fn, backend=record, dynamic=False)(*args, **kwargs)
    except Exception as e:
        return Report(function=name, regions=[], error=f"torch.compile could not capture {name}: {summary(e)}")
    merged = Report(function=name, regions=[], graph="\n\n".join(r.graph for r in reports if r.graph))
    for number, report in enumerate(reports):
        for region in report.regions:
            region.index, region.anchor = len(merged.regions), f"graph {number}: {region.anchor}"
            merged.regions.append(region)
    errors = [r.error for r in reports if r.error]
    merged.error = "; ".join(errors)
    return merged
