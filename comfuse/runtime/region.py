"""A fused GEMM + epilogue region inside a captured graph (``FusedRegion``): its chosen plan's
kernel, autotuned among its candidate plans on a GPU, or its original ops."""
from __future__ import annotations

import functools

import torch

from ..ir import Op, canonical_shape, evaluate_by_rows, evaluate_with_scale
from ..planner.cost import estimate_ms
from . import prediction, tuning
from .build import build, chosen, kernel_name, release
from ..errors import KernelMismatch
from .check import agreement_tolerance, compare, region_tolerance
from .fused import Fused
from .operands import Views, operand3, output_strides, prepare
from .pad_columns import zero_columns

SPLIT_SCHEDULES = ("split", "ws_split")


class FusedRegion(Fused):
    kind = "region"

    def __init__(self, cand, plan, unfused, report, alternatives=()):
        super().__init__(unfused, report)
        self.cand_inputs = cand.inputs
        self.operands = cand.operands
        self.out_shapes = [ob.shape for ob in cand.outputs]
        # (per output, the columns the kernel writes of a padded product saved whole; 0: all)
        self.out_columns = [ob.columns for ob in cand.outputs]
        self.saves_padded = any(self.out_columns)
        self.plan = plan
        self.alternatives = list(alternatives) or [plan]  # candidate plans for autotuning
        self.region = cand.region  # as found (original orientation)
        self.regions = [cand.region]
        self.tolerance = agreement_tolerance(cand.region)
        self._views = Views()
        self.canon_outs = [(canonical_shape(cand.region, o.axes), o.dtype) for o in cand.region.outputs]

    def device_of(self, ext) -> torch.device:
        return ext[self.operands[0]].device

    @property
    def output_specs(self) -> list:
        """(shape, dtype) of each output: what a fake (meta) execution returns."""
        return [(shape, out.dtype) for shape, out in zip(self.out_shapes, self.region.outputs)]

    @functools.cached_property
    def _out_layouts(self) -> list:
        """(shape, strides, dtype) of each output (``output_strides``: wide rows along N aligned)."""
        n = self.region.sizes.N
        return [(tuple(shape), output_strides(shape, out.dtype, "N" in out.axes and tuple(shape)[-1:] == (n, )),
                 out.dtype) for shape, out in zip(self.out_shapes, self.region.outputs)]

    def empty_outputs(self, device) -> list:
        """The outputs' tensors as a launch returns them."""
        return [torch.empty_strided(shape, strides, dtype=dtype, device=device)
                for shape, strides, dtype in self._out_layouts]

    def laid_out(self, outs):
        """``outs`` with a copy laid out as a launch lays it out (``_out_layouts``) in place of
        each that is not: a wide row padded for alignment (GPT-2's logits), which the ops leave
        packed. Inductor compiled the graph for the launch's strides and asserts them."""
        outs = list(outs)
        for i, (o, (shape, strides, _)) in enumerate(zip(outs, self._out_layouts)):
            if o.stride() != strides and o.numel() > 1:
                outs[i] = torch.empty_strided(shape, strides, dtype=o.dtype, device=o.device).copy_(o)
        return outs

    def tune(self, ext, device) -> None:
        """Pick the fastest of the candidate plans and the unfused ops (runtime/tuning.py),
        among the candidates the cost model shortlists; none where it predicts that the ops
        win (planner/cost.py)."""
        why = prediction.predicted_loss(self.alternatives, self.region, device)
        if why:
            tuning.log.info("region at %s: %s", self.report.anchor, why)
            self.prefer_unfused = True
            self.report.fused, self.report.reason = False, why
            self.tuned.add(device)
            return
        plans = prediction.shortlisted(self.alternatives, self.region, device)
        if len(plans) < len(self.alternatives):
            tuning.log.info("region at %s: %d of %d candidate plans shortlisted by their estimates",
                            self.report.anchor, len(plans), len(self.alternatives))
            self.alternatives = plans
        names = [kernel_name(p) for p in self.alternatives]
        kernels = {}  # built on the first call: the timed calls only launch

        def run_fused(i):
            if i not in kernels:
                kernels[i] = build(self.alternatives[i])
            return self.run(ext, device, kernels[i])
        s = self.region.sizes
        about = {"sizes": {"B": s.B, "M": s.M, "N": s.N, "K": s.K}, "kind": self.report.kind,
                 "plans": {n: dict(tuning.plan_fields(p), estimate_ms=estimate_ms(p))
                           for n, p in zip(names, self.alternatives)}}
        key = tuning.key(self.region, device)
        decision = self.autotune(ext, device, key, names, run_fused, about)
        prediction.remember(self.alternatives, names, decision, key, device)
        kept = tuning.memory_first(self.region, decision) if decision["choice"] == tuning.UNFUSED else ""
        if kept:  # slower fused, but the unfused ops would hold a huge intermediate
            decision = dict(decision, choice=kept)
        for i, kernel in kernels.items():  # (the candidates not chosen keep no workspace)
            if names[i] != decision["choice"]:
                release(kernel)
        if decision["choice"] == tuning.UNFUSED:
            self.keep_unfused(ext, decision, "every fused plan")
            return
        times = decision["times_ms"]
        self.prefer_unfused = False
        self.plan = self.alternatives[names.index(decision["choice"])]
        self.kernel = chosen(self.plan)
        self.report.fused, self.report.reason = True, ""
        self.report.schedule, self.report.stages = self.plan.schedule, len(self.plan.stages)
        self.report.plan = (f"{self.plan.describe()} (autotuned: {times[decision['choice']]:.4f} ms vs "
                            f"{times[tuning.UNFUSED]:.4f} ms unfused"
                            f"{'; kept fused for memory: ' + tuning.intermediate_text(self.region) if kept else ''})")
        self.report.kernel_path = self.kernel.path
        self.report.tuned_ms = (times[decision["choice"]], times[tuning.UNFUSED])

    @functools.cached_property
    def index_bounds(self) -> dict:
        """{argument position: bound} of each integer side input the region compares with the
        column or row index (a loss's targets, which its pick reads at ``iota(N) == target``):
        random inputs for autotuning draw it in [0, bound). Zeros, valid anywhere, put every
        target in column 0, which made a template that picks in-kernel look faster in its
        autotuning than in the model (1.2992 against 1.484 ms at GPT-2's head)."""
        nodes, bounds = self.region.nodes, {}
        for node in nodes:
            if node.op not in (Op.EQ, Op.NE):
                continue
            ops = {nodes[i].op: nodes[i] for i in node.src}
            iota, given = ops.get(Op.IOTA), ops.get(Op.INPUT)
            if iota is not None and given is not None and not given.dtype.is_floating_point and given.dtype != torch.bool:
                bounds[self.cand_inputs[given.arg].ext] = self.region.sizes.of(iota.arg)
        return bounds

    def run(self, ext, device, kernel=None, check: bool = False):
        """Launch ``kernel`` (default: the chosen plan's); ``check``: compare with the float64
        reference afterwards (COMFUSE_CHECK)."""
        if kernel is None:
            if self.kernel is None:
                self.kernel = chosen(self.plan)
                self.report.kernel_path = self.kernel.path
            kernel = self.kernel
        batched = self.region.gemm.batched
        a3, b3 = operand3(ext[self.operands[0]], batched), operand3(ext[self.operands[1]], batched)
        ins = [self._views(j, ext[bind.ext], bind, device) for j, bind in enumerate(self.cand_inputs)]
        ins += self.second_b(ext)
        # each output allocated in its own shape, the kernel given its canonical view: the
        # tensors returned are bases of their own (no view of a temporary for a caller to inspect)
        results = self.empty_outputs(device)
        outs = [w.view(canon) for w, (canon, _) in zip(self.written(results), self.canon_outs)]
        if kernel.plan.transposed:
            kernel.launch(b3.transpose(1, 2), a3.transpose(1, 2), [t.transpose(1, 2) for t in ins],
                          [t.transpose(1, 2) for t in outs])
        else:
            kernel.launch(a3, b3, ins, outs)
        if self.saves_padded:  # (a padded product's columns past the region's are zeros, as the GEMM made them)
            for r, c in zip(results, self.out_columns):
                if c:
                    zero_columns(r, c)
        if check:
            self.check(a3, b3, ins, outs, kernel)
        return tuple(results)

    def written(self, results) -> list:
        """What the kernel writes of each output: all of it, or a padded product's first columns."""
        if not self.saves_padded:
            return results
        return [r.narrow(-1, 0, c) if c else r for r, c in zip(results, self.out_columns)]

    def check(self, a3, b3, ins, outs, kernel) -> None:
        refs, scales = evaluate_with_scale(self.region, a3, b3, ins)
        tol = region_tolerance(self.region)
        for out, ref, scale, spec in zip(outs, refs, scales, self.region.outputs):
            result = compare(out, ref, tol, scale)
            if not result.ok:
                raise KernelMismatch(f"kernel {kernel.source.name} output {spec.name}: {result}")

    def region_operands(self, ext):
        """(a3, b3, side inputs) in the region's canonical 3-D layout, as views of ``ext``."""
        a, b = ext[self.operands[0]], ext[self.operands[1]]
        batched = self.region.gemm.batched
        return operand3(a, batched), operand3(b, batched), [prepare(ext[bind.ext], bind, a.device)
                                                            for bind in self.cand_inputs] + self.second_b(ext)

    def second_b(self, ext) -> list:
        """[the second product's B as [1, K, N]] for a region with one (``ir.Gemm.b2``: it comes
        after the side inputs), else []."""
        return [operand3(ext[self.operands[2]], False)] if self.region.dual else []

    def exact(self, ext) -> list:
        """The region's outputs in float64 (the IR's reference interpreter), shaped like a
        call's: the second opinion when a fused result and the unfused ops disagree."""
        rows = tuning.exact_rows(self.region)
        with torch.no_grad():
            a3, b3, ins = self.region_operands(ext)
            refs = evaluate_by_rows(self.region, a3.detach(), b3.detach(), [t.detach() for t in ins], rows)
        return [torch.nn.functional.pad(r.reshape(*shape[:-1], c), (0, shape[-1] - c)) if c else r.reshape(shape)
                for r, shape, c in zip(refs, self.out_shapes, self.out_columns)]

    def canonical(self, ext):
        """(a3, b3, side inputs) in the plan's orientation, as views of ``ext`` (so autograd
        reaches the original tensors through them)."""
        a3, b3, ins = self.region_operands(ext)
        if self.plan.transposed:
            return b3.transpose(1, 2), a3.transpose(1, 2), [t.transpose(1, 2) for t in ins]
        return a3, b3, ins
