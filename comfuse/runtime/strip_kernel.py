"""Launching the warp-specialised Gluon template (codegen/gluon/strip.py) for a ws_strip plan,
with the same interface as runtime.kernel.Kernel (``launch(a3, b3, ins, outs)``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..codegen.triton import KernelSource
from ..planner import Plan
from .kernel import UnsupportedLayout


def config(plan: Plan):
    """The template's constexprs for ``plan`` (prefetch: the residual TMA-loaded into the
    hand-off buffer while the mainloop runs, else loaded by the epilogue chunk by chunk)."""
    from ..codegen.gluon.strip import KIND_LAYERNORM, KIND_RMSNORM, StripConfig
    t = plan.template
    return StripConfig(kind=KIND_LAYERNORM if t.kind == "layernorm" else KIND_RMSNORM,
                       has_bias=t.bias is not None, residual=0 if t.residual is None else (2 if plan.prefetch else 1),
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
    _scratch: dict = dataclasses.field(default_factory=dict)  # device -> (workspace, counters)

    @property
    def path(self) -> str:
        from ..codegen.gluon import strip
        return str(Path(strip.__file__))

    def launch(self, a3: torch.Tensor, b3: torch.Tensor, ins: list, outs: list) -> None:
        from ..codegen.gluon import strip
        dev = a3.device
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
            raise UnsupportedLayout("ws_strip: the Gluon template runs on sm_90 (Hopper) GPUs only")
        cfg = config(self.plan)
        t = self.plan.template
        a = _tma_ready(a3[0], "A")
        b = _tma_ready(b3[0].t() if cfg.b_kmajor else b3[0], "B")
        out = _tma_ready(outs[0][0], "the output")
        M, N = out.shape

        def vec(i):
            return None if i is None else ins[i].reshape(-1).contiguous()
        residual = None if t.residual is None else _tma_ready(ins[t.residual].reshape(M, N), "the residual")
        key = (dev, M, N)
        if key not in self._scratch:
            self._scratch[key] = (torch.empty(strip.workspace_numel(M, N), dtype=torch.float32, device=dev),
                                  torch.zeros(M // strip.BM, dtype=torch.int32, device=dev))
        ws, counters = self._scratch[key]
        strip.launch(cfg, a, b, out, bias=vec(t.bias), residual=residual, gamma=vec(t.gamma), beta=vec(t.beta),
                     eps=t.eps, ws=ws, counters=counters, num_sms=_sm_count(dev))


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def build(plan: Plan, name: str) -> StripKernel:
    return StripKernel(plan, KernelSource(name, f"# Gluon template: {plan.describe()}", (), (), 12, plan.num_stages))
