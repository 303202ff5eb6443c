"""A fused GEMM + epilogue region inside a captured graph (``FusedRegion``): its chosen plan's
kernel, autotuned among its candidate plans on a GPU, or its original ops.

A split region (a loss over a wide row) also keeps the per-row statistics its last call
computed, for the backward (``take_statistics``; runtime/onepass_grad.py)."""
from __future__ import annotations

import torch

from ..ir import canonical_shape, evaluate, evaluate_with_scale
from . import onepass_grad, tuning
from .build import build, kernel_name
from ..errors import KernelMismatch
from .check import agreement_tolerance, compare, region_tolerance
from .fused import Fused
from .operands import Views, operand3, prepare

SPLIT_SCHEDULES = ("split", "ws_split")


class FusedRegion(Fused):
    kind = "region"

    def __init__(self, cand, plan, unfused, report, alternatives=()):
        super().__init__(unfused, report)
        self.cand_inputs = cand.inputs
        self.operands = cand.operands
        self.out_shapes = [ob.shape for ob in cand.outputs]
        self.plan = plan
        self.alternatives = list(alternatives) or [plan]  # candidate plans for autotuning
        self.region = cand.region  # as found (original orientation)
        self.regions = [cand.region]
        self.tolerance = agreement_tolerance(cand.region)
        self._views = Views()
        self._canon_outs = [(canonical_shape(cand.region, o.axes), o.dtype) for o in cand.region.outputs]
        self._split_ran = None  # (kernel, device, M) of this call's split launch, for its statistics

    def forward(self, *ext):
        if self._split_ran is not None:  # (nn.Module's attribute writes cost microseconds a call)
            self._split_ran = None
        return super().forward(*ext)

    def device_of(self, ext) -> torch.device:
        return ext[self.operands[0]].device

    def run_separate(self, ext):
        self._split_ran = None  # (autotuning's launches do not count)
        return self.separate(*ext)

    def validate(self, ext, device, outs):
        checked = super().validate(ext, device, outs)
        if checked is not outs:
            self._split_ran = None
        return checked

    @property
    def output_specs(self) -> list:
        """(shape, dtype) of each output: what a fake (meta) execution returns."""
        return [(shape, out.dtype) for shape, out in zip(self.out_shapes, self.region.outputs)]

    def tune(self, ext, device) -> None:
        """Pick the fastest of the candidate plans and the unfused ops (runtime/tuning.py)."""
        names = [kernel_name(p) for p in self.alternatives]
        kernels = {}  # built on the first call: the timed calls only launch

        def run_fused(i):
            if i not in kernels:
                kernels[i] = build(self.alternatives[i])
            return self.run(ext, device, kernels[i])
        decision = self.autotune(ext, device, tuning.key(self.region, device), names, run_fused)
        kept = tuning.memory_first(self.region, decision) if decision["choice"] == tuning.UNFUSED else ""
        if kept:  # slower fused, but the unfused ops would hold a huge intermediate
            decision = dict(decision, choice=kept)
        if decision["choice"] == tuning.UNFUSED:
            self.keep_unfused(ext, decision, "every fused plan")
            return
        times = decision["times_ms"]
        self.prefer_unfused = False
        self.plan = self.alternatives[names.index(decision["choice"])]
        self.kernel = build(self.plan)
        self.report.fused, self.report.reason = True, ""
        self.report.schedule, self.report.stages = self.plan.schedule, len(self.plan.stages)
        self.report.plan = (f"{self.plan.describe()} (autotuned: {times[decision['choice']]:.4f} ms vs "
                            f"{times[tuning.UNFUSED]:.4f} ms unfused"
                            f"{'; kept fused for memory: ' + tuning.intermediate_text(self.region) if kept else ''})")
        self.report.kernel_path = self.kernel.path

    def run(self, ext, device, kernel=None, check: bool = False):
        """Launch ``kernel`` (default: the chosen plan's); ``check``: compare with the float64
        reference afterwards (COMFUSE_CHECK)."""
        if kernel is None:
            if self.kernel is None:
                self.kernel = build(self.plan)
                self.report.kernel_path = self.kernel.path
            kernel = self.kernel
        batched = self.region.gemm.batched
        a3, b3 = operand3(ext[self.operands[0]], batched), operand3(ext[self.operands[1]], batched)
        ins = [self._views(j, ext[bind.ext], bind, device) for j, bind in enumerate(self.cand_inputs)]
        # each output allocated in its own shape, the kernel given its canonical view: the
        # tensors returned are bases of their own (no view of a temporary for a caller to inspect)
        results = [torch.empty(shape, dtype=dtype, device=device)
                   for shape, (_, dtype) in zip(self.out_shapes, self._canon_outs)]
        outs = [r.view(canon) for r, (canon, _) in zip(results, self._canon_outs)]
        if kernel.plan.transposed:
            kernel.launch(b3.transpose(1, 2), a3.transpose(1, 2), [t.transpose(1, 2) for t in ins],
                          [t.transpose(1, 2) for t in outs])
        else:
            kernel.launch(a3, b3, ins, outs)
            if kernel.plan.schedule in SPLIT_SCHEDULES and a3.shape[0] == 1:
                self._split_ran = (kernel, device, a3.shape[1])
        if check:
            self.check(a3, b3, ins, outs, kernel)
        return tuple(results)

    def check(self, a3, b3, ins, outs, kernel) -> None:
        refs, scales = evaluate_with_scale(self.region, a3, b3, ins)
        tol = region_tolerance(self.region)
        for out, ref, scale, spec in zip(outs, refs, scales, self.region.outputs):
            result = compare(out, ref, tol, scale)
            if not result.ok:
                raise KernelMismatch(f"kernel {kernel.source.name} output {spec.name}: {result}")

    # ---- the backward of a split region (a loss over a wide row) ---------------------------
    def split_statistics(self, ext) -> list:
        """A split plan's merged per-row statistics on ``ext``, from its fused statistics
        kernel (the backward's first pass; runtime/onepass_grad.py)."""
        with torch.no_grad():
            a3, b3, ins = self.canonical(ext)
            a3, b3, ins = a3.detach(), b3.detach(), [t.detach() for t in ins]
            outs = [torch.empty(canonical_shape(self.plan.region, o.axes), dtype=o.dtype, device=a3.device)
                    for o in self.plan.region.outputs]
            if self.kernel is None or self.kernel.plan is not self.plan:
                self.kernel = build(self.plan)
            return onepass_grad.merge_slices(self.plan.form.onepass, self.kernel.split_statistics(a3, b3, ins, outs))

    def carries_statistics(self) -> int:
        """How many per-row statistic rows a call hands its backward (``take_statistics``):
        those of a split plan (or the Gluon template's terminal kind, ws_split) over one batch
        in the found orientation, else 0."""
        plan = self.plan
        if plan.schedule not in SPLIT_SCHEDULES or plan.transposed or self.region.sizes.B != 1:
            return 0
        return onepass_grad.packed_rows(plan.form.onepass)

    def take_statistics(self):
        """The merged per-row statistics of the split kernel this call just ran, packed
        [rows, M] fp32 (``onepass_grad.pack_statistics``), or None when the call ran
        something else (unfused ops, another plan): the forward's first pass, kept so the
        backward need not run it again."""
        ran, self._split_ran = self._split_ran, None
        if ran is None or ran[0] is not self.kernel:
            return None
        kernel, device, M = ran
        op = self.plan.form.onepass
        with torch.no_grad():
            return onepass_grad.pack_statistics(op, onepass_grad.merge_slices(op, kernel.split_workspace(device, M)))

    def region_operands(self, ext):
        """(a3, b3, side inputs) in the region's canonical 3-D layout, as views of ``ext``."""
        a, b = ext[self.operands[0]], ext[self.operands[1]]
        batched = self.region.gemm.batched
        return operand3(a, batched), operand3(b, batched), [prepare(ext[bind.ext], bind, a.device)
                                                            for bind in self.cand_inputs]

    def exact(self, ext) -> list:
        """The region's outputs in float64 (the IR's reference interpreter), shaped like a
        call's: the second opinion when a fused result and the unfused ops disagree."""
        tuning.exact_fits([self.region])
        with torch.no_grad():
            a3, b3, ins = self.region_operands(ext)
            refs = evaluate(self.region, a3.detach(), b3.detach(), [t.detach() for t in ins])
        return [r.reshape(shape) for r, shape in zip(refs, self.out_shapes)]

    def canonical(self, ext):
        """(a3, b3, side inputs) in the plan's orientation, as views of ``ext`` (so autograd
        reaches the original tensors through them)."""
        a3, b3, ins = self.region_operands(ext)
        if self.plan.transposed:
            return b3.transpose(1, 2), a3.transpose(1, 2), [t.transpose(1, 2) for t in ins]
        return a3, b3, ins
