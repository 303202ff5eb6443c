"""Emit one Triton kernel for a back-to-back GEMM chain (see planner/chain.py).

Layout of the kernel: the program's rows; GEMM1's mainloop and F1 run per chunk of N1,
and each chunk is multiplied into GEMM2's accumulator straight away; then F2 runs on
GEMM2's resident output, which (after its epilogue) is the A operand of GEMM3, and so
on. Each region's values and parameters carry a prefix (``r0_``, ``r1_``, ...).
"""
from __future__ import annotations

from ...ir import Op, format_region, needed_by
from ..source import KernelSource, Param
from .emit import module_header
from .exprs import TL_DTYPE, Exprs
from .statistics import stat_init, stat_update


class _ChainEmitter:
    def __init__(self, plan, name: str):
        self.plan = plan
        self.name = name
        self.lines: list[str] = []
        self.params: list[Param] = []
        self.ems = [Exprs(r, vp=f"r{k}v", pp=f"r{k}_", acc=f"acc{k}") for k, r in enumerate(plan.regions)]

    def line(self, text: str = "", indent: int = 1) -> None:
        self.lines.append("    " * indent + text if text else "")

    def param(self, name: str, role: str, index=None, axis=None, comment=None) -> None:
        self.params.append(Param(name, role, index, axis))
        # a tile's strides are compile-time constants (a layout is one compilation, as the
        # sizes already are): addresses fold into the loads' immediate offsets, and at 4
        # warps ptxas then issues every load of a program before the first shared-memory
        # store (with runtime strides it held one back: a second memory latency per program)
        const = role.startswith("stride_") and axis != "B"
        self.sig.append(f"    {name}{': tl.constexpr' if const else ''},{'  # ' + comment if comment else ''}")

    def signature(self) -> None:
        p = self.plan
        self.sig = []
        batched = p.regions[0].gemm.batched
        self.param("a_ptr", "a", 0, None, f"{p.regions[0].gemm.a.name}: GEMM1's A")
        for k, r in enumerate(p.regions):
            self.param(f"r{k}_b_ptr", "b", k, None, f"{r.gemm.b.name}: GEMM{k + 1}'s B")
            for j, inp in enumerate(r.inputs):
                self.param(f"r{k}_in{j}_ptr", "in", (k, j), None, inp.name)
            for j in p.writes[k]:
                self.param(f"r{k}_out{j}_ptr", "out", (k, j), None, r.outputs[j].name)
        self.param("M", "size", None, "M")
        self.param("K", "size", None, "K")
        for k in range(len(p.regions)):
            self.param(f"N{k}", "size", k, "N", f"GEMM{k + 1}'s N")
        for axis in (("B", "M", "K") if batched else ("M", "K")):
            self.param(f"stride_a_{axis.lower()}", "stride_a", 0, axis)
        for k, r in enumerate(p.regions):
            for axis in (("B", "K", "N") if batched else ("K", "N")):
                self.param(f"stride_r{k}_b_{axis.lower()}", "stride_b", k, axis)
            for j, inp in enumerate(r.inputs):
                for axis in ("B", "M", "N"):
                    if axis in inp.axes:
                        self.param(f"stride_r{k}_in{j}_{axis.lower()}", "stride_in", (k, j), axis)
            for j in p.writes[k]:
                for axis in ("B", "M", "N"):
                    if axis in r.outputs[j].axes:
                        self.param(f"stride_r{k}_out{j}_{axis.lower()}", "stride_out", (k, j), axis)

    def epilogue(self, k: int, indent: int) -> None:
        """Region k's stages over its tile (acc{k}, offs_n/mask_n set for its columns)."""
        em, r = self.ems[k], self.plan.regions[k]
        for stage in self.plan.stages[k]:
            for i in stage.nodes:
                line = em.value_line(i)
                if line:
                    self.line(line, indent)
            for j in stage.stores:
                if j not in self.plan.writes[k]:
                    continue
                out = r.outputs[j]
                mask = em.mask(out.axes)
                self.line(f"tl.store({em.offsets(f'r{k}_out{j}', out.axes)}, {em.store_value(out)}"
                          f"{', mask=' + mask if mask else ''})  # {out.name}", indent)

    def read_once(self) -> str:
        """The eviction hint for the operands' loads: when each batch has one program (batched,
        M within one block of rows), every byte of A and the Bs is read by one program only,
        so it need not stay in L2 (target attention, H200 2026-11-30: 78.4 -> 76.9 us for a
        hand-written kernel). Weights shared by programs keep L2."""
        p = self.plan
        once = p.regions[0].gemm.batched and p.regions[0].sizes.M <= p.block_m
        return ', eviction_policy="evict_first"' if once else ""

    def operand(self, k: int, value: str) -> str:
        """Region k-1's link value as GEMM k's A operand: zero past its columns, in the
        GEMM's operand dtype (eager rounds the intermediate the same way)."""
        dt = TL_DTYPE[self.plan.regions[k].gemm.a.dtype]
        return f"tl.where(mask_n[None, :], {value}, 0.0).to({dt})"

    def emit(self) -> KernelSource:
        p = self.plan
        batched = p.regions[0].gemm.batched
        self.signature()
        consts = ["BLOCK_M", "BLOCK_K", "STREAM_N"] + [f"WIDTH{k}" for k in range(1, len(p.regions))] + [
            "EVEN_M", "UPCAST_OPERANDS", "DOT_PRECISION"]
        self.line("@triton.jit", 0)
        self.line(f"def {self.name}(", 0)
        self.lines += self.sig
        self.line(", ".join(f"{c}: tl.constexpr" for c in consts) + ",")
        self.line("):", 0)
        self.line(f'"""{p.describe()}"""')
        self.line("pid_m = tl.program_id(0)")
        if batched:
            self.line("pid_b = tl.program_id(1).to(tl.int64)")
        self.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        self.line("mask_m = (offs_m < M) | EVEN_M  # EVEN_M: M is a multiple of BLOCK_M, no row masks")
        a_base = "a_ptr + pid_b * stride_a_b" if batched else "a_ptr"
        b1_base = "r1_b_ptr + pid_b * stride_r1_b_b" if batched else "r1_b_ptr"
        self.line()
        if p.onepass is not None:
            self.deferred_first_link(a_base, b1_base, batched)
        else:
            self.line("# ---- GEMM1 -> F1, chunk by chunk along N1, each chunk straight into GEMM2 ----")
            self.line("offs_w1 = tl.arange(0, WIDTH1)  # GEMM2's output columns, all held")
            self.line("acc1 = tl.zeros((BLOCK_M, WIDTH1), dtype=tl.float32)")
            if p.flat:
                self.flat_loop_head(a_base, batched)
                self.line("if step % K_STEPS == K_STEPS - 1:  # the chunk's last K step: F1, then GEMM2", 2)
            else:
                self.chunk_loop_head(a_base, batched, b1_base if p.early_w else None)
            body = 3 if p.flat else 2
            self.line("# F1 on this chunk", body)
            self.epilogue(0, body)
            self.line("# the chunk is GEMM2's A for rows offs_n of its B: into acc1, never to memory", body)
            self.line(f"p = {self.operand(1, self.ems[0].ref(p.regions[0].outputs[p.links[0]].node))}", body)
            if not p.early_w:
                self.load_w1(b1_base, body)
            self.dot("acc1", "p", "w", body)
            if p.flat:
                self.line("acc0 = tl.zeros((BLOCK_M, STREAM_N), dtype=tl.float32)  # the next chunk's sum", body)
        for k in range(1, len(p.regions)):
            self.line()
            self.line(f"# ---- F{k + 1} over GEMM{k + 1}'s resident output ----")
            self.line(f"offs_n = tl.arange(0, WIDTH{k})")
            self.line(self.column_mask(f"N{k}", p.regions[k].sizes.N, p.widths[k - 1], f"WIDTH{k}"))
            self.epilogue(k, 1)
            if k + 1 < len(p.regions):
                nb = f"r{k + 1}_b_ptr + pid_b * stride_r{k + 1}_b_b" if batched else f"r{k + 1}_b_ptr"
                self.line()
                self.line(f"# ---- GEMM{k + 2}: its A is F{k + 1}'s tile, read from registers ----")
                self.line(f"offs_w{k + 1} = tl.arange(0, WIDTH{k + 1})")
                self.line(f"p = {self.operand(k + 1, self.ems[k].ref(p.regions[k].outputs[p.links[k]].node))}")
                cols = "" if p.regions[k + 1].sizes.N == p.widths[k] else f" & (offs_w{k + 1} < N{k + 1})[None, :]"
                self.line(f"w = tl.load({nb} + offs_n[:, None] * stride_r{k + 1}_b_k + offs_w{k + 1}[None, :] * "
                          f"stride_r{k + 1}_b_n, mask=mask_n[:, None]{cols}, other=0.0{self.read_once()})")
                self.line(f"acc{k + 1} = tl.zeros((BLOCK_M, WIDTH{k + 1}), dtype=tl.float32)")
                self.dot(f"acc{k + 1}", "p", "w", 1)
        header = module_header(self.name, p.describe(), "\n".join(
            format_region(r) + (f"\n  (out{p.links[k]} feeds GEMM{k + 2})" if k < len(p.links) else "")
            for k, r in enumerate(p.regions)))
        constexprs = (("BLOCK_M", p.block_m), ("BLOCK_K", p.block_k), ("STREAM_N", p.stream_n)) + tuple(
            (f"WIDTH{k}", w) for k, w in enumerate(p.widths, start=1))
        return KernelSource(self.name, header + "\n".join(self.lines) + "\n", tuple(self.params),
                            constexprs, p.num_warps, p.num_stages)

    def chunk_loop_head(self, a_base: str, batched: bool, early_w_base: str | None = None) -> None:
        """``for n0 ...:`` and GEMM1's mainloop for the chunk's columns, into acc0; with
        ``early_w_base``, GEMM2's B rows for the chunk are loaded first (``w``)."""
        p = self.plan
        n0, k = p.regions[0].sizes.N, p.regions[0].sizes.K
        b0_base = "r0_b_ptr + pid_b * stride_r0_b_b" if batched else "r0_b_ptr"
        if p.resident_a:
            k_mask = "" if k == p.block_k else " & (offs_k < K)[None, :]"
            self.line("# GEMM1's A: the program's rows over all of K (BLOCK_K), loaded once for every chunk")
            self.line("offs_k = tl.arange(0, BLOCK_K)")
            self.line(f"a_rows = tl.load({a_base} + offs_m[:, None] * stride_a_m + offs_k[None, :] * stride_a_k, "
                      f"mask=mask_m[:, None]{k_mask}, other=0.0{self.read_once()})")
        if n0 <= p.stream_n:  # one chunk: unrolled, no loop for the compiler to keep
            self.line("for n0 in tl.static_range(0, STREAM_N, STREAM_N):  # N0 fits one chunk")
        else:
            # the planned N0 as the bound (the source is specialised to it): with the runtime
            # N0, ptxas serialised the resident form's wgmmas (C7515; a constant trip count not)
            self.line(f"for n0 in range(0, {n0}, STREAM_N):  # N0")
        self.line("offs_n = n0 + tl.arange(0, STREAM_N)", 2)
        self.line(self.column_mask("N0", n0, p.stream_n, "STREAM_N"), 2)
        if not p.resident_a:  # (a resident chunk is one product: no accumulator to clear)
            self.line("acc0 = tl.zeros((BLOCK_M, STREAM_N), dtype=tl.float32)", 2)
        if early_w_base is not None:
            self.line("# GEMM2's B rows for this chunk, loaded now: in flight during GEMM1's K loop", 2)
            self.load_w1(early_w_base)
        if p.resident_a:
            k_mask = "" if k == p.block_k else "(offs_k < K)[:, None] & "
            self.line(f"b = tl.load({b0_base} + offs_k[:, None] * stride_r0_b_k + offs_n[None, :] * stride_r0_b_n, "
                      f"mask={k_mask}mask_n[None, :], other=0.0{self.read_once()})", 2)
            self.line("a = a_rows  # (one product over all of K)", 2)
            # a fresh product, not one added to zeros: ptxas serialises the wgmmas of a product
            # whose accumulator other instructions set (C7515; H200, DLRM: 0.1988 ms against
            # 0.1534 for the same form written without it)
            self.dot("acc0", "a", "b", 2, fresh=True)
            return
        if k <= p.block_k:
            self.line("for k0 in tl.static_range(0, BLOCK_K, BLOCK_K):  # K fits one step", 2)
        else:
            self.line("for k0 in range(0, K, BLOCK_K):", 2)
        self.line("offs_k = k0 + tl.arange(0, BLOCK_K)", 3)
        self.gemm1_operands(a_base, b0_base, 3)
        self.dot("acc0", "a", "b", 3)

    @staticmethod
    def column_mask(size_name: str, size: int, block: int, block_name: str) -> str:
        """``mask_n`` for columns ``offs_n``: all true when the planned size is a multiple of
        the block (the compiler then drops the masks; the launcher checks the sizes)."""
        if size % block == 0:
            return f"mask_n = tl.full(({block_name},), 1, tl.int1)  # {size_name} = {size}: whole blocks"
        return f"mask_n = offs_n < {size_name}"

    def load_w1(self, b1_base: str, indent: int = 2) -> None:
        cols = "" if self.plan.regions[1].sizes.N == self.plan.widths[0] else " & (offs_w1 < N1)[None, :]"
        self.line(f"w = tl.load({b1_base} + offs_n[:, None] * stride_r1_b_k + offs_w1[None, :] * stride_r1_b_n, "
                  f"mask=mask_n[:, None]{cols}, other=0.0{self.read_once()})", indent)

    def flat_loop_head(self, a_base: str, batched: bool) -> None:
        """One loop over GEMM1's chunks and K steps together (``step``), so the loads' pipeline
        runs through from one chunk into the next; the chunk's sum is cleared after its last K
        step, where GEMM2 takes it. Clearing it by a select at the first step instead keeps
        ptxas from serialising the wgmmas (C7515) but ran slower by hand on the H200 (DLRM:
        0.1457 against 0.1323 ms; generated 0.1576)."""
        p = self.plan
        n0, k = p.regions[0].sizes.N, p.regions[0].sizes.K
        chunks, k_steps = -(-n0 // p.stream_n), -(-k // p.block_k)
        self.line(f"K_STEPS: tl.constexpr = {k_steps}  # GEMM1's K steps a chunk (K = {k})")
        self.line("acc0 = tl.zeros((BLOCK_M, STREAM_N), dtype=tl.float32)")
        self.line(f"for step in range(0, {chunks * k_steps}):  # {chunks} chunks of N0 = {n0}, K_STEPS each")
        self.line("n0 = (step // K_STEPS) * STREAM_N", 2)
        self.line("offs_n = n0 + tl.arange(0, STREAM_N)", 2)
        self.line(self.column_mask("N0", n0, p.stream_n, "STREAM_N"), 2)
        self.line("offs_k = (step % K_STEPS) * BLOCK_K + tl.arange(0, BLOCK_K)", 2)
        self.gemm1_operands(a_base, "r0_b_ptr + pid_b * stride_r0_b_b" if batched else "r0_b_ptr", 2)
        self.dot("acc0", "a", "b", 2)

    def gemm1_operands(self, a_base: str, b0_base: str, indent: int) -> None:
        """``a`` and ``b``: GEMM1's operands at K step ``offs_k``, columns ``offs_n``."""
        k = self.plan.regions[0].sizes.K
        k_mask = "" if k % self.plan.block_k == 0 else " & (offs_k < K)[None, :]"
        self.line(f"a = tl.load({a_base} + offs_m[:, None] * stride_a_m + offs_k[None, :] * stride_a_k, "
                  f"mask=mask_m[:, None]{k_mask}, other=0.0{self.read_once()})", indent)
        k_mask = "" if k % self.plan.block_k == 0 else "(offs_k < K)[:, None] & "
        self.line(f"b = tl.load({b0_base} + offs_k[:, None] * stride_r0_b_k + offs_n[None, :] * stride_r0_b_n, "
                  f"mask={k_mask}mask_n[None, :], other=0.0{self.read_once()})", indent)

    def deferred_first_link(self, a_base: str, b1_base: str, batched: bool) -> None:
        """F1 reduces over a long N1: gather its statistics chunk by chunk while GEMM2
        accumulates the link's terms, then scale and combine them once (planner/chain.py)."""
        p = self.plan
        op = p.onepass
        em = self.ems[0]
        em.region = op.tile
        link = op.link
        exp_link = type(link).__name__ == "ExpLink"
        dt = TL_DTYPE[p.regions[1].gemm.a.dtype]
        self.line("# ---- GEMM1 -> F1 with F1's reductions deferred: statistics gathered chunk by chunk, ----")
        self.line("# ---- GEMM2 accumulating the link's terms; scaled and combined after the last chunk ----")
        self.line("offs_w1 = tl.arange(0, WIDTH1)  # GEMM2's output columns, all held")
        for line in stat_init(op.stats):
            self.line(line)
        if exp_link:
            self.line('run_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # online softmax: running max')
            self.line("g_exp = tl.zeros((BLOCK_M, WIDTH1), dtype=tl.float32)  # sum of exp(t - run_max) @ W2")
            bases = [link.base]
        else:
            for k, (t, _) in enumerate(link.terms):
                shape = "(BLOCK_M, WIDTH1)" if "M" in op.tile.nodes[t].axes else "(WIDTH1,)"
                self.line(f"g{k} = tl.zeros({shape}, dtype=tl.float32)  # %{t} @ W2")
            if link.const is not None:
                self.line("g_ones = tl.zeros((WIDTH1,), dtype=tl.float32)  # column sums of W2")
            bases = [t for t, _ in link.terms]
        self.chunk_loop_head(a_base, batched)
        needed = needed_by(op.tile.nodes, [st.node for st in op.stats] + bases)
        self.line("# F1's tile values on this chunk", 2)
        for i in sorted(needed):
            node = op.tile.nodes[i]
            if node.op is Op.SHIFT:  # fixed on the first chunk: the mean of the row's first values
                base = em.ref(op.stats[node.arg].node)
                self.line(f"first_mean = tl.sum(tl.where(mask_n[None, :], {base}, 0.0), axis=1) / "
                          "tl.maximum(tl.sum(mask_n.to(tl.float32), axis=0), 1.0)", 2)
                self.line(f"stat{node.arg} = tl.where(n0 == 0, first_mean, stat{node.arg})", 2)
            line = em.value_line(i)
            if line:
                self.line(line, 2)
        for line in stat_update(op.stats, em.ref):
            self.line(line, 2)
        self.load_w1(b1_base)
        if exp_link:
            t = em.ref(link.base)
            self.line(f'chunk_max = tl.reduce(tl.where(mask_n[None, :], {t}, float("-inf")), 1, max_propagate_nan)', 2)
            self.line("new_max = tl.maximum(run_max, chunk_max, propagate_nan=tl.PropagateNan.ALL)", 2)
            self.line('rescale = tl.where(run_max == float("-inf"), 0.0, tl.exp(run_max - new_max))', 2)
            self.line(f"p = tl.where(mask_n[None, :], tl.exp({t} - new_max[:, None]), 0.0).to({dt})", 2)
            self.line("g_exp = g_exp * rescale[:, None]", 2)
            self.dot("g_exp", "p", "w", 2)
            self.line("run_max = new_max", 2)
        else:
            for k, (t, _) in enumerate(link.terms):
                v = f"tl.where(mask_n[None, :], {em.ref(t)}, 0.0)"
                if "M" in op.tile.nodes[t].axes:
                    self.line(f"p = {v}.to({dt})", 2)
                    self.dot(f"g{k}", "p", "w", 2)
                else:  # a row vector (gamma, beta): the same for every row
                    self.line(f"g{k} += tl.sum(tl.trans({v}) * w.to(tl.float32), axis=0)", 2)
            if link.const is not None:
                self.line("g_ones += tl.sum(w.to(tl.float32), axis=0)", 2)
        self.line("# ---- F1's statistics are complete: its per-row values, then GEMM2's accumulator ----")
        for i, st in enumerate(op.stats):
            if st.kind == "lse":
                self.line(f"stat{i} = stat{i}_m + tl.log(stat{i}_s)")
        rows = Exprs(self.plan.regions[0].replace(nodes=op.combine, outputs=op.outputs, inputs=op.tile.inputs),
                     vp="r0c", pp="r0_", acc="acc0")
        for i in range(len(op.combine)):
            line = rows.value_line(i)
            if line:
                self.line(line)
        if exp_link:
            arg = "run_max[:, None]" if link.shift is None else f"({rows.ref(link.shift)} + run_max[:, None])"
            factor = f"tl.exp({arg})" + (f" * {rows.ref(link.scale)}" if link.scale is not None else "")
            self.line(f"acc1 = {factor} * g_exp")
        else:
            self.line("acc1 = tl.zeros((BLOCK_M, WIDTH1), dtype=tl.float32)")
            for k, (t, c) in enumerate(link.terms):
                g = f"g{k}" if "M" in op.tile.nodes[t].axes else f"g{k}[None, :]"
                self.line(f"acc1 += {rows.ref(c)} * {g}")
            if link.const is not None:
                self.line(f"acc1 += {rows.ref(link.const)} * g_ones[None, :]")
        for j in p.writes[0]:
            out = op.outputs[j]
            mask = rows.mask(out.axes)
            self.line(f"tl.store({rows.offsets(f'r0_out{j}', out.axes)}, {rows.store_value(out)}"
                      f"{', mask=' + mask if mask else ''})  # {out.name}")
        em.region = self.plan.regions[0]

    def dot(self, acc: str, a: str, b: str, indent: int, fresh: bool = False) -> None:
        """``acc += a @ b`` (``fresh``: ``acc = a @ b``)."""
        self.line("if UPCAST_OPERANDS:  # Triton 3.6's interpreter multiplies bf16 bit patterns", indent)
        self.line(f"{a} = {a}.to(tl.float32)", indent + 1)
        self.line(f"{b} = {b}.to(tl.float32)", indent + 1)
        self.line(f"{acc} = tl.dot({a}, {b}{'' if fresh else ', ' + acc}, input_precision=DOT_PRECISION)", indent)


def emit_chain(plan, name: str) -> KernelSource:
    return _ChainEmitter(plan, name).emit()
