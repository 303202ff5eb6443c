"""Compiled functions: capture, find regions, plan, generate, and run.

``CompiledFunction`` keeps one specialisation per input signature (shapes,
dtypes, devices, and the values of non-tensor arguments); a call with a new
signature traces again, so a call never reuses a kernel built for other shapes.
In each specialisation the captured graph has every fused region replaced by a
``FusedRegion`` module; everything else runs as eager PyTorch ops.

Failures never give a wrong answer: a region whose planning or code generation
fails, or whose kernel fails at launch, runs its original ops instead, with a
``ComfuseWarning`` naming the reason (``COMFUSE_STRICT=1`` raises instead).
"""
from __future__ import annotations

import collections
import functools
import heapq
import inspect
import operator
import warnings

import torch
import torch.fx as fx

from .. import settings as settings_mod
from ..frontend.capture import CaptureError, capture
from ..frontend.regions import Candidate, find_chains, find_regions
from ..ir import canonical_shape, evaluate, evaluate_with_scale, format_region
from ..planner import NotFused, candidates, plan as make_plan
from ..planner.plan import template_offers
from ..planner.chain import attention_scale, plan_chain
from ..report import RegionReport, Report
from . import kernel as kernel_mod
from . import chain as chain_mod
from . import tuning
from .check import KernelMismatch, agreement_tolerance, compare, region_tolerance
from .kernel import ComfuseWarning, notice_once


