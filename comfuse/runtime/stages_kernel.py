"""Launching a ws_stages plan: the warp-specialised Gluon kernel generated from the region's
stages (codegen/gluon/stages.py), with the interface of runtime.kernel.Kernel
(``launch(a3, b3, ins, outs)``). The first call per layout of the tensors checks them and
launches through Triton's JIT; later calls launch the compiled kernel directly, their TMA
descriptors rebuilt from the checked ones' fields (``launch.launch_direct``)."""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..codegen.gluon import parts, stages
from ..codegen.source import KernelSource
from ..errors import UnsupportedLayout
from ..planner import Plan
from ..planner.gluon import tma_residual
from . import cache, kept
from .launch import launch_direct, layout_key, sm90_only, sm_count, tma_ready


@functools.cache
def _descriptor_class():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor


def _descriptor(fields: dict, base):
    """A TMA descriptor of ``fields`` (a checked TensorDescriptor's, less its base) over
    ``base``, without TensorDescriptor's checks: the launch's layout key has the shape, the
    strides, the dtype and the 16-byte alignment they checked (the checks took two fifths of
    a launch's own host time)."""
    d = object.__new__(_descriptor_class())
    d.__dict__.update(fields)
    d.base = base
    return d


def source_text(plan: Plan, name: str) -> str:
    return stages.emit(plan.region, plan.stages, name, plan.describe(), plan.form)


def options(plan: Plan, N: int) -> dict:
    """Every constexpr of a plan's generated kernel (launch_direct's own launcher takes them
    all; a missing one sends each call through the JIT's binding) and the launch options."""
    bn = plan.block_n
    return dict(B_KMAJOR=plan.region.gemm.b.major == "K", BN=bn, TILES_N=N // bn, TILES_P2=parts.pow2(N // bn),
                STAGES=plan.num_stages, CHUNK=stages.CHUNK, EPI_WARPS=stages.EPI_WARPS, EPI_REGS=stages.EPI_REGS,
                LANES_N=plan.form.lanes, num_warps=plan.num_warps, maxnreg=168)


