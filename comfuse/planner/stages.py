"""Stage partitioning (the Stage-Stream model).

Reductions are stage boundaries. A node's level is the number of reductions on
its longest path from the accumulator; stage L computes the nodes of level L
over the resident tile and ends with the reductions of level-L values, whose
results stream into stage L + 1. Independent reductions over the same values
(sum and sum of squares, max and a count) share a boundary. Leaves (loads,
constants) are placed in the first stage that uses them, so they are loaded
just before use.
"""
from __future__ import annotations

import dataclasses

from ..ir import LEAF, REDUCE, Region


@dataclasses.dataclass(frozen=True, slots=True)
class Stage:
    index: int
    nodes: tuple[int, ...]  # computed in this stage, in emission order
    reductions: tuple[int, ...]  # reductions that end this stage (subset of nodes, last)
    stores: tuple[int, ...]  # outputs (indices into Region.outputs) written in this stage


def levels(region: Region) -> list[int]:
    level = []
    for node in region.nodes:
        if node.op in LEAF:
            level.append(0)
        else:
            base = max(level[s] for s in node.src)
            level.append(base + 1 if node.op in REDUCE else base)
    return level


def partition(region: Region) -> tuple[Stage, ...]:
    level = levels(region)
    stage_of = {}
    users: dict[int, list[int]] = {i: [] for i in range(len(region.nodes))}
    for i, node in enumerate(region.nodes):
        for s in node.src:
            users[s].append(i)
        if node.op in REDUCE:
            stage_of[i] = level[node.src[0]]
        elif node.op not in LEAF:
            stage_of[i] = level[i]
    for i, node in enumerate(region.nodes):
        if node.op in LEAF:
            uses = [stage_of[u] for u in users[i] if u in stage_of]
            stage_of[i] = min(uses) if uses else 0
    count = max(stage_of.values(), default=0) + 1
    stages = []
    for k in range(count):
        body = [i for i in range(len(region.nodes)) if stage_of[i] == k and region.nodes[i].op not in REDUCE]
        reds = [i for i in range(len(region.nodes)) if stage_of[i] == k and region.nodes[i].op in REDUCE]
        stores = [j for j, o in enumerate(region.outputs) if stage_of[o.node] == k]
        stages.append(Stage(k, tuple(body + reds), tuple(reds), tuple(stores)))
    return tuple(stages)