class FusedRegion(torch.nn.Module):
    """One fused region inside a captured graph: runs its kernel, or its original ops."""

    def __init__(self, cand: Candidate, plan, unfused: fx.GraphModule, report: RegionReport,
                 alternatives=()):
        super().__init__()
        self.cand_inputs = cand.inputs
        self.operands = cand.operands
        self.out_shapes = [ob.shape for ob in cand.outputs]
        self.plan = plan
        self.alternatives = list(alternatives) or [plan]  # candidate plans for autotuning
        self.region = cand.region  # as found (original orientation)
        self.unfused = unfused
        self.report = report
        self.kernel = None
        self.failed = ""
        self.tuned: set = set()  # devices whose choice is made
        self.validated: set = set()  # devices where the first call was compared with the ops
        self.prefer_unfused = False
        self.separate = None  # the unfused ops as autotuning timed them (Inductor on a GPU)
        self._views: dict = {}  # side input layout -> its canonical view's (size, stride, offset)
        self._canon_outs = None  # (shape, dtype) of each output in canonical form
        self._split_ran = None  # (kernel, device, M) of this call's split launch, for its statistics

    def forward(self, *ext):
        settings = settings_mod.get()
        if self._split_ran is not None:  # (nn.Module's attribute writes cost microseconds a call)
            self._split_ran = None
        if self.failed or settings.disable:
            return self.unfused(*ext)
        a, b = ext[self.operands[0]], ext[self.operands[1]]
        why = kernel_mod.can_run_on(a.device)
        if why:
            notice_once(f"device:{why}", f"comfuse: running unfused: {why}")
            return self.unfused(*ext)
        if a.device.type == "cpu":
            notice_once("interpreter", "comfuse: fused kernels on CPU tensors run through Triton's "
                        "interpreter (exact but slow); use CUDA tensors for speed")
        try:
            if a.device not in self.tuned and tuning.enabled(a.device, settings):
                self.tune(ext, a, b)
            if self.prefer_unfused:
                self._split_ran = None  # (autotuning's launches do not count)
                return self.separate(*ext)
            outs = self.run_kernel(ext, a, b, check=settings.check)
            if a.device not in self.tuned and a.device not in self.validated:
                return self.validate(ext, a.device, outs)
            return outs
        except KernelMismatch:
            raise
        except kernel_mod.UnsupportedLayout as e:  # this call only: the next may fit again
            notice_once(f"layout:{id(self)}", f"comfuse: region at {self.report.anchor}: {e}; "
                        "calls with such tensors run unfused")
            return self.unfused(*ext)
        except Exception as e:
            if settings.strict:
                raise
            self.fail(f"kernel failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            return self.unfused(*ext)

    @property
    def output_specs(self) -> list:
        """(shape, dtype) of each output: what a fake (meta) execution returns."""
        return [(shape, out.dtype) for shape, out in zip(self.out_shapes, self.region.outputs)]

    def validate(self, ext, device, outs):
        """The first call's fused outputs against the region's own ops (COMFUSE_VALIDATE):
        on disagreement the region runs unfused from now on, and this call returns the ops'
        outputs."""
        self.validated.add(device)
        if not tuning.validating(device, [self.region]):
            return outs
        checked = tuning.check_first_call(outs, lambda: self.unfused(*ext), agreement_tolerance(self.region),
                                          f"region at {self.report.anchor}", self.fail,
                                          exact=lambda: self.exact(ext))
        if checked is not outs:
            self._split_ran = None
        return checked

    def fail(self, reason: str) -> None:
        self.failed = reason
        self.report.fused = False
        self.report.reason = reason
        warnings.warn(f"comfuse: region at {self.report.anchor} runs unfused: {reason}",
                      ComfuseWarning, stacklevel=4)

    def tune(self, ext, a, b) -> None:
        """Pick the fastest of the candidate plans and the unfused ops (see runtime.tuning)."""
        k = tuning.key(self.region, a.device)
        decision = tuning.load(k)
        names = [kernel_mod.kernel_name(p) for p in self.alternatives]
        if not tuning.reusable(decision, names):
            kernels = {}  # built on the first call: the timed calls only launch

            def run_fused(i):
                if i not in kernels:
                    kernels[i] = kernel_mod.build(self.alternatives[i])
                return self.run_kernel(ext, a, b, kernels[i], check=False)
            tuning.log.info("autotuning the region at %s", self.report.anchor)
            self.separate, form = tuning.separate(self.unfused, ext)
            decision = tuning.decide(names, run_fused, lambda: tuple(self.separate(*ext)), a.device,
                                     agreement_tolerance(self.region), exact=lambda: self.exact(ext))
            decision["separate"] = form  # (a later process runs the same form without timing it)
            if not any(why.startswith("UnsupportedLayout") for why in decision["rejected"].values()):
                tuning.store(k, decision)
            # (else this call's layout, a misaligned operand, ruled some plans out: the choice
            # holds for this process, and the next one measures again rather than inherit it)
        self.tuned.add(a.device)
        times = decision["times_ms"]
        best_fused = min((t for n, t in times.items() if n != tuning.UNFUSED), default=float("inf"))
        kept = tuning.memory_first(self.region, decision) if decision["choice"] == tuning.UNFUSED else ""
        if kept:  # slower fused, but the unfused ops would hold a huge intermediate
            decision = dict(decision, choice=kept)
        if decision["choice"] == tuning.UNFUSED:
            self.prefer_unfused = True
            if self.separate is None:
                self.separate, _ = tuning.separate(self.unfused, ext, form=decision.get("separate"))
            self.report.fused = False
            self.report.reason = (f"autotune: the unfused ops ({decision.get('separate', 'ops')}, "
                                  f"{times[tuning.UNFUSED]:.4f} ms) beat every "
                                  f"fused plan (best {best_fused:.4f} ms)")
            return
        self.prefer_unfused = False
        self.plan = self.alternatives[names.index(decision["choice"])]
        self.kernel = kernel_mod.build(self.plan)
        self.report.fused, self.report.reason = True, ""
        self.report.schedule, self.report.stages = self.plan.schedule, len(self.plan.stages)
        self.report.plan = (f"{self.plan.describe()} (autotuned: {best_fused:.4f} ms vs "
                            f"{times[tuning.UNFUSED]:.4f} ms unfused"
                            f"{'; kept fused for memory: ' + tuning.intermediate_text(self.region) if kept else ''})")
        self.report.kernel_path = self.kernel.path

    def run_kernel(self, ext, a: torch.Tensor, b: torch.Tensor, kernel=None, check: bool = False):
        """Launch ``kernel`` (default: the chosen plan's); ``check``: compare with the float64
        reference afterwards (COMFUSE_CHECK, read once by the caller)."""
        if kernel is None:
            if self.kernel is None:
                self.kernel = kernel_mod.build(self.plan)
                self.report.kernel_path = self.kernel.path
            kernel = self.kernel
        region = self.region
        device = a.device
        a3 = a if region.gemm.batched else a.unsqueeze(0)
        b3 = b if region.gemm.batched else b.unsqueeze(0)
        ins = [self.prepare_cached(j, ext[bind.ext], bind, device) for j, bind in enumerate(self.cand_inputs)]
        if self._canon_outs is None:
            self._canon_outs = [(canonical_shape(region, o.axes), o.dtype) for o in region.outputs]
        # each output allocated in its own shape, the kernel given its canonical view: the
        # tensors returned are bases of their own (no view of a temporary for a caller, such
        # as the backend's custom op, to inspect)
        results = [torch.empty(shape, dtype=dtype, device=device)
                   for shape, (_, dtype) in zip(self.out_shapes, self._canon_outs)]
        outs = [r.view(canon) for r, (canon, _) in zip(results, self._canon_outs)]
        if kernel.plan.transposed:
            kernel.launch(b3.transpose(1, 2), a3.transpose(1, 2),
                          [t.transpose(1, 2) for t in ins], [t.transpose(1, 2) for t in outs])
        else:
            kernel.launch(a3, b3, ins, outs)
            if kernel.plan.schedule in ("split", "ws_split") and a3.shape[0] == 1:
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

    def split_statistics(self, ext) -> list:
        """A split plan's merged per-row statistics on ``ext``, from its fused statistics
        kernel (the backward's first pass; runtime/onepass_grad.py)."""
        from .onepass_grad import merge_slices
        with torch.no_grad():
            a3, b3, ins = self.canonical(ext)
            a3, b3, ins = a3.detach(), b3.detach(), [t.detach() for t in ins]
            outs = [torch.empty(canonical_shape(self.plan.region, o.axes), dtype=o.dtype, device=a3.device)
                    for o in self.plan.region.outputs]
            if self.kernel is None or self.kernel.plan is not self.plan:
                self.kernel = kernel_mod.build(self.plan)
            return merge_slices(self.plan.onepass, self.kernel.split_statistics(a3, b3, ins, outs))

    def carries_statistics(self) -> int:
        """How many per-row statistic rows a call hands its backward (``take_statistics``):
        those of a split plan (or the Gluon template's terminal kind, ws_split) over one batch
        in the found orientation, else 0."""
        plan = self.plan
        if plan.schedule not in ("split", "ws_split") or plan.transposed or self.region.sizes.B != 1:
            return 0
        from .onepass_grad import packed_rows
        return packed_rows(plan.onepass)

    def take_statistics(self):
        """The merged per-row statistics of the split kernel this call just ran, packed
        [rows, M] fp32 (``onepass_grad.pack_statistics``), or None when the call ran
        something else (unfused ops, another plan): the forward's first pass, kept so the
        backward need not run it again."""
        ran, self._split_ran = self._split_ran, None
        if ran is None or ran[0] is not self.kernel:
            return None
        from .onepass_grad import merge_slices, pack_statistics
        kernel, device, M = ran
        with torch.no_grad():
            return pack_statistics(self.plan.onepass, merge_slices(self.plan.onepass, kernel.split_workspace(device, M)))

    def region_operands(self, ext):
        """(a3, b3, side inputs) in the region's canonical 3-D layout, as views of ``ext``."""
        a, b = ext[self.operands[0]], ext[self.operands[1]]
        a3 = a if self.region.gemm.batched else a.unsqueeze(0)
        b3 = b if self.region.gemm.batched else b.unsqueeze(0)
        return a3, b3, [self.prepare(ext[bind.ext], bind, a.device) for bind in self.cand_inputs]

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

    def prepare_cached(self, j: int, t, bind, device: torch.device) -> torch.Tensor:
        """``prepare``, remembered per layout: the canonical view of side input ``j`` is
        rebuilt with one ``as_strided`` once its sizes, strides and offset are known (when
        the view shares ``t``'s storage; otherwise the slow path runs every time)."""
        if not isinstance(t, torch.Tensor) or t.device != device:
            return self.prepare(t, bind, device)
        key = (j, t.shape, t.stride(), t.dtype)
        known = self._views.get(key)
        if known is None:
            v = self.prepare(t, bind, device)
            same = v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            known = (tuple(v.shape), v.stride(), v.storage_offset() - t.storage_offset()) if same else False
            if len(self._views) > 64:
                self._views.clear()
            self._views[key] = known
            return v
        if known is False:
            return self.prepare(t, bind, device)
        size, stride, offset = known
        return t.as_strided(size, stride, t.storage_offset() + offset)

    @staticmethod
    def prepare(t: torch.Tensor, bind, device: torch.device) -> torch.Tensor:
        """A side input as a canonical (B, M, N) view; axes it does not vary along have size 1."""
        if not isinstance(t, torch.Tensor):
            t = torch.tensor(t)
        if t.device != device:
            t = t.to(device)  # 0-d CPU tensors may feed CUDA ops
        v = t.expand(bind.expand_to).reshape(bind.canon)
        for d, axis in enumerate(("B", "M", "N")):
            if axis not in bind.axes and v.shape[d] != 1:
                v = v.narrow(d, 0, 1)
        return v


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _extract(gm: fx.GraphModule, cand: Candidate) -> fx.GraphModule:
    """The region's original ops as a graph of their own: the unfused path."""
    members = set(cand.members)
    for m in cand.members:  # every outside value the ops read becomes an argument
        for i in m.all_input_nodes:
            if i not in members and i not in cand.externals:
                cand.externals.append(i)
    g = fx.Graph()
    env = {ext: g.placeholder(f"ext{i}") for i, ext in enumerate(cand.externals)}
    for m in cand.members:
        env[m] = g.node_copy(m, lambda n: env[n])
    g.output(tuple(env[ob.node] for ob in cand.outputs))
    return fx.GraphModule(gm, g)


def _toposort(graph: fx.Graph) -> None:
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    pending = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(index[n], n) for n in nodes if pending[n] == 0 and n.op != "output"]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            pending[u] -= 1
            if pending[u] == 0 and u.op != "output":
                heapq.heappush(ready, (index[u], u))
    if len(order) != len(nodes) - 1:
        raise RuntimeError("graph has a cycle after fusion")  # a bug in region finding
    prev = order[0]
    for n in order[1:]:
        if prev.next is not n:
            prev.append(n)
        prev = n


