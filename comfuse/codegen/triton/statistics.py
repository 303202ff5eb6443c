"""Per-row statistics merged tile by tile (sum, max, min, log-sum-exp, moments): the lines that
start them and merge a tile's partials into them, shared by the split schedule's kernels
(split.py) and the back-to-back chain's (chain.py)."""
from __future__ import annotations

LOG2E = 1.4426950408889634  # log2(e): exp(x) = 2^(x log2(e))


def stat_init(stats) -> list[str]:
    """Lines that start each statistic's per-row accumulators (BLOCK_M rows)."""
    lines = []
    init = {"sum": "tl.zeros((BLOCK_M,), dtype=tl.float32)",
            "shift": "tl.zeros((BLOCK_M,), dtype=tl.float32)",
            "max": 'tl.full((BLOCK_M,), float("-inf"), tl.float32)',
            "min": 'tl.full((BLOCK_M,), float("inf"), tl.float32)'}
    for i, st in enumerate(stats):
        if st.kind == "lse":
            lines.append(f'stat{i}_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max')
            lines.append(f"stat{i}_s = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum of exp(x - max)")
        elif st.kind == "moments":
            for part, what in (("n", "count"), ("mean", "mean"), ("m2", "sum of squared deviations")):
                lines.append(f"stat{i}_{part} = tl.zeros((BLOCK_M,), dtype=tl.float32)  # {what} of %{st.node}")
        else:
            lines.append(f"stat{i} = {init[st.kind]}  # {st.kind} of %{st.node}")
    return lines


def stat_update(stats, ref, skip=frozenset()) -> list[str]:
    """Lines that merge this tile's partials (columns mask_n) into the accumulators, but for
    the statistics in ``skip`` (merged by the caller). A max and a log-sum-exp of the same
    value (cross-entropy has both) share one tile maximum."""
    lines = []
    tile_max = {}  # node -> the name of its tile maximum, reduced once

    def maximum(st) -> str:
        if st.node not in tile_max:
            tile_max[st.node] = f"tile_max{st.node}"
            lines.append(f'tile_max{st.node} = tl.reduce(tl.where(mask_n[None, :], {ref(st.node)}.to(tl.float32), '
                         f'float("-inf")), 1, max_propagate_nan)')
        return tile_max[st.node]
    # plain sums first: each reduces a tile value to a row at once, so that its [BM, BN]
    # values are not live across the max and exp passes (cross-entropy's pick of the target
    # column, kept for after the log-sum-exp, spilled 184 bytes at 128x256, sm_90)
    for i, st in sorted(enumerate(stats), key=lambda e: e[1].kind != "sum"):
        if i in skip:
            continue
        v = f"{ref(st.node)}.to(tl.float32)"
        if st.kind == "shift":
            continue  # set on the first chunk, where its value is first needed (codegen/triton/chain.py)
        if st.kind == "sum":
            lines.append(f"stat{i} += tl.sum(tl.where(mask_n[None, :], {v}, 0.0), axis=1)")
        elif st.kind == "max":
            lines.append(f"stat{i} = tl.maximum(stat{i}, {maximum(st)}, propagate_nan=tl.PropagateNan.ALL)")
        elif st.kind == "min":
            lines.append(f'stat{i} = tl.minimum(stat{i}, tl.reduce(tl.where(mask_n[None, :], {v}, float("inf")), 1, '
                         f'min_propagate_nan), propagate_nan=tl.PropagateNan.ALL)')
        elif st.kind == "moments":
            lines.append("tile_n = tl.sum(mask_n.to(tl.float32), axis=0) + tl.zeros((BLOCK_M,), dtype=tl.float32)")
            lines.append(f"tile_mean = tl.sum(tl.where(mask_n[None, :], {v}, 0.0), axis=1) / tl.maximum(tile_n, 1.0)")
            lines.append(f"tile_dev = tl.where(mask_n[None, :], {v} - tile_mean[:, None], 0.0)")
            lines.append("tile_m2 = tl.sum(tile_dev * tile_dev, axis=1)")
            lines.append(f"stat{i}_n, stat{i}_mean, stat{i}_m2 = moments_merge(stat{i}_n, stat{i}_mean, "
                         f"stat{i}_m2, tile_n, tile_mean, tile_m2)")
        else:
            m = maximum(st)
            # exp(x - m) as 2^(x log2(e) - m log2(e)): one FMA per element where tl.exp's
            # lowering multiplies (x - m) by log2(e), a subtraction and a multiplication (sm_90
            # PTX). The rounding of m log2(e) is one factor common to the row's terms: it moves
            # the log-sum-exp by at most an ulp of m
            lines.append(f"tile_s = tl.sum(tl.where(mask_n[None, :], tl.exp2({v} * {LOG2E!r} - "
                         f"({m} * {LOG2E!r})[:, None]), 0.0), axis=1)")
            lines.append(f"stat{i}_m, stat{i}_s = lse_merge(stat{i}_m, stat{i}_s, {m}, tile_s)")
    return lines
