"""Where a region's reductions run, and which of them can share one exchange of partials.

- ``reduction_axis``: the one axis every reduction runs along (a region reducing along both
  M and N has no strip of tiles that holds both);
- ``moment_pairs`` / ``merge_pairs``: a row's sum with its sum of squared deviations (merged
  by Chan's formula), and a max with its sum of exp(x - max) (merged online): each pair is
  published in one exchange, not two;
- ``layout_of``: the exchanges of a partition into stages, with those pairs merged.
"""
from __future__ import annotations

import dataclasses

from ..ir import Op, Region


def reduction_axis(region: Region) -> tuple[str | None, str]:
    """('N' | 'M' | None, reason when reductions run along both axes)."""
    by_axis: dict[str, list[int]] = {}
    for i in region.reductions():
        by_axis.setdefault(region.nodes[i].arg, []).append(i)
    if len(by_axis) > 1:
        m, n = by_axis["M"][0], by_axis["N"][0]
        return None, (f"reductions along both M (%{m} {region.nodes[m].op.value}) and N "
                      f"(%{n} {region.nodes[n].op.value}): no strip of tiles holds both")
    return (next(iter(by_axis)) if by_axis else None), ""


def moment_pairs(region: Region) -> tuple[tuple[int, int], ...]:
    """(R1, R2) node pairs where R1 = sum[N](x) and R2 = sum[N](d * d) with d = x - R1 / N:
    a row's sum and its sum of squared deviations from the row mean (LayerNorm's variance).
    A strip exchanges both at R1's exchange as tile moments (sum and the tile's own centred
    sum of squares, merged by Chan's formula), one exchange instead of two."""
    nodes, n = region.nodes, region.sizes.N
    pairs = []
    for j, node in enumerate(nodes):
        if node.op is not Op.SUM or node.arg != "N" or not node.dtype.is_floating_point:
            continue
        sq = nodes[node.src[0]]
        if sq.op is Op.MUL and sq.src[0] == sq.src[1]:
            d = sq.src[0]
        elif sq.op is Op.POW and sq.arg == 2:
            d = sq.src[0]
        else:
            continue
        if nodes[d].op is not Op.SUB:
            continue
        x, mean = nodes[d].src
        m = nodes[mean]
        if m.op not in (Op.DIV, Op.MUL) or nodes[m.src[1]].op is not Op.CONST:
            continue
        c = float(nodes[m.src[1]].arg)
        if (m.op is Op.DIV and c != n) or (m.op is Op.MUL and abs(c * n - 1.0) > 1e-12):
            continue
        r1 = nodes[m.src[0]]
        if r1.op is Op.SUM and r1.arg == "N" and r1.src[0] == x and r1.dtype.is_floating_point:
            pairs.append((m.src[0], j))
    return tuple(pairs)


def merge_pairs(region: Region) -> tuple:
    """((kind, first, second), ...): reductions of tile values whose second can join the
    first's exchange.

    - "moments": a row's sum R1 of x and R2 = sum((x - R1 / N)^2) (``moment_pairs``): each
      tile publishes its sum and its own centred sum of squares, merged by Chan's formula
      (exact: no E[x^2] - E[x]^2);
    - "lse": a max R1 of x and R2 = sum(exp(x - R1)): each tile publishes its max and its sum
      of exp(x - its max), rescaled to the row's max when merged."""
    nodes = region.nodes
    out = [("moments", r1, r2) for r1, r2 in moment_pairs(region)
           if nodes[nodes[r1].src[0]].axes == frozenset("MN")]
    for j, node in enumerate(nodes):
        if node.op is not Op.SUM or nodes[node.src[0]].op is not Op.EXP:
            continue
        sub = nodes[nodes[node.src[0]].src[0]]
        if sub.op is Op.SUB and nodes[sub.src[1]].op is Op.RMAX and nodes[sub.src[1]].src[0] == sub.src[0] \
                and nodes[sub.src[0]].axes == frozenset("MN"):
            out.append(("lse", sub.src[1], j))
    return tuple(out)


def exchange_shape(stages, pairs) -> tuple[int, int]:
    """(exchanges, most arrays published at one) of a cooperative strip: a paired R2 needs no
    exchange of its own, a paired R1 publishes two arrays."""
    r1s, r2s = {a for a, _ in pairs}, {b for _, b in pairs}
    widths = []
    for st in stages:
        live = [i for i in st.reductions if i not in r2s]
        if live:
            widths.append(len(live) + sum(1 for i in live if i in r1s))
    return len(widths), max(widths, default=0)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the region's reductions go: one exchange per stage that ends in reductions, less
    the merged ones; ``slot[r]`` is reduction node r's (exchange, index within it, index among
    all statistics); ``second[r]``: (kind, first) where r is merged into its first's exchange."""
    exchanges: tuple  # per exchange: its reduction nodes
    slot: dict
    second: dict = dataclasses.field(default_factory=dict)
    first: dict = dataclasses.field(default_factory=dict)  # first -> (kind, second)

    @property
    def width(self) -> int:
        return max((len(e) for e in self.exchanges), default=1)


def layout_of(stages, pairs=()) -> Layout:
    """The exchanges of ``stages``; with ``pairs`` (``merge_pairs``), each pair's second joins
    its first's exchange."""
    second = {r2: (kind, r1) for kind, r1, r2 in pairs}
    first = {r1: (kind, r2) for kind, r1, r2 in pairs}
    groups = []
    for s in stages:
        own = [r for r in s.reductions if r not in second]
        if own:
            groups.append(own)
    for g in groups:
        g += [first[r][1] for r in list(g) if r in first]
    slot, k = {}, 0
    for e, g in enumerate(groups):
        for w, r in enumerate(g):
            slot[r] = (e, w, k)
            k += 1
    return Layout(tuple(tuple(g) for g in groups), slot, second, first)
