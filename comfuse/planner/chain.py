"""Back-to-back GEMMs: GEMM1 -> F1 -> GEMM2 -> F2 (-> GEMM3 -> F3 ...) in one kernel.

A chain is a list of GEMM + epilogue regions where an output of region i is the A
operand of region i + 1 and nothing else reads it (``links``). One program owns a block
of rows. GEMM1's output is produced chunk by chunk along N1 and each chunk, after F1, is
multiplied into GEMM2's accumulator at once, so the intermediate never reaches memory.
Later GEMMs read their predecessor's whole (post-epilogue) tile from registers.

What the first link can stream:
- elementwise F1 (bias, ReLU, GELU, SiLU, scaling): any N1, in chunks;
- F1 with a reduction along N1 (softmax, as in target attention): when N1 fits one
  chunk, the row is resident and the reduction finishes before GEMM2 reads it;
- over a longer N1 the reduction is deferred through F1's one-pass form
  (planner/onepass.py): softmax by online rescaling of GEMM2's accumulator (running max
  and sum, as flash attention), LayerNorm/RMSNorm algebraically: GEMM2 accumulates
  ``(y * gamma) @ W2`` while the row statistics are gathered, and at the end
  ``rstd * acc - rstd * mean * (gamma @ W2) + beta @ W2`` is formed. Numerics: the
  statistics are merged stably (Chan's moments, online log-sum-exp); the LayerNorm
  deferral subtracts two products that nearly cancel when |mean| >> std of a row, so
  its error grows like u * |mean| / std (tested against float64 with offsets);
- long self-attention is routed to scaled_dot_product_attention instead (faster).
Every GEMM after the first must be narrow enough for one program to hold its whole
output row block (``width_limit``); otherwise fusing would recompute the previous GEMM
once per output tile, which loses (a transformer MLP, 4096 -> 16384 -> 4096).
"""
from __future__ import annotations

import dataclasses

from ..ir import Op, Region, verify
from . import passes
from .onepass import NotOnePass, one_pass
from .schedules import pow2
from .records import NotFused
from .stages import Stage, partition


@dataclasses.dataclass(frozen=True, slots=True)
class ChainPlan:
    regions: tuple[Region, ...]
    links: tuple[int, ...]  # links[i]: the output of region i that is region i+1's A operand
    writes: tuple[tuple[int, ...], ...]  # per region, the outputs the kernel stores
    stages: tuple[tuple[Stage, ...], ...]
    block_m: int
    block_k: int  # GEMM1's K step
    stream_n: int  # GEMM1's N chunk, streamed into GEMM2
    widths: tuple[int, ...]  # padded output width of each later GEMM (held whole)
    num_warps: int
    num_stages: int
    onepass: object = None  # GEMM1's epilogue in one-pass form, when it reduces over a long N1
    early_w: bool = False  # load each chunk's rows of GEMM2's B before GEMM1's K loop (in flight during it)
    resident_a: bool = False  # GEMM1's A rows loaded once, all of K (block_k = K padded), reused by every chunk
    flat: bool = False  # GEMM1's chunks and K steps in one loop (GEMM2 at each chunk's last step)

    def describe(self) -> str:
        dims = " -> ".join(str(r.sizes.N) for r in self.regions)
        how = ""
        if self.onepass is not None:
            how = ("; F1's reductions deferred: " +
                   ("online softmax rescaling of GEMM2's accumulator" if type(self.onepass.link).__name__ == "ExpLink"
                    else f"GEMM2 accumulates {len(self.onepass.link.terms)} term(s), scaled by F1's row "
                         "statistics at the end"))
        early = "; GEMM2's B chunk loaded before GEMM1's K loop" if self.early_w else ""
        early += "; GEMM1's A rows loaded once, all of K" if self.resident_a else ""
        early += "; GEMM1's chunks and K steps in one loop" if self.flat else ""
        return (f"b2b: {len(self.regions)} GEMMs (K={self.regions[0].sizes.K} -> {dims}); GEMM1 "
                f"streamed in chunks of {self.stream_n} into GEMM2{how}{early}; rows per program {self.block_m}")


