"""The warp-specialised Gluon kernels run on the CPU: the generated ws_stages module
(codegen/gluon/stages.py's text) and the hand-written template (codegen/gluon/strip.py's
``strip_kernel``, also its terminal kind for ws_split) executed by Python over torch tensors
(runtime/emulate_gluon.py), so that CI checks their arithmetic and their strip exchanges
against the IR's float64 reference. Gluon kernels do not run in Triton's interpreter; this
runs the kernels' own function bodies. Not emulated: the mainloop (an fp32 product stands in),
layouts (so bit-level disagreements between groups that sum in different orders), the order
of floating-point sums, and time.
"""
from __future__ import annotations

import torch

from ..codegen.gluon import stages, strip
from ..ir import canonical_shape, evaluate_with_scale
from ..planner.gluon import tma_residual
from . import cache, stages_kernel, strip_kernel
from .build import build
from .check import compare, region_tolerance
from .emulate_gluon import BM, BN, Desc, Emulation, Ptr, launch, module_env
from .operands import empty_output


def _grid(M: int, N: int, programs: int, strips: bool = True) -> int:
    if M % BM or (N % BN and strips):
        raise ValueError(f"emulate.run: M a multiple of {BM}, N of {BN} (got {M}x{N})")
    tiles_n = -(-N // BN)
    programs = min(programs, (M // BM) * tiles_n)
    if strips and programs < tiles_n:
        raise ValueError(f"emulate.run: {programs} programs cannot hold a strip of {tiles_n} tiles at once")
    return programs


def _b_operand(plan, b3):
    """B as the kernels take it: [N, K] where the region's B is K-major (nn.Linear's weight)."""
    return b3[0].t() if plan.region.gemm.b.major == "K" else b3[0]


def run(plan, a3: torch.Tensor, b3: torch.Tensor, ins, outs=None, programs: int = 132, launches: int = 1,
        name: str = "k", timeout: float = 120.0, source: str | None = None):
    """Run ``plan``'s kernel on CPU tensors in canonical 3-D layout: a ws_stages plan's
    generated kernel, or a ws_strip plan's template (strip.py's ``strip_kernel``); row form,
    unbatched. Each of the persistent grid's ``programs`` programs (at least a strip's tiles,
    which must be resident at once) is a thread, and each program's two partitions are threads.
    The kernel function, its partitions and its per-tile function are the module's own; the
    mainloop partition and the residual's TMA load are stand-ins (emulate_gluon.module_env).
    Returns the outputs in canonical 3-D layout (written into ``outs`` when given). ``launches``: how many
    times to run it with the same counters (they only grow; each strip's is checked after each
    launch); ``timeout``: seconds a launch may take before it is taken to wait forever;
    ``source``: a ws_stages module's text in place of the plan's (tests of the emulation)."""
    region = plan.region
    builders = {"ws_stages": _stages, "ws_strip": _strip, "ws_split": _split}
    if plan.schedule not in builders or plan.transposed or region.gemm.batched:
        raise ValueError("emulate.run: a ws_stages, ws_strip or ws_split plan, row form, unbatched")
    s = region.sizes
    programs = _grid(s.M, s.N, programs, strips=plan.schedule != "ws_split")
    if outs is None:
        outs = [empty_output(canonical_shape(region, o.axes), o.dtype, "cpu", "N" in o.axes) for o in region.outputs]
    em = Emulation()
    kernel, args, options, counters, arrivals, finish = builders[plan.schedule](plan, em, a3, b3, ins, outs, name,
                                                                                source)
    for n in range(launches):
        launch(em, kernel, args, options, programs, timeout)
        expected = (n + 1) * arrivals
        if any(int(c) != expected for c in counters):
            raise RuntimeError(f"emulate.run: the strips' counters are {counters.tolist()}, not {expected} each")
        if finish is not None:
            finish()
    return outs


def _stages(plan, em, a3, b3, ins, outs, name, source):
    """(kernel, arguments, constexprs, counters, arrivals a strip a launch) of a ws_stages plan."""
    region = plan.region
    M, N, K = region.sizes.M, region.sizes.N, region.sizes.K
    text = source if source is not None else stages_kernel.source_text(plan, name)
    module = cache.load_source(f"{name}_emulated_{abs(hash(text)) % 10**12}", text)
    kernel = module_env(module, em)[name]
    residual = tma_residual(region) if plan.form.res_tma else None
    flat_in = [t[0].contiguous().reshape(-1) if spec.axes == frozenset("MN") else t.reshape(-1).contiguous()
               for t, spec in zip(ins, region.inputs)]
    flat_out = [o.view(-1) for o in outs]
    args = [Desc(a3[0], (BM, 64)), Desc(_b_operand(plan, b3), (64, BN)), *[Ptr(t) for t in flat_in + flat_out]]
    if residual is not None:  # r_desc
        args.append(Desc(flat_in[residual].view(M, N), (BM, BN)))
    ws = torch.zeros(stages.workspace_numel(M, N, plan.stages, plan.form.moments), dtype=torch.float32)
    counters = torch.zeros(M // BM, dtype=torch.int64)
    args += [Ptr(ws), Ptr(counters), M, N, K]
    options = {k: v for k, v in stages_kernel.options(plan, N).items() if k != "maxnreg"}
    return kernel, args, options, counters, plan.form.exchanges * 2 * (N // BN), None


def _strip(plan, em, a3, b3, ins, outs, name, source):
    """(kernel, arguments, constexprs, counters, arrivals a strip a launch) of a ws_strip plan:
    the template's roles as runtime/strip_kernel.py fills them."""
    if source is not None:
        raise ValueError("emulate.run: the template's source is strip.py's")
    kernel = module_env(strip, em)["strip_kernel"]
    a, b, out, bias, residual, gamma, beta = strip_kernel.operands(plan, a3, b3, ins, outs)
    cfg = strip_kernel.config(plan)
    M, N, K = out.shape[0], out.shape[1], a.shape[1]

    def ptr(t):
        return Ptr((out if t is None else t).reshape(-1))
    args = [Desc(a, (BM, 64)), Desc(b, (BN, 64) if cfg.b_kmajor else (64, BN)),
            Desc(residual if residual is not None else out, (BM, BN)), ptr(bias), ptr(residual), ptr(gamma),
            ptr(beta), ptr(out), ptr(None)]
    ws = torch.zeros(strip.workspace_numel(M, N, cfg.kind), dtype=torch.float32)
    counters = torch.zeros(M // BM, dtype=torch.int64)
    args += [Ptr(ws), Ptr(counters), M, N, K, plan.form.template.eps]
    options = dict(cfg.constexprs(N // BN), num_warps=8)
    arrivals = N // BN if cfg.kind in (strip.KIND_LAYERNORM, strip.KIND_RMSNORM, strip.KIND_SOFTMAX) else 0
    return kernel, args, options, counters, arrivals, None


def _split(plan, em, a3, b3, ins, outs, name, source):
    """The same for a ws_split plan: the template's terminal kind (KIND_LSE, grouped tile
    order) leaves each tile's log-sum-exp per row and the logits at the targets in the
    workspace (NaN where it writes nothing), then the generated Triton combine kernel (Triton's
    interpreter on the CPU) turns them into the outputs, as runtime/strip_kernel.LseKernel does;
    where the region returns the logits, the template writes them too."""
    if source is not None:
        raise ValueError("emulate.run: the template's source is strip.py's")
    lse = build(plan)
    kernel = module_env(strip, em)["strip_kernel"]
    a, b, targets = lse.operands(a3, b3, ins)
    cfg = lse.config()
    M, K = a.shape
    N = b.shape[0] if cfg.b_kmajor else b.shape[1]
    dummy = torch.empty(BM, BN, dtype=torch.bfloat16)
    ws = torch.full((strip.workspace_numel(M, N, strip.KIND_LSE, cfg.exact_max), ), float("nan"))
    counters = torch.zeros(M // BM, dtype=torch.int64)
    logits = lse.logits(outs, dummy)  # (the dummy where the region has no logits output)
    args = [Desc(a, (BM, 64)), Desc(b, (BN, 64) if cfg.b_kmajor else (64, BN)), Desc(logits, (BM, BN)),
            *[Ptr(dummy.view(-1))] * 5, Ptr(targets), Ptr(ws), Ptr(counters), M, N, K, 1e-5]
    options = dict(cfg.constexprs(-(-N // BN), N % BN == 0), num_warps=8)
    return kernel, args, options, counters, 0, lambda: lse.combine(a3, b3, ins, outs, ws)


def check(plan, a3, b3, ins, **kw) -> list:
    """``run``'s outputs against the IR's float64 reference, judged as ``COMFUSE_CHECK`` judges
    a kernel's (``runtime.check``: the region's tolerance, errors in units of the reference
    interpreter's error scale): the list of comparisons, each with ``.ok``."""
    outs = run(plan, a3, b3, ins, **kw)
    refs, scales = evaluate_with_scale(plan.region, a3, b3, ins)
    tol = region_tolerance(plan.region)
    return [compare(o, r, tol, s) for o, r, s in zip(outs, refs, scales)]
