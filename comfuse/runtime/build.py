"""From a plan to a launchable kernel: its name, its source on disk, its loaded module.

A kernel's name hashes everything its source depends on (the region's structure, the plan's
choices, the code generator's version), so a name is one source and is built once per
process (``build``). Sources are written to the cache directory, where a person can open them.
"""
from __future__ import annotations

from ..codegen.triton import emit
from ..ir import structural_text
from ..planner import Plan
from . import cache, stages_kernel, strip_kernel
from .cache import CODEGEN_VERSION
from .kernel import Kernel
from .launch import interpreting

_kernels: dict = {}


def kernel_name(plan: Plan) -> str:
    key = cache.digest(structural_text(plan.region), repr(plan.key_fields()), CODEGEN_VERSION)
    return f"comfuse_{plan.schedule}_{key}"


def _triton_kernel(plan: Plan, name: str) -> Kernel:
    """A Triton plan's kernel; under the interpreter a cooperative plan also gets its phase
    kernels (codegen.triton.emit.emit_kernel)."""
    source = emit(plan, name)
    module = cache.load_source(name, source.text)
    phases = []
    if plan.schedule == "cooperative" and interpreting():
        for phase in range(plan.form.exchanges + 1):
            phase_name = f"{name}_phase{phase}"
            text = emit(plan, phase_name, phase=phase).text
            phases.append(getattr(cache.load_source(phase_name, text), phase_name))
    return Kernel(plan, source, getattr(module, name), tuple(phases), getattr(module, f"{name}_combine", None))


BUILDERS = {"ws_strip": strip_kernel.build,   # the hand-written Gluon template
            "ws_split": strip_kernel.build_lse,  # its terminal kind and a generated combine
            "ws_stages": stages_kernel.build}  # a Gluon kernel generated from the region's stages


CHOSEN: set = set()  # names of the kernels regions run (``chosen``)


def build(plan: Plan):
    """Generate (or reuse) the kernel for ``plan``."""
    name = kernel_name(plan)
    if name not in _kernels:
        _kernels[name] = BUILDERS.get(plan.schedule, _triton_kernel)(plan, name)
    return _kernels[name]


def chosen(plan: Plan):
    """The kernel for ``plan``, which a region runs from now on (``release`` keeps its scratch:
    a CUDA graph may have captured its launches)."""
    CHOSEN.add(kernel_name(plan))
    return build(plan)


def release(kernel) -> None:
    """Drop what ``kernel`` keeps between launches, unless some region runs it (``chosen``):
    its scratch (workspace and arrival counters) and its prepared launches, which hold that
    scratch. For the candidates autotuning did not choose: each kept its workspace for good,
    and an LM head's eight or nine candidates at 8192 x 128256 held about 33 MB each. Launched
    again, it allocates anew (counters at zero, as at its first launch)."""
    if kernel_name(kernel.plan) in CHOSEN:
        return
    for kept in ("_scratch", "_bound"):  # (dicts on every kernel class that has them)
        getattr(kernel, kept, {}).clear()
