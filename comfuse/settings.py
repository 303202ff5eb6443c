"""Typed settings, read from ``COMFUSE_*`` environment variables.

Every setting that changes generated code is listed in ``CODEGEN_SETTINGS`` and
goes into the kernel cache key. ``override(...)`` sets values for a block of code
(tests use it) and restores them afterwards.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Iterator


def _truthy(raw: str) -> bool:
    return raw.strip().lower() not in ("0", "false", "no", "off")


def _integer(name: str, raw) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return _truthy(raw)


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return _integer(name, raw)


def coerce(name: str, value):
    """``value`` (an option's, e.g. the torch.compile backend's) as the type of Settings field
    ``name``, read as its COMFUSE_* variable's text would be."""
    kind = {f.name: f.type for f in dataclasses.fields(Settings)}[name]
    kind = getattr(kind, "__name__", kind)
    if kind == "bool":
        return _truthy(value) if isinstance(value, str) else bool(value)
    if kind == "int":
        return _integer(name, value)
    return str(value)


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    # COMFUSE_STRICT=1: a failure inside compilation raises instead of running unfused.
    strict: bool
    # COMFUSE_DISABLE=1: find and report regions, but run everything unfused.
    disable: bool
    # COMFUSE_CACHE_DIR: where generated kernel sources are written.
    cache_dir: Path
    # COMFUSE_ROW_BUDGET: most fp32 accumulator elements one program may hold for the
    # row-in-CTA schedule (BLOCK_M * BLOCK_N). Rows wider than budget/16 are not fused.
    row_budget: int
    # COMFUSE_MAX_SPECIALIZATIONS: distinct input signatures one compiled function keeps.
    max_specializations: int
    # COMFUSE_CHECK=1: after every kernel launch, compare the outputs with the IR's reference
    # interpreter in float64 and raise KernelMismatch beyond tolerance (slow; for tests).
    check: bool
    # COMFUSE_SCHEDULE: force one schedule ("tile", "row_in_cta"); a region it cannot run
    # is not fused, with the reason. Empty: the planner chooses.
    schedule: str
    # COMFUSE_MAINLOOP: force the mainloop's loads: "tma" (tensor descriptors, where the
    # operands allow) or "pointer". Empty: pointer loads unless autotuning picks TMA.
    mainloop: str
    # COMFUSE_PREFETCH=1: load whole-tile side inputs (residuals) before the mainloop in every
    # plan (default: only in the autotuner's candidates, where it competes on time).
    prefetch: bool
    # COMFUSE_PERSISTENT=1: tile plans run on a persistent grid (one program per SM walking
    # the tiles, its tile and K loops fused by Triton). Default: only autotuning candidates.
    persistent: bool
    # COMFUSE_OVERLAP=1: cooperative plans wait for a strip's first exchange behind the next
    # strip's mainloop (experimental: not among the autotuner's candidates until timed).
    overlap: bool
    # COMFUSE_WS_MERGE (default 1): ws_stages plans (the generated Gluon kernel) merge a row's
    # sum with its sum of squared deviations (Chan) and a max with its sum of exp(x - max)
    # (online) into one exchange each, and keep an exchange's value in the hand-off buffer
    # where the later passes need nothing else of the tile; 0: one exchange per stage.
    ws_merge: bool
    # COMFUSE_WS_LANES: lanes of a warp along a row of a ws_stages epilogue's chunks, 32 or 8
    # (0, the default: autotuning times both; the planner's own choice is 8).
    ws_lanes: int
    # COMFUSE_WS_TMA_STORE=1: ws_stages kernels with one bf16 [M, N] output write it from the
    # hand-off buffer by one TMA bulk store a tile (correct on the H200 but no faster, sixteenth
    # session, so not among the autotuner's candidates without it).
    ws_tma_store: bool
    # COMFUSE_WS_TAIL: rows (a multiple of 32, at most 128) of each program's last tile whose
    # epilogue a ws_stages kernel's mainloop warps run, idle by then, beside the epilogue
    # partition's rows (0, the default: none, and autotuning also times 96 rows at 8 lanes).
    ws_tail: int
    # COMFUSE_WS_RES_TMA=1: a ws_stages kernel whose region adds a bf16 [M, N] input to the
    # GEMM's tile (a residual; codegen/gluon/stages.tma_residual) TMA-loads it into the hand-off
    # buffer while the next tile's mainloop runs, which adds it before the hand-off, rather than
    # each pass reading it from global memory (alone not faster on the H200; with nothing kept
    # and the last tile shared, an autotuning candidate since the eighteenth session).
    ws_res_tma: bool
    # COMFUSE_WS_LOOKAHEAD=1: each chunk of a ws_stages epilogue's passes issues the next
    # chunk's loads (the tile's rows from the buffer, [M, N] inputs from global memory) before
    # its own work (experimental). With COMFUSE_WS_ROLL (twenty-second session, not yet run on
    # a GPU) only the [M, N] inputs, carried by the pass's loop a chunk ahead.
    ws_lookahead: bool
    # COMFUSE_WS_KEEP=0: a merged ws_stages kernel recomputes an exchange's value in the later
    # passes rather than keep it in the hand-off buffer (the keep's shared-memory stores put two
    # barriers of the epilogue's warps in each chunk; H200, eighteenth session: slower where the
    # later pass reads the residual again, faster with the residual by TMA).
    ws_keep: bool
    # COMFUSE_WS_VEC (8 by default): a ws_stages epilogue's thread at 8 lanes a row takes 8
    # adjacent columns of a row at a time (a row's 8 lanes then cover 128 adjacent bytes: no
    # shared-memory bank conflicts on the swizzled tile, whole sectors in global memory); 0: all
    # its 256 / lanes columns adjacent (Nsight Compute, eighteenth session: 4x the tile reads'
    # ideal wavefronts). H200, nineteenth session, sustained, x cuBLAS's GEMM at 8192x1024x1024:
    # RMSNorm 1.367x -> 1.131x, softmax 1.580x -> 1.298x, multi-stage 2.364x -> 2.012x, mblr
    # 1.763x -> 1.367x, LayerNorm (autotuning's fourth form) 1.821x -> 1.624x.
    ws_vec: int
    # COMFUSE_WS_NARROW=1: a ws_stages epilogue computes the region's bf16 / fp16 adds and
    # products whose operands come in that type (the tile's bias and residual adds) in it, as
    # eager rounds them, rather than unpack them into fp32 (a third of LayerNorm's epilogue
    # instructions unpack bf16; experimental: correct on the H200, -2.5 % to +1.4 %, nineteenth
    # session).
    ws_narrow: bool
    # COMFUSE_WS_EXP_FMA=1: a ws_stages epilogue computes exp(x - a row's max) as
    # 2^(x log2(e) - max log2(e)), one FFMA an element rather than an FADD and an FMUL
    # (softmax's epilogue: 13 % of its instructions; experimental: correct on the H200, 0.5-4 %
    # faster with COMFUSE_WS_VEC=0, nineteenth session; not yet timed alone with the default 8).
    ws_exp_fma: bool
    # COMFUSE_WS_ROW_OUTPUTS=1: ws_stages kernels also take regions with per-row [M] outputs
    # (LayerNorm's saved mean and rstd in a training graph), written by each strip's first tile
    # (experimental: correct on the H200 since the eighteenth session, not yet timed).
    ws_row_outputs: bool
    # COMFUSE_WS_ROLL=1: a ws_stages epilogue's passes loop over their chunks at run time
    # rather than unrolled (strip.chunk_view: a chunk of the hand-off tile by a run-time index).
    # Unrolled, multi-stage's epilogue partition is 7 740 SASS instructions, and Nsight Compute
    # (twenty-first session) put a third of its warps' stall samples on instructions not yet
    # fetched (no_inst), 56 % with nothing kept; with loops 1 567. Needs 8 lanes a row with 8
    # adjacent columns a lane (the default) and no lookahead; elsewhere the passes stay
    # unrolled. Without the setting, autotuning times both (H200, sustained, x cuBLAS's GEMM,
    # with the shared tile: multi-stage 8192x1024x1024 1.871x -> 1.587x, RMSNorm 1.152x ->
    # 1.089x, softmax and LayerNorm within 1 %; 0.4-4 % slower at 8192x4096x4096).
    ws_roll: bool
    # COMFUSE_WS_LAST_IN_RING=1: with the last tile shared
    # (COMFUSE_WS_TAIL), a ws_stages kernel hands off each program's last tile into the B
    # operand's ring, free once its last K step is done, rather than the hand-off buffer, so
    # its mainloop warps start their rows of it at once instead of waiting for the epilogue to
    # free the buffer from the tile before (Nsight Compute, twenty-first session: multi-stage's
    # mainloop warps spent 52 % of their stall samples waiting for the buffer). Not with the
    # residual by TMA or lookahead. Alone it gained little (twenty-second session: the last
    # tile's exchanges still waited for the epilogue partition); with COMFUSE_WS_TAIL=128 and
    # loops, an autotuning candidate (multi-stage 8192x1024x1024 1.604x -> 1.464x the GEMM).
    ws_last_in_ring: bool
    # COMFUSE_WS_CHUNK=32 (experimental, twenty-second session; not yet run on a GPU): a
    # ws_stages epilogue's chunks of 32 rows rather than 16, so that each epilogue thread
    # holds two rows of a chunk, independent work for its one warp a scheduler to overlap
    # (the H200 trace: 4 epilogue warps took 18.4 us for multi-stage's tile, 10.5 the
    # mainloop). Unrolled, 32-row chunks changed nothing (twenty-first session: 2.002x ->
    # 1.998x), where the unrolled chunks already offered that overlap. With a shared tail the
    # mainloop warps' chunks are 64 rows, so the tail must be 64 or 128. 0: 16.
    ws_chunk: int
    # COMFUSE_WS_TILE_N=128 (experimental; correct on the H200 and slower everywhere, twentieth
    # session): ws_stages kernels on 128x128 tiles, the mainloop in one warpgroup (4 warps: the
    # same 128 accumulator registers a thread as two warpgroups on 128x256) beside 8 epilogue
    # warps, 12 warps at 168 registers. Twice the epilogue warps on half the tile: for short-K
    # shapes, where the epilogue partition is the bound (8192x1024x1024). 256 (the default):
    # 128x256 tiles, 8 + 4 warps.
    ws_tile_n: int
    # COMFUSE_AUTOTUNE: "auto" (time the candidate plans and the unfused ops on the first
    # call on a GPU, keep the fastest, remember it on disk), "1" (also under the
    # interpreter, for tests), "0" (use the planner's choice).
    autotune: str
    # COMFUSE_FUEL: cap on the number of regions fused per compiled graph (-1: no cap);
    # lowering it bisects a bad fusion.
    fuel: int
    # COMFUSE_UNFUSED_MODE: how autotuning compiles a region's unfused ops, its contender:
    # "default" (Inductor's default mode), "max-autotune" (max-autotune-no-cudagraphs:
    # slower first call, tens of seconds per region; on the DLRM chain its Triton GEMMs ran
    # 0.1355 ms where the default's took 0.1664, H200 2026-11-30) or "best" (both, the
    # faster kept: neither wins everywhere; on GEMM + LayerNorm the default's 0.0420 ms beat
    # max-autotune's 0.0524, on the multi-stage epilogue max-autotune's 0.0541 beat 0.0598).
    unfused_mode: str
    # COMFUSE_TUNE_TIMING: how autotuning times the candidates: "launch" (each call through
    # Python, what an eager call costs) or "graph" (CUDA-graph replays: the GPU's time, what
    # a graph-captured model, e.g. torch.compile's reduce-overhead mode, costs).
    tune_timing: str
    # COMFUSE_GRAD_COMPILE: the sliced backward of a split region (linear + cross-entropy)
    # runs each slice's elementwise work and its gradient as Inductor kernels: "auto" (on
    # CUDA tensors), "1" (also on the CPU, for tests), "0" (plain torch ops, one kernel each).
    grad_compile: str
    # COMFUSE_VALIDATE: a region whose plan autotuning did not compare with its own ops
    # (autotuning off, or a plan forced) is compared on its first call per device: "auto" (on
    # a GPU), "1" (also under the interpreter), "0" (never). A disagreement beyond the
    # operands' tolerance turns the region off (unfused, with a warning; COMFUSE_STRICT=1
    # raises). Skipped where the region's ops would hold an intermediate of
    # COMFUSE_MEMORY_FIRST_MB or more (linear + cross-entropy over a vocabulary).
    validate: str
    # COMFUSE_GRAPH_CHECK: the backend times each inference graph it fused against Inductor's
    # compilation of the same graph without comfuse's regions, on Dynamo's example inputs, and
    # keeps the faster: "auto" (on a GPU, where autotuning runs), "1" (also on the CPU, for
    # tests), "0" (never). A fused region that wins its own timing can still lose in the model:
    # on the H200 (tenth session) a BERT layer with its Q/K/V projections fused ran 0.72 ms
    # per call against Inductor's 0.56 (the regions' host time, cut fusions around them).
    graph_check: str


