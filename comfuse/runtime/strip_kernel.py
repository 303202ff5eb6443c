"""Launching the warp-specialised Gluon template (codegen/gluon/strip.py) for a ws_strip plan,
with the same interface as runtime.kernel.Kernel (``launch(a3, b3, ins, outs)``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..codegen.triton import KernelSource
from ..planner import Plan
from .kernel import UnsupportedLayout, launch_direct, layout_key


def config(plan: Plan):
    """The template's constexprs for ``plan`` (prefetch: the residual TMA-loaded into the
    hand-off buffer while the mainloop runs, else loaded by the epilogue chunk by chunk)."""
    from ..codegen.gluon import strip
    t = plan.template
    kind = {"layernorm": strip.KIND_LAYERNORM, "rmsnorm": strip.KIND_RMSNORM, "softmax": strip.KIND_SOFTMAX}[t.kind]
    return strip.StripConfig(kind=kind, has_bias=t.bias is not None,
                             residual=0 if t.residual is None else (2 if plan.prefetch else 1),
                             has_gamma=t.gamma is not None, has_beta=t.beta is not None, relu=t.relu,
                             b_kmajor=plan.region.gemm.b.major == "K")


def _tma_ready(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
        raise UnsupportedLayout(f"ws_strip: {what} needs unit inner stride and 16-byte aligned rows; "
                                f"got strides {t.stride()}")
    return t


@dataclasses.dataclass
class StripKernel:
    plan: Plan
    source: KernelSource
    _scratch: dict = dataclasses.field(default_factory=dict)  # (device, M, N) -> (workspace, counters)
    _bound: dict = dataclasses.field(default_factory=dict)  # tensor layout -> (run, statics, config)

    @property
    def path(self) -> str:
        from ..codegen.gluon import strip
        return str(Path(strip.__file__))

    def operands(self, a3, b3, ins, outs) -> tuple:
        """(a, b, out, bias, residual, gamma, beta): the template's 2-D and 1-D views of a call's
        tensors (None for a role the template does not take)."""
        t = self.plan.template
        out = outs[0][0]

        def vec(i):
            return None if i is None else ins[i].reshape(-1).contiguous()
        return (a3[0], b3[0].t() if self.plan.region.gemm.b.major == "K" else b3[0], out, vec(t.bias),
                None if t.residual is None else ins[t.residual].reshape(out.shape), vec(t.gamma), vec(t.beta))

    def launch(self, a3: torch.Tensor, b3: torch.Tensor, ins: list, outs: list) -> None:
        """The first call per layout of the tensors (shapes, strides, 16-byte alignment) checks
        them and launches through Triton's JIT; later calls launch the compiled kernel directly
        with new descriptors (``kernel.launch_direct``: the JIT's argument binding and
        specialisation skipped)."""
        from ..codegen.gluon import strip
        layout = layout_key((a3, b3, *ins, *outs))
        bound = self._bound.get(layout)
        a, b, out, bias, residual, gamma, beta = self.operands(a3, b3, ins, outs)
        if bound is None:
            if len(self._bound) > 64:
                self._bound.clear()
            self._bound[layout] = self.bind(a, b, out, bias, residual, gamma, beta)
            return
        run, statics, cfg = bound
        run(*strip.call_arguments(cfg, a, b, out, bias, residual, gamma, beta), *statics[strip.PER_CALL:])

    def bind(self, a, b, out, bias, residual, gamma, beta):
        """Check a layout's tensors, launch once through the JIT; return (run, statics, config)."""
        from ..codegen.gluon import strip
        dev = a.device
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
            raise UnsupportedLayout("ws_strip: the Gluon template runs on sm_90 (Hopper) GPUs only")
        _tma_ready(a, "A")
        _tma_ready(b, "B")
        _tma_ready(out, "the output")
        if residual is not None:
            _tma_ready(residual, "the residual")
        M, N = out.shape
        key = (dev, M, N)
        if key not in self._scratch:
            self._scratch[key] = (torch.empty(strip.workspace_numel(M, N), dtype=torch.float32, device=dev),
                                  torch.zeros(M // strip.BM, dtype=torch.int32, device=dev))
        ws, counters = self._scratch[key]
        cfg = config(self.plan)
        grid, args, options = strip.arguments(cfg, a, b, out, bias=bias, residual=residual, gamma=gamma, beta=beta,
                                              eps=self.plan.template.eps, ws=ws, counters=counters,
                                              num_sms=_sm_count(dev))
        return (*launch_direct(strip.strip_kernel, grid, args, options, set(range(strip.PER_CALL))), cfg)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def build(plan: Plan, name: str) -> StripKernel:
    return StripKernel(plan, KernelSource(name, f"# Gluon template: {plan.describe()}", (), (), 12, plan.num_stages))
