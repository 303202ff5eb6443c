"""The cost model: which of a region's candidate plans are worth compiling and timing on a GPU.

Compiling a candidate costs seconds (Triton's compiler, on the host); timing it costs the
GPU's time. A model's first call through the backend tuned every region it found, and on
the H200 that was 95 of BERT's 116 seconds, for regions that all kept Inductor's code. So
before anything is compiled:

1. **What each kind of plan has ever reached**: per schedule, the best time its plans
   reached against the region's unfused ops as Inductor compiles them, over every stored
   autotuning decision in the benchmark results on the H200 (``BEST_SEEN``); and, once
   ``MEASURED_ENOUGH`` regions of a class (schedule, batched or not, size within a factor of
   4, deep or flat: ``plan_class``) were measured inside models, in the benchmark results
   (``MEASURED_CLASSES``) or on this GPU (the record each tuned region adds to, on disk,
   shared by processes: runtime/prediction.py), the best of those instead. A region none of whose candidates is of
   a kind that has ever been ``MIN_GAIN`` faster than the ops is not tuned: its ops go to
   Inductor at once. Inside Inductor's compilation this is the
   common case: only the one-launch Triton plans can be launched by Inductor's wrapper, and
   the cooperative and row-in-CTA plans of a row reduction (LayerNorm, RMSNorm, softmax)
   never beat Inductor's code for the same ops (best 0.99 and 1.45 of its time); the
   warp-specialised Gluon kernels that do (0.69-0.97) run only through comfuse's own launch.
2. **A roofline estimate** (``estimate_ms``) ranks the rest: the GEMM's tile grid in waves
   over the SMs at the measured GEMM rate, plus the bytes the kernel reads and writes at the
   measured copy bandwidth, plus a fixed cost per launch. Only the plans of the
   ``SHORTLIST`` best tile shapes are compiled and timed. It orders tile shapes (wave
   quantisation, tiles wasted at the edges) and schedules (a second launch); it cannot tell a
   shape's forms apart (mainloop, grid), which are all kept, and it is not trusted to decide
   between a plan and the unfused ops, which autotuning measures.

Each stored decision records the estimates beside the measured times (``about``), so the
constants can be fitted again as decisions accumulate (``scripts/plan_record.py``).
"""
from __future__ import annotations

import math

from ..ir import Op
from .records import Plan
from .schedules import cdiv

