"""Where a ws_stages kernel's time goes (the Gluon kernel generated from a region's stages,
codegen/gluon/stages.py): one launch with its timers on, per phase the median over tiles,
for each way of laying a chunk's rows over a warp's lanes (LANES_N: 32 lanes a row, five
shuffles a row reduction; 8 lanes, three) and of sizing the persistent grid (one program per
SM, or a multiple of the strip's tiles, so that no strip straddles two rounds).

Each form's output is checked against float64 before it is timed. Each variant is traced
twice: one launch alone (the GPU rested), and one queued right behind a CUDA graph of
``--after-graph`` calls (the GPU as the sustained timings see it).

    python scripts/stages_trace.py [--only multi_stage,ln_postnorm] [--shapes 8192x4096x4096]

A short table is printed last (graph replays, interleaved rounds, x cuBLAS ``x @ w``).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import comfuse  # noqa: E402
from comfuse.bench.timing import graph_rounds, print_ratio_table, ratio_rows  # noqa: E402
from comfuse.bench.workloads import SUITE  # noqa: E402
from comfuse.ir import canonical_shape  # noqa: E402
from comfuse.codegen.gluon import stages  # noqa: E402
from comfuse.runtime import kernel as kernel_mod, stages_kernel  # noqa: E402


def phases(E: int) -> list:
    out = [("MMA: mainloop (K loop)", 0, 1), ("MMA: wait for the buffer", 1, 2), ("MMA: hand-off", 2, 3),
           ("epilogue: hand-off -> has the tile", 3, 4)]
    prev = 4
    for e in range(E):
        out += [(f"epilogue: pass {e} (partials of exchange {e})", prev, 5 + 2 * e),
                (f"epilogue: wait at exchange {e}", 5 + 2 * e, 6 + 2 * e)]
        prev = 6 + 2 * e
    out += [("epilogue: output pass", prev, 5 + 2 * E), ("epilogue: whole tile", 4, 5 + 2 * E)]
    return out


def timeline(trace, grid: int, tiles: int, E: int) -> str:
    t = trace[:grid].double()
    valid = torch.zeros(grid, 64, dtype=torch.bool, device=t.device)
    last = torch.zeros_like(valid)  # each program's last tile
    for p in range(grid):
        valid[p, :len(range(p, tiles, grid))] = True
        last[p, len(range(p, tiles, grid)) - 1] = True
    # (a tile the epilogue partition had no part in, COMFUSE_WS_TAIL=128: its marks not written)
    seen = valid & (t[..., 4] > 0)
    lines = []
    for name, a, b in phases(E):
        rows = seen if name.startswith("epilogue") else valid
        if rows.any():
            d = ((t[..., b] - t[..., a]) / 1e3)[rows]
            lines.append(f"    {name:50s} median {d.median().item():8.2f} us, max {d.max().item():8.2f}")
    for name, rows, b in [("last tile: hand-off -> epilogue partition's done", last & seen, 5 + 2 * E),
                          ("last tile: hand-off -> mainloop warps' rows done", last & (t[..., 15] > 0), 15)]:
        if rows.any():
            d = ((t[..., b] - t[..., 3]) / 1e3)[rows]
            lines.append(f"    {name:50s} median {d.median().item():8.2f} us, max {d.max().item():8.2f}")
    # (slot 15: the mainloop warps' rows of a shared last tile written, 0 where none)
    start, end = t[..., 0][valid].min(), torch.maximum(t[..., 5 + 2 * E], t[..., 15])[valid].max()
    last_mma = t[..., 1][valid].max()
    lines.append(f"    span {(end - start).item() / 1e3:.2f} us, after the last mainloop "
                 f"{(end - last_mma).item() / 1e3:.2f} us")
    # row 63: each program's start (before its partitions fork) and end (after they join)
    entry, leave = t[:, 63, 0], t[:, 63, 1]
    first = t[:, 0, 0]
    lines.append(f"    program start -> its first tile: median {((first - entry) / 1e3).median().item():.2f} us, max "
                 f"{((first - entry) / 1e3).max().item():.2f}; first start -> last end "
                 f"{(leave.max() - entry.min()).item() / 1e3:.2f} us; last mark -> last end "
                 f"{(leave.max() - end).item() / 1e3:.2f} us")
    return "\n".join(lines)


# A variant's letters after its lane count, in the order they are written: (label, the
# settings they set). "a" and "q" change the launch rather than a setting (variant_of).
FLAGS = {
    "a": ("grid a strip multiple", {}),  # every strip in one round of the persistent loop
    "v": ("8 adjacent columns a lane", dict(ws_vec=8)),  # a row's lanes over 128 adjacent bytes
    "t": ("TMA store", dict(ws_tma_store=True)),  # the output tile by one TMA store
    "r": ("residual by TMA", dict(ws_res_tma=True)),  # into the hand-off buffer, added by the mainloop
    "p": ("loads a chunk ahead", dict(ws_lookahead=True)),
    "c": ("32-row chunks", dict(ws_chunk=32)),  # CHUNK = 32, not 16
    "k": ("nothing kept", dict(ws_keep=False)),  # in the hand-off buffer between passes
    "n": ("16-bit adds in 16 bits", dict(ws_narrow=True)),
    "e": ("exp by one FFMA", dict(ws_exp_fma=True)),  # exp(x - a row's max)
    "w": ("128-wide tiles, 4 + 8 warps", dict(ws_tile_n=128)),  # one mainloop warpgroup, 8 epilogue warps
    "q": ("a 3-slot ring", {}),  # STAGES = 3 (128-wide tiles take 4)
    "o": ("passes not unrolled", dict(ws_roll=True)),  # a run-time loop over the chunks (strip.chunk_view)
    "s": ("the last tile in the B ring", dict(ws_last_in_ring=True)),  # with h: its mainloop warps need not wait
}
FORM = "LANES[" + "][".join(FLAGS) + "][hROWS]"


def variant_of(spec: str):
    """(label, settings, grid_options) for a variant FORM: the epilogue's rows over LANES lanes
    of a warp (COMFUSE_WS_LANES), the letters of FLAGS, and "hROWS": the last ROWS rows of each
    program's last tile by the mainloop's warps (COMFUSE_WS_TAIL). "a": the grid a multiple of
    the strip's tiles, not one program per SM; "q": a 3-slot ring."""
    m = re.fullmatch(rf"(\d+)([{''.join(FLAGS)}]*)(?:h(\d+))?", spec)
    if not m:
        raise SystemExit(f"variant {spec!r}: {FORM}, e.g. 8 or 32t or 8rph96")
    lanes, flags, tail = int(m[1]), m[2], int(m[3] or 0)

    def grid_options(self, dev, M, N, _orig=stages_kernel.StagesKernel.grid_options):
        grid, options = _orig(self, dev, M, N)
        if "a" in flags:
            tiles_n = N // self.plan.block_n
            grid = ((grid[0] // tiles_n) * tiles_n, )
        if "q" in flags:
            options = dict(options, STAGES=3)
        return grid, options
    settings = dict(ws_lanes=lanes, ws_tma_store=False, ws_res_tma=False, ws_tail=tail, ws_lookahead=False,
                    ws_keep=True, ws_vec=0, ws_narrow=False, ws_exp_fma=False, ws_tile_n=256,
                    ws_roll=False, ws_last_in_ring=False, ws_chunk=0)
    for f in FLAGS:
        if f in flags:
            settings.update(FLAGS[f][1])
    label = ", ".join([f"{lanes} lanes a row"] + [FLAGS[f][0] for f in FLAGS if f in flags] +
                      ([f"last {tail} rows by the mainloop warps"] if tail else []))
    return label, settings, grid_options


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="multi_stage,ln_postnorm")
    ap.add_argument("--shapes", default="8192x4096x4096,8192x1024x1024", help="MxKxN, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--after-graph", type=int, default=20,
                    help="also trace a launch queued right behind a CUDA graph of this many calls (0: not)")
    ap.add_argument("--variants", default="32,8,8v,32t",
                    help=f"{FORM}: LANES_N (lanes of a warp along a row), then the letters of "
                         + ", ".join(f"'{f}': {label}" for f, (label, _) in FLAGS.items())
                         + ", 'hROWS': the last ROWS rows of a program's last tile by the mainloop warps")
    args = ap.parse_args()
    args.variants = args.variants.split(",")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs", flush=True)
    table = []
    orig = stages_kernel.StagesKernel.grid_options
    for name in args.only.split(","):
        wl = SUITE[name]
        for shape in args.shapes.split(","):
            M, K, N = (int(v) for v in shape.split("x"))
            label = f"{name} {M}x{K}x{N}"
            print(label, flush=True)
            xs = wl.inputs(M, K, N, dtype=torch.bfloat16, device="cuda")
            ref = wl.fn(*[t.double() if t.is_floating_point() else t for t in xs])
            forms = {"cuBLAS GEMM": lambda xs=xs: xs[0] @ xs[1]}
            for variant, overrides, grid_fn in [variant_of(v) for v in args.variants]:
                stages_kernel.StagesKernel.grid_options = grid_fn
                # kernels are shared by name across compiled functions, and with them the launcher
                # bound at their first call (grid included): each variant builds its own
                kernel_mod._kernels.clear()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
                        with comfuse.settings.override(schedule="ws_stages", **overrides):
                            # (every call forced: one outside the override would autotune)
                            made = comfuse.compile(wl.fn, xs)
                        compiled = comfuse.settings.pinned(made, autotune="0", schedule="ws_stages", strict=True,
                                                           **overrides)
                        out = compiled(*xs)
                    (r,) = made.report.regions
                    if not (r.fused and r.schedule == "ws_stages"):
                        print(f"  {variant}: not ws_stages ({r.reason})")
                        continue
                    err = ((out.double() - ref).norm() / ref.norm()).item()
                    ok = err < 2e-2
                    print(f"  {variant}: rel err {err:.2e} {'OK' if ok else 'WRONG'}")
                    if not ok:
                        continue
                    (region,) = made.fused_regions()
                    k = region.kernel
                    E = len(stages.layout_of(k.plan.stages, k.plan.moments).exchanges)
                    a3, b3, ins = region.region_operands(xs)
                    outs = [torch.empty(canonical_shape(k.plan.region, o.axes), dtype=o.dtype, device="cuda")
                            for o in k.plan.region.outputs]
                    trace, grid, tiles = k.trace(a3, b3, ins, outs)
                    print(f"  {variant} ({grid} programs, {tiles} tiles, {E} exchange(s)) timeline:")
                    print(timeline(trace, grid, tiles, E), flush=True)
                    if args.after_graph:
                        # the same launch right behind a graph of back-to-back calls: the GPU as
                        # it is in the sustained timings (clocks, caches, the previous kernel's
                        # tail), where one launch alone runs rested
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            for _ in range(args.after_graph):
                                compiled(*xs)
                        for _ in range(3):
                            g.replay()
                        g.replay()
                        trace, grid, tiles = k.trace(a3, b3, ins, outs)
                        print(f"  {variant}, right after {args.after_graph} graph-replayed calls:")
                        print(timeline(trace, grid, tiles, E), flush=True)
                    forms[f"ws_stages, {variant}"] = lambda compiled=compiled, xs=xs: compiled(*xs)
                except Exception as e:  # one variant's failure is a line of the log, not the run's end
                    print(f"  {variant}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                finally:
                    stages_kernel.StagesKernel.grid_options = orig
            times = graph_rounds(forms, args.rounds)
            rows = ratio_rows(label, times, "cuBLAS GEMM")
            for row in rows:
                print(f"  = {row[1]}: {row[2]:.4f} ms [{row[3]:.4f}..{row[4]:.4f}] {row[5]:.3f}x GEMM", flush=True)
            table += rows
    print_ratio_table(table)


if __name__ == "__main__":
    main()
