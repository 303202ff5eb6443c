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
from .pipeline import compile_graph
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
        self._trainer = None  # torch.compile's form, built at the first call that needs gradients
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
            return self._training()(*args)
        return self._specialize(args, state)(*args)

    def _training(self):
        """The function compiled for training: through torch.compile with comfuse's backend,
        where Dynamo guards it, AOTAutograd differentiates it and comfuse fuses regions in the
        forward and the backward graphs Inductor lowers."""
        if self._trainer is None:
            notice_once(f"grad:{id(self)}", "comfuse: inputs or parameters require grad; "
                        f"{getattr(self._fn, '__name__', type(self._fn).__name__)} trains through "
                        "torch.compile(backend=\"comfuse\") (forward and backward graphs)")
            self._trainer = torch.compile(self._fn, backend="comfuse", dynamic=False)
        return self._trainer


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
    """The regions of every graph Inductor lowers for ``fn(*args, **kwargs)`` under the
    torch.compile backend (graph breaks and all), each region's anchor prefixed by its graph
    ("forward graph 0: mm_3"). Where inputs or parameters require grad, the backward's graphs
    too: gradients are taken (and returned, not accumulated) so that AOTAutograd compiles the
    backward. Everything runs unfused (COMFUSE_DISABLE) and nothing is autotuned."""
    from .inductor_pass import REPORTS
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    REPORTS.clear()  # (the pass keeps the last few: these are this call's)
    try:
        with settings_mod.override(disable=True, autotune="0", graph_check="0"):
            torch._dynamo.reset()
            out = torch.compile(fn, backend="comfuse", dynamic=False)(*args, **kwargs)
            _differentiate(out, fn, args, kwargs)
    except Exception as e:
        return Report(function=name, regions=[], error=f"torch.compile could not capture {name}: {summary(e)}")
    finally:
        torch._dynamo.reset()
    reports = list(REPORTS)
    merged = Report(function=name, regions=[], graph="\n\n".join(r.graph for r in reports if r.graph))
    for report in reports:
        for region in report.regions:
            region.index, region.anchor = len(merged.regions), f"{report.function}: {region.anchor}"
            merged.regions.append(region)
    merged.error = "; ".join(r.error for r in reports if r.error)
    return merged


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
    if torch.is_grad_enabled() and outs and leaves:
        torch.autograd.grad([t.float().sum() for t in outs], leaves, allow_unused=True)