# Best measured time of a schedule's plans over the region's unfused ops (Inductor's code
# for them, timed as CUDA-graph replays), across the stored decisions of
# bench/results/2026-12-01-h200-models, 2026-12-03-h200-paper-* and 2026-12-03-h200-b2b-*
# (H200; per schedule: regions measured, best ratio). A schedule absent here has no record
# and is always tuned.
BEST_SEEN = {
    "tile": 0.94,  # 4 regions (0.94-1.02): pointwise epilogues
    "split": 0.95,  # 1 region: a loss over a 32768 vocabulary
    "cooperative": 0.99,  # 19 regions (0.99-1.78): row reductions
    "row_in_cta": 1.45,  # 14 regions (1.45-5.10): row reductions
    "ws_stages": 0.69,  # 17 regions (0.69-0.97)
    "ws_strip": 0.86,  # 16 regions (0.86-1.10)
}
# Classes of plans (``plan_class``) measured inside a model: class -> {region's decision key:
# the class's best time over the region's ops'}. From the record BERT's first call left on the
# H200 (2 layers, 32 x 512 tokens, bf16; bench/results/2026-12-05-h200-standin-and-cost-model/
# measured-run3.json), LM heads, and the Llama-3-8B-shaped block. A GPU's own measurements add
# to it.
MEASURED_CLASSES = {
    "row_in_cta/batched/16/flat": {"7c36a48abb7806cf": 1.7695, "e39b553b2a8f0237": 1.8053},
    "tile/batched/16/flat": {"7c36a48abb7806cf": 1.1014, "e39b553b2a8f0237": 1.3147},  # attention's bmm
    "tile/single/18/flat": {"4c4e1e1e0cc31c05": 1.1825, "a02ebf9cd38d57be": 1.0256},  # GEMM + GELU
    # GPT-2's MLP up projection with its GELU (8192 x 768 x 3072; training and inference graphs;
    # an H100, 2026-12-06: bench/results/2026-12-06-h100-region-replay/): 2.7-3.0 s of tuning a graph
    "tile/single/17/flat": {"354d29f4bd9b5fab": 1.0307, "c029c7d73c5b9adc": 1.3821},
    # weight gradients into an LM head's vocabulary with their epilogue (BERT's decoder, 30522 x
    # 768 x 16384; GPT-2's tied head, 50257 x 768 x 8192): an H100, 2026-12-07,
    # bench/results/2026-12-07-h100-region-inputs-and-bias/ and 2026-12-07-h100-swiglu-class/
    # (BERT's 0.90 on the H200 on 2026-12-05 timed ops Inductor had not padded, as the graph does)
    "tile/single/19/deep": {"bert-decoder-wgrad-h100-a": 1.8861, "bert-decoder-wgrad-h100-b": 1.7995,
                            "gpt2-head-wgrad-h100-a": 1.5333, "gpt2-head-wgrad-h100-b": 1.5226},
    # GELU's backward after dY @ W2 and the bias gradient's column sum, the derivative computed in
    # the region (GPT-2's 8192 x 3072 x 768, BERT's 16384 x 3072 x 768; the same runs)
    "split/single/17/flat": {"gpt2-gelu-backward-h100-a": 1.1059, "gpt2-gelu-backward-h100-b": 1.0773},
    "split/single/18/flat": {"bert-gelu-backward-h100-a": 1.2025, "bert-gelu-backward-h100-b": 1.1770},
    # LM heads with their loss that return the logits (GPT-2's 8192 x 768 x 50257, Llama's
    # 8192 x 2048 x 32000; training and inference graphs; H100 and H200, 2026-12-05:
    # bench/results/2026-12-05-gpt2-head-padded/, 2026-12-05-h100-lm-head-logits/llama-run1/)
    "split/single/19/flat": {"gpt2-head-training-h100": 1.2163, "gpt2-head-h100": 1.1825,
                             "gpt2-head-training-h200": 1.1737, "gpt2-head-h200": 1.1738,
                             "llama-head-training-h100": 1.2589, "llama-head-h100": 1.2984},
    # the 8B block's MLP GEMMs with their pointwise epilogues (8192 x 14336 x 4096; training and
    # inference graphs; an H100, 2026-12-06: bench/results/2026-12-06-first-calls-and-host-layers/;
    # on the H200 autotuning chose Inductor's code for them in every run of 2026-12-06)
    "tile/single/19/flat": {"31b97a33766d6ee3": 1.1463, "6edecf479dbed63d": 1.1071, "d5ba41e1879ba225": 1.1517},
    # the 8B block's down projection with its residual (8192 x 4096 x 14336; training and
    # inference graphs; H100 and H200, 2026-12-06: the same results): tuning it took 5-9 s a
    # graph for at best 2 %
    "ws_stages/single/19/deep": {"1fc29563fd86789f": 1.0347, "ec551c31c0bfb9ad": 0.9815,
                                 "8f84ff76da60d516": 0.9781, "e18b85933713b296": 0.9994},
    "ws_strip/single/19/deep": {"1fc29563fd86789f": 1.0457, "8f84ff76da60d516": 0.9818},
    # the Triton split plans at the 8B LM head (8192 x 128256 x 4096, inference graphs, the H200
    # and an H100, 2026-12-06: the same results and 2026-12-06-cheaper-first-calls/), where the
    # Gluon template reached 0.93-0.97: compiling and timing them took 4-8 s a graph
    "split/single/21/flat": {"f56b1d68e9241809": 0.9974, "7c2ca7339db6d5ca": 1.0199},
    # the 8B block's gate and up products with SwiGLU, in its training forward, which writes both
    # products for the backward (8192 x 4096 -> 14336; an H100, 2026-12-07:
    # bench/results/2026-12-07-h100-models-suite/llama8b/ and 2026-12-07-h100-region-inputs-and-bias/
    # llama8b-gpt2/, 5-7 s of tuning a first step; on the H200 the same day no candidate beat the ops)
    "tile/dual-writes-products/19/flat": {"8b-swiglu-training-h100-a": 0.9964, "8b-swiglu-training-h100-b": 0.9944},
}
# a schedule must have been at least this much faster than the ops to be tried: autotuning
# keeps a plan only 2 % faster than the ops (runtime/tuning.py's KEEP_MARGIN), and a kind whose
# best was about that wins a tie at most
MIN_GAIN = 0.03
# regions of a class (``plan_class``) measured (MEASURED_CLASSES and this GPU's record, which
# the decisions autotuning makes add to: runtime/prediction.py) before they replace BEST_SEEN
# for it
MEASURED_ENOUGH = 2
SHORTLIST = 3  # tile shapes compiled and timed per region (each in all its forms), best estimates first

