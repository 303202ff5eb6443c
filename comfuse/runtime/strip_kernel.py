"""Launching the warp-specialised Gluon template (codegen/gluon/strip.py): a ws_strip plan
(``StripKernel``) and a ws_split plan (``LseKernel``, the template's terminal kind and a
generated combine kernel), with the interface of runtime.kernel.Kernel
(``launch(a3, b3, ins, outs)``). The first call per layout of the tensors checks them and
launches through Triton's JIT; later calls launch the compiled kernel directly with new
descriptors (``launch.launch_direct``)."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from ..codegen.gluon import strip
from ..codegen.source import KernelSource
from ..codegen.triton import emit
from ..codegen.triton.split import as_split
from ..planner import Plan
from ..planner.onepass import parts
from . import cache, kept
from .kernel import Kernel
from .launch import bind_tensors, filled, interpreting, launch_direct, layout_key, sm90_only, sm_count, tma_ready


def config(plan: Plan):
    """The template's constexprs for ``plan`` (``residual_tma``: the residual TMA-loaded into the
    hand-off buffer while the mainloop runs, else loaded by the epilogue chunk by chunk)."""
    t = plan.form.template
    kind = {"layernorm": strip.KIND_LAYERNORM, "rmsnorm": strip.KIND_RMSNORM, "softmax": strip.KIND_SOFTMAX}[t.kind]
    return strip.StripConfig(kind=kind, has_bias=t.bias is not None,
                             residual=0 if t.residual is None else (2 if plan.form.residual_tma else 1),
                             has_gamma=t.gamma is not None, has_beta=t.beta is not None, relu=t.relu,
                             b_kmajor=plan.region.gemm.b.major == "K")


def operands(plan: Plan, a3, b3, ins, outs) -> tuple:
    """(a, b, out, bias, residual, gamma, beta): the template's 2-D and 1-D views of a call's
    tensors (None for a role the template does not take)."""
    t = plan.form.template
    out = outs[0][0]

    def vec(i):
        return None if i is None else ins[i].reshape(-1).contiguous()
    return (a3[0], b3[0].t() if plan.region.gemm.b.major == "K" else b3[0], out, vec(t.bias),
            None if t.residual is None else ins[t.residual].reshape(out.shape), vec(t.gamma), vec(t.beta))


@dataclasses.dataclass
class StripKernel:
    plan: Plan
    source: KernelSource
    _scratch: dict = dataclasses.field(default_factory=dict)  # (device, M, N) -> (workspace, counters)
    _bound: dict = dataclasses.field(default_factory=dict)  # tensor layout -> (run, statics, config)

    @property
    def path(self) -> str:
        return str(Path(strip.__file__))

    def operands(self, a3, b3, ins, outs) -> tuple:
        return operands(self.plan, a3, b3, ins, outs)

    def launch(self, a3: torch.Tensor, b3: torch.Tensor, ins: list, outs: list) -> None:
        """The first call per layout of the tensors (shapes, strides, 16-byte alignment) checks
        them and launches through Triton's JIT; later calls launch the compiled kernel directly
        with new descriptors (``kernel.launch_direct``: the JIT's argument binding and
        specialisation skipped)."""
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
        dev = a.device
        sm90_only(dev, "ws_strip")
        tma_ready(a, "A")
        tma_ready(b, "B")
        tma_ready(out, "the output")
        if residual is not None:
            tma_ready(residual, "the residual")
        M, N = out.shape
        key = (dev, M, N)
        ws, counters = kept.once(self._scratch, key, dev, lambda: (
            torch.empty(strip.workspace_numel(M, N), dtype=torch.float32, device=dev),
            torch.zeros(M // strip.BM, dtype=torch.int64, device=dev)))  # (int64: never wraps)
        cfg = config(self.plan)
        grid, args, options = strip.arguments(cfg, a, b, out, bias=bias, residual=residual, gamma=gamma, beta=beta,
                                              eps=self.plan.form.template.eps, ws=ws, counters=counters,
                                              num_sms=sm_count(dev))
        return (*launch_direct(strip.strip_kernel, grid, args, options, set(range(strip.PER_CALL))), cfg)


def build(plan: Plan, name: str) -> StripKernel:
    return StripKernel(plan, KernelSource(name, f"# Gluon template: {plan.describe()}", (), (), 12, plan.num_stages))


@dataclasses.dataclass
class LseKernel:
    """A ws_split plan: the Gluon template's terminal kind (KIND_LSE: per tile and row the
    log-sum-exp of its columns, and the logit at the row's target) and the generated Triton
    combine kernel that merges them and computes the outputs (codegen/triton/split.py,
    ``emit_lse_combine``). Memory besides inputs and outputs: (N / 256 + 1) fp32 per row, 0.8 %
    of the bf16 logits (with the row maxima, 2 N / 256 + 1)."""
    plan: Plan
    source: KernelSource  # the combine's
    combine_fn: object
    _scratch: dict = dataclasses.field(default_factory=dict)  # (device, M, N) -> (workspace, dummy tile, counters); ("no targets", device, M) -> -1s
    _bound: dict = dataclasses.field(default_factory=dict)  # tensor layout -> (template run, statics, config)

    @property
    def path(self) -> str:
        return str(Path(strip.__file__))

    @functools.cached_property
    def helper(self):
        """The combine's arguments and options, as a generated split kernel takes them (made once)."""
        return Kernel(as_split(self.plan), self.source, self.combine_fn)

    def config(self):
        t = self.plan.form.template
        return strip.StripConfig(kind=strip.KIND_LSE, residual=0, b_kmajor=self.plan.region.gemm.b.major == "K",
                                 group_m=strip.GROUP_M, lse_out=t.logits is not None, exact_max=t.exact_max,
                                 pick=t.pick is not None and t.logits is None)

    def logits(self, outs, dummy):
        """What the template writes its tile to: the region's logits output ([M, N], unit
        column stride, rows 16-byte aligned for its TMA store) where it has one, else the dummy
        tile it never writes."""
        k = self.plan.form.template.logits
        if k is None:
            return dummy
        return tma_ready(outs[k][0], "the logits (written by TMA)", "ws_split")

    def operands(self, a3, b3, ins):
        t = self.plan.form.template
        b = b3[0].t() if self.plan.region.gemm.b.major == "K" else b3[0]
        M = a3.shape[1]
        if t.target is not None:
            return a3[0], b, ins[t.target].reshape(-1).contiguous()
        key = ("no targets", str(a3.device), M)  # (read, never written: one tensor for every call)
        return a3[0], b, kept.once(self._scratch, key, a3.device,
                                   lambda: torch.full((M, ), -1, dtype=torch.int64, device=a3.device))

    def workspace(self, device, M: int, N: int):
        """(workspace, dummy tile, counters) for [M, N], made at the first call for them and
        kept: a call that binds another layout allocates nothing it keeps (inside a CUDA-graph
        warm-up, a tensor kept from it would sit in the graphs' memory pool untracked, and
        Inductor refuses every later run of that pool). KIND_LSE counts no arrivals; its
        counters are a placeholder the kernel never reads."""
        return kept.once(self._scratch, (str(device), M, N), device, lambda: (
            torch.empty(strip.workspace_numel(M, N, strip.KIND_LSE, self.plan.form.template.exact_max),
                        dtype=torch.float32, device=device),
            torch.empty(strip.BM, strip.BN, dtype=torch.bfloat16, device=device),
            torch.zeros(1, dtype=torch.int64, device=device)))

    def combine(self, a3, b3, ins, outs, ws) -> None:
        """The combine kernel alone, on a workspace as the template leaves it (runs under
        Triton's interpreter too: the CPU tests check it there)."""
        helper = self.helper
        M = a3.shape[1]
        on_cpu = a3.device.type == "cpu" or interpreting()
        grid = (-(-M // self.plan.block_m), )
        tensors = (a3, b3, *ins, *outs)
        key = ("combine", torch.backends.cuda.matmul.allow_tf32, *layout_key((*tensors, ws)))
        bound = None if on_cpu else self._bound.get(key)
        if bound is not None:  # a later call with the layout: the compiled kernel, this call's tensors
            run, statics, slots = bound
            run(*filled(statics, slots, tensors))
            return
        args = helper.arguments(a3, b3, ins, outs, ws, None, 0)
        options = helper.options(a3, b3, ins, outs, on_cpu)
        if on_cpu:
            self.combine_fn[grid](*args, **options)
            return
        # through Triton's JIT once per layout, as the Triton plans bind their launches
        # (kernel.py): the JIT's argument binding and specialisation cost tens of microseconds
        self._bound[key] = bind_tensors(self.combine_fn, grid, args, options, tensors)

    def statistics(self, a3, b3, ins, outs) -> torch.Tensor:
        """Run the template alone (writing the logits where the region has them); its workspace
        (a view, valid until the next launch)."""
        a, b, targets = self.operands(a3, b3, ins)
        ws, dummy, _ = self.workspace(a.device, a.shape[0], b3.shape[2])
        out = self.logits(outs, dummy)
        layout = layout_key((a3, b3, *ins, out))
        bound = self._bound.get(("stats", layout))
        if bound is None:
            self._bound[("stats", layout)] = self.bind(a, b, targets, out)
            return ws
        run, statics, cfg = bound
        run(*strip.call_arguments(cfg, a, b, out, targets=targets, tile=dummy), *statics[strip.PER_CALL:])
        return ws

    def launch(self, a3: torch.Tensor, b3: torch.Tensor, ins: list, outs: list) -> None:
        ws = self.statistics(a3, b3, ins, outs)
        self.combine(a3, b3, ins, outs, ws)

    def bind(self, a, b, targets, out):
        """Check a layout's tensors, launch the template once through the JIT; return (run,
        statics, config)."""
        dev = a.device
        sm90_only(dev, "ws_split")
        tma_ready(a, "A", "ws_split")
        tma_ready(b, "B", "ws_split")
        cfg = self.config()
        M = a.shape[0]
        N = b.shape[0] if cfg.b_kmajor else b.shape[1]
        ws, dummy, counters = self.workspace(dev, M, N)
        grid, args, options = strip.arguments(cfg, a, b, out, ws=ws, counters=counters, targets=targets,
                                              num_sms=sm_count(dev), tile=dummy)
        if len(self._bound) > 64:
            self._bound.clear()
        return (*launch_direct(strip.strip_kernel, grid, args, options, set(range(strip.PER_CALL))), cfg)


def build_lse(plan: Plan, name: str) -> LseKernel:
    source = emit(plan, name)
    module = cache.load_source(name, source.text)
    return LseKernel(plan, source, getattr(module, f"{name}_combine"))
