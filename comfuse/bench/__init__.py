"""Benchmarks (owns: workload definitions, timing, baselines, reports)."""