# the H200's measured ceilings (bench/results/2026-12-03-h200-paper-comfuse: bf16 GEMM
# 753 TFLOP/s on random data, copy 4.24 TB/s) and the fixed cost of a launch inside a graph
# (its ramp and tail)
GEMM_TFLOPS = {2: 750.0, 4: 60.0}  # by operand bytes: bf16 / fp16, fp32 (no TF32)
COPY_TBPS = 4.2
LAUNCH_MS = 0.003
SM_COUNT = 132


def plan_class(plan: Plan) -> str:
    """The class of regions a measurement of ``plan`` speaks for: its schedule, whether
    the GEMM is batched or has a second product, its size within a factor of 4 (B * M * N * K), and its shape: deep
    (K at least the smaller side of its output: few output tiles, each with a long mainloop,
    as in a weight gradient) or flat. A weight gradient and a forward GEMM of the same size
    fare differently against cuBLAS (LM heads' weight gradients at 1.52-1.89 of their ops'
    time, the 8B block's MLP GEMMs of that size at 1.11-1.15)."""
    r, s = plan.region, plan.region.sizes
    work = max(s.B * s.M * s.N * s.K, 1)
    shape = "deep" if s.K >= min(s.M, s.N) else "flat"
    # (two products of one A: its ops are two GEMMs and their epilogue, another comparison;
    # one that writes a product too, as a training forward saves them for its backward, gains
    # less still: the 8B MLP's gate and up products, at 0.994-0.996 of their ops' time where
    # the region wrote them, 0.85-0.98 where it wrote their epilogue's result alone)
    kind = "batched" if r.gemm.batched else "dual" if r.dual else "single"
    if r.dual and any(r.nodes[o.node].op is Op.ACC for o in r.outputs):
        kind = "dual-writes-products"
    return f"{plan.schedule}/{kind}/{round(math.log2(work) / 2)}/{shape}"


def _best(plan: Plan, measured: dict) -> tuple:
    """(best time over the ops' a plan like ``plan`` has reached, where that comes from): from
    the measurements of its class (``MEASURED_CLASSES`` and this GPU's own) where there are
    ``MEASURED_ENOUGH``; else from those of its size, deep and flat together (the classes
    before the shape told them apart: attention's backward GEMMs, deep, go by its forward's);
    else from ``BEST_SEEN``; (0, ...) where none knows."""
    c = plan_class(plan)
    seen = {**MEASURED_CLASSES.get(c, {}), **measured.get(c, {})}
    if len(seen) >= MEASURED_ENOUGH:
        return min(seen.values()), f"{len(seen)} regions of its class measured"
    size = c.rsplit("/", 1)[0] + "/"
    for record in (MEASURED_CLASSES, measured):
        for other, regions in record.items():
            if other.startswith(size):
                seen.update(regions)
    if len(seen) >= MEASURED_ENOUGH:
        return min(seen.values()), f"{len(seen)} regions of its size measured"
    if plan.schedule in BEST_SEEN:
        return BEST_SEEN[plan.schedule], "the benchmark record"
    return 0.0, "no record"


