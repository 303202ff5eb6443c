"""Planner (owns: reduction-axis analysis, region passes, stage partitioning and the choice
of schedule and tile sizes).

Invariants: every function here is pure (region in, new region or plan out); a
plan's region is in row form, so reductions run along N only.
"""
from .passes import cse, dce, one_hot_counts, transpose
from .plan import NotFused, Plan, SCHEDULES, candidates, plan, reduction_axis
from .stages import Stage, levels, partition

__all__ = ["NotFused", "Plan", "SCHEDULES", "Stage", "candidates", "cse", "dce", "levels", "one_hot_counts",
           "partition", "plan", "reduction_axis", "transpose"]
