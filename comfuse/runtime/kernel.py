"""The Triton kernel of a tile, row-in-CTA, cooperative or split plan, and its launches.

``Kernel.launch`` takes canonical views (a3 [B, M, K], b3 [B, K, N], side inputs and outputs
[B|1, M|1, N|1]). On a GPU each layout of the tensors is bound once (grids, constexprs, sizes,
strides, scratch), and a later call only fills in the tensors (``launch.launch_direct``).
Under the interpreter a cooperative plan runs as consecutive phase kernels (a strip's
programs run one after another there, so none may wait for another).
"""
from __future__ import annotations

import dataclasses

import torch
import triton

from ..codegen.source import KernelSource
from ..errors import UnsupportedLayout
from ..planner import Plan
from ..planner.onepass import parts
from . import cache, kept
from .launch import bind_tensors, filled, interpreting, layout_key, wide_index


def even_n(plan: Plan, N: int) -> bool:
    """Whether every tile's columns lie inside N (the EVEN_N constexpr: no column masks): N a
    multiple of BLOCK_N. (A split plan's last slice stops at the last tile rather than run
    tiles past N.)"""
    return N % plan.block_n == 0


@dataclasses.dataclass
class Kernel:
    plan: Plan
    source: KernelSource
    fn: object
    phases: tuple = ()  # interpreter form of a cooperative plan: one kernel per phase
    combine: object = None  # split plans: the kernel that merges the slices' statistics
    _scratch: dict = dataclasses.field(default_factory=dict)  # device -> (workspace, counters)
    _resident: dict = dataclasses.field(default_factory=dict)  # device -> programs per SM
    _bound: dict = dataclasses.field(default_factory=dict)  # tensor layout -> prepared launch

    @property
    def path(self) -> str:
        return str(cache.kernel_dir() / f"{self.source.name}.py")

    def launch(self, a3: torch.Tensor, b3: torch.Tensor, ins: list, outs: list) -> None:
        """Run on canonical views: a3 [B, M, K], b3 [B, K, N], ins/outs [B|1, M|1, N|1],
        already transposed for column-strip plans.

        On a GPU the launches (grids, compile-time options, sizes, strides, scratch) are
        worked out once per layout of the tensors and remembered; a call then only fills in
        the tensors: Python time per call matters when a kernel takes tens of microseconds.
        TMA plans rebuild their descriptors (they hold the data pointers) every call; the
        JIT's own per-call work is skipped (``bind``)."""
        tensors = (a3, b3, *ins, *outs)
        if a3.device.type == "cpu" or interpreting():
            for fn, grid, args, options in self.launches(a3, b3, ins, outs):
                fn[grid](*args, **options)
            return
        layout = (torch.backends.cuda.matmul.allow_tf32, *layout_key(tensors))
        bound = self._bound.get(layout)
        if bound is None:
            if len(self._bound) > 64:
                self._bound.clear()
            self._bound[layout] = self.bind(a3, b3, ins, outs)  # (launches once)
            return
        for run, statics, slots, descriptors in bound:
            args = filled(statics, slots, tensors)
            for j, i, major, row_major, block in descriptors:
                args[j] = self.descriptor(tensors[i][0], major, row_major, block)
            run(*args)

    def bind(self, a3, b3, ins, outs) -> list:
        """Launch through Triton's JIT once and remember, per launch, its compiled kernel and
        where each call's tensors (and TMA descriptors, which hold data pointers) go among
        the arguments: later calls with the same layout skip the JIT's argument binding and
        specialisation (about half the Python time of a launch, measured on the H200)."""
        tensors = (a3, b3, *ins, *outs)
        gemm = self.plan.region.gemm
        desc_roles = {"a_desc": (0, gemm.a.major, "K", (self.plan.block_m, self.plan.block_k)),
                      "b_desc": (1, gemm.b.major, "N", (self.plan.block_k, self.plan.block_n))}
        if gemm.b2 is not None:  # (after the side inputs among the tensors: ir.Gemm)
            desc_roles["b2_desc"] = (2 + len(self.plan.region.inputs), gemm.b2.major, "N", (self.plan.block_k, self.plan.block_n))
        bound = []
        # every launch takes the arguments of ``arguments``, one per source parameter
        descriptors = [(j, *desc_roles[q.role]) for j, q in enumerate(self.source.params) if q.role in desc_roles]
        for fn, grid, args, options in self.launches(a3, b3, ins, outs):
            bound.append((*bind_tensors(fn, grid, args, options, tensors, [d[0] for d in descriptors]),
                          descriptors))
        return bound

    def launches(self, a3, b3, ins, outs) -> list:
        """[(kernel, grid, arguments, options)] that run the plan, in order."""
        B, M, K = a3.shape
        N = b3.shape[2]
        plan = self.plan
        on_cpu = a3.device.type == "cpu" or interpreting()
        options = self.options(a3, b3, ins, outs, on_cpu)
        if plan.schedule == "split":
            row_blocks = triton.cdiv(M, plan.block_m)
            slots = sum(len(parts(st)) for st in plan.form.onepass.stats)
            ws, _ = self.scratch(a3.device, slots * plan.form.chunks * M)
            args = self.arguments(a3, b3, ins, outs, ws, None, 0)
            return [(self.fn, (row_blocks * plan.form.chunks,), args, options),
                    (self.combine, (row_blocks,), args, options)]
        if getattr(plan.form, "persistent", False):  # one program per SM (three under the interpreter: still a walk)
            tiles = triton.cdiv(M, plan.block_m) * triton.cdiv(N, plan.block_n)
            sms = 3 if on_cpu else torch.cuda.get_device_properties(a3.device).multi_processor_count
            programs = min(tiles, sms)
            return [(self.fn, (programs, B), self.arguments(a3, b3, ins, outs, None, None, programs), options)]
        if plan.schedule != "cooperative":
            grid = (triton.cdiv(M, plan.block_m) * triton.cdiv(N, plan.block_n), B)
            return [(self.fn, grid, self.arguments(a3, b3, ins, outs, None, None, 0), options)]
        strips = triton.cdiv(M, plan.block_m) * B
        if on_cpu and plan.tiles_n == 1:
            # a strip of one tile never waits for another program: the interpreter can run
            # the GPU form itself, two slots walking the strips (its persistent loop, its
            # exchanges through the workspace)
            groups = min(strips, 2)
            ws, counters = self.scratch(a3.device, self.workspace_size(groups), groups)
            return [(self.fn, (groups,), self.arguments(a3, b3, ins, outs, ws, counters, groups), options)]
        if on_cpu:
            # interpreter form: one slot per strip, phases as consecutive launches
            ws, counters = self.scratch(a3.device, self.workspace_size(strips), strips)
            args = self.arguments(a3, b3, ins, outs, ws, counters, strips)
            return [(fn, (strips * plan.tiles_n,), args, options) for fn in self.phases]
        groups = min(strips, self.resident_slots(a3.device, a3, b3, ins, outs, options, strips))
        ws, counters = self.scratch(a3.device, self.workspace_size(groups), groups)
        return [(self.fn, (groups * plan.tiles_n,),
                 self.arguments(a3, b3, ins, outs, ws, counters, groups), options)]

    def options(self, a3, b3, ins, outs, on_cpu: bool) -> dict:
        """Compile-time arguments of a launch (constexprs, warps, stages)."""
        low = a3.dtype in (torch.float16, torch.bfloat16)
        tf32 = torch.backends.cuda.matmul.allow_tf32 and not on_cpu
        return dict(self.source.constexprs, UPCAST_OPERANDS=on_cpu and low,
                    DOT_PRECISION="tf32" if tf32 else "ieee", WIDE_INDEX=wide_index(a3, b3, *ins, *outs),
                    EVEN_N=even_n(self.plan, b3.shape[2]),
                    num_warps=self.source.num_warps, num_stages=self.source.num_stages)

    def resident_slots(self, device, a3, b3, ins, outs, options, strips: int) -> int:
        """How many strips may be in flight: every program of every slot must be resident at
        once (members spin until their strip has arrived), so the persistent grid is at most
        the SM count times the programs one SM holds, from the compiled kernel's registers
        and shared memory.

        The kernel is compiled for that with the strip count as its slot count: the launch
        passes min(strips, slots), nearly always the same kind of integer for Triton's
        specialisation (1 becomes a constant, multiples of 16 are marked divisible), so the
        launch finds this compilation rather than compiling again."""
        key = str(device)
        if key not in self._resident:
            args = self.arguments(a3, b3, ins, outs, *self.scratch(device, self.workspace_size(1), 1), strips)
            compiled = self.fn.warmup(*args, grid=(1,), **options)
            props = torch.cuda.get_device_properties(device)
            warps = self.source.num_warps
            regs = max(getattr(compiled, "n_regs", 0) or 0, 1)
            smem = max(compiled.metadata.shared, 1)
            smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
            per_sm = min(65536 // (regs * 32 * warps), smem_sm // smem, 64 // warps, 32)
            self._resident[key] = max(per_sm, 0) * props.multi_processor_count
        slots = self._resident[key] // self.plan.tiles_n
        if slots < 1:
            raise RuntimeError(f"cooperative strip of {self.plan.tiles_n} tiles cannot be resident "
                               f"at once ({self._resident[key]} programs fit the GPU)")
        return slots

    def workspace_size(self, slots: int) -> int:
        """fp32 elements of a cooperative plan's partials for ``slots`` strips in flight."""
        form = self.plan.form
        pow2 = dict(self.source.constexprs)["TILES_POW2"]
        return slots * max(form.exchanges, 2) * max(form.exchange_width, 1) * pow2 * self.plan.block_m

    def scratch(self, device, numel: int, counters: int = 1):
        """Workspace (fp32) and arrival counters, kept per device and grown as needed;
        counters start at zero once and only ever grow: int64, so that no count of launches
        wraps them (int32 would after 2**31 / (TILES_N x exchanges) launches, a few tens of
        millions at N = 4096: a long-lived server's count)."""
        key = str(device)
        ws, cnt = self._scratch.get(key, (None, None))
        if ws is None or ws.numel() < numel or cnt.numel() < counters:
            ws, cnt = self._scratch[key] = kept.allocate(device, lambda: (
                torch.empty(max(numel, 1), dtype=torch.float32, device=device),
                torch.zeros(max(counters, 1), dtype=torch.int64, device=device)))
        return ws, cnt

    @staticmethod
    def descriptor(t2: torch.Tensor, major: str, row_major: str, block: tuple):
        """A TMA descriptor over a 2-D operand: as stored when its last dim is the unit-stride
        one (``row_major``), else over its transpose, with the block transposed to match."""
        from triton.tools.tensor_descriptor import TensorDescriptor
        view = t2 if major == row_major else t2.t()
        if view.stride(-1) != 1:
            raise UnsupportedLayout(f"TMA plan expects a {major}-major operand; got strides {t2.stride()}")
        if view.data_ptr() % 16 or any(st * view.element_size() % 16 for st in view.stride()[:-1]):
            raise UnsupportedLayout("TMA needs 16-byte aligned operands; this one is not")
        shape = list(block) if major == row_major else list(reversed(block))
        return TensorDescriptor.from_tensor(view, shape)

    def arguments(self, a3, b3, ins, outs, ws, counters, groups) -> list:
        B, M, K = a3.shape
        N = b3.shape[2]
        dims3 = {"B": 0, "M": 1, "N": 2}
        args = []
        for p in self.source.params:
            if p.role == "a":
                args.append(a3)
            elif p.role == "b":
                args.append(b3)
            elif p.role == "b2":  # (after the side inputs: ir.Gemm)
                args.append(ins[p.index])
            elif p.role == "a_desc":
                args.append(self.descriptor(a3[0], self.plan.region.gemm.a.major, "K",
                                            (self.plan.block_m, self.plan.block_k)))
            elif p.role in ("b_desc", "b2_desc"):
                gemm = self.plan.region.gemm
                b, op = (b3, gemm.b) if p.role == "b_desc" else (ins[p.index], gemm.b2)
                args.append(self.descriptor(b[0], op.major, "N", (self.plan.block_k, self.plan.block_n)))
            elif p.role == "in":
                args.append(ins[p.index])
            elif p.role == "out":
                args.append(outs[p.index])
            elif p.role == "size":
                args.append({"B": B, "M": M, "N": N, "K": K}[p.axis])
            elif p.role == "workspace":
                args.append(ws)
            elif p.role == "counters":
                args.append(counters)
            elif p.role == "tiles_n":
                args.append(self.plan.tiles_n)
            elif p.role == "groups":
                args.append(groups)
            elif p.role == "chunks":
                args.append(self.plan.form.chunks)
            elif p.role == "tiles_per_chunk":
                args.append(self.plan.form.tiles_per_chunk)
            elif p.role == "stride_a":
                args.append(a3.stride({"B": 0, "M": 1, "K": 2}[p.axis]))
            elif p.role in ("stride_b", "stride_b2"):
                args.append((b3 if p.role == "stride_b" else ins[p.index]).stride({"B": 0, "K": 1, "N": 2}[p.axis]))
            elif p.role == "stride_in":
                args.append(ins[p.index].stride(dims3[p.axis]))
            elif p.role == "stride_out":
                args.append(outs[p.index].stride(dims3[p.axis]))
            else:  # pragma: no cover
                raise AssertionError(p)
        return args