def _rewrite(gm: fx.GraphModule, fused: list) -> None:
    graph = gm.graph
    replaced: dict = {}  # outputs of regions already rewritten -> the getitem that replaced them
    for i, (cand, module) in enumerate(fused):
        name = f"comfuse_region{i}"
        gm.add_submodule(name, module)
        members = set(cand.members)
        with graph.inserting_before(cand.anchor):
            call = graph.call_module(name, tuple(replaced.get(e, e) for e in cand.externals))
            outs = [graph.call_function(operator.getitem, (call, k)) for k in range(len(cand.outputs))]
        for ob, new in zip(cand.outputs, outs):
            ob.node.replace_all_uses_with(new, delete_user_cb=lambda u: u not in members)
            replaced[ob.node] = new
        for m in reversed(cand.members):
            graph.erase_node(m)
    _toposort(graph)
    drop_identity_views(graph)
    graph.lint()
    gm.recompile()


_VIEWS = (torch.ops.aten.expand.default, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default)


def drop_identity_views(graph: fx.Graph) -> int:
    """Remove views that change nothing (``expand`` or ``view`` of a tensor to its own sizes,
    with its own strides), which the capture leaves around batched matmuls: each costs a
    dispatch per call (~3.5 us on the CPU of our CI machine; target attention's call had six,
    and the call, not the GPU, was its bottleneck on the H200). Views the graph returns stay
    (a caller may rely on getting a new tensor object). Returns how many were removed."""
    returned: set = set()
    for n in graph.nodes:
        if n.op == "output":
            fx.node.map_arg(n.args, returned.add)
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _VIEWS or node in returned:
            continue
        src = node.args[0]
        before = src.meta.get("val") if isinstance(src, fx.Node) else None
        after = node.meta.get("val")
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
            continue
        if before.shape == after.shape and before.stride() == after.stride() and before.dtype == after.dtype:
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            removed += 1
    return removed


