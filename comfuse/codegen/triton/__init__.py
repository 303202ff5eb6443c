"""Triton code generation (owns: turning a Plan into readable kernel source and the
description of its parameters).

Invariant: the same source runs on the H200 and in Triton's CPU interpreter;
the ``UPCAST_OPERANDS`` constexpr works around the interpreter's bf16 ``tl.dot``.
"""
from .emit import KernelSource, Param, emit

__all__ = ["KernelSource", "Param", "emit"]
