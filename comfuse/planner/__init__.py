"""Planner (owns: region passes, the reductions' axis and merged pairs, stage partitioning, the
choice of schedule, tile and form, and the search space autotuning times).

Modules, in the order a region goes through them: ``passes`` (dce, cse, transpose),
``reductions``, ``stages`` (the Stage-Stream partition), ``schedules`` (the pass pipeline ``plan`` and the Triton
schedules), ``gluon`` (the warp-specialised schedules), ``records`` (Plan, its forms,
NotFused), ``candidates`` (the search space), ``chain`` (back-to-back GEMM chains),
``onepass`` and ``template`` (the forms the split and template schedules read a region in).

Invariants: every function here is pure (region in, new region or plan out); a plan's region
is in row form, so reductions run along N only; nothing here imports code generation.
"""
from .candidates import candidates
from .gluon import GLUON_SCHEDULES
from .passes import cse, dce, one_hot_counts, transpose
from .schedules import SCHEDULES, plan
from .records import NotFused, Plan
from .reductions import reduction_axis
from .stages import Stage, levels, partition

__all__ = ["GLUON_SCHEDULES", "NotFused", "Plan", "SCHEDULES", "Stage", "candidates", "cse", "dce", "levels",
           "one_hot_counts", "partition", "plan", "reduction_axis", "transpose"]