def plan_chain(regions, links, writes, target: str = "cuda") -> ChainPlan | NotFused:
    """Plan a chain; ``writes`` lists per region the outputs read outside the chain."""
    regions = [verify(passes.cse(passes.dce(r))) for r in regions]
    first = regions[0]
    width_limit = 256
    for i, r in enumerate(regions):
        if any(r.nodes[j].arg == "M" for j in r.reductions()):
            return NotFused(f"GEMM{i + 1}'s epilogue reduces along M: a chain streams rows")
        if r.gemm.batched != first.gemm.batched or r.sizes.B != first.sizes.B or r.sizes.M != first.sizes.M:
            return NotFused("the GEMMs of the chain do not share their rows and batches")
    for i, link in enumerate(links):
        out = regions[i].outputs[link]
        if out.axes != regions[i].tile_axes:
            return NotFused(f"GEMM{i + 2} reads a reduced value of GEMM{i + 1}'s epilogue")
    for i, r in enumerate(regions[1:], start=2):
        if pow2(r.sizes.N) > width_limit:
            return NotFused(f"GEMM{i}'s output row (N={r.sizes.N}) is wider than one program holds "
                            f"({width_limit}); fusing would recompute GEMM{i - 1} for every output "
                            "tile, which costs more than the intermediate's round trip")
    n1 = first.sizes.N
    onepass = None
    if first.reductions() and pow2(n1) <= width_limit:
        stream = max(16, pow2(n1))  # the whole row in one chunk: F1 reduces it in registers
    elif first.reductions():
        try:  # defer F1's reductions: statistics along the way, GEMM2 corrected at the end
            onepass = one_pass(first, links[0])
        except NotOnePass as e:
            return NotFused(f"GEMM1's epilogue reduces over N1={n1}, more than one chunk holds, "
                            f"and cannot be deferred ({e})")
        stream = 64 if target != "interpreter" else min(32, max(16, pow2(n1)))
    else:
        stream = 64 if target != "interpreter" else min(32, max(16, pow2(n1)))
    widths = tuple(max(16, pow2(r.sizes.N)) for r in regions[1:])
    if target == "interpreter":
        bm = min(64, max(16, pow2(first.sizes.M)))
        bk = min(64, max(16, pow2(first.sizes.K)))
        return ChainPlan(tuple(regions), tuple(links), tuple(tuple(w) for w in writes),
                         tuple(partition(r) for r in regions), bm, bk, stream, widths, 4, 1, onepass)
    # later GEMMs at least 64 columns wide on a GPU (masks keep the padding out): at 16 and
    # 32 columns (wgmma n16/n32) the H200 gave a wrong three-GEMM chain in fp16/bf16 that the
    # interpreter does not reproduce (2026-11-30; suspected Triton 3.6 lowering)
    widths = tuple(max(64, w) for w in widths)
    held = max(widths + (stream,))
    bm = 128 if held <= 128 else 64
    bm = min(bm, max(16, pow2(first.sizes.M)))  # short rows per batch (attention over few queries)
    return ChainPlan(tuple(regions), tuple(links), tuple(tuple(w) for w in writes),
                     tuple(partition(r) for r in regions), bm, 64, stream, widths,
                     8 if bm * held >= 128 * 128 else 4, 3, onepass)


def chain_candidates(plan: ChainPlan) -> list[ChainPlan]:
    """The chain plans worth timing: the planner's, the other warp count (16-row attention
    chains spill at 4 warps and not at 8, by ptxas at sm_90), and for a long elementwise
    GEMM1 the other program height, 128-column chunks and GEMM2's operand loaded early."""
    out = [plan]
    out.append(dataclasses.replace(plan, num_warps=8 if plan.num_warps == 4 else 4))
    if plan.onepass is None and plan.stream_n == 64 and plan.regions[0].sizes.M >= 128:
        other = 64 if plan.block_m == 128 else 128
        out.append(dataclasses.replace(plan, block_m=other, num_warps=8))
        if plan.regions[0].sizes.N >= 256:  # half the chunks, so half the pipeline restarts of
            # GEMM1's K loop (DLRM at 64 rows: 162 registers, no spills), and at 128 rows
            # GEMM1's wgmmas 128 wide (a hand-written DLRM chain of one loop over chunks and K
            # steps in this shape ran 0.1355 ms, H200 2026-12-03, against 0.1930 for 64 columns)
            out.append(dataclasses.replace(plan, block_m=64, stream_n=128, num_warps=8))
            out.append(dataclasses.replace(plan, block_m=128, stream_n=128, num_warps=8))
        if plan.regions[0].sizes.K > plan.block_k:
            # each chunk's GEMM2 operand loaded before GEMM1's K loop, its latency hidden behind
            # it (one program per SM at 142 registers has nothing else to hide it; a single-step
            # attention chain was slower this way: 0.0888 vs 0.0779 ms, H200 2026-11-30)
            out.append(dataclasses.replace(plan, block_m=64, num_warps=8, early_w=True))
    out += resident_candidates(plan) + flat_candidates(plan)
    unique = []
    for p in out:
        if p not in unique:
            unique.append(p)
    return unique


