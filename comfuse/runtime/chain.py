"""Back-to-back GEMM chains at run time: the chain's kernel and the modules that run it.

A chain's regions are contracted into one ``FusedChain`` module in the captured graph; the
links between them (GEMM1's post-epilogue tile feeding GEMM2) never become tensors. Failures
fall back to the chain's original ops, as for single regions (runtime/fused.py). Attention
over long rows is routed to ``scaled_dot_product_attention`` instead (``FusedAttention``).
"""
from __future__ import annotations

import dataclasses

import torch
import triton

from .. import settings as settings_mod
from ..codegen.triton.chain import emit_chain
from ..errors import KernelMismatch
from ..ir import canonical_shape, evaluate, structural_text
from ..planner.chain import chain_candidates
from . import cache, tuning
from .cache import CODEGEN_VERSION
from .check import agreement_tolerance, compare, region_tolerance
from .fused import Fused
from .launch import interpreting, launch_direct
from .operands import operand3, prepare


def chain_name(plan) -> str:
    params = tuple((f.name, getattr(plan, f.name)) for f in dataclasses.fields(plan)
                   if f.name not in ("regions", "stages"))
    text = "\n".join(structural_text(r) for r in plan.regions)
    # the source is specialised to K and every N (loop bounds and masks; see ChainKernel.launch)
    sizes = (plan.regions[0].sizes.K, *(r.sizes.N for r in plan.regions))
    return f"comfuse_b2b_{cache.digest(text, repr(params), repr(sizes), CODEGEN_VERSION)}"