CODEGEN_SETTINGS = ("row_budget", "schedule", "mainloop", "prefetch", "overlap", "persistent", "ws_merge",
                    "ws_lanes", "ws_tma_store", "ws_tail",
                    "ws_res_tma", "ws_lookahead", "ws_keep", "ws_vec", "ws_narrow", "ws_exp_fma", "ws_row_outputs",
                    "ws_tile_n", "ws_roll", "ws_last_in_ring", "ws_chunk")

_overrides: dict[str, object] = {}


_ENV_NAMES = ("COMFUSE_STRICT", "COMFUSE_DISABLE", "COMFUSE_CACHE_DIR", "XDG_CACHE_HOME", "HOME",
              "COMFUSE_ROW_BUDGET", "COMFUSE_MAX_SPECIALIZATIONS", "COMFUSE_CHECK", "COMFUSE_SCHEDULE",
              "COMFUSE_AUTOTUNE", "COMFUSE_MAINLOOP", "COMFUSE_FUEL", "COMFUSE_PREFETCH",
              "COMFUSE_UNFUSED_MODE", "COMFUSE_OVERLAP", "COMFUSE_PERSISTENT", "COMFUSE_TUNE_TIMING",
              "COMFUSE_GRAD_COMPILE", "COMFUSE_VALIDATE", "COMFUSE_GRAPH_CHECK", "COMFUSE_WS_MERGE",
              "COMFUSE_WS_LANES", "COMFUSE_WS_TMA_STORE", "COMFUSE_WS_TAIL",
              "COMFUSE_WS_RES_TMA", "COMFUSE_WS_LOOKAHEAD", "COMFUSE_WS_KEEP",
              "COMFUSE_WS_VEC", "COMFUSE_WS_NARROW", "COMFUSE_WS_EXP_FMA", "COMFUSE_WS_ROW_OUTPUTS",
              "COMFUSE_WS_TILE_N", "COMFUSE_WS_ROLL", "COMFUSE_WS_LAST_IN_RING",
              "COMFUSE_WS_CHUNK")