@dataclasses.dataclass
class StagesKernel:
    plan: Plan
    source: KernelSource
    fn: object
    _scratch: dict = dataclasses.field(default_factory=dict)  # (device, M, N) -> (workspace, counters)
    _bound: dict = dataclasses.field(default_factory=dict)  # tensor layout -> (run, statics, fresh, fields)

    @property
    def path(self) -> str:
        return str(cache.kernel_dir() / f"{self.source.name}.py")

    def tensors(self, a3, b3, ins, outs) -> list:
        """A, B (as [N, K] when K-major) and the flat views the generated kernel indexes: [N]
        and [M] vectors, [M, N] row-major matrices."""
        flat = [a3[0], b3[0].t() if self._kmajor else b3[0]]
        inputs = len(ins)
        for i, (t, matrix) in enumerate(zip((*ins, *outs), self._matrices)):
            v = t[0] if matrix else t.reshape(-1)
            if not v.is_contiguous():
                if i >= inputs:
                    raise UnsupportedLayout("ws_stages: outputs must be contiguous")
                v = v.contiguous()
            flat.append(v)
        return flat

    @functools.cached_property
    def _kmajor(self) -> bool:
        return self.plan.region.gemm.b.major == "K"

    @functools.cached_property
    def _matrices(self) -> list:
        """For each input, then each output: whether it is an [M, N] matrix (worked out once:
        ``tensors`` runs at every launch)."""
        region = self.plan.region
        return [spec.axes == frozenset("MN") for spec in (*region.inputs, *region.outputs)]

    @functools.cached_property
    def residual(self):
        """The input the mainloop adds into the tile (the form's res_tma), or None."""
        return tma_residual(self.plan.region) if self.plan.form.res_tma else None

    @functools.cached_property
    def _descriptors(self) -> list:
        """(index into ``tensors``, block shape, shared layout) of each TMA descriptor, in the
        order the kernel takes them: A, B, then the residual's after the flat tensors."""
        la, lb, lt = parts.layouts(self._kmajor)
        out = [(0, [parts.BM, parts.BK], la), (1, [parts.BN, parts.BK] if self._kmajor else [parts.BK, parts.BN], lb)]
        if self.residual is not None:
            out.append((2 + self.residual, [parts.BM, parts.BN], lt))
        return out

    def arguments(self, tensors, ws, counters):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        a, b = tensors[:2]
        M, K = a.shape
        N = b.shape[0] if self._kmajor else b.shape[1]
        descs = [TensorDescriptor.from_tensor(tensors[j], block, layout) for j, block, layout in self._descriptors]
        return [*descs[:2], *tensors[2:], *descs[2:], ws, counters, M, N, K]

    def launch(self, a3, b3, ins, outs) -> None:
        tensors = self.tensors(a3, b3, ins, outs)
        layout = layout_key(tensors)
        bound = self._bound.get(layout)
        if bound is None:
            if len(self._bound) > 64:
                self._bound.clear()
            self._bound[layout] = self.bind(tensors)
            return
        run, statics, fresh, fields = bound
        descs = [_descriptor(f, tensors[j]) for (j, _, _), f in zip(self._descriptors, fields)]
        run(*descs[:2], *tensors[2:], *descs[2:], *statics[fresh:])

    def bind(self, tensors):
        a, b = tensors[:2]
        dev = a.device
        sm90_only(dev, "ws_stages")
        tma_ready(a, "A", "ws_stages")
        tma_ready(b, "B", "ws_stages")
        if self.residual is not None:
            tma_ready(tensors[2 + self.residual], "the residual", "ws_stages")
        M = a.shape[0]
        N = b.shape[0] if self._kmajor else b.shape[1]
        key = (str(dev), M, N)
        ws, counters = kept.once(self._scratch, key, dev, lambda: (
            torch.empty(stages.workspace_numel(M, N, self.plan.stages, self.plan.form.moments),
                        dtype=torch.float32, device=dev),
            torch.zeros(M // parts.BM, dtype=torch.int64, device=dev)))  # (int64: never wraps)
        if N // self.plan.block_n > sm_count(dev):
            raise UnsupportedLayout(f"ws_stages: a strip of {N // self.plan.block_n} tiles cannot be resident at once")
        args = self.arguments(tensors, ws, counters)
        grid = (min(sm_count(dev), (M // parts.BM) * (N // self.plan.block_n)), )
        fresh = self.fresh(tensors)
        return (*launch_direct(self.fn, grid, args, options(self.plan, N), set(range(fresh))), fresh,
                self.descriptor_fields(args, len(tensors)))

    def fresh(self, tensors) -> int:
        """How many of the arguments are each call's own: the tensors and the descriptors."""
        return len(tensors) + (self.residual is not None)

    def descriptor_fields(self, args, tensors: int) -> list:
        """Each TMA descriptor's fields in ``args`` (``arguments``' list for ``tensors``
        tensors), less its base: what ``launch`` builds a call's descriptors from (no tensor
        kept alive between calls)."""
        descs = [*args[:2], *args[tensors:tensors + len(self._descriptors) - 2]]
        return [{k: v for k, v in vars(d).items() if k != "base"} for d in descs]


def build(plan: Plan, name: str) -> StagesKernel:
    text = source_text(plan, name)
    module = cache.load_source(name, text)
    source = KernelSource(name, text, (), (), 12, 3)
    return StagesKernel(plan, source, getattr(module, name))


def compile_sm90(plan: Plan, name: str):
    """Compile a plan's generated kernel for sm_90 on any machine (no GPU needed), as
    ``strip.compile_sm90`` does for the template; ``name``: the module's (a loaded module is
    reused by name)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    module = cache.load_source(name, source_text(plan, name))
    fn = getattr(module, name)
    kmajor = plan.region.gemm.b.major == "K"
    la, lb, lt = parts.layouts(kmajor)
    bshape = [parts.BN, parts.BK] if kmajor else [parts.BK, parts.BN]
    sig = {"a_desc": f"tensordesc<bf16[{parts.BM}, {parts.BK}],{la!r}>",
           "b_desc": f"tensordesc<bf16[{bshape[0]}, {bshape[1]}],{lb!r}>"}
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    for j, inp in enumerate(plan.region.inputs):
        sig[f"in{j}_ptr"] = "*" + short[inp.dtype]
    for k, out in enumerate(plan.region.outputs):
        sig[f"out{k}_ptr"] = "*" + short[out.dtype]
    if plan.form.res_tma:
        sig["r_desc"] = f"tensordesc<bf16[{parts.BM}, {parts.BN}],{lt!r}>"
    sig.update({"ws_ptr": "*fp32", "counter_ptr": "*i64", "M": "i32", "N": "i32", "K": "i32"})
    constexprs = {k: v for k, v in options(plan, plan.region.sizes.N).items() if k != "maxnreg"}
    sig.update({k: "constexpr" for k in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(2, len(sig) - len(constexprs))}
    return triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": plan.num_warps, "maxnreg": 168})