@dataclasses.dataclass
class ChainKernel:
    plan: object
    source: object
    fn: object
    _bound: dict = dataclasses.field(default_factory=dict)  # tensor layout -> prepared launch

    @property
    def path(self) -> str:
        return str(cache.kernel_dir() / f"{self.source.name}.py")

    def launch(self, a3, b3s, ins, outs) -> None:
        """a3 [B, M, K]; b3s[k] [B, K_k, N_k]; ins[k][j] and outs[(k, j)] canonical 3-D.

        On a GPU the launch (grid, sizes, strides, options) is worked out once per layout of
        the tensors and remembered, as in ``Kernel.launch``: a target-attention chain takes
        ~80 us, and rebuilding its arguments every call left the GPU waiting on Python."""
        tensors = (a3, *b3s, *(t for group in ins for t in group), *outs.values())
        on_cpu = a3.device.type == "cpu" or interpreting()
        layout = None if on_cpu else (torch.backends.cuda.matmul.allow_tf32, tuple(outs),
                                      *((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
                                        for t in tensors))
        bound = self._bound.get(layout) if layout is not None else None
        if bound is None:
            grid, args, options = self.prepare(a3, b3s, ins, outs, on_cpu)
            if layout is None:
                self.fn[grid](*args, **options)
                return
            ids = {id(t): i for i, t in enumerate(tensors)}
            slots = [(j, ids[id(v)]) for j, v in enumerate(args) if id(v) in ids]
            if len(self._bound) > 64:
                self._bound.clear()
            run, statics = launch_direct(self.fn, grid, args, options, {j for j, _ in slots})  # (launches once)
            self._bound[layout] = (run, statics, slots)
            return
        run, statics, slots = bound
        args = list(statics)
        for j, i in slots:
            args[j] = tensors[i]
        run(*args)

    def prepare(self, a3, b3s, ins, outs, on_cpu: bool):
        """(grid, arguments, options) of a launch on these tensors."""
        B, M, K = a3.shape
        planned = (self.plan.regions[0].sizes.K, *(r.sizes.N for r in self.plan.regions))
        if (K, *(b.shape[2] for b in b3s)) != planned:  # the source is specialised to them
            raise RuntimeError(f"chain kernel {self.source.name} was generated for K, N = {planned}; "
                               f"called with {(K, *(b.shape[2] for b in b3s))}")
        args = []
        for p in self.source.params:
            if p.role == "a":
                args.append(a3)
            elif p.role == "b":
                args.append(b3s[p.index])
            elif p.role == "in":
                args.append(ins[p.index[0]][p.index[1]])
            elif p.role == "out":
                args.append(outs[p.index])
            elif p.role == "size":
                args.append({"M": M, "K": K}[p.axis] if p.index is None else b3s[p.index].shape[2])
            elif p.role == "stride_a":
                args.append(a3.stride({"B": 0, "M": 1, "K": 2}[p.axis]))
            elif p.role == "stride_b":
                args.append(b3s[p.index].stride({"B": 0, "K": 1, "N": 2}[p.axis]))
            elif p.role == "stride_in":
                args.append(ins[p.index[0]][p.index[1]].stride({"B": 0, "M": 1, "N": 2}[p.axis]))
            elif p.role == "stride_out":
                args.append(outs[p.index].stride({"B": 0, "M": 1, "N": 2}[p.axis]))
            else:  # pragma: no cover
                raise AssertionError(p)
        low = a3.dtype in (torch.float16, torch.bfloat16)
        tf32 = torch.backends.cuda.matmul.allow_tf32 and not on_cpu
        grid = (triton.cdiv(M, self.plan.block_m), B)
        options = dict(self.source.constexprs, EVEN_M=M % self.plan.block_m == 0,
                       UPCAST_OPERANDS=on_cpu and low, DOT_PRECISION="tf32" if tf32 else "ieee",
                       num_warps=self.source.num_warps, num_stages=self.source.num_stages)
        return grid, args, options


_kernels: dict = {}


def build_chain(plan) -> ChainKernel:
    name = chain_name(plan)
    if name not in _kernels:
        source = emit_chain(plan, name)
        module = cache.load_source(name, source.text)
        _kernels[name] = ChainKernel(plan, source, getattr(module, name))
    return _kernels[name]


class FusedChain(Fused):
    """A back-to-back GEMM chain inside a captured graph: one kernel, or its original ops."""
    kind = "chain"

    def __init__(self, cands: list, merged, plan, unfused, report):
        super().__init__(unfused, report)
        index = {e: i for i, e in enumerate(merged.externals)}
        self.plan = plan
        self.a_ext = index[cands[0].externals[cands[0].operands[0]]]
        self.b_ext = [index[c.externals[c.operands[1]]] for c in cands]
        self.inputs = [[(index[c.externals[b.ext]], b) for b in c.inputs] for c in cands]
        written = {ob.node for ob in merged.outputs}
        self.outputs = [(k, j, ob.shape) for k, c in enumerate(cands)
                        for j, ob in enumerate(c.outputs) if ob.node in written]
        self.regions = [c.region for c in cands]  # as found, for checks
        self.tolerance = max(agreement_tolerance(r) for r in self.regions)
        self._out_specs = [((k, j), canonical_shape(self.regions[k], self.regions[k].outputs[j].axes),
                            self.regions[k].outputs[j].dtype) for k, j, _ in self.outputs]

    @property
    def output_specs(self) -> list:
        return [(shape, self.regions[k].outputs[j].dtype) for k, j, shape in self.outputs]

    def device_of(self, ext) -> torch.device:
        return ext[self.a_ext].device

    def tune(self, ext, device) -> None:
        """Time the chain's candidate plans and its ops compiled by Inductor; keep the fastest."""
        plans = chain_candidates(self.plan)
        names = [chain_name(p) for p in plans]

        def run_fused(i):
            self.kernel = build_chain(plans[i])
            return self.run(ext, device)
        key = tuning.key(self.plan.regions[0], device) + "-" + chain_name(self.plan)[-8:]
        decision = self.autotune(ext, device, key, names, run_fused)
        if decision["choice"] == tuning.UNFUSED:
            self.keep_unfused(ext, decision, "the fused chain")
            return
        times = decision["times_ms"]
        self.prefer_unfused = False
        self.plan = plans[names.index(decision["choice"])]
        self.kernel = build_chain(self.plan)
        self.report.fused, self.report.reason = True, ""
        self.report.plan = (f"{self.plan.describe()}, {self.plan.num_warps} warps (autotuned: "
                            f"{times[decision['choice']]:.4f} ms vs {times[tuning.UNFUSED]:.4f} ms unfused)")
        self.report.planned, self.report.kernel_path = self.plan, self.kernel.path

    def run(self, ext, device, check: bool = False):
        """One launch of the chain on ``ext``; ``check``: against the IR's interpreter (COMFUSE_CHECK)."""
        if self.kernel is None:
            self.kernel = build_chain(self.plan)
            self.report.kernel_path = self.kernel.path
        a3, b3s, ins = self.operands(ext)
        outs = {key: torch.empty(shape, dtype=dtype, device=device) for key, shape, dtype in self._out_specs}
        self.kernel.launch(a3, b3s, ins, outs)
        if check:
            self.check(a3, b3s, ins, outs)
        return tuple(outs[(k, j)].view(shape) for k, j, shape in self.outputs)

    def operands(self, ext):
        """(a3, [b3 per GEMM], [side inputs per GEMM]) in the regions' canonical 3-D layout."""
        batched = self.regions[0].gemm.batched
        a = ext[self.a_ext]
        ins = [[prepare(ext[e], bind, a.device) for e, bind in region_inputs] for region_inputs in self.inputs]
        return operand3(a, batched), [operand3(ext[i], batched) for i in self.b_ext], ins

    def exact(self, ext) -> list:
        """The chain's outputs in float64 (the IR's interpreter, region after region), shaped
        like a call's: the second opinion when the kernel and the unfused ops disagree."""
        tuning.exact_fits(self.regions)
        with torch.no_grad():
            a3, b3s, ins = self.operands(ext)
            refs = self.evaluate64(a3.detach(), [b.detach() for b in b3s], [[t.detach() for t in g] for g in ins])
        return [refs[k][j].reshape(shape) for k, j, shape in self.outputs]

    def evaluate64(self, a3, b3s, ins) -> list:
        """Each GEMM's outputs (canonical 3-D) from the IR's interpreter in float64, region
        after region, each fed its link's exact value."""
        refs, lhs = [], a3
        for k, region in enumerate(self.regions):
            refs.append(evaluate(region, lhs, b3s[k], ins[k], torch.float64))
            if k < len(self.plan.links):
                lhs = refs[k][self.plan.links[k]]
        return refs

    def check(self, a3, b3s, ins, outs) -> None:
        """The chain against the IR's interpreter, region after region, in float64."""
        refs = self.evaluate64(a3, b3s, ins)
        for (k, j), out in outs.items():
            region = self.regions[k]
            result = compare(out, refs[k][j], region_tolerance(region), floor=1.0)
            if not result.ok:
                raise KernelMismatch(f"chain {self.kernel.source.name} GEMM{k + 1} output "
                                     f"{region.outputs[j].name}: {result}")


class FusedAttention(torch.nn.Module):
    """softmax(s * q @ k^T) @ v routed to scaled_dot_product_attention (flash attention on
    a GPU): for long rows it is faster than anything comfuse would generate."""

    def __init__(self, cands: list, merged, scale: float, unfused, report):
        super().__init__()
        index = {e: i for i, e in enumerate(merged.externals)}
        self.q = index[cands[0].externals[cands[0].operands[0]]]
        self.kt = index[cands[0].externals[cands[0].operands[1]]]
        self.v = index[cands[1].externals[cands[1].operands[1]]]
        self.shape = merged.outputs[0].shape
        self.output_specs = [(self.shape, cands[1].region.outputs[0].dtype)]
        self.scale = scale
        self.unfused = unfused
        self.report = report

    def forward(self, *ext):
        q, kt, v = ext[self.q], ext[self.kt], ext[self.v]
        if settings_mod.get().disable or q.dtype != v.dtype:
            return self.unfused(*ext)
        # flash and memory-efficient attention take only 4-D [batch, heads, L, d] inputs;
        # 3-D ones would silently get the slow math kernel
        lead = (1,) * (4 - q.dim())
        q4, k4, v4 = (t.reshape(lead + tuple(t.shape)) for t in (q, kt.transpose(-1, -2), v))
        out = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, scale=self.scale)
        return (out.reshape(self.shape),)