# (every variable _read reads: the memo's key; tests/test_settings... checks the list is whole)
_ENV_KEYS = tuple(os.environ.encodekey(n) if hasattr(os.environ, "encodekey") else n for n in _ENV_NAMES)
_memo: dict[tuple, Settings] = {}


def get() -> Settings:
    """The settings now: environment variables, then ``override``. Read on every fused call,
    so the result is remembered per (environment, overrides) snapshot."""
    raw = getattr(os.environ, "_data", None)  # CPython's encoded mapping: no decoding per lookup
    if isinstance(raw, dict):
        env = tuple(map(raw.get, _ENV_KEYS))
    else:
        env = tuple(os.environ.get(name) for name in _ENV_NAMES)
    key = (env,
           tuple(sorted((k, repr(v)) for k, v in _overrides.items())))
    found = _memo.get(key)
    if found is None:
        if len(_memo) > 256:
            _memo.clear()
        found = _memo[key] = _read()
    return found


def _read() -> Settings:
    cache_default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "comfuse"
    values = dict(
        strict=_flag("COMFUSE_STRICT", False),
        disable=_flag("COMFUSE_DISABLE", False),
        cache_dir=Path(os.environ.get("COMFUSE_CACHE_DIR") or cache_default),
        row_budget=_int("COMFUSE_ROW_BUDGET", 128 * 256),
        max_specializations=_int("COMFUSE_MAX_SPECIALIZATIONS", 64),
        check=_flag("COMFUSE_CHECK", False),
        schedule=os.environ.get("COMFUSE_SCHEDULE", ""),
        autotune=os.environ.get("COMFUSE_AUTOTUNE", "auto"),
        mainloop=os.environ.get("COMFUSE_MAINLOOP", ""),
        prefetch=_flag("COMFUSE_PREFETCH", False),
        overlap=_flag("COMFUSE_OVERLAP", False),
        ws_merge=_flag("COMFUSE_WS_MERGE", True),
        ws_lanes=_int("COMFUSE_WS_LANES", 0),
        ws_tma_store=_flag("COMFUSE_WS_TMA_STORE", False),
        ws_tail=_int("COMFUSE_WS_TAIL", 0),
        ws_res_tma=_flag("COMFUSE_WS_RES_TMA", False),
        ws_lookahead=_flag("COMFUSE_WS_LOOKAHEAD", False),
        ws_keep=_flag("COMFUSE_WS_KEEP", True),
        ws_vec=_int("COMFUSE_WS_VEC", 8),
        ws_narrow=_flag("COMFUSE_WS_NARROW", False),
        ws_exp_fma=_flag("COMFUSE_WS_EXP_FMA", False),
        ws_row_outputs=_flag("COMFUSE_WS_ROW_OUTPUTS", False),
        ws_roll=_flag("COMFUSE_WS_ROLL", False),
        ws_last_in_ring=_flag("COMFUSE_WS_LAST_IN_RING", False),
        ws_chunk=_int("COMFUSE_WS_CHUNK", 0),
        ws_tile_n=_int("COMFUSE_WS_TILE_N", 256),
        persistent=_flag("COMFUSE_PERSISTENT", False),
        fuel=_int("COMFUSE_FUEL", -1),
        unfused_mode=os.environ.get("COMFUSE_UNFUSED_MODE", "best"),
        tune_timing=os.environ.get("COMFUSE_TUNE_TIMING", "launch"),
        grad_compile=os.environ.get("COMFUSE_GRAD_COMPILE", "auto"),
        validate=os.environ.get("COMFUSE_VALIDATE", "auto"),
        graph_check=os.environ.get("COMFUSE_GRAPH_CHECK", "auto"),
    )
    values.update(_overrides)
    return Settings(**values)


def _known(values) -> None:
    unknown = set(values) - {f.name for f in dataclasses.fields(Settings)}
    if unknown:
        raise TypeError(f"unknown comfuse settings: {sorted(unknown)}")


@contextlib.contextmanager
def override(**values: object) -> Iterator[Settings]:
    """Temporarily set settings: ``with override(strict=True): ...``."""
    _known(values)
    if isinstance(values.get("cache_dir"), str):  # (a path as text, as COMFUSE_CACHE_DIR gives it)
        values["cache_dir"] = Path(values["cache_dir"])
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield get()
    finally:
        _overrides.clear()
        _overrides.update(saved)


def pinned(fn, **values: object):
    """``fn`` with ``values`` in force at every call, not only while it was made: settings are
    read at each call (a compiled function built under ``override(autotune="0")`` autotunes at
    its first call outside it), so a benchmark's forced form must carry them."""
    _known(values)  # (here, not at the first call)

    def run(*args, **kwargs):
        with override(**values):
            return fn(*args, **kwargs)
    return run
