"""Emit the Triton source of a planned region.

One kernel shape serves the tile, row-in-CTA and cooperative schedules. A program owns a
BLOCK_M x BLOCK_N output tile; under "row_in_cta" BLOCK_N covers the whole row (N), so each
program holds complete rows and every reduction along N finishes inside it; under
"cooperative" the TILES_N programs of a row strip publish per-tile partials at each stage
boundary, wait for each other, and resume on the tile they kept. The GEMM mainloop
accumulates in fp32; then the epilogue streams stage by stage over the tile that stays in
registers, and every output is written once. The split schedule's kernels are split.py's.
"""
from __future__ import annotations

from ...ir import REDUCE, Op, format_region
from ...planner import Plan
from ..source import KernelSource, Param, docstring, flat_index, import_line, paren, times
from .exprs import Exprs

HELPERS = ("expm1", "log1p", "lse_merge", "max_propagate_nan", "min_propagate_nan", "moments_merge", "pow_int",
           "pow_real", "strip_barrier", "tanh")
# the constexprs every Triton kernel takes, whatever its schedule
CONSTEXPRS = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "UPCAST_OPERANDS", "DOT_PRECISION", "WIDE_INDEX", "EVEN_N"]


def pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def module_header(name: str, describe: str, ir: str, helpers=HELPERS) -> str:
    """The top of a generated Triton kernel file: what it is, the IR it came from, its imports."""
    return "\n".join(docstring(name, describe, ir) + [
        "import triton",
        "import triton.language as tl",
        "", *import_line("comfuse.codegen.triton.helpers", helpers), "", "", ""])