def may_win(plans: list[Plan], measured: dict | None = None) -> bool:
    """Whether some plan's kind has ever beaten a region's unfused ops by ``MIN_GAIN`` (or
    has no record yet). ``measured``: this GPU's record (class -> {region: best ratio})."""
    return any(_best(p, measured or {})[0] <= 1.0 - MIN_GAIN for p in plans)


def why_not_tuned(plans: list[Plan], measured: dict | None = None) -> str:
    """'' where ``plans`` may win, else the reason the region's ops are kept untimed."""
    if may_win(plans, measured):
        return ""
    bests = {}
    for p in plans:
        bests.setdefault(p.schedule, _best(p, measured or {}))
    text = "; ".join(f"{s} {b:.2f} ({where})" for s, (b, where) in sorted(bests.items()))
    return (f"predicted: no candidate it can launch here has beaten the ops' Inductor code "
            f"(best time over the ops': {text}); not tuned")


def moved_bytes(plan: Plan) -> int:
    """Bytes a plan's kernel reads and writes at least: both operands once, every side input
    and every output."""
    r, s = plan.region, plan.region.sizes
    a = r.gemm.a.dtype.itemsize
    operands = (s.B * s.M * s.K + (s.B if r.gemm.batched else 1) * s.K * s.N * r.products) * a
    sides = sum(math.prod(s.of(x) for x in i.axes) * i.dtype.itemsize for i in r.inputs)
    outs = sum(math.prod(s.of(x) for x in o.axes) * o.dtype.itemsize for o in r.outputs)
    return operands + sides + outs


def gemm_ms(region) -> float:
    """The region's GEMM alone at the measured rate for its operands' dtype, ms."""
    s = region.sizes
    rate = GEMM_TFLOPS.get(region.gemm.a.dtype.itemsize, GEMM_TFLOPS[4]) * 1e12
    return 2.0 * s.B * s.M * s.N * s.K * region.products / rate * 1e3


def estimate_ms(plan: Plan, sm_count: int = SM_COUNT) -> float:
    """A roofline time of ``plan``: its tile grid's waves over the SMs at the GEMM rate (each
    wave as long as one tile's mainloop on one SM), then its bytes at the copy bandwidth
    (a Triton plan's epilogue follows its mainloop), and a fixed cost per launch."""
    r, s = plan.region, plan.region.sizes
    rate = GEMM_TFLOPS.get(r.gemm.a.dtype.itemsize, GEMM_TFLOPS[4]) * 1e12 / sm_count  # FLOP/s an SM
    tiles = s.B * cdiv(s.M, plan.block_m) * cdiv(s.N, plan.block_n)
    waves = cdiv(tiles, sm_count)
    mainloop = waves * 2.0 * plan.block_m * plan.block_n * s.K * r.products / rate * 1e3
    memory = moved_bytes(plan) / (COPY_TBPS * 1e12) * 1e3
    launches = 2 if plan.schedule in ("split", "ws_split") else 1
    return mainloop + memory + launches * LAUNCH_MS


def _shape(plan: Plan) -> tuple:
    return plan.schedule, plan.block_m, plan.block_n, plan.block_k, plan.num_warps


def shortlist(plans: list[Plan], count: int = SHORTLIST, sm_count: int = SM_COUNT) -> list[Plan]:
    """The plans of the ``count`` tile shapes (schedule, tile, warps) with the least
    estimates, each in all its forms (mainloop, grid, prefetch: the roofline cannot tell
    those apart), in the order given."""
    best = {}
    for p in plans:
        best[_shape(p)] = min(best.get(_shape(p), float("inf")), estimate_ms(p, sm_count))
    if len(best) <= count:
        return list(plans)
    kept = set(sorted(best, key=lambda shape: best[shape])[:count])  # (stable: ties keep the planner's order)
    return [p for p in plans if _shape(p) in kept]
