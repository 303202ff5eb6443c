"""The pipeline: from a program to a captured graph whose fused regions launch kernels.

``compile_graph`` lists every step, in order; ``comfuse.compile`` and the torch.compile
backend both call it:

1. ``capture``: the program as an aten graph (make_fx with comfuse's decompositions);
2. ``find_regions`` / ``find_chains``: each GEMM with the largest epilogue DAG after it, lowered
   to the IR, and chains of GEMMs whose intermediate can stay on chip;
3. ``plan`` (``plan_chain``): the passes, the stages, a schedule and its tile, or why not;
4. ``candidates`` (``chain_candidates``): the plans autotuning times at the first call on a GPU;
5. ``build``: the chosen plan's kernel, generated and loaded now, so that errors surface here;
6. ``rewrite``: each fused region replaced by one call of its module (runtime/fused.py).

A failure in steps 3-5 leaves that region's ops in the graph, with a warning naming the reason
(``COMFUSE_STRICT=1`` raises); a failure in step 6 leaves the whole graph as captured.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from . import settings as settings_mod
from .errors import CaptureError, fallback, notice_once, summary
from .frontend.capture import capture
from .frontend.regions import Candidate, find_chains, find_regions, merge
from .ir import format_region
from .planner import NotFused, candidates, plan
from .planner.chain import attention_scale, plan_chain
from .planner.schedules import gluon_offers
from .report import RegionReport, Report
from .rewrite import extract, rewrite
from .runtime import tuning
from .runtime.build import build
from .runtime.chain import FusedAttention, FusedChain, build_chain
from .runtime.launch import can_run_on, sm_count, target_of
from .runtime.region import FusedRegion

KINDS = ("gemm_epilogue", "b2b")


def compile_graph(fn, args: tuple, execute: bool = True, disabled_kinds=frozenset()) -> tuple:
    """(the captured graph with its fused regions rewritten, or None when nothing fuses or
    capture fails; the report). ``execute``: the graph will run (a capture failure then says
    the program runs eagerly); ``disabled_kinds``: of KINDS, those not to fuse."""
    settings = settings_mod.get()
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    report = Report(function=name, regions=[])
    try:
        gm = capture(fn, args)                                          # 1. capture
    except CaptureError as e:
        if settings.strict:
            raise
        report.error = str(e)
        if execute:
            notice_once(f"capture:{name}", f"comfuse: {e}; running eagerly")
        return None, report
    cands = find_regions(gm)                                            # 2. regions and chains
    chains = [] if "b2b" in disabled_kinds else find_chains(cands)
    fuel = settings.fuel
    fused, in_chain = [], set()
    for chain, links in chains:
        if fuel == 0:
            break
        found = fuse_chain(gm, [cands[i] for i in chain], links, report)  # 3-5 for a chain
        if found is not None:
            fused.append(found)
            in_chain.update(chain)
            fuel -= 1
    for index, cand in enumerate(cands):
        if index in in_chain:
            continue
        rep = region_report(index, cand)
        report.regions.append(rep)
        if cand.reason:
            continue
        if "gemm_epilogue" in disabled_kinds:
            rep.reason = "gemm_epilogue fusion is disabled (backend option)"
        elif fuel == 0:
            rep.reason = "fuel exhausted (COMFUSE_FUEL caps the number of fused regions)"
        elif (module := fuse_region(gm, cand, rep)) is not None:     # 3-5 for a region
            fused.append((cand, module))
            fuel -= 1
    if fused:
        try:
            rewrite(gm, fused)                                          # 6. rewrite
        except Exception as e:  # a bug in region finding must not break the program
            fallback("rewriting the graph failed", e, "the graph runs as captured")
            report.error = f"rewriting the graph failed ({summary(e)}); running unfused"
            for rep in report.regions:
                rep.fused, rep.reason = False, report.error
            return None, report
    report.graph = gm.code
    return (gm if fused else None), report


def region_report(index: int, cand: Candidate) -> RegionReport:
    return RegionReport(
        index=index, anchor=cand.anchor.name, kind="gemm_epilogue", fused=False,
        reason=cand.reason, stages=0, schedule="",
        ir=format_region(cand.region) if cand.region is not None else "",
        ops=[m.name for m in cand.members], outputs=[ob.node.name for ob in cand.outputs],
        notes=list(cand.notes), through=list(cand.through), found=cand.region)


def _device(cand: Candidate) -> torch.device:
    return cand.anchor.meta["val"].device


def _failed(rep: RegionReport, e: Exception) -> None:
    """A region (or chain) whose planning or code generation raised: its ops run, with a warning."""
    fallback(f"{rep.kind} at {rep.anchor} could not be compiled", e, "its ops run unfused", stacklevel=4)
    rep.reason = f"compilation failed: {summary(e)}"


def fuse_region(gm: fx.GraphModule, cand: Candidate, rep: RegionReport):
    """The region's module (plan, candidates and kernel built), or None with the reason in ``rep``."""
    device = _device(cand)
    target = target_of(device)
    try:
        planned = plan(cand.region, target=target, sm_count=sm_count(device))                  # 3. plan
        rep.forms = [(name, format_region(r)) for name, r in planned.ir_forms]
        rep.reason = planned.reason if isinstance(planned, NotFused) else can_run_on(device)
        if rep.reason:
            return None
        kernel = build(planned)                                                                  # 5. build
        alternatives = (candidates(cand.region, target=target, sm_count=sm_count(device))      # 4. candidates
                        if tuning.enabled(device) else [planned])
        unfused = extract(gm, cand)
    except Exception as e:
        return _failed(rep, e)
    rep.fused, rep.reason = True, ""
    rep.stages, rep.schedule, rep.plan, rep.planned = len(planned.stages), planned.schedule, planned.describe(), planned
    try:
        rep.templates = gluon_offers(cand.region, sm_count=sm_count(device))
    except Exception as e:  # (a line of the report only)
        rep.templates = [("ws_*", f"not worked out ({summary(e)})")]
    rep.kernel_path = kernel.path
    module = FusedRegion(cand, planned, unfused, rep, alternatives)
    module.kernel = kernel
    return module


