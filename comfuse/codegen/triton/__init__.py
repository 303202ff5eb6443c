"""Triton code generation (owns: turning a Plan into readable kernel source and the
description of its parameters).

Modules: ``exprs`` (a region's values as Triton expressions), ``emit`` (the tile, row-in-CTA
and cooperative kernels), ``split`` (the split schedule's statistics and combine kernels),
``statistics`` (per-row statistics merged tile by tile), ``chain`` (back-to-back GEMM
chains), ``helpers`` (the device functions generated kernels import).

Invariant: the same source runs on the H200 and in Triton's CPU interpreter; the
``UPCAST_OPERANDS`` constexpr works around the interpreter's bf16 ``tl.dot``.
"""
from ..source import KernelSource, Param
from .emit import emit_kernel
from .split import emit_split


def emit(plan, name: str, phase: int | None = None) -> KernelSource:
    """The source of ``plan``'s Triton kernel(s), named ``name`` (``phase``: a cooperative
    plan's interpreter form, ``emit.emit_kernel``)."""
    if plan.schedule in ("split", "ws_split"):
        return emit_split(plan, name)
    return emit_kernel(plan, name, phase)


__all__ = ["KernelSource", "Param", "emit"]
