"""``comfuse.compile(fn, example_inputs)`` and ``comfuse.explain``.

``CompiledFunction`` keeps one specialisation per input signature (shapes, dtypes, devices,
and the values of non-tensor arguments); a call with a new signature captures again, so a
call never reuses a kernel built for other shapes. In each specialisation the captured graph
has every fused region replaced by its module (pipeline.py); everything else runs as eager
PyTorch ops.
"""
from __future__ import annotations

import collections
import functools
import inspect

import torch

from . import settings as settings_mod
from .errors import notice_once
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
        self._specs: collections.OrderedDict = collections.OrderedDict()
        self._specialize(tuple(example_inputs))

    def _bind(self, args, kwargs) -> tuple:
        if not kwargs or self._sig is None:
            return args
        bound = self._sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def _specialize(self, args: tuple) -> Specialization:
        key = _signature(args)
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
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            notice_once(f"grad:{id(self)}", "comfuse: inputs require grad and comfuse.compile's kernels have no "
                        "backward; running the function eagerly (torch.compile(backend=\"comfuse\") trains)")
            return self._fn(*args)
        return self._specialize(args)(*args)


def explain(fn, example_inputs) -> Report:
    """Find, plan and generate without running anything; return the report."""
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError("comfuse.explain: example_inputs must be a tuple or list of arguments")
    return Specialization(fn, tuple(example_inputs), execute=False).report
