"""Launching a ws_stages plan: the warp-specialised Gluon kernel generated from the region's
stages (codegen/gluon/stages.py), with the interface of runtime.kernel.Kernel
(``launch(a3, b3, ins, outs)``)."""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..codegen.triton import KernelSource
from ..planner import Plan
from . import cache
from .kernel import UnsupportedLayout, launch_direct, layout_key
from .strip_kernel import _sm_count, _tma_ready


# rows of the tile the generated epilogue holds at once: 16, where the template holds 32 (its
# stages' values are recomputed per pass, several [rows, 256] values live together: at 32 rows
# the multi-stage workload's epilogue spilled 1208 bytes a thread for sm_90, at 16 rows 8)
CHUNK = 16


def chunk_rows(plan: Plan) -> int:
    """Rows of a chunk of the plan's epilogue: CHUNK, or more where the epilogue warps' row
    layout spans more (8 warps at 8 lanes a row cover 32 rows at once; a 16-row chunk would
    have two threads hold each value, and the 8 warps do the work of 4)."""
    return max(plan.chunk or CHUNK, plan.epi_warps * (32 // plan.lanes))


@functools.cache
def _descriptor_class():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor


def _descriptor(fields: dict, base):
    """A TMA descriptor of ``fields`` (a checked TensorDescriptor's, less its base) over
    ``base``, without TensorDescriptor's checks: the launch's layout key has the shape, the
    strides, the dtype and the 16-byte alignment they checked (the checks took two fifths of
    a launch's own host time, 2026-12-01)."""
    d = object.__new__(_descriptor_class())
    d.__dict__.update(fields)
    d.base = base
    return d


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
    def _descriptors(self) -> list:
        """(index into ``tensors``, block shape, shared layout) of each TMA descriptor, in the
        order the kernel takes them: A, B, then the residual's (Plan.res_tma) and the
        output's (Plan.tma_store) after the flat tensors."""
        from ..codegen.gluon import strip
        bn = self.plan.block_n
        la, lb, lt = strip.layouts(self._kmajor, bn)
        out = [(0, [strip.BM, strip.BK], la), (1, [bn, strip.BK] if self._kmajor else [strip.BK, bn], lb)]
        if self.plan.res_tma:
            out.append((2 + self.residual, [strip.BM, bn], lt))
        if self.plan.tma_store:
            out.append((-1, [strip.BM, bn], lt))
        return out

    def arguments(self, tensors, ws, counters):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        a, b = tensors[:2]
        M, K = a.shape
        N = b.shape[0] if self._kmajor else b.shape[1]
        descs = [TensorDescriptor.from_tensor(tensors[j], block, layout) for j, block, layout in self._descriptors]
        return [*descs[:2], *tensors[2:], *descs[2:], ws, counters, M, N, K, counters]

    @functools.cached_property
    def residual(self):
        """The input the mainloop adds into the tile (Plan.res_tma), or None (worked out once)."""
        from ..codegen.gluon import stages
        return stages.tma_residual(self.plan.region) if self.plan.res_tma else None

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
        from ..codegen.gluon import stages, strip
        a, b = tensors[:2]
        dev = a.device
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
            raise UnsupportedLayout("ws_stages: the generated Gluon kernel runs on sm_90 (Hopper) GPUs only")
        _tma_ready(a, "A")
        _tma_ready(b, "B")
        if self.plan.res_tma:
            _tma_ready(tensors[2 + self.residual], "the residual")
        M = a.shape[0]
        N = b.shape[0] if self.plan.region.gemm.b.major == "K" else b.shape[1]
        key = (str(dev), M, N)
        if key not in self._scratch:
            self._scratch[key] = (torch.empty(stages.workspace_numel(M, N, self.plan.stages, self.plan.moments,
                                                                     self.plan.block_n),
                                              dtype=torch.float32, device=dev),
                                  torch.zeros(M // strip.BM, dtype=torch.int64, device=dev))  # (int64: never wraps)
        ws, counters = self._scratch[key]
        if N // self.plan.block_n > _sm_count(dev):
            raise UnsupportedLayout(f"ws_stages: a strip of {N // self.plan.block_n} tiles cannot be resident at once")
        args = self.arguments(tensors, ws, counters)
        grid, options = self.grid_options(dev, M, N)
        fresh = self.fresh(tensors)
        return (*launch_direct(self.fn, grid, args, options, set(range(fresh))), fresh,
                self.descriptor_fields(args, len(tensors)))

    def fresh(self, tensors) -> int:
        """How many of the arguments are each call's own: the tensors and the descriptors."""
        return len(tensors) + self.plan.res_tma + self.plan.tma_store

    def descriptor_fields(self, args, tensors: int) -> list:
        """Each TMA descriptor's fields in ``args`` (``arguments``' list for ``tensors``
        tensors), less its base: what ``launch`` builds a call's descriptors from (no tensor
        kept alive between calls)."""
        descs = [*args[:2], *args[tensors:tensors + len(self._descriptors) - 2]]
        return [{k: v for k, v in vars(d).items() if k != "base"} for d in descs]

    def grid_options(self, dev, M: int, N: int):
        from ..codegen.gluon import strip
        return (min(_sm_count(dev), (M // strip.BM) * (N // self.plan.block_n)), ), self.options(N)

    def options(self, N: int) -> dict:
        return options(self.plan, N)

    def trace(self, a3, b3, ins, outs):
        """One launch through Triton's JIT with the kernel's timers on: (trace, grid, tiles),
        trace[program, n, slot] the global timer (ns) at each mark of its n-th tile. Slots 0-3:
        the mainloop partition (tile start, last MMA done, buffer free, hand-off); 4: the
        epilogue has the tile; 5 + 2e / 6 + 2e: exchange e's partials published / its wait
        over; 5 + 2E: the outputs written (E exchanges, at most 5 here); 15, of a program's last
        tile where the mainloop's warps share it (``Plan.tail``): their rows written. Row 63
        (so at most 63 tiles a program): slot 0 the program's start, slot 1 its end."""
        from ..codegen.gluon import stages, strip
        tensors = self.tensors(a3, b3, ins, outs)
        self.launch(a3, b3, ins, outs)  # scratch, checks, and the counters in step
        a, b = tensors[:2]
        M = a.shape[0]
        N = b.shape[0] if self.plan.region.gemm.b.major == "K" else b.shape[1]
        E = len(stages.layout_of(self.plan.stages, self.plan.moments).exchanges)
        if E > 5 or (E == 5 and self.plan.tail):
            raise ValueError("ws_stages trace: more than 5 exchanges (4 with a shared last tile) do not fit 16 timer "
                             "slots a tile")
        ws, counters = self._scratch[(str(a.device), M, N)]
        grid, options = self.grid_options(a.device, M, N)
        tiles = (M // strip.BM) * (N // self.plan.block_n)
        if -(-tiles // grid[0]) > 63:
            raise ValueError("ws_stages trace: more than 63 tiles a program")
        buf = torch.zeros(grid[0], 64, 16, dtype=torch.int64, device=a.device)
        args = self.arguments(tensors, ws, counters)
        args[-1] = buf
        self.fn[grid](*args, **dict(options, TRACE=True))
        torch.cuda.synchronize(a.device)
        return buf, grid[0], tiles


# the epilogue partition's registers a thread, by its warps: 4 beside the 8 mainloop warps of a
# 128x256 tile (12 warps at the kernel's 168); 8 beside the 4 of a 128x128 tile
# (COMFUSE_WS_TILE_N=128: 8 x 32 x EPI_REGS_8 of the 65 536, the rest the mainloop warpgroup's)
EPI_REGS = {4: 152, 8: 160}


def options(plan: Plan, N: int) -> dict:
    """Every constexpr of a plan's generated kernel (launch_direct's own launcher takes them
    all; a missing one sends each call through the JIT's binding) and the launch options."""
    from ..codegen.gluon import strip
    bn = plan.block_n
    return dict(B_KMAJOR=plan.region.gemm.b.major == "K", BN=bn, TILES_N=N // bn,
                TILES_P2=strip._pow2(N // bn), STAGES=plan.num_stages, CHUNK=chunk_rows(plan), EPI_WARPS=plan.epi_warps,
                EPI_REGS=EPI_REGS[plan.epi_warps], LANES_N=plan.lanes, VEC=plan.vec or bn // plan.lanes, TRACE=False,
                num_warps=plan.num_warps, maxnreg=168)


def source_text(plan: Plan, name: str) -> str:
    from ..codegen.gluon import stages
    return stages.emit(plan.region, plan.stages, name, plan.describe(), plan.moments,
                       keep=bool(plan.moments) and plan.keep,
                       tma_store=plan.tma_store, tail=plan.tail,
                       residual=stages.tma_residual(plan.region) if plan.res_tma else None,
                       lookahead=plan.lookahead, narrow=plan.narrow,
                       exp_fma=plan.exp_fma, tile_n=plan.block_n, roll=plan.roll, last_in_ring=plan.last_in_ring)


def build(plan: Plan, name: str) -> StagesKernel:
    text = source_text(plan, name)
    module = cache.load_source(name, text)
    source = KernelSource(name, text, (), (), 12, 3)
    return StagesKernel(plan, source, getattr(module, name))


def compile_sm90(plan: Plan, name: str = "", chunk: int = 0, vec: int = 0, trace: bool = False,
                 epi_warps: int | None = None, epi_regs: int | None = None, maxnreg: int = 168):
    """Compile a plan's generated kernel for sm_90 on any machine (no GPU needed), as
    ``strip.compile_sm90`` does for the template. ``name``: the module's (by default the plan's
    kernel name: a loaded module is reused by name); ``epi_warps`` / ``epi_regs`` / ``maxnreg``:
    the epilogue partition's warps and registers and the kernel's register limit, for probing
    other splits (launches use the plan's warps, EPI_REGS and 168)."""
    from .kernel import kernel_name
    name = name or kernel_name(plan)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from ..codegen.gluon import strip
    module = cache.load_source(name, source_text(plan, name))
    fn = getattr(module, name)
    kmajor = plan.region.gemm.b.major == "K"
    bn = plan.block_n
    la, lb, lt = strip.layouts(kmajor, bn)
    bshape = [bn, strip.BK] if kmajor else [strip.BK, bn]
    sig = {"a_desc": f"tensordesc<bf16[{strip.BM}, {strip.BK}],{la!r}>",
           "b_desc": f"tensordesc<bf16[{bshape[0]}, {bshape[1]}],{lb!r}>"}
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    for j, inp in enumerate(plan.region.inputs):
        sig[f"in{j}_ptr"] = "*" + short[inp.dtype]
    for k, out in enumerate(plan.region.outputs):
        sig[f"out{k}_ptr"] = "*" + short[out.dtype]
    if plan.res_tma:
        sig["r_desc"] = f"tensordesc<bf16[{strip.BM}, {bn}],{lt!r}>"
    if plan.tma_store:
        sig["o_desc"] = f"tensordesc<bf16[{strip.BM}, {bn}],{lt!r}>"
    sig.update({"ws_ptr": "*fp32", "counter_ptr": "*i64", "M": "i32", "N": "i32", "K": "i32", "trace_ptr": "*i64"})
    # the launch's constexprs, but for what a probe changes
    constexprs = {k: v for k, v in options(plan, plan.region.sizes.N).items() if k != "maxnreg"}
    epi_warps = epi_warps or plan.epi_warps
    constexprs.update(TRACE=trace, EPI_WARPS=epi_warps, EPI_REGS=epi_regs or EPI_REGS[epi_warps])
    if chunk:
        constexprs["CHUNK"] = chunk
    if vec:
        constexprs["VEC"] = vec
    sig.update({k: "constexpr" for k in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(2, len(sig) - len(constexprs))}
    return triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": plan.num_warps, "maxnreg": maxnreg})