# Shared memory a program may have at sm_90 (227 KB; Triton's count for the 128-row DLRM form
# equals ``resident_smem``'s, and a form it refuses only scores inf in autotuning)
SMEM_LIMIT = 232448
# (rows, chunk, warps, stages) of the resident-A forms, fastest first on the H200 (DLRM bottom
# MLP, 65536 x 512 -> 512 -> 256 -> 128, bf16, 2026-12-03, written by hand: 128 rows in
# chunks of 32 with two stages 0.1433 ms against the streamed plans' best 0.1898; 128 rows
# need 8 warps to hold GEMM2's [128, 256] fp32 accumulator)
RESIDENT_FORMS = ((128, 32, 8, 2), (128, 16, 8, 3), (64, 32, 4, 3))


def resident_smem(plan: ChainPlan, block_m: int, stream_n: int, stages: int) -> int:
    """Shared memory of a resident-A form: A's rows over all of K, and per pipeline stage a
    chunk of GEMM1's B ([K, chunk]) and of GEMM2's ([chunk, width])."""
    k = pow2(plan.regions[0].sizes.K)
    size = plan.regions[0].gemm.a.dtype.itemsize
    return size * (block_m * k + stages * (k * stream_n + stream_n * plan.widths[0]))


def resident_candidates(plan: ChainPlan) -> list[ChainPlan]:
    """GEMM1's A rows loaded once for every chunk of N1 (when they fit shared memory beside
    two pipeline stages): the streamed plans run GEMM1's K loop once per chunk, reading the
    rows from L2 again each time and restarting the loop's pipeline, and at K = 512 a
    program's rows outweigh the weights it reads. Elementwise first links only, and rows that
    fill a 64-row program."""
    first = plan.regions[0]
    if plan.onepass is not None or first.sizes.M < 64 or plan.block_m < 64:
        return []
    out = []
    for bm, sn, warps, stages in RESIDENT_FORMS:
        if sn > pow2(first.sizes.N) or resident_smem(plan, bm, sn, stages) > SMEM_LIMIT:
            continue
        out.append(dataclasses.replace(plan, block_m=bm, stream_n=sn, num_warps=warps, num_stages=stages,
                                       block_k=max(16, pow2(first.sizes.K)), early_w=False, resident_a=True))
    return out


# (rows, chunk, warps, stages) of the one-loop forms (DLRM bottom MLP, H200, 2026-12-03,
# written by hand: 128 rows in chunks of 128, 3 stages, 0.1355 ms, the
# fastest chain measured; the generated streamed plans' best 0.1930)
FLAT_FORMS = ((128, 128, 8, 3), (128, 128, 8, 4))


def flat_candidates(plan: ChainPlan) -> list[ChainPlan]:
    """GEMM1's chunks and K steps in one loop: the nested loops restart GEMM1's pipeline at
    every chunk. Elementwise first links with several chunks and several K steps, rows that
    fill a 64-row program."""
    first = plan.regions[0]
    if (plan.onepass is not None or first.sizes.M < 64 or plan.block_m < 64
            or first.sizes.K <= plan.block_k):
        return []
    return [dataclasses.replace(plan, block_m=bm, stream_n=sn, num_warps=warps, num_stages=stages, flat=True,
                                early_w=False, resident_a=False)
            for bm, sn, warps, stages in FLAT_FORMS if sn < pow2(first.sizes.N)]


def attention_scale(first: Region, second: Region, link: int) -> float | None:
    """The scale s when the chain is exactly ``softmax(s * (q @ k^T)) @ v`` (GEMM2 with no
    epilogue of its own), else None. Casts between floats are looked through."""
    r = passes.cse(passes.dce(first))
    if not r.gemm.batched or len(second.nodes) != 1 or len(r.outputs) != 1:
        return None
    nodes = r.nodes

    def skip(i):
        while nodes[i].op is Op.CAST and nodes[i].arg.is_floating_point:
            i = nodes[i].src[0]
        return i
    out = skip(r.outputs[link].node)
    div = nodes[out]
    if div.op is not Op.DIV:
        return None
    e, total = skip(div.src[0]), skip(div.src[1])
    if nodes[e].op is not Op.EXP or nodes[total].op is not Op.SUM or skip(nodes[total].src[0]) != e:
        return None
    sub = nodes[skip(nodes[e].src[0])]
    if sub.op is not Op.SUB or nodes[skip(sub.src[1])].op is not Op.RMAX:
        return None
    logits = skip(sub.src[0])
    if skip(nodes[skip(sub.src[1])].src[0]) != logits:
        return None
    node = nodes[logits]
    if node.op is Op.ACC:
        return 1.0
    if node.op in (Op.MUL, Op.DIV) and nodes[skip(node.src[0])].op is Op.ACC and nodes[node.src[1]].op is Op.CONST:
        c = float(nodes[node.src[1]].arg)
        return c if node.op is Op.MUL else 1.0 / c
    return None
