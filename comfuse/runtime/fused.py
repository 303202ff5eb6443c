"""The module that runs a fused region or chain inside a captured graph: its kernel, or its
original ops.

Failures never give a wrong answer: a kernel that fails at launch, or whose first call
disagrees with the region's own ops (``validate``), turns the region off with a
``FallbackWarning`` (``COMFUSE_STRICT=1`` raises); tensors a kernel cannot take (a misaligned
TMA operand) run this call unfused. On a GPU the first call autotunes (``autotune``): the
candidate plans and the region's ops compiled by Inductor are timed, and the fastest runs.
"""
from __future__ import annotations

import warnings

import torch

from .. import settings as settings_mod
from ..errors import FallbackWarning, KernelMismatch, UnsupportedLayout, notice_once, summary
from . import tuning
from .launch import can_run_on


class Fused(torch.nn.Module):
    """Subclasses give ``kind`` ("region", "chain"), ``regions`` (as found), ``unfused`` (the
    ops), ``report``, and ``device_of(ext)``, ``run(ext, device, check)``, ``tune(ext, device)``,
    ``exact(ext)`` (the float64 outputs) and ``tolerance`` (their agreement tolerance)."""

    kind = "region"
    pinned: tuple = ()  # the settings overridden where it was made, which hold for its calls

    def __init__(self, unfused, report):
        super().__init__()
        self.unfused = unfused
        self.report = report
        self.kernel = None
        self.failed = ""
        self.tuned: set = set()  # devices whose choice is made
        self.validated: set = set()  # devices where the first call was compared with the ops
        self.prefer_unfused = False
        self.separate = None  # the unfused ops as autotuning timed them (Inductor on a GPU)
        self.separate_form = None  # the form autotuning chose for them, when read from a decision
        # (the compilation's settings: the backend's options, and any override it ran under)
        self.pinned = settings_mod.overrides_now()

    def __getstate__(self):
        """What a later process loads (region_op.py stores regions in comfuse's cache): the
        plan autotuning chose and where it was tuned, not its built kernel nor the ops as
        Inductor compiled them, which that process builds again. A region that was not tuned
        (autotuning off) checks its first call against its ops there again."""
        state = dict(self.__dict__)
        state.pop("_replay", None)  # (launchers of this process: region_op.py)
        state.update(kernel=None, separate=None, validated=set(),
                     _modules={k: m for k, m in self._modules.items() if k != "separate"})
        return state

    def empty_outputs(self, device) -> list:
        """The outputs' tensors as a launch returns them (what a fake execution returns)."""
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.output_specs]

    def laid_out(self, outs):
        """``outs`` (the unfused ops', where they run in the kernel's place) as a launch lays
        them out: the graph that calls the region was compiled for those strides."""
        return outs

    def forward(self, *ext):
        return self._call(ext)

    def settled(self, device, settings) -> bool:
        """Whether a call on ``device`` now runs the chosen kernel and nothing else: no tuning
        or comparison to come, no check, no fallback (a replay of its launches may stand for
        it: region_op.py)."""
        if self.kernel is None or self.failed or self.prefer_unfused or settings.disable or settings.check:
            return False
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return False  # (the interpreter's launches are not bound: nothing to replay)
        return device in self.tuned or (device in self.validated and not tuning.enabled(device, settings))

    def choose(self, *ext) -> None:
        """What the first call decides (autotuning, or the comparison with the ops), made now
        on ``ext``, without running the unfused ops if they win: inside Inductor's compilation
        they go back into the graph instead, and compiling them here would be wasted."""
        self._call(ext, choose_only=True)

    def _call(self, ext, choose_only: bool = False):
        if not self.pinned:
            return self._decide_and_run(ext, choose_only)
        with settings_mod.beneath(self.pinned):  # (for tuning's and the check's own reads too)
            return self._decide_and_run(ext, choose_only)

    def _decide_and_run(self, ext, choose_only: bool):
        settings = settings_mod.get()  # (once a call: Python's time per call matters)
        unfused = (lambda: None) if choose_only else (lambda: self.laid_out(self.unfused(*ext)))
        if self.failed or settings.disable:
            return unfused()
        device = self.device_of(ext)
        why = can_run_on(device)
        if why:
            notice_once(f"device:{why}", f"comfuse: running unfused: {why}")
            return unfused()
        if device.type == "cpu":
            notice_once("interpreter", "comfuse: fused kernels on CPU tensors run through Triton's "
                        "interpreter (exact but slow); use CUDA tensors for speed")
        # under CUDA-graph capture nothing may synchronise or copy from the host: no timing,
        # no comparison (the warm-up call before capture has tuned and checked the region)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        try:
            if device not in self.tuned and not capturing and tuning.enabled(device, settings):
                self.tune(ext, device)
            if self.prefer_unfused:
                return None if choose_only else self.laid_out(self.run_separate(ext))
            outs = self.run(ext, device, check=settings.check and not capturing)
            if device not in self.tuned and device not in self.validated and not capturing:
                return self.laid_out(self.validate(ext, device, outs))
            return outs
        except KernelMismatch:
            raise
        except UnsupportedLayout as e:  # this call only: the next may fit again
            notice_once(f"layout:{id(self)}", f"comfuse: {self.kind} at {self.report.anchor}: {e}; "
                        "calls with such tensors run unfused")
            return unfused()
        except Exception as e:
            if settings.strict:
                raise
            self.fail(f"kernel failed: {summary(e)}")
            return unfused()

    def run_separate(self, ext):
        if self.separate is None:  # (a decision read from disk: the ops are compiled at their first run)
            self.separate, _ = tuning.separate(self.unfused, ext, form=self.separate_form)
        return self.separate(*ext)

    def validate(self, ext, device, outs):
        """The first call's fused outputs against the region's own ops (COMFUSE_VALIDATE): on
        disagreement it runs unfused from now on, and this call returns the ops' outputs."""
        self.validated.add(device)
        if not tuning.validating(device, self.regions):
            return outs
        return tuning.check_first_call(outs, lambda: self.unfused(*ext), self.tolerance,
                                       f"{self.kind} at {self.report.anchor}", self.fail, exact=lambda: self.exact(ext))

    def fail(self, reason: str) -> None:
        self.failed = reason
        self.report.fused, self.report.reason = False, reason
        warnings.warn(f"comfuse: {self.kind} at {self.report.anchor} runs unfused: {reason}", FallbackWarning,
                      stacklevel=4)

    def autotune(self, ext, device, key: str, names: list, run_fused, about: dict | None = None) -> dict:
        """The decision among ``names`` (``run_fused(i)`` runs the i-th) and the unfused ops:
        stored on disk under ``key``, or made now (``tuning.decide``), with ``about`` (what was
        tuned: sizes, each candidate's plan, the data a cost model is fitted to). Where the ops
        win they run from then on (``prefer_unfused``), and the report says why."""
        decision = tuning.load(key)
        if not tuning.reusable(decision, names):
            tuning.log.info("autotuning the %s at %s", self.kind, self.report.anchor)
            self.separate, form = tuning.separate(self.unfused, ext)
            decision = tuning.decide(names, run_fused, lambda: tuple(self.separate(*ext)), device, self.tolerance,
                                     exact=lambda: self.exact(ext))
            decision["separate"] = form  # (a later process runs the same form without timing it)
            decision.update(about or {})
            # (a misaligned operand that ruled plans out holds for this process only: the next
            # one measures again rather than inherit the choice)
            if not any(why.startswith("UnsupportedLayout") for why in decision["rejected"].values()):
                tuning.store(key, decision)
        self.tuned.add(device)
        return decision

    def keep_unfused(self, ext, decision: dict, what: str) -> None:
        """Autotuning chose the unfused ops over ``what``: they run from now on."""
        times = decision["times_ms"]
        self.prefer_unfused = True
        # (compiled when first run, not now: inside Inductor's compilation the ops are put back
        # into the graph and never run here, and a decision read from disk then costs no compile)
        self.separate_form = decision.get("separate")
        fused_ms = min((t for n, t in times.items() if n != tuning.UNFUSED), default=float("inf"))
        self.report.fused = False
        self.report.reason = (f"autotune: the unfused ops ({decision.get('separate', 'ops')}, "
                              f"{times[tuning.UNFUSED]:.4f} ms) beat {what} ({fused_ms:.4f} ms)")
