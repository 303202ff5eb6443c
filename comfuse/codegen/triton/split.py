"""The split schedule's kernels: per-row statistics over slices of N, then a combine kernel.

Kernel 1 (``{name}``): each program reduces one slice of N for a block of rows, in grouped
order (GROUP_M row blocks at a time, as a plain GEMM takes its tiles, so a slice's B columns
are shared by the programs in flight). A tile's work is ``{name}_tile``, inlined into the
loop over the slice's tiles: it takes the running statistics and returns them, so they stay
in registers and are stored once a slice; an output that needs no reduction (the logits a
model returns beside its loss) is stored by the tile as it passes. Kernel 2
(``{name}_combine``) merges each row's statistics over the slices (Chan's formula for
moments, rescaled sums for log-sum-exps) and runs the region's per-row combine step
(planner/onepass.py). A ws_split plan's combine
(``emit_lse_combine``) reads the Gluon template's per-tile log-sum-exps instead.
"""
from __future__ import annotations

import dataclasses

from ...ir import Region, format_region, needed_by
from ...planner import Plan
from ...planner.onepass import parts
from ...planner.records import SplitForm
from ..source import KernelSource, flat_index, paren
from .emit import CONSTEXPRS, Emitter, module_header, pow2
from .statistics import stat_init, stat_update

SPLIT_CONSTEXPRS = CONSTEXPRS + ["CHUNKS_POW2"]


def as_split(plan: Plan) -> Plan:
    """A ws_split plan as the split plan whose combine kernel it shares: one slice a tile."""
    form = SplitForm(chunks=plan.tiles_n, tiles_per_chunk=1, onepass=plan.form.onepass)
    return dataclasses.replace(plan, schedule="split", mainloop="pointer", form=form)


def split_constexprs(p: Plan) -> tuple:
    """The constexprs of a split plan's kernels (and of a ws_split plan's combine)."""
    return (("BLOCK_M", p.block_m), ("BLOCK_N", p.block_n), ("BLOCK_K", p.block_k), ("GROUP_M", p.group_m),
            ("CHUNKS_POW2", pow2(p.form.chunks)))


def stat_slots(op) -> list:
    """(statistic, part) per workspace array: lse keeps a running max and a sum."""
    return [(i, part) for i, st in enumerate(op.stats) for part in parts(st)]