def _refused(rep: RegionReport, plan, device, because_note: str = "") -> bool:
    """Record why a plan will not run fused here (the planner said no, or the device cannot
    run generated kernels); False when it can run."""
    if isinstance(plan, NotFused):
        rep.reason = plan.reason + because_note
    else:
        rep.reason = kernel_mod.can_run_on(device) or ""
    return bool(rep.reason)


def _compilation_failed(rep: RegionReport, e: Exception, settings):
    """A region (or chain) whose planning or code generation raised: unfused, with a warning."""
    if settings.strict:
        raise e
    rep.reason = f"compilation failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    warnings.warn(f"comfuse: {rep.kind} at {rep.anchor} runs unfused: {rep.reason}",
                  ComfuseWarning, stacklevel=6)
    return None


def _region_report(index: int, cand: Candidate) -> RegionReport:
    return RegionReport(
        index=index, anchor=cand.anchor.name, kind="gemm_epilogue", fused=False,
        reason=cand.reason, stages=0, schedule="",
        ir=format_region(cand.region) if cand.region is not None else "",
        ops=[m.name for m in cand.members], outputs=[ob.node.name for ob in cand.outputs],
        notes=list(cand.notes), found=cand.region)


class Specialization:
    """The captured, rewritten graph for one input signature, and its report."""

    def __init__(self, fn, args: tuple, execute: bool = True, disabled_kinds=frozenset()):
        self.fn = fn
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        self.report = Report(function=name, regions=[])
        self.gm = None
        settings = settings_mod.get()
        try:
            gm = capture(fn, args)
        except CaptureError as e:
            if settings.strict:
                raise
            self.report.error = str(e)
            if execute:
                notice_once(f"capture:{name}", f"comfuse: {e}; running eagerly")
            return
        fused = []
        fuel = settings.fuel
        cands = find_regions(gm)
        in_chain = set()
        for chain, links in ([] if "b2b" in disabled_kinds else find_chains(cands)):
            if fuel == 0:
                break
            planned = self._plan_chain(gm, [cands[i] for i in chain], links, settings)
            if planned is not None:  # (merged candidate, module)
                fused.append(planned)
                in_chain.update(chain)
                fuel -= 1
        for index, cand in enumerate(cands):
            if index in in_chain:
                continue
            rep = _region_report(index, cand)
            self.report.regions.append(rep)
            if cand.reason:
                continue
            if "gemm_epilogue" in disabled_kinds:
                rep.reason = "gemm_epilogue fusion is disabled (backend option)"
                continue
            if fuel == 0:
                rep.reason = "fuel exhausted (COMFUSE_FUEL caps the number of fused regions)"
                continue
            module = self._plan_region(gm, cand, rep, settings)
            if module is not None:
                fused.append((cand, module))
                fuel -= 1
        if not fused:  # nothing to gain from the captured graph: run the program as written
            self.report.graph = gm.code
            return
        try:
            _rewrite(gm, fused)
        except Exception as e:  # a bug in region finding must not break the program
            if settings.strict:
                raise
            self.report.error = f"rewriting the graph failed ({type(e).__name__}: {e}); running unfused"
            for rep in self.report.regions:
                rep.fused, rep.reason = False, self.report.error
            warnings.warn(f"comfuse: {self.report.error}", ComfuseWarning, stacklevel=3)
            return
        self.gm = gm
        self.report.graph = gm.code

    def _plan_chain(self, gm, cands: list, links: list, settings):
        """A back-to-back chain as one kernel, or None (then its regions fuse one by one);
        either way the report has an entry of kind "b2b" saying which and why."""
        merged = chain_mod.merge(cands)
        rep = RegionReport(index=len(self.report.regions), anchor=cands[0].anchor.name, kind="b2b",
                           fused=False, reason="", stages=0, schedule="",
                           ir="\n".join(format_region(c.region) for c in cands),
                           ops=[m.name for m in merged.members],
                           outputs=[ob.node.name for ob in merged.outputs],
                           notes=[n for c in cands for n in c.notes])
        self.report.regions.append(rep)
        device = cands[0].anchor.meta["val"].device
        target = "cuda" if device.type == "cuda" and not kernel_mod.interpreting() else "interpreter"
        link_nodes = {cands[i + 1].anchor.args[0] for i in range(len(cands) - 1)}
        writes = [[j for j, ob in enumerate(c.outputs) if ob.node not in link_nodes] for c in cands]
        rep.found = ([c.region for c in cands], links, writes)
        try:
            plan = plan_chain([c.region for c in cands], links, writes, target, settings)
            scale = attention_scale(cands[0].region, cands[1].region, links[0]) if len(cands) == 2 else None
            long_keys = cands[0].region.sizes.N > 256
            if scale is not None and (long_keys or isinstance(plan, NotFused)):
                unfused = _extract(gm, merged)
                rep.fused, rep.schedule = True, "sdpa"
                why = plan.reason if isinstance(plan, NotFused) else "more keys than one chunk"
                rep.plan = (f"attention softmax({scale:g} * q @ k^T) @ v over {cands[0].region.sizes.N} keys: "
                            "routed to scaled_dot_product_attention (flash attention is faster "
                            f"than a generated chain here: {why})")
                return merged, chain_mod.FusedAttention(cands, merged, scale, unfused, rep)
            if _refused(rep, plan, device, "; the GEMMs fuse their own epilogues instead"):
                return None
            unfused = _extract(gm, merged)
            kernel = chain_mod.build_chain(plan)
        except Exception as e:
            return _compilation_failed(rep, e, settings)
        rep.fused, rep.schedule, rep.plan, rep.planned = True, "b2b_stream", plan.describe(), plan
        rep.stages = sum(len(st) for st in plan.stages)
        rep.kernel_path = kernel.path
        module = chain_mod.FusedChain(cands, merged, plan, unfused, rep)
        module.kernel = kernel
        return merged, module

    @staticmethod
    def _plan_region(gm, cand: Candidate, rep: RegionReport, settings):
        device = cand.anchor.meta["val"].device
        target = "cuda" if device.type == "cuda" and not kernel_mod.interpreting() else "interpreter"
        try:
            plan = make_plan(cand.region, target=target, settings=settings, sm_count=_sm_count(device))
            rep.forms = [(name, format_region(r)) for name, r in plan.forms]
            if _refused(rep, plan, device):
                return None
            unfused = _extract(gm, cand)
            kernel = kernel_mod.build(plan)  # generate and load the source now: errors surface here
            alternatives = candidates(cand.region, target=target, settings=settings,
                                      sm_count=_sm_count(device)) if tuning.enabled(device) else [plan]
        except Exception as e:
            return _compilation_failed(rep, e, settings)
        rep.fused, rep.reason = True, ""
        rep.stages, rep.schedule, rep.plan = len(plan.stages), plan.schedule, plan.describe()
        rep.planned = plan
        try:
            rep.templates = template_offers(cand.region, sm_count=_sm_count(device))
        except Exception as e:  # (only a report line)
            rep.templates = [("ws_*", f"not worked out ({type(e).__name__})")]
        rep.kernel_path = kernel.path
        module = FusedRegion(cand, plan, unfused, rep, alternatives)
        module.kernel = kernel
        return module

    def __call__(self, *args):
        if self.gm is None:
            return self.fn(*args)
        return self.gm.forward(*args)  # (not gm(...): nn.Module's call path costs ~1.6 us a call)