def fuse_chain(gm: fx.GraphModule, cands: list, links: list, report: Report):
    """A back-to-back chain as one kernel: (merged candidate, module), or None (its regions
    then fuse one by one); either way ``report`` gets an entry of kind "b2b" saying which."""
    merged = merge(cands)
    rep = RegionReport(index=len(report.regions), anchor=cands[0].anchor.name, kind="b2b", fused=False, reason="",
                       stages=0, schedule="", ir="\n".join(format_region(c.region) for c in cands),
                       ops=[m.name for m in merged.members], outputs=[ob.node.name for ob in merged.outputs],
                       notes=[n for c in cands for n in c.notes])
    report.regions.append(rep)
    device = _device(cands[0])
    link_nodes = {cands[i + 1].anchor.args[0] for i in range(len(cands) - 1)}
    writes = [[j for j, ob in enumerate(c.outputs) if ob.node not in link_nodes] for c in cands]
    rep.found = ([c.region for c in cands], links, writes)
    try:
        planned = plan_chain([c.region for c in cands], links, writes, target_of(device))      # 3. plan
        scale = attention_scale(cands[0].region, cands[1].region, links[0]) if len(cands) == 2 else None
        if scale is not None and (cands[0].region.sizes.N > 256 or isinstance(planned, NotFused)):
            why = planned.reason if isinstance(planned, NotFused) else "more keys than one chunk"
            rep.fused, rep.schedule = True, "sdpa"
            rep.plan = (f"attention softmax({scale:g} * q @ k^T) @ v over {cands[0].region.sizes.N} keys: "
                        "routed to scaled_dot_product_attention (flash attention is faster than a generated "
                        f"chain here: {why})")
            return merged, FusedAttention(cands, merged, scale, extract(gm, merged), rep)
        rep.reason = planned.reason + "; the GEMMs fuse their own epilogues instead" \
            if isinstance(planned, NotFused) else can_run_on(device)
        if rep.reason:
            return None
        kernel = build_chain(planned)                                                            # 5. build
        unfused = extract(gm, merged)
    except Exception as e:
        return _failed(rep, e)
    rep.fused, rep.schedule, rep.plan, rep.planned = True, "b2b_stream", planned.describe(), planned
    rep.stages = sum(len(st) for st in planned.stages)
    rep.kernel_path = kernel.path
    module = FusedChain(cands, merged, planned, unfused, rep)  # (its candidates: at tuning, 4.)
    module.kernel = kernel
    return merged, module


def fake_inputs(example_inputs) -> tuple:
    """Dynamo's example inputs as fake tensors of a fresh fake mode without a shape
    environment: capture then sees plain integer sizes (no sym_size nodes), so views
    between regions stay inside them. Nothing is allocated. Each keeps ``requires_grad``:
    ops that decide by it what to save for a backward (attention's log-sum-exp) must decide
    as they will when Inductor's AOTAutograd differentiates the graph."""
    mode = FakeTensorMode()
    out = []
    with mode:
        for t in example_inputs:
            if isinstance(t, torch.Tensor):
                fake = torch.empty_strided(tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()),
                                           dtype=t.dtype, device=t.device)
                out.append(fake.requires_grad_(t.requires_grad) if t.is_floating_point() else fake)
            else:
                out.append(t)
    return tuple(out)
