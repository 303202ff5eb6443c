"""Compiled kernels: from a plan to a launchable function, and the launch itself.

On CUDA tensors the kernel runs through Triton's JIT. On CPU tensors it runs
through Triton's interpreter, which must be chosen before Triton is imported
(``comfuse`` does that on machines without a GPU); a one-time notice says so.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
import triton

from ..codegen.triton import KernelSource, emit
from ..ir import structural_text
from ..planner import Plan
from . import cache

CODEGEN_VERSION = "triton-1"


class ComfuseWarning(UserWarning):
    """Something was not fused, or ran on a slower path than asked."""


_notices: set[str] = set()


def notice_once(key: str, message: str) -> None:
    if key not in _notices:
        _notices.add(key)
        warnings.warn(message, ComfuseWarning, stacklevel=3)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter in this process."""
    return bool(triton.knobs.runtime.interpret)


def can_run_on(device: torch.device) -> str:
    """'' when a kernel can run on ``device``, else the reason it cannot."""
    if device.type == "cuda":
        return "" if torch.cuda.is_available() else "CUDA is not available"
    if device.type == "cpu":
        if interpreting():
            return ""
        return ("CPU tensors need Triton's interpreter, which is off in this process; set "
                "TRITON_INTERPRET=1 before importing comfuse (or triton) to run fused kernels "
                "on the CPU")
    return f"no kernels for {device.type} tensors"


def kernel_name(plan: Plan) -> str:
    params = (plan.transposed, plan.schedule, plan.block_m, plan.block_n, plan.block_k,
              plan.group_m, plan.num_warps, plan.num_stages)
    key = cache.digest(structural_text(plan.region), repr(params), CODEGEN_VERSION)
    return f"comfuse_{plan.schedule}_{key}"


@dataclasses.dataclass
class Kernel:
    plan: Plan
    source: KernelSource
    fn: object

    @property
    def path(self) -> str:
        return str(cache.kernel_dir() / f"{self.source.name}.py")

    def launch(self, a3: torch.Tensor, b3: torch.Tensor, ins: list, outs: list) -> None:
        """Run on canonical views: a3 [B, M, K], b3 [B, K, N], ins/outs [B|1, M|1, N|1],
        already transposed for column-strip plans."""
        B, M, K = a3.shape
        N = b3.shape[2]
        dims3 = {"B": 0, "M": 1, "N": 2}
        args = []
        for p in self.source.params:
            if p.role == "a":
                args.append(a3)
            elif p.role == "b":
                args.append(b3)
            elif p.role == "in":
                args.append(ins[p.index])
            elif p.role == "out":
                args.append(outs[p.index])
            elif p.role == "size":
                args.append({"M": M, "N": N, "K": K}[p.axis])
            elif p.role == "stride_a":
                args.append(a3.stride({"B": 0, "M": 1, "K": 2}[p.axis]))
            elif p.role == "stride_b":
                args.append(b3.stride({"B": 0, "K": 1, "N": 2}[p.axis]))
            elif p.role == "stride_in":
                args.append(ins[p.index].stride(dims3[p.axis]))
            elif p.role == "stride_out":
                args.append(outs[p.index].stride(dims3[p.axis]))
            else:  # pragma: no cover
                raise AssertionError(p)
        plan = self.plan
        grid = (triton.cdiv(M, plan.block_m) * triton.cdiv(N, plan.block_n), B)
        on_cpu = a3.device.type == "cpu" or interpreting()
        low = a3.dtype in (torch.float16, torch.bfloat16)
        tf32 = torch.backends.cuda.matmul.allow_tf32 and not on_cpu
        self.fn[grid](*args, **dict(self.source.constexprs),
                      UPCAST_OPERANDS=on_cpu and low,
                      DOT_PRECISION="tf32" if tf32 else "ieee",
                      WIDE_INDEX=_wide(a3, b3, *ins, *outs),
                      num_warps=self.source.num_warps, num_stages=self.source.num_stages)


def _wide(*tensors: torch.Tensor) -> bool:
    limit = 2**31 - 1
    for t in tensors:
        span = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)
        if span >= limit:
            return True
    return False


_kernels: dict[str, Kernel] = {}


def build(plan: Plan) -> Kernel:
    """Generate (or reuse) the kernel for ``plan``."""
    name = kernel_name(plan)
    if name not in _kernels:
        source = emit(plan, name)
        module = cache.load_source(name, source.text)
        _kernels[name] = Kernel(plan, source, getattr(module, name))
    return _kernels[name]