def _signature(args) -> tuple:
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            # which of the last two dims has unit stride: plans with TMA loads depend on it
            st = a.stride()
            unit = (st[-2] == 1, st[-1] == 1) if len(st) >= 2 else ()
            key.append(("T", a.shape, a.dtype, a.device, unit))
        else:
            try:
                hash(a)
            except TypeError:
                raise TypeError(f"comfuse.compile: argument of type {type(a).__name__} is neither a "
                                "tensor nor a hashable constant") from None
            key.append(("C", type(a), a))
    return tuple(key)


class CompiledFunction:
    """``comfuse.compile(fn, example_inputs)``: call it like ``fn``."""

    def __init__(self, fn, example_inputs):
        if not callable(fn):
            raise TypeError(f"comfuse.compile expects a callable, got {type(fn).__name__}")
        if isinstance(example_inputs, (torch.Tensor,)) or not isinstance(example_inputs, (tuple, list)):
            raise TypeError("comfuse.compile: example_inputs must be a tuple or list of arguments")
        functools.update_wrapper(self, fn, updated=())
        self._fn = fn
        try:
            self._sig = inspect.signature(fn)
        except (TypeError, ValueError):
            self._sig = None
        self._specs: collections.OrderedDict = collections.OrderedDict()
        self._specialize(tuple(example_inputs))

    def _bind(self, args, kwargs) -> tuple:
        if not kwargs or self._sig is None:
            return args
        bound = self._sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def _specialize(self, args: tuple) -> Specialization:
        key = _signature(args)
        spec = self._specs.get(key)
        if spec is None:
            limit = settings_mod.get().max_specializations
            if len(self._specs) >= limit:
                self._specs.popitem(last=False)
                notice_once(f"specs:{id(self)}", f"comfuse: more than {limit} input signatures for "
                            f"{getattr(self._fn, '__name__', self._fn)}; dropping the oldest")
            spec = Specialization(self._fn, args)
            self._specs[key] = spec
        return spec

    @property
    def report(self) -> Report:
        """The report of the most recently built specialisation."""
        return next(reversed(self._specs.values())).report

    def fused_regions(self) -> list:
        """The FusedRegion modules of the most recently built specialisation, in graph order
        (each holds its plan, its alternatives and, once called, its kernel)."""
        gm = next(reversed(self._specs.values())).gm
        return [] if gm is None else [m for m in gm.modules() if isinstance(m, FusedRegion)]

    def __call__(self, *args, **kwargs):
        args = self._bind(args, kwargs)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in args):
            notice_once(f"grad:{id(self)}", "comfuse: inputs require grad and fused kernels have no "
                        "backward yet; running the function eagerly")
            return self._fn(*args)
        return self._specialize(args)(*args)


def explain(fn, example_inputs) -> Report:
    """Find, plan and generate without running anything; return the report."""
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError("comfuse.explain: example_inputs must be a tuple or list of arguments")
    return Specialization(fn, tuple(example_inputs), execute=False).report
