"""The host time a fused region adds to a compiled graph's call, on a GPU, and where it goes.

Each case is a small function compiled by Inductor alone and through the backend (autotuning
and the whole-graph check off, the schedule forced), at sizes where the GPU waits on the host:
the wall time per call of back-to-back calls, synchronised only at the end, is then the host's.
The difference between the two is what the fused region's call costs the host beyond
Inductor's own kernels for the same ops. For the backend's form: the profiler's CPU record of
each launch (as ``models_check.py`` reports it inside models) and a cProfile of its calls (the
functions with the most time of their own, per call). Every result is first checked against
float64.

Cases: ``ln`` (GEMM + residual + LayerNorm, a Triton kernel) launched from Inductor's wrapper,
and ``ln-op`` the same kept from it, called as a region (``comfuse_region(...)`` in Inductor's
code, region_op.call); ``head`` (LM head + cross-entropy, the Gluon template ``ws_split``),
called as a region. One JSON line per case; the cProfile tables go to ``$OUT/region-host/``.
For the called regions, the host time of each layer of a call (``layers``).

    python scripts/region_host.py [ln,ln-op,head]
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402,F401  (registers the backend)
from comfuse import inductor_pass, region_op, settings  # noqa: E402
from comfuse.runtime.timing import profiled  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: a check of this script, the interpreter's times)
DT = torch.bfloat16 if DEV == "cuda" else torch.float32


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def case(name: str):
    """(function, inputs, schedule, launched from Inductor's wrapper)."""
    torch.manual_seed(0)
    if name.startswith("ln"):
        M = K = N = 1024 if DEV == "cuda" else 64
        x, w, r = (torch.randn(M, K, device=DEV, dtype=DT), torch.randn(K, N, device=DEV, dtype=DT) / 32,
                   torch.randn(M, N, device=DEV, dtype=DT))
        g, b = torch.rand(N, device=DEV, dtype=DT), torch.rand(N, device=DEV, dtype=DT)

        def f(x, w, r, g, b):
            return F.layer_norm(x @ w + r, (N,), g, b)
        return f, (x, w, r, g, b), "", name == "ln"
    M, K, V = (1024, 512, 8192) if DEV == "cuda" else (64, 32, 256)
    x, w = torch.randn(M, K, device=DEV, dtype=DT), torch.randn(V, K, device=DEV, dtype=DT) / 16
    t = torch.randint(0, V, (M,), device=DEV)

    def head(x, w, t):
        return F.cross_entropy(F.linear(x, w).float(), t)
    return head, (x, w, t), "ws_split", False


def per_call_us(fn, calls: int = 300 if DEV == "cuda" else 5, rounds: int = 5) -> tuple:
    """(median, min) host microseconds per call: back-to-back calls, one synchronisation."""
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(times), 1), round(min(times), 1)


def launches(fn) -> dict:
    kinds: dict = {}
    for e in profiled(fn, "CPU", 50).events():
        n = e.name
        k = "region op" if n == "comfuse::region" else "comfuse kernel" if n.startswith("comfuse_") else \
            "inductor kernel" if n.startswith("triton_") else ""
        if k:
            kinds.setdefault(k, []).append(e.cpu_time_total)
    return {k: [len(v) // 50, round(statistics.median(v), 1)] for k, v in kinds.items()}


def own_time(fn, out: Path, calls: int = 300 if DEV == "cuda" else 5) -> list:
    """The 12 functions with the most time of their own, in us per call (and the whole table to ``out``)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    out.write_text(text.getvalue())
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:12]
    return [[f"{Path(k[0]).name}:{k[1]} {k[2]}", round(v[2] / calls * 1e6, 2)] for k, v in rows]


def layers(call) -> dict:
    """Where a called region's host time goes: per call, the region module's ``forward`` on
    the arguments the graph passed (its Python and its launch), its replay (its launches alone,
    runtime/replay.py) where it has one, ``region_op.call`` (what Inductor's code calls), the
    ``comfuse::region`` operator called directly (the dispatcher and ``custom_op``'s layers,
    which Inductor's code no longer goes through), and the whole compiled call."""
    seen = []
    run = region_op._run

    def record(region_id, tensors, scalars):
        seen.append((region_id, list(tensors), list(scalars)))
        return run(region_id, tensors, scalars)
    region_op._run = record
    try:
        call()
    finally:
        region_op._run = run
    if not seen:
        return {}
    rid, tensors, scalars = seen[0]
    module, args = region_op.module_of(rid)[0], region_op._arguments(rid, tensors, scalars)
    replay = module.__dict__.get("_replay")
    rows = {"module_forward": per_call_us(lambda: module.forward(*args))}
    if replay is not None and hasattr(replay, "launches"):
        rows["replay"] = per_call_us(lambda: replay(tensors))
    rows.update(region_call=per_call_us(lambda: region_op.call(rid, tensors, scalars)),
                operator=per_call_us(lambda: torch.ops.comfuse.region(rid, tensors, scalars)),
                compiled_call=per_call_us(call))
    return rows


def run(name: str, out_dir: Path) -> dict:
    f, args, schedule, from_inductor = case(name)
    want = f(*(a.double() if a.is_floating_point() else a for a in args))
    row = {"case": name}
    torch._dynamo.reset()
    plain = torch.compile(f)
    got = plain(*args)
    row["inductor_err"] = float((got.double() - want).abs().max() / want.abs().max())
    row["inductor_us"] = per_call_us(lambda: plain(*args))
    torch._dynamo.reset()
    inductor_pass.REPORTS.clear()
    inductor_pass.LAUNCH_FROM_INDUCTOR = from_inductor
    # (the settings hold for the calls too: a region's calls read them, and would tune it)
    with settings.override(autotune="0", graph_check="0", schedule=schedule):
        fused = torch.compile(f, backend="comfuse")
        got = fused(*args)
        inductor_pass.LAUNCH_FROM_INDUCTOR = True
        row["regions"] = [(x.fused, x.launch, x.schedule) for r in inductor_pass.REPORTS for x in r.regions]
        row["comfuse_err"] = float((got.double() - want).abs().max() / want.abs().max())
        row["comfuse_us"] = per_call_us(lambda: fused(*args))
        row["added_us"] = round(row["comfuse_us"][0] - row["inductor_us"][0], 1)
        if DEV == "cuda":
            row["launch_host_us"] = launches(lambda: fused(*args))
        if not from_inductor:
            row["layers_us"] = layers(lambda: fused(*args))
        row["own_time_us"] = own_time(lambda: fused(*args), out_dir / f"{name}-cprofile.txt")
    return row


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "/tmp/comfuse-out")) / "region-host"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (sys.argv[1] if len(sys.argv) > 1 else "ln,ln-op,head").split(","):
        try:
            row = run(name, out_dir)
        except Exception as e:  # reported, not hidden
            row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