class Emitter(Exprs):
    def __init__(self, plan: Plan, name: str):
        super().__init__(plan.region, keepdims=plan.schedule != "cooperative")
        self.plan = plan
        self.name = name
        self.lines: list[str] = []
        self.params: list[Param] = []
        self.base = 0  # extra indentation: the persistent loop over tiles
        self.phase: int | None = None
        self.cooperative = plan.schedule == "cooperative"
        self.prefetched: set = set()  # nodes loaded before the mainloop (prefetch_inputs)

    def line(self, text: str = "", indent: int = 1) -> None:
        self.lines.append("    " * (indent + self.base) + text if text else "")

    # ---- the kernel ----------------------------------------------------------------------
    def signature(self) -> list[str]:
        r, p = self.region, self.plan
        batched = r.gemm.batched
        tma = p.mainloop == "tma"
        if tma:
            args = [("a_desc", Param("a_desc", "a_desc"), f"{r.gemm.a.name}: A, {r.gemm.a.major}-major tensor descriptor"),
                    ("b_desc", Param("b_desc", "b_desc"), f"{r.gemm.b.name}: B, {r.gemm.b.major}-major tensor descriptor")]
        else:
            args = [("a_ptr", Param("a_ptr", "a"), f"{r.gemm.a.name}: the A operand"),
                    ("b_ptr", Param("b_ptr", "b"), f"{r.gemm.b.name}: the B operand")]
        if r.dual and tma:  # (its tensor comes after the side inputs: ir.Gemm)
            args.append(("b2_desc", Param("b2_desc", "b2_desc", len(r.inputs)),
                         f"{r.gemm.b2.name}: the second product's B, {r.gemm.b2.major}-major tensor descriptor"))
        elif r.dual:
            args.append(("b2_ptr", Param("b2_ptr", "b2", len(r.inputs)), f"{r.gemm.b2.name}: the second product's B"))
        for j, inp in enumerate(r.inputs):
            args.append((f"in{j}_ptr", Param(f"in{j}_ptr", "in", j), f"{inp.name}"))
        for k, out in enumerate(r.outputs):
            args.append((f"out{k}_ptr", Param(f"out{k}_ptr", "out", k), f"{out.name}"))
        if p.schedule == "split":
            args.append(("ws_ptr", Param("ws_ptr", "workspace"),
                         "fp32 [statistic arrays, CHUNKS, M]: each slice's statistics"))
        if self.cooperative:
            args.append(("ws_ptr", Param("ws_ptr", "workspace"),
                         "fp32 [slots, 2, reductions, TILES_POW2, BLOCK_M]: per-tile partials"))
            args.append(("counter_ptr", Param("counter_ptr", "counters"),
                         "int64 [slots]: arrivals at each strip's exchanges"))
        for axis in ("M", "N", "K"):
            args.append((axis, Param(axis, "size", None, axis), None))
        if getattr(p.form, "persistent", False):
            args.append(("PROGRAMS", Param("PROGRAMS", "groups"), "programs of the persistent grid"))
        if p.schedule == "split":
            args.append(("CHUNKS", Param("CHUNKS", "chunks"), "slices of N per row block"))
            args.append(("TILES_PER_CHUNK", Param("TILES_PER_CHUNK", "tiles_per_chunk"), "N tiles per slice"))
        if self.cooperative:
            args.append(("NUM_B", Param("NUM_B", "size", None, "B"), "batches"))
            args.append(("TILES_N", Param("TILES_N", "tiles_n"), "tiles per row strip"))
            args.append(("GROUPS", Param("GROUPS", "groups"), "strips in flight at once"))
        for prefix, role, axes in ([] if tma else
                                   [("a", "a", ("B", "M", "K") if batched else ("M", "K")),
                                    ("b", "b", ("B", "K", "N") if batched else ("K", "N"))]):
            for axis in axes:
                name = f"stride_{prefix}_{axis.lower()}"
                args.append((name, Param(name, f"stride_{role}", None, axis), None))
        if r.dual and not tma:
            for axis in ("K", "N"):
                name = f"stride_b2_{axis.lower()}"
                args.append((name, Param(name, "stride_b2", len(r.inputs), axis), None))
        for j, inp in enumerate(r.inputs):
            for axis in ("B", "M", "N"):
                if axis in inp.axes:
                    name = f"stride_in{j}_{axis.lower()}"
                    args.append((name, Param(name, "stride_in", j, axis), None))
        for k, out in enumerate(r.outputs):
            for axis in ("B", "M", "N"):
                if axis in out.axes:
                    name = f"stride_out{k}_{axis.lower()}"
                    args.append((name, Param(name, "stride_out", k, axis), None))
        self.params = [q for _, q, _ in args]
        return [f"    {name},{'  # ' + comment if comment else ''}" for name, _, comment in args]

    def program_ids(self) -> None:
        p, batched = self.plan, self.region.gemm.batched
        persistent = getattr(p.form, "persistent", False)
        self.line("# ---- which tile this program owns ----")
        if self.cooperative:  # inside the strip function (see emit): strip, pid_n, slot given
            exchanges = times("(strip - slot) // GROUPS", p.form.exchanges)
            self.line(f"exchange = {exchanges}  # exchanges this program did before: picks the workspace buffer")
            if batched:
                self.line("pid_b = (strip // strips_per_batch).to(tl.int64)")
            self.line("pid_m = strip % strips_per_batch")
            return
        self.line("pid = tile" if persistent else "pid = tl.program_id(0)")
        if batched:
            self.line("pid_b = tl.program_id(1).to(tl.int64)")
        if p.schedule == "row_in_cta":
            self.line("pid_m = pid  # one program per strip of BLOCK_M whole rows")
            self.line("pid_n = 0")
        else:
            self.line("num_pid_m = tl.cdiv(M, BLOCK_M)")
            self.line("num_pid_n = tl.cdiv(N, BLOCK_N)")
            self.line("group = GROUP_M * num_pid_n  # grouped order: neighbours share operand tiles in L2")
            self.line("first_m = (pid // group) * GROUP_M")
            self.line("group_m = min(num_pid_m - first_m, GROUP_M)")
            self.line("pid_m = first_m + (pid % group) % group_m")
            self.line("pid_n = (pid % group) // group_m")

    def tile_offsets(self) -> None:
        """Rows and columns of the tile (pid_m, pid_n), and their masks."""
        self.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        self.line("offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
        self.line("if WIDE_INDEX:  # some tensor spans more than 2**31 elements")
        self.line("offs_m = offs_m.to(tl.int64)", 2)
        self.line("offs_n = offs_n.to(tl.int64)", 2)
        self.line("mask_m = offs_m < M")
        self.line("mask_n = (offs_n < N) | EVEN_N  # EVEN_N: N is a multiple of BLOCK_N, no column masks")

    def mainloop(self) -> None:
        g = self.region.gemm
        self.tile_offsets()
        self.line()
        self.prefetch_inputs()
        if self.plan.mainloop == "tma":
            self.line("# ---- mainloop: tensor-descriptor (TMA) tile loads, zero past the edges; fp32 accumulation ----")
        else:
            self.line("# ---- mainloop: acc = A[rows, :] @ B[:, cols] with fp32 accumulation ----")
            self.line(f"a_rows = {'a_ptr + pid_b * stride_a_b' if g.batched else 'a_ptr'} + offs_m[:, None] * stride_a_m")
            self.line(f"b_cols = {'b_ptr + pid_b * stride_b_b' if g.batched else 'b_ptr'} + offs_n[None, :] * stride_b_n")
        if g.b2 is not None and self.plan.mainloop != "tma":
            self.line("b2_cols = b2_ptr + offs_n[None, :] * stride_b2_n  # the second product's B: the same A tile")
        self.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        if g.b2 is not None:
            self.line("acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        self.line("for k0 in range(0, K, BLOCK_K):")
        if self.plan.mainloop == "tma":
            if g.a.major == "K":
                self.line("a = a_desc.load([pid_m * BLOCK_M, k0])", 2)
            else:
                self.line("a = a_desc.load([k0, pid_m * BLOCK_M]).T  # A is stored M-major", 2)
            for b, op in (("b", g.b), ("b2", g.b2)) if g.b2 is not None else (("b", g.b),):
                if op.major == "N":
                    self.line(f"{b} = {b}_desc.load([k0, pid_n * BLOCK_N])", 2)
                else:
                    self.line(f"{b} = {b}_desc.load([pid_n * BLOCK_N, k0]).T  # {b.upper()} is stored K-major", 2)
        else:
            self.line("offs_k = k0 + tl.arange(0, BLOCK_K)", 2)
            self.line("if WIDE_INDEX:", 2)
            self.line("offs_k = offs_k.to(tl.int64)", 3)
            self.line("mask_k = offs_k < K", 2)
            self.line("a = tl.load(a_rows + offs_k[None, :] * stride_a_k, "
                      "mask=mask_m[:, None] & mask_k[None, :], other=0.0)", 2)
            self.line("b = tl.load(b_cols + offs_k[:, None] * stride_b_k, "
                      "mask=mask_k[:, None] & mask_n[None, :], other=0.0)", 2)
            if g.b2 is not None:
                self.line("b2 = tl.load(b2_cols + offs_k[:, None] * stride_b2_k, "
                          "mask=mask_k[:, None] & mask_n[None, :], other=0.0)", 2)
        self.line("if UPCAST_OPERANDS:  # Triton 3.6's interpreter multiplies bf16 bit patterns", 2)
        self.line("a = a.to(tl.float32)", 3)
        self.line("b = b.to(tl.float32)", 3)
        if g.b2 is not None:
            self.line("b2 = b2.to(tl.float32)", 3)
        self.line("acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)", 2)
        if g.b2 is not None:
            self.line("acc2 = tl.dot(a, b2, acc2, input_precision=DOT_PRECISION)", 2)

    def prefetch_inputs(self) -> None:
        """Plans with ``prefetch``: load the side inputs that span the whole tile (a residual)
        before the mainloop, so that their DRAM latency passes while the GEMM runs instead of
        after it (they stay in registers meanwhile: autotuning weighs that)."""
        self.prefetched = set()
        if not getattr(self.plan.form, "prefetch", False):
            return
        for i, node in enumerate(self.region.nodes):
            if node.op is Op.INPUT and {"M", "N"} <= set(self.region.inputs[node.arg].axes):
                self.line(f"{self.vp}{i} = {self.expr(i)}  # {self.comment(i)}, loaded before the mainloop")
                self.prefetched.add(i)
        if self.prefetched:
            self.line()

    # ---- the cooperative strip's exchanges ----------------------------------------------
    def live_reductions(self, stage) -> list:
        """The reductions of ``stage`` that need an exchange: a sum of squared deviations
        paired with its row sum (the form's moments) arrives with the sum's exchange instead."""
        paired = {b for _, b in self.plan.form.moments}
        return [i for i in stage.reductions if i not in paired]

    def publish(self, stage) -> None:
        """Store this tile's partials of ``stage``'s exchange at ``ws_base``, one array each;
        a row sum paired with a sum of squared deviations also stores its tile's own centred
        sum of squares (the moments that Chan's formula merges)."""
        r, pairs = self.region, dict(self.plan.form.moments)
        k = 0
        for i in self.live_reductions(stage):
            node = r.nodes[i]
            x = self.ref(node.src[0])
            part = self.reduction(node, x, axis=1, keep=False, mask="mask_n[None, :]")
            self.line(f"part{i} = {part}")
            self.line(f"tl.store(ws_base + {paren(flat_index(str(k), ('pid_n', 'TILES_POW2')))} * BLOCK_M + ws_rows, "
                      f"part{i})")
            k += 1
            if i in pairs:
                self.line("tile_cols = tl.maximum(tl.sum(mask_n.to(tl.float32), axis=0), 1.0)")
                self.line(f"tile_mean = part{i} / tile_cols")
                self.line(f"tile_dev = tl.where(mask_n[None, :], {x} - tile_mean[:, None], 0.0)")
                self.line(f"tl.store(ws_base + {paren(flat_index(str(k), ('pid_n', 'TILES_POW2')))} * BLOCK_M + ws_rows, "
                          "tl.sum(tile_dev * tile_dev, axis=1))  # the tile's centred sum of squares")
                k += 1

    def combine(self, stage) -> None:
        """Read the strip's partials of ``stage``'s exchange from ``ws_base`` and reduce them."""
        r, pairs = self.region, dict(self.plan.form.moments)

        def load(k: int) -> str:
            return (f"tl.load(ws_base + {paren(flat_index(str(k), ('tiles[:, None]', 'TILES_POW2')))} * BLOCK_M + "
                    "ws_rows[None, :], mask=(tiles < TILES_N)[:, None], other=0.0, cache_modifier=\".cg\")")
        self.line("tiles = tl.arange(0, TILES_POW2)")
        k = 0
        for i in self.live_reductions(stage):
            node = r.nodes[i]
            if i in pairs:
                j = pairs[i]
                self.line(f"sums = {load(k)}")
                self.line(f"m2s = {load(k + 1)}")
                self.line("cols = tl.minimum(tl.maximum(N - tiles * BLOCK_N, 0), BLOCK_N).to(tl.float32)[:, None]")
                self.line("row_sum = tl.sum(sums, axis=0)")
                self.line("dev = tl.where(cols > 0, sums / tl.maximum(cols, 1.0) - (row_sum / N)[None, :], 0.0)")
                self.line(f"v{i} = row_sum[:, None]  # {self.comment(i)}, whole strip")
                self.line(f"v{j} = tl.sum(m2s + cols * dev * dev, axis=0)[:, None]  # {self.comment(j)}: the "
                          f"squared deviations from the row mean, the tiles' moments merged (Chan)")
                k += 2
                continue
            total = self.reduction(node, load(k), axis=0, keep=False, mask="(tiles < TILES_N)[:, None]")
            self.line(f"v{i} = {total}[:, None]  # {self.comment(i)}, whole strip")
            k += 1

    def exchange(self, stage, index: int) -> bool:
        """The cooperative strip's exchange at the end of ``stage``: publish this tile's
        partials, wait for the strip, combine. Returns False where an interpreter-form
        kernel ends (its phase is this exchange)."""
        form = self.plan.form
        self.line(f"# exchange {index}: publish this tile's partials, wait for the strip's "
                  f"{len(self.live_reductions(stage))} x TILES_N, combine")
        # GPU: a slot's two buffers alternate between consecutive exchanges, so a fast tile
        # can publish exchange e+1 while a slow one still reads e. Interpreter form: each
        # phase re-publishes the exchanges before it, so every (strip, exchange) has its own.
        where = "(slot * 2 + exchange % 2)" if self.phase is None else \
            f"({flat_index('strip', (index, max(form.exchanges, 2)))})"
        self.line(f"ws_base = ws_ptr + {where} * ({times('TILES_POW2', form.exchange_width)} * BLOCK_M)")
        self.line("ws_rows = tl.arange(0, BLOCK_M)")
        self.publish(stage)
        if self.phase is not None and self.phase == index:
            self.line(f"# interpreter form, phase {index}: the strip's other tiles publish in this "
                      "launch; the next launch combines")
            return False
        if self.phase is None:
            self.line("strip_barrier(counter_ptr + slot, TILES_N)")
            self.line("exchange += 1")
        self.combine(stage)
        return True

    def stage_values(self, stage) -> None:
        """``stage``'s values over the tile; a cooperative strip's reductions come from its
        exchange instead, and prefetched inputs were loaded before the mainloop."""
        for i in stage.nodes:
            if (self.cooperative and self.region.nodes[i].op in REDUCE) or i in self.prefetched:
                continue
            line = self.value_line(i)
            if line:
                self.line(line)

    def emit(self) -> KernelSource:
        p, r = self.plan, self.region
        sig = self.signature()
        consts = CONSTEXPRS + (["TILES_POW2"] if self.cooperative else [])
        persistent = getattr(p.form, "persistent", False)
        self.lines = []
        if self.cooperative:
            # the work on one strip is a function of its own, called from the persistent loop,
            # so ptxas allocates its registers apart from the loop's
            self.function(f"{self.name}_strip", sig, consts,
                          "One row strip: this program's tile, its stages and exchanges.",
                          "strip, pid_n, slot, strips_per_batch,", noinline=True)
        else:
            self.function(self.name, sig, consts, p.describe())
        if persistent:
            # one program per SM (PROGRAMS of them) walks the tiles; Triton fuses this loop
            # with the K loop, so the next tile's first loads are issued during this tile's
            # epilogue instead of after it
            self.line("for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), PROGRAMS, "
                      "flatten=True):")
            self.base += 1
        self.program_ids()
        self.mainloop()
        exchanges = 0
        for stage in p.stages:
            self.line()
            self.line(self.stage_title(stage))
            self.stage_values(stage)
            if self.cooperative and self.live_reductions(stage):
                if not self.exchange(stage, exchanges):
                    break
                exchanges += 1
            for k in stage.stores:
                out = r.outputs[k]
                mask = self.mask(out.axes)
                if self.cooperative and "N" not in out.axes:
                    mask = f"{mask} & (pid_n == 0)" if mask else "pid_n == 0"  # one tile writes row values
                mask_arg = f", mask={mask}" if mask else ""
                self.line(f"tl.store({self.offsets(f'out{k}', out.axes)}, "
                          f"{self.store_value(out)}{mask_arg})  # {out.name}")
        if persistent:
            self.base -= 1
        if self.cooperative:
            self.persistent_loop(sig, consts)
        header = module_header(self.name, p.describe(), format_region(r))
        constexprs = (("BLOCK_M", p.block_m), ("BLOCK_N", p.block_n), ("BLOCK_K", p.block_k),
                      ("GROUP_M", p.group_m))
        if self.cooperative:
            constexprs += (("TILES_POW2", pow2(p.tiles_n)),)
        return KernelSource(self.name, header + "\n".join(self.lines) + "\n", tuple(self.params), constexprs,
                            p.num_warps, p.num_stages)

    def function(self, name: str, sig: list, consts: list, doc: str, extra: str = "",
                 noinline: bool = False) -> None:
        """A @triton.jit function's header: the kernel's parameters, ``extra`` ones, the
        constexprs and a docstring. ``noinline``: a function of its own in the PTX, so that
        ptxas allocates its registers apart from the caller's loop."""
        self.line("@triton.jit(noinline=True)" if noinline else "@triton.jit", -1)
        self.line(f"def {name}(", -1)
        self.lines += sig
        if extra:
            self.line(extra)
        self.line(", ".join(f"{c}: tl.constexpr" for c in consts) + ",")
        self.line("):", -1)
        self.line(f'"""{doc}"""')

    def call(self, name: str, extra: str, consts: list, indent: int) -> None:
        """A call of ``name`` with every kernel parameter and ``extra`` ones by position, the
        constexprs by name."""
        self.line(f"{name}(", indent)
        self.line(", ".join(q.name for q in self.params) + ",", indent + 1)
        self.line(extra, indent + 1)
        self.line(", ".join(f"{c}={c}" for c in consts) + ",", indent + 1)
        self.line(")", indent)

    def persistent_loop(self, sig: list, consts: list) -> None:
        """The cooperative kernel proper: a persistent grid whose programs walk the strips
        of their slot, calling the strip function for each."""
        self.line()
        self.line()
        self.function(self.name, sig, consts, self.plan.describe())
        self.line("pid = tl.program_id(0)")
        self.line("pid_n = pid % TILES_N  # this program's tile in every strip it works on")
        self.line("slot = pid // TILES_N  # the programs of one slot share strips and exchanges")
        self.line("strips_per_batch = tl.cdiv(M, BLOCK_M)")
        self.line("for strip in range(slot, strips_per_batch * NUM_B, GROUPS):")
        self.call(f"{self.name}_strip", "strip, pid_n, slot, strips_per_batch,", consts, 2)

    def stage_title(self, stage) -> str:
        reds = [self.region.nodes[i] for i in stage.reductions]
        what = ", ".join(f"{n.op.value} over {n.arg}" for n in reds)
        tail = f"; ends with {what}" if what else ""
        head = "over the resident tile" if stage.index == 0 else "resumes on the resident tile"
        return f"# ---- stage {stage.index}: elementwise {head}{tail} ----"


def emit_kernel(plan: Plan, name: str, phase: int | None = None) -> KernelSource:
    """The source text of a tile, row-in-CTA or cooperative ``plan``'s kernel, named ``name``,
    and its parameter list.

    ``phase`` (cooperative plans only) emits the interpreter form: the kernel runs up to
    exchange ``phase`` and publishes its partials there, with no waiting; launching phases
    0..E in order computes what the single GPU launch computes, without a spin-wait that
    Triton's interpreter (one program after another) could never leave."""
    e = Emitter(plan, name)
    e.phase = phase
    return e.emit()