class SplitEmitter(Emitter):
    def __init__(self, plan: Plan, name: str, template=None):
        super().__init__(plan, name)
        self.template = template  # a ws_split plan's (planner.template.LseTemplate)

    def row_block(self) -> None:
        """A combine kernel's rows: program pid_m's BLOCK_M of them, and their mask."""
        self.line("pid_m = tl.program_id(0)")
        self.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        self.line("mask_m = offs_m < M")

    def emit_split(self) -> KernelSource:
        p = self.plan
        op = p.form.onepass
        original = self.region
        self.region = op.tile  # tile values: the region plus what the statistics reduce
        sig = self.signature()
        consts = SPLIT_CONSTEXPRS
        slots = stat_slots(op)
        names = [f"stat{i}_{part}" if part else f"stat{i}" for i, part in slots]

        def ws_at(j: int) -> str:
            return f"ws_ptr + {paren(flat_index(str(j), ('chunk', 'CHUNKS')))} * M + offs_m"
        self.lines = []
        self.function(f"{self.name}_tile", sig, consts,
                      "Tile t of the slice: its GEMM and tile values, merged into the slice's statistics "
                      "(passed in and returned).", "pid_m, chunk, t, " + ", ".join(names) + ",")
        self.line("pid_n = chunk * TILES_PER_CHUNK + t")
        self.mainloop()
        stored = [(k, op.outputs[k]) for k in op.tile_outputs]  # full tiles the slices write
        needed = needed_by(self.region.nodes, [st.node for st in op.stats])
        for_stores = needed_by(self.region.nodes, [o.node for _, o in stored])
        self.line()
        picks = {k: pick for k, pick in self.column_picks(op.stats, needed | for_stores).items()
                 if not pick[0] & for_stores}
        inside = set().union(*(pick[0] for pick in picks.values()))  # computed in the pick's branch only
        self.line("# ---- tile values the statistics reduce" + (" and the full tiles this slice writes ----"
                                                                 if stored else " ----"))
        for i in sorted((needed | for_stores) - inside):
            line = self.value_line(i)
            if line and i not in self.prefetched:
                self.line(line)
        for k, out in stored:
            self.line(f"tl.store({self.offsets(f'out{k}', out.axes)}, {self.store_value(out)}, "
                      f"mask={self.mask(out.axes)})  # {out.name}: needs no reduction, written once here")
        self.line("# ---- this tile's partials, merged into the slice's statistics ----")
        for i, (_, value, column) in picks.items():
            self.line(f"# stat{i} picks one column per row (cross-entropy's target): only a tile holding")
            self.line("# some row's column adds to it, the others skip the compare and select per element")
            self.line(f"pick{i} = {column}")
            self.line(f"if tl.max(((pick{i} >= pid_n * BLOCK_N) & (pick{i} < pid_n * BLOCK_N + BLOCK_N)).to(tl.int32)) > 0:")
            self.line(f"stat{i} += tl.sum(tl.where(mask_n[None, :] & (offs_n[None, :] == pick{i}), "
                      f"{self.ref(value)}.to(tl.float32), 0.0), axis=1)", 2)
        for line in stat_update(op.stats, self.ref, skip=set(picks)):
            self.line(line)
        self.line(f"return {', '.join(names)}")
        self.line()
        self.line()
        self.function(self.name, sig, consts, f"{p.describe()}: statistics of one slice of N")
        self.line("pid = tl.program_id(0)")
        self.line("# grouped order, as a plain GEMM takes its tiles: GROUP_M row blocks at a time, each")
        self.line("# slice's B columns shared by the GROUP_M programs in flight beside each other")
        self.line("num_pid_m = tl.cdiv(M, BLOCK_M)")
        self.line("group = GROUP_M * CHUNKS")
        self.line("first_m = (pid // group) * GROUP_M")
        self.line("group_m = min(num_pid_m - first_m, GROUP_M)")
        self.line("pid_m = first_m + (pid % group) % group_m")
        self.line("chunk = (pid % group) // group_m")
        self.line("# the last slice may hold fewer tiles (CHUNKS * TILES_PER_CHUNK can exceed the tiles)")
        self.line("tiles = tl.minimum(TILES_PER_CHUNK, tl.cdiv(N, BLOCK_N) - chunk * TILES_PER_CHUNK)")
        for line in stat_init(op.stats):
            self.line(line)
        self.line("for t in range(0, tiles):")
        self.line(f"{', '.join(names)} = {self.name}_tile(", 2)
        self.line(", ".join(q.name for q in self.params) + ",", 3)
        self.line("pid_m, chunk, t, " + ", ".join(names) + ",", 3)
        self.line(", ".join(f"{c}={c}" for c in consts) + ",", 3)
        self.line(")", 2)
        self.line("# the slice's statistics, stored once")
        self.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        self.line("if WIDE_INDEX:")
        self.line("offs_m = offs_m.to(tl.int64)", 2)
        self.line("mask_m = offs_m < M")
        for j, name in enumerate(names):
            self.line(f"tl.store({ws_at(j)}, {name}, mask=mask_m)")
        first = "\n".join(self.lines)

        # kernel 2: merge the slices' statistics per row, then the per-row combine step
        self.lines = []
        self.function(f"{self.name}_combine", sig, consts,
                      "merge each row's statistics over the slices of N; compute the outputs")
        self.row_block()
        self.line("chunks = tl.arange(0, CHUNKS_POW2)")
        self.line("both = (chunks < CHUNKS)[:, None] & mask_m[None, :]")
        slot_of = {key: j for j, key in enumerate(slots)}

        def slice_load(key, other: str) -> str:
            row = flat_index(str(slot_of[key]), ("chunks[:, None]", "CHUNKS"))
            return f"tl.load(ws_ptr + {paren(row)} * M + offs_m[None, :], mask=both, other={other})"
        neg_inf = 'float("-inf")'
        for i, st in enumerate(op.stats):
            if st.kind == "sum":
                self.line(f"stat{i} = tl.sum({slice_load((i, ''), '0.0')}, axis=0)  # sum of %{st.node}")
            elif st.kind in ("max", "min"):
                fill, combine = (neg_inf, "max_propagate_nan") if st.kind == "max" else \
                    ('float("inf")', "min_propagate_nan")
                self.line(f"stat{i} = tl.reduce({slice_load((i, ''), fill)}, 0, {combine})  "
                          f"# {st.kind} of %{st.node}")
            elif st.kind == "moments":  # Chan: mean = sum n_c mean_c / n; M2 = sum M2_c + n_c (mean_c - mean)^2
                self.line(f"slice_n = {slice_load((i, 'n'), '0.0')}")
                self.line(f"slice_mean = {slice_load((i, 'mean'), '0.0')}")
                self.line(f"slice_m2 = {slice_load((i, 'm2'), '0.0')}")
                self.line("row_n = tl.sum(slice_n, axis=0)")
                self.line(f"stat{i}_mean = tl.sum(slice_n * slice_mean, axis=0) / tl.maximum(row_n, 1.0)")
                self.line(f"stat{i}_m2 = tl.sum(slice_m2 + slice_n * (slice_mean - stat{i}_mean[None, :]) * "
                          f"(slice_mean - stat{i}_mean[None, :]), axis=0)")
            else:
                self.line(f"slice_m = {slice_load((i, 'm'), neg_inf)}")
                self.line(f"slice_s = {slice_load((i, 's'), '0.0')}")
                self.line("row_m = tl.reduce(slice_m, 0, max_propagate_nan)")
                self.line("scaled = tl.where(slice_m > float(\"-inf\"), slice_s * tl.exp(slice_m - row_m[None, :]), 0.0)")
                self.line(f"stat{i} = row_m + tl.log(tl.sum(scaled, axis=0))  # log-sum-exp of %{st.node}")
        return self.combine_source(original, op, f"{p.describe()} (kernels {self.name} and {self.name}_combine)",
                                   first + "\n\n\n", p.num_warps, p.num_stages)

    def combine_source(self, original: Region, op, describe: str, before: str, num_warps: int,
                       num_stages: int) -> KernelSource:
        """The module of a split plan's kernels: the combine kernel (its lines so far, then the
        IR's combine step) after ``before``, under a header naming ``describe`` and the region."""
        self.combine_step(original, op)
        text = "\n".join(self.lines)
        self.region = original
        header = module_header(self.name, describe, format_region(original))
        return KernelSource(self.name, header + before + text + "\n", tuple(self.params),
                            split_constexprs(self.plan), num_warps, num_stages)

    def combine_step(self, original: Region, op) -> None:
        """The per-row combine step on the merged statistics (``stat{i}``, [BLOCK_M] each) and
        the stores of the outputs."""
        self.region = original.replace(nodes=op.combine, outputs=op.outputs)
        self.line("# ---- per-row combine step ----")
        for i in range(len(op.combine)):
            line = self.value_line(i)
            if line:
                self.line(line)
        for k, out in enumerate(op.outputs):
            if k in op.tile_outputs:  # written by the slices
                continue
            mask = self.mask(out.axes)
            mask_arg = f", mask={mask}" if mask else ""
            self.line(f"tl.store({self.offsets(f'out{k}', out.axes)}, {self.store_value(out)}{mask_arg})"
                      f"  # {out.name}")
        self.region = original

    def emit_lse_combine(self, describe: str) -> KernelSource:
        """The combine kernel of a ws_split plan (the Gluon template's KIND_LSE, codegen/gluon/
        strip.py): its workspace holds [CHUNKS = tiles per row, M] per-tile log-sum-exps, then
        [M] target logits, written only where a row's target is a column (where the template
        writes no logits; else they are read from the logits), then with the row
        maxima [CHUNKS, M] per-tile maxima. Merged per row, they stand in for the one-pass
        form's statistics (planner/template.py, ``match_lse``: the log-sum-exp for itself and
        for a max that only shifts, else the row max; the pick for the sum of
        where(column == target, x, 0), 0 for a target outside [0, N)); then the combine step."""
        t = self.template
        op = self.plan.form.onepass
        original = self.region
        self.region = op.tile
        sig = self.signature()
        self.lines = []
        self.function(f"{self.name}_combine", sig, SPLIT_CONSTEXPRS,
                      "merge each row's per-tile log-sum-exps and its target logit; compute the outputs")
        self.row_block()
        maxima = t.exact_max and t.shifts  # the tiles' row maxima, after the picks: from CHUNKS + 1
        self.line("# log-sum-exp over the row's tiles, 32 tiles at a time (a running max and a rescaled sum)"
                  + ("; the row max over the tiles' maxima" if maxima else ""))
        self.line('run_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)')
        self.line("run_s = tl.zeros((BLOCK_M,), dtype=tl.float32)")
        if maxima:
            self.line('row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)')
        self.line("for j0 in range(0, CHUNKS, 32):")
        self.line("jj = j0 + tl.arange(0, 32)", 2)
        self.line('tiles = (jj < CHUNKS)[:, None] & mask_m[None, :]', 2)
        self.line('part = tl.load(ws_ptr + jj[:, None] * M + offs_m[None, :], mask=tiles, other=float("-inf"))', 2)
        self.line("new_m = tl.maximum(run_m, tl.max(part, 0))", 2)
        self.line("run_s = run_s * tl.exp(run_m - new_m) + tl.sum(tl.exp(part - new_m[None, :]), 0)", 2)
        self.line("run_m = new_m", 2)
        if maxima:
            self.line("row_max = tl.maximum(row_max, tl.max(tl.load(ws_ptr + (CHUNKS + 1 + jj[:, None]) * M + "
                      'offs_m[None, :], mask=tiles, other=float("-inf")), 0))', 2)
        self.line("lse = run_m + tl.log(run_s)")
        for k in t.lse:
            self.line(f"stat{k} = lse  # log-sum-exp of %{op.stats[k].node}")
        for k in t.shifts:
            if t.exact_max:
                self.line(f"stat{k} = row_max  # max of %{op.stats[k].node}")
            else:
                self.line(f"stat{k} = lse  # max of %{op.stats[k].node}: only a shift, the log-sum-exp stands in")
        if t.pick is not None:
            inp = op.tile.inputs[t.target]
            rows = self.offsets(f"in{t.target}", inp.axes).replace("offs_m[:, None]", "offs_m")
            self.line(f"target = tl.load({rows}, mask=mask_m, other=-1)")
            inside = "mask=mask_m & (target >= 0) & (target < N), other=0.0"
            if t.logits is None:
                self.line(f"stat{t.pick} = tl.load(ws_ptr + CHUNKS * M + offs_m, {inside})  # the logit at the target")
            else:  # the template wrote the logits: the one at the row's target, read from them
                k = t.logits
                self.line(f"stat{t.pick} = tl.load(out{k}_ptr + offs_m * stride_out{k}_m + target * stride_out{k}_n, "
                          f"{inside}).to(tl.float32)  # the logit at the target")
        return self.combine_source(original, op, f"the combine of {describe}", "", 4, 1)


def emit_split(plan: Plan, name: str) -> KernelSource:
    """The source of a split plan's two kernels, or of a ws_split plan's combine kernel (the
    template itself is Gluon)."""
    if plan.schedule == "ws_split":
        return SplitEmitter(as_split(plan), name, plan.form.template).emit_lse_combine(plan.describe())
    return SplitEmitter(plan, name).emit_split()
