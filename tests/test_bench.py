"""The evaluation harness: timing aggregation, reference checks, reports and figures on
synthetic data, missing baselines, and the ncu output parser."""
import json

import pytest
import torch

from comfuse.bench import report, runner, workloads
from comfuse.bench.profile import parse_csv, profile_markdown, summarize as summarize_ncu
from comfuse.runtime.timing import measure, measure_rounds, summarize


def test_summarize_median_and_quartiles():
    t = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (t.median_ms, t.q1_ms, t.q3_ms, t.iqr_ms, t.reps) == (3.0, 2.0, 4.0, 2.0, 5)
    assert summarize([7.0]).iqr_ms == 0.0
    with pytest.raises(ValueError):
        summarize([])


def test_measure_on_cpu_takes_at_least_20_repetitions():
    calls = []
    t = measure(lambda: calls.append(1), device="cpu")
    assert t.reps >= 20 and len(calls) == t.reps + 1  # one warm-up call


def _synthetic(comfuse_ms=0.5, eager_ms=1.0, inductor_ms=0.8, gemm_ms=0.4, epilogue_ms=0.3):
    def ok(ms):
        return {"status": "ok", "median_ms": ms, "q1_ms": ms * 0.98, "q3_ms": ms * 1.02,
                "iqr_ms": ms * 0.04, "reps": 50, "err": 1e-3}
    return {"suite": "paper", "workload": "ln_postnorm", "shape": [8192, 1024, 1024], "dtype": "bfloat16",
            "flops": 2 * 8192 * 1024 * 1024, "min_bytes": 3 * 8192 * 1024 * 2,
            "candidates": {"comfuse": {**ok(comfuse_ms), "fused": "1/1", "schedules": "row_in_cta"},
                           "eager": ok(eager_ms), "inductor": ok(inductor_ms),
                           "inductor-max-autotune": {"status": "wrong", "err": 0.5, "reason": "MISMATCH"},
                           "gemm": ok(gemm_ms), "epilogue": ok(epilogue_ms),
                           "sdpa": {"status": "n/a", "reason": "SDPA does not compute this program"},
                           "tensorrt": {"status": "unavailable", "reason": "torch_tensorrt missing"}}}


def _results(*cases):
    return {"meta": {"gpu": "NVIDIA H200", "sm_count": 132, "device": "cuda", "torch": "2.11",
                     "triton": "3.6.0", "dtype": "bf16", "date": "2026-11-30"},
            "ceilings": {"copy_tb_s": 4.3, "bf16_gemm_tflops": 790.0}, "cases": list(cases)}


def test_derive_uses_only_correct_baselines():
    d = report.derive(_synthetic())
    assert d["best_baseline"] == "inductor"  # max-autotune was wrong: not a candidate for "best"
    assert d["speedup_vs_best"] == pytest.approx(0.8 / 0.5)
    assert d["comfuse_over_gemm"] == pytest.approx(0.5 / 0.4)
    assert d["epilogue_cost_ms"] == pytest.approx(0.1)
    assert d["standalone_epilogue_ms"] == pytest.approx(0.3)
    assert d["ceiling_vs_best"] == pytest.approx(0.8 / 0.4)  # the best baseline over the GEMM alone


def test_missing_candidates_derive_to_none():
    case = _synthetic()
    del case["candidates"]["comfuse"]
    d = report.derive(case)
    assert d["speedup_vs_best"] is None and d["epilogue_cost_ms"] is None


def test_markdown_reports_wrong_and_unavailable_candidates():
    md = report.markdown(_results(_synthetic(), _synthetic(comfuse_ms=1.6)))
    assert "NVIDIA H200" in md and "790 TFLOP/s" in md
    assert "WRONG (err 5.0e-01)" in md
    assert "- tensorrt: torch_tensorrt missing" in md
    assert "Geometric-mean speedup of comfuse over the best baseline: 0.89x" in md  # sqrt(1.6 * 0.5)
    # the ceilings: 0.8 / 0.4 and 0.8 / 0.4 (the second case's GEMM alone as in the first)
    assert "Ceiling (best baseline / GEMM alone" in md and "geometric mean 2.00x" in md


def test_markdown_says_how_repetitions_were_timed():
    results = _results(_synthetic())
    assert "each repetition a Python call" in report.markdown(results)
    results["meta"]["graph"] = True  # comfuse bench --graph
    assert "CUDA-graph replay of one call" in report.markdown(results)
    results["meta"]["tune_timing"] = "graph"
    assert "autotuning timed its candidates by CUDA-graph replays" in report.markdown(results)


def test_a_graph_timed_run_tunes_by_graph_replays_unless_told(monkeypatch):
    """comfuse bench --graph on a GPU: autotuning times graph replays too (the launch-timed
    choice counts Python's host time, which a replay does not pay); COMFUSE_TUNE_TIMING wins."""
    monkeypatch.delenv("COMFUSE_TUNE_TIMING", raising=False)
    assert runner._tune_timing(True, "cuda") == "graph"
    assert runner._tune_timing(False, "cuda") == "launch" and runner._tune_timing(True, "cpu") == "launch"
    monkeypatch.setenv("COMFUSE_TUNE_TIMING", "launch")
    assert runner._tune_timing(True, "cuda") == "launch"


def test_figures_and_files_are_written(tmp_path):
    paths = report.write(_results(_synthetic(), _synthetic(comfuse_ms=0.3)), tmp_path)
    names = {p.name for p in paths}
    assert {"results.json", "results.md", "speedup.png", "roofline.png", "epilogue.png"} <= names
    for p in paths:
        assert p.stat().st_size > 0
    assert json.loads((tmp_path / "results.json").read_text())["cases"][0]["workload"] == "ln_postnorm"


def test_run_case_reports_a_wrong_candidate_without_timing_it():
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    prog = workloads.Program("paper", "toy", (8, 16, 8), torch.float32, lambda x, w: torch.relu(x @ w),
                             (x, w), 2 * 8 * 16 * 8, 1.0, gemm=lambda: x @ w,
                             sdpa=lambda: torch.relu(x @ w) + 1.0)  # deliberately wrong
    row = runner.run_case(prog, ["eager", "sdpa", "gemm", "tensorrt"], "cpu", progress=lambda s: None)
    c = row["candidates"]
    assert c["eager"]["status"] == "ok" and c["eager"]["reps"] >= 20
    assert c["sdpa"]["status"] == "wrong" and "median_ms" not in c["sdpa"]
    assert c["gemm"]["status"] == "ok"  # a floor: timed, not checked against the program
    assert c["tensorrt"]["status"] in ("unavailable", "not run")


def test_reduce_overhead_candidates_run_by_name_and_report_their_own_ratio(monkeypatch):
    """torch.compile(..., mode="reduce-overhead") with and without comfuse: asked for by name
    (not in the default list), checked like any candidate, n/a under --graph on a GPU, and
    reported side by side with their ratio."""
    assert set(runner.GRAPH_MODE_CANDIDATES) <= set(runner.ALL_CANDIDATES)
    assert not set(runner.GRAPH_MODE_CANDIDATES) & set(runner.DEFAULT_CANDIDATES)
    x, w = torch.randn(64, 32), torch.randn(32, 48)
    prog = workloads.Program("paper", "toy", (64, 32, 48), torch.float32, lambda x, w: torch.relu(x @ w) * 2.0,
                             (x, w), 2 * 64 * 32 * 48, 1.0, gemm=lambda: x @ w)
    row = runner.run_case(prog, list(runner.GRAPH_MODE_CANDIDATES), "cpu", progress=lambda s: None)
    for name in runner.GRAPH_MODE_CANDIDATES:
        assert row["candidates"][name]["status"] == "ok", row["candidates"][name]
    row = runner.run_case(prog, list(runner.GRAPH_MODE_CANDIDATES), "cuda", progress=lambda s: None, graph=True)
    assert all(row["candidates"][n]["status"] == "n/a" for n in runner.GRAPH_MODE_CANDIDATES)
    case = _synthetic()
    ok = case["candidates"]["inductor"]
    case["candidates"]["inductor-reduce-overhead"] = {**ok, "median_ms": 0.6}
    case["candidates"]["comfuse-backend-reduce-overhead"] = {**ok, "median_ms": 0.4}
    assert report.derive(case)["reduce_overhead_speedup"] == pytest.approx(1.5)
    assert report.derive(case)["best_baseline"] == "inductor-reduce-overhead"
    md = report.markdown(_results(case))
    assert "| reduce-overhead | torch.compile(comfuse, reduce-overhead) |" in md
    assert "both in mode reduce-overhead (CUDA graphs): ln_postnorm 8192x1024x1024 1.50x" in md


def test_run_case_survives_a_failing_candidate():
    x, w = torch.randn(4, 4), torch.randn(4, 4)

    def broken():
        raise RuntimeError("kaputt")
    prog = workloads.Program("paper", "toy", (4, 4, 4), torch.float32, lambda x, w: x @ w, (x, w), 1.0, 1.0,
                             gemm=broken)
    row = runner.run_case(prog, ["gemm", "eager"], "cpu", progress=lambda s: None)
    assert row["candidates"]["gemm"]["status"] == "failed" and "kaputt" in row["candidates"]["gemm"]["reason"]
    assert row["candidates"]["eager"]["status"] == "ok"


def test_repeat_times_checked_candidates_in_interleaved_rounds():
    """--repeat 3: every candidate that passed its check is timed in three rounds, in the
    order A B, then B A; the median of the round medians is reported with their range."""
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    order = []

    def fn(x, w):
        order.append("eager")
        return torch.relu(x @ w)

    def gemm():
        order.append("gemm")
        return x @ w
    prog = workloads.Program("paper", "toy", (8, 16, 8), torch.float32, fn, (x, w), 2 * 8 * 16 * 8, 1.0,
                             gemm=gemm, reference=lambda x, w: torch.relu(x.double() @ w.double()))
    row = runner.run_case(prog, ["eager", "gemm"], "cpu", progress=lambda s: None, repeat=3)
    for name in ("eager", "gemm"):
        c = row["candidates"][name]
        assert len(c["round_medians_ms"]) == 3
        assert c["rounds_min_ms"] <= c["median_ms"] <= c["rounds_max_ms"]
    # after the first (build, check, time) pass, the rounds alternate between candidates
    switches = sum(1 for a, b in zip(order, order[1:]) if a != b)
    assert switches >= 4
    assert "[" in report._fmt(row["candidates"]["eager"])


def test_measure_rounds_rotates_the_order_and_keeps_rounds_that_ran():
    """Each round starts one callable later (A B C, B C A, C A B), so none always runs first;
    a round that raises goes to on_error and the others still count."""
    starts, failures = [], []
    calls = {}
    for name in "abc":
        def call(name=name):
            starts.append(name)
            if name == "c" and starts.count("c") > 21:  # c's second round: warm-up + 20 reps ran once
                raise RuntimeError("kaputt")
        calls[name] = call
    got = measure_rounds(calls, rounds=3, device="cpu", on_error=lambda n, e: failures.append((n, str(e))))
    firsts = [starts[0]] + [b for a, b in zip(starts, starts[1:]) if a != b]
    assert firsts[:3] == ["a", "b", "c"] and firsts[3:5] == ["b", "c"]
    assert failures and failures[0] == ("c", "kaputt")
    assert len(got["a"].round_medians_ms) == 3 and len(got["c"].round_medians_ms) < 3
    assert got["a"].pooled.reps >= 60
    assert set(got["b"].as_dict()) >= {"median_ms", "round_medians_ms", "rounds_min_ms", "q1_ms"}
    assert measure_rounds({}, rounds=3, device="cpu") == {}


def test_suites_list_the_paper_workloads():
    quick = workloads.cases("all", quick=True)
    assert ("paper", "linear_ce", (8192, 4096, 32768)) in quick
    assert ("attention", "self_attention", None) in quick
    assert len(workloads.cases("paper")) > len(workloads.cases("paper", quick=True))
    own = workloads.cases("paper", sweep=False)  # the suite's own shapes, as its definition names them
    assert len(own) == sum(len(wl.gpu_shapes) for wl in workloads.SUITE.values())
    assert sum(len(wl.gpu_shapes) for wl in workloads.SUITE.values() if wl.paper) == 11  # the paper's eleven
    assert ("paper", "ln_postnorm", (16384, 2048, 8192)) in own
    assert ("paper", "ln_postnorm", (8191, 1024, 1024)) not in own
    with pytest.raises(ValueError):
        workloads.cases("nope")


NCU_CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python","h","comfuse_row_in_cta_ab","1","7","(256, 1, 1)","(256, 1, 1)","Command line profiler metrics","dram__bytes_read.sum","byte","33,554,432"
"0","1","python","h","comfuse_row_in_cta_ab","1","7","(256, 1, 1)","(256, 1, 1)","Command line profiler metrics","dram__bytes_write.sum","byte","16777216"
"0","1","python","h","comfuse_row_in_cta_ab","1","7","(256, 1, 1)","(256, 1, 1)","Command line profiler metrics","gpu__time_duration.sum","nsecond","120000"
"1","1","python","h","other_kernel","1","7","(1, 1, 1)","(1, 1, 1)","Command line profiler metrics","dram__bytes_read.sum","byte","1000"
'''


def test_ncu_csv_parsing_and_report():
    s = summarize_ncu(parse_csv(NCU_CSV))
    assert s["read_bytes"] == 33554432 + 1000 and s["write_bytes"] == 16777216
    assert s["time_us"] == pytest.approx(120.0) and len(s["kernels"]) == 2
    md = profile_markdown({"workload": "ln_postnorm", "shape": "8192,1024,1024", "dtype": "bf16",
                           "min_bytes": 50e6, "variants": {"fused": s}})
    assert "| fused | 2 | 33.6 | 16.8 | 50.3 | 50.0 | 1.01 |" in md


def test_profile_without_ncu_says_so(monkeypatch):
    from comfuse.bench import profile
    monkeypatch.setattr(profile, "find_ncu", lambda: None)
    with pytest.raises(SystemExit, match="Nsight Compute"):
        profile.profile("ln_postnorm", "8192,1024,1024")


def test_bench_measures_the_paper_workloads_at_given_shapes(tmp_path):
    """`comfuse bench --shapes` (shapes outside the suite: M not a multiple of the
    tile, other N): each chosen workload at each shape, checked against float64."""
    from comfuse import cli
    out = tmp_path / "b"
    assert cli.main(["bench", "--suite", "paper", "--device", "cpu", "--dtype", "fp32", "--only", "rmsnorm",
                     "--shapes", "33,16,40;8,16,24", "--candidates", "eager,comfuse", "--out", str(out)]) == 0
    import json
    cases = json.loads((out / "results.json").read_text())["cases"]
    assert [(c["workload"], c["shape"]) for c in cases] == [("rmsnorm", [33, 16, 40]), ("rmsnorm", [8, 16, 24])]
    assert all(c["candidates"][n]["status"] == "ok" for c in cases for n in ("eager", "comfuse"))
    with pytest.raises(SystemExit):
        cli.main(["bench", "--suite", "paper", "--device", "cpu", "--shapes", "1,2", "--out", str(out)])


def test_bench_suite_shapes_leave_the_sweep_out(tmp_path):
    """`--shapes suite`: each workload at its own shapes only (LayerNorm's three, not its sweep);
    on the CPU each shrinks to the workload's small shape."""
    from comfuse import cli
    out = tmp_path / "s"
    assert cli.main(["bench", "--suite", "paper", "--device", "cpu", "--dtype", "fp32", "--only", "ln_postnorm",
                     "--shapes", "suite", "--candidates", "eager,gemm", "--out", str(out)]) == 0
    import json
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["sweep"] is False
    assert len(results["cases"]) == len(workloads.SUITE["ln_postnorm"].gpu_shapes) == 3


def test_ratio_rows_take_medians_of_rounds_against_the_base(capsys):
    from comfuse.runtime.timing import print_ratio_table, ratio_rows
    rows = ratio_rows("8x8x8", {"gemm": [1.0, 2.0, 3.0], "fused": [2.0, 4.0, 9.0]}, "gemm")
    assert rows == [("8x8x8", "gemm", 2.0, 1.0, 3.0, 1.0), ("8x8x8", "fused", 4.0, 2.0, 9.0, 2.0)]
    print_ratio_table(rows)
    assert "| 8x8x8 | fused | 4.0000 | 2.0000..9.0000 | 2.000 |" in capsys.readouterr().out


def test_models_check_forms_and_table():
    """scripts/models_check.py (the whole-model runs on a GPU): a form names the backend and,
    after '@', torch.compile's mode; an unknown one is a clear error; the table gives tokens a
    second and the step's peak memory beside the times."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "models_check.py"
    spec = importlib.util.spec_from_file_location("models_check", path)
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    assert mc.configure("inductor@max-autotune-no-cudagraphs")[1] == {"backend": "inductor",
                                                                      "mode": "max-autotune-no-cudagraphs"}
    assert mc.configure("forced")[1] == {"backend": "comfuse"}
    assert mc.configure("comfuse@reduce-overhead")[1] == {"backend": "comfuse", "mode": "reduce-overhead"}
    with pytest.raises(ValueError, match="unknown form 'comfuse@fast'"):
        mc.configure("comfuse@fast")
    row = {"model": "gpt2", "form": "inductor", "batch": 8, "seq": 1024, "first_call_s": 15.0,
           "forward_ms": [2.5, 2.4, 2.6], "step_ms": [8.0, 7.9, 8.1], "step_peak_gib": 21.5,
           "loss_rel_err": 1e-5, "grads_rel_err": 9e-3}
    table = mc.markdown([row])
    assert "| 1,024,000 | 21.5 |" in table and "8.000 [7.900..8.100]" in table
    moded = {"model": "llama", "mode": "max-autotune-no-cudagraphs", "forced": False, "backend": "inductor",
             "sizes": [{"batch": 2, "seq": 128, "first_call_s": 20.5, "loss_rel_err": 1e-5, "grads_rel_err": 7e-3}]}
    assert "| llama | max-autotune-no-cudagraphs, Inductor alone | 2x128: 20.5 s, 1.0e-05, 7.0e-03 |" in \
        mc.markdown([moded])

    assert not mc.interleaves(["inductor@reduce-overhead", "comfuse@reduce-overhead"]) and mc.interleaves(
        ["inductor", "comfuse"]) and not mc.interleaves(["comfuse"])
    paired = {"model": "gpt2", "side_by_side": {"inductor": {"forward_ms": [2.5, 2.4, 2.6], "step_ms": [8, 7.9, 8.1]}}}
    assert "| gpt2 | inductor | 2.500 [2.400..2.600] | 8.000 [7.900..8.100] |" in mc.markdown([row, paired])


def test_side_by_side_rounds_rotate_the_order_and_time_every_call():
    """``time_side_by_side``: each call is timed in every round, the order rotating, so a
    call's place in the run does not favour it; each result is (median, min, max)."""
    from comfuse.bench import models
    order = []
    calls = {n: (lambda n=n: order.append(n)) for n in ("a", "b", "c")}
    times = models.time_side_by_side(calls, rounds=3, device="cpu")
    assert set(times) == {"a", "b", "c"} and all(lo <= med <= hi for med, lo, hi in times.values())
    reps = (len(order) - 6) // 9  # (two untimed calls each first)
    firsts = [order[6 + r * 3 * reps] for r in range(3)]
    assert firsts == ["a", "b", "c"]


def test_memory_peak_lists_what_is_alive_at_the_peak():
    """scripts/memory_peak.py replays the allocator's history: the tensors alive when the
    most was allocated, largest first, each named by the comfuse or wrapper line that made it."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "memory_peak.py"
    spec = importlib.util.spec_from_file_location("memory_peak", path)
    mp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp)
    ours = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": "/repo/comfuse/runtime/kernel.py", "line": 170, "name": "scratch"}]
    events = [{"action": "alloc", "addr": 1, "size": 100, "frames": ours},
              {"action": "alloc", "addr": 2, "size": 50, "frames": []},
              {"action": "free_requested", "addr": 1, "size": 100},
              {"action": "alloc", "addr": 3, "size": 20, "frames": ours}]
    alive = mp.live_at_peak({"device_traces": [events]})
    assert [size for size, _ in alive] == [100, 50]
    assert alive[0][1].startswith("kernel.py:170 scratch") and "no Python frame" in alive[1][1]


def test_models_suite_runs_each_model_and_form_in_processes_of_their_own(tmp_path, monkeypatch):
    """``comfuse bench --suite models``: each (model, form) in a process of its own with empty
    caches, checked against eager there before it is timed, then its first calls again in a new
    process with the caches it left (warm: faster than cold); forms that do not apply are listed
    with the reason; the table and the figure are written. (Regions found, none fused: the
    interpreter's kernels would take minutes, and this checks the harness.)"""
    from comfuse.bench import models
    monkeypatch.setenv("COMFUSE_FUEL", "0")
    forms = ["eager", "comfuse", "liger", "inductor@reduce-overhead"]
    results = models.run(["gpt2"], forms, tmp_path, small=True, rounds=1, device="cpu", progress=lambda m: None)
    rows = {r["form"]: r for r in results["rows"]}
    assert list(rows) == forms
    assert rows["eager"]["loss_rel_err"] == 0 and rows["eager"]["step_ms"][0] > 0 and "warm" not in rows["eager"]
    compiled = rows["comfuse"]
    assert "error" not in compiled, compiled
    assert compiled["loss_rel_err"] < 1e-4 and compiled["grads_rel_err"] < 1e-4
    assert max(compiled["loss_step_rel_err"]) < 1e-4 and compiled["loss_step_ms"][0] > 0  # (the loss alone returned)
    assert compiled["loss_forward_ms"][0] > 0
    assert compiled["warm"]["first_step_s"] < compiled["first_step_s"]
    assert rows["liger"]["skipped"] == "Liger-Kernel patches Llama-family models only"
    assert rows["inductor@reduce-overhead"]["skipped"] == "CUDA graphs need a GPU"
    written = models.write(results, tmp_path)
    table = (tmp_path / "results.md").read_text()
    assert "| gpt2 (1 layer) | comfuse |" in table and "n/a: CUDA graphs need a GPU" in table
    assert any(p.name == "models.png" for p in written)
    assert not (tmp_path / "caches").exists() or not any((tmp_path / "caches").iterdir())
    logs = {p.name for p in (tmp_path / "logs").iterdir()}  # (each process's stderr: comfuse's log)
    assert logs == {"gpt2-eager.log", "gpt2-comfuse.log", "gpt2-comfuse-warm.log"}, logs
    # resumed: the rows that ran are kept, nothing runs again; a row past its limit is stopped
    # (its process group killed) and says so, the earlier rows of other forms kept beside it
    said = []
    again = models.run(["gpt2"], ["eager", "comfuse"], tmp_path, small=True, rounds=1, device="cpu",
                       progress=said.append, resume=True)
    assert said == [] and again["rows"] == [rows["eager"], rows["comfuse"]]
    stopped = models.run(["gpt2"], ["comfuse@max-autotune-no-cudagraphs"], tmp_path, small=True, rounds=1,
                         device="cpu", progress=lambda m: None, resume=True, row_limit=0.5)
    assert stopped["rows"][:2] == [rows["eager"], rows["comfuse"]]
    assert stopped["rows"][2]["error"] == "stopped after 0.5 s (the row limit)"
    assert (tmp_path / "logs" / "gpt2-comfuse-max-autotune-no-cudagraphs.log").exists()
    # another GPU's rows are refused
    other = json.loads((tmp_path / "results.json").read_text())
    other["meta"]["gpu"] = "another GPU"
    (tmp_path / "results.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="--resume: .* other gpu"):
        models.run(["gpt2"], ["eager"], tmp_path, small=True, rounds=1, device="cpu", resume=True)
    with pytest.raises(SystemExit, match="unknown models"):
        models.run(["gpt3"], ["eager"], tmp_path, device="cpu")
    with pytest.raises(SystemExit, match="unknown candidates"):
        models.run(["gpt2"], ["comfuse@fast"], tmp_path, device="cpu")


def test_a_failed_models_suite_row_names_what_was_raised():
    """A child's error is the exception's line after its traceback, not the debugging hints
    that follow it (Inductor's CUDA-graph pool check ends with "Data Pointer: ..., history:")."""
    from comfuse.bench.models import error_line
    stderr = ("comfuse: region at mm: fused\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
              "RuntimeError: Detected 1 tensor(s) in the cudagraph pool not tracked as outputs.\nDebugging:\n"
              "- Set a flag\nAllocations:\nData Pointer: 1407, history: \n")
    assert error_line(stderr) == "RuntimeError: Detected 1 tensor(s) in the cudagraph pool not tracked as outputs."
    assert error_line("killed\n") == "killed" and error_line("") == "no output"


def test_the_index_lists_a_models_suite_run(tmp_path):
    """``python -m comfuse.bench.report``: a models-suite folder (rows, not cases) gets its
    section, each row's times or why it has none."""
    from comfuse.bench import report
    row = {"model": "gpt2", "form": "comfuse", "layers": 12, "forward_ms": [6.398, 6.298, 6.649],
           "step_ms": [22.611, 22.468, 22.843], "step_peak_gib": 6.028, "first_step_s": 53.74}
    failed = {"model": "gpt2", "form": "comfuse@reduce-overhead", "layers": 12, "error": "RuntimeError: pool"}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text(json.dumps(
        {"meta": {"suite": "models", "gpu": "NVIDIA H100", "rounds": 5, "date": "2026-12-06"}, "rows": [row, failed]}))
    (tmp_path / "runs" / "second").mkdir(parents=True)  # (a folder of several runs)
    (tmp_path / "runs" / "second" / "results.json").write_text(json.dumps(
        {"meta": {"suite": "models", "gpu": "NVIDIA H200", "rounds": 3, "date": "2026-12-07"}, "rows": [row]}))
    text = report.write_index(tmp_path).read_text()
    assert "| gpt2 (12 layers) | comfuse | 6.398 | 22.611 | 6.028 | 53.74 |" in text
    assert "| gpt2 (12 layers) | comfuse@reduce-overhead | error: RuntimeError: pool |" in text
    assert text.index("(runs/second/results.md)") < text.index("(run/results.md)")  # (newest first)


def test_models_suite_profiles_are_reported_beside_the_times():
    """``--profile``: a row's profiles (GPU ms a call of its forward, step and loss-only step,
    and the step's launches by kind) get a table of their own under the times; a comfuse row's
    regions fused per graph and its whole-graph checks are listed; a profile's file name keeps
    only letters, digits, '-', '.' and '_'."""
    from comfuse.bench import kernels, models
    launches = {"Inductor kernel launch": [120, 14.5], "comfuse::region op": [2, 25.0]}
    row = {"model": "gpt2", "form": "comfuse@reduce-overhead", "layers": 12, "batch": 8, "seq": 1024,
           "forward_ms": [6.4, 6.3, 6.5], "step_ms": [22.6, 22.4, 22.8],
           "profile": {"forward": {"gpu_ms": 6.1, "kernels": 90, "host_us": {}},
                       "step": {"gpu_ms": 21.95, "kernels": 300, "host_us": launches},
                       "loss_step": {"gpu_ms": 21.5, "kernels": 290, "host_us": {}}}}
    table = models.markdown({"meta": {}, "rows": [row, {"model": "gpt2", "form": "inductor", "layers": 12,
                                                         "error": "x"}]})
    assert ("| gpt2 | comfuse@reduce-overhead | 6.100 | 21.950 | 21.500 | Inductor kernel launch 120 x 14.5; "
            "comfuse::region op 2 x 25.0 |") in table
    assert "GPU time a call by the profiler" not in models.markdown({"meta": {}, "rows": [dict(row, profile=None)]})
    fused = dict(row, profile=None, regions=[{"graph": "forward_1", "fused": 1, "found": 13, "schedules": ["ws_split"]}],
                 graph_checks=[{"regions": 1, "training": True, "fused_ms": 6.4, "inductor_ms": 6.8, "fused_step_ms": 22.5,
                                "inductor_step_ms": 21.0, "kept": "inductor"}])
    text = models.markdown({"meta": {}, "rows": [fused]})
    assert "- forward_1: 1 of 13 (ws_split)" in text
    assert "- check (training, 1 region(s)): forward 6.400 vs 6.800; step 22.500 vs 21.000; kept inductor" in text
    assert kernels.file_name("gpt2-comfuse@reduce-overhead-step") == "gpt2-comfuse-mode-reduce-overhead-step"
    assert kernels.file_name("a b/c") == "a-b-c"


def test_models_suite_compares_a_mode_with_inductor_in_the_same_mode():
    """comfuse under reduce-overhead against Inductor's reduce-overhead where both ran; the
    default form against Inductor's default."""
    from comfuse.bench import models

    def row(form, step, loss_step):
        return {"model": "gpt2", "form": form, "layers": 12, "batch": 8, "seq": 1024, "forward_ms": [6.0] * 3,
                "step_ms": [step] * 3, "loss_step_ms": [loss_step] * 3}
    rows = [row("inductor", 24.0, 20.0), row("inductor@reduce-overhead", 22.0, 21.0),
            row("comfuse@reduce-overhead", 20.0, 20.0), row("comfuse", 20.0, 20.0)]
    lines = models.markdown({"meta": {}, "rows": rows}).splitlines()
    ro = next(line for line in lines if "| comfuse@reduce-overhead |" in line)
    default = next(line for line in lines if "| comfuse |" in line)
    assert "| 1.100x |" in ro and "| 1.050x |" in ro  # 22 / 20 and 21 / 20
    assert "| 1.200x |" in default and "| 1.000x |" in default
    # the ratios' table: speeds, then memory and first step as fractions of Inductor's
    rows[1].update(forward_ms=[5.0] * 3, loss_forward_ms=[4.0] * 3, step_peak_gib=2.0, first_step_s=20.0)
    rows[2].update(loss_forward_ms=[5.0] * 3, step_peak_gib=1.0, first_step_s=50.0)
    lines = models.markdown({"meta": {}, "rows": rows}).splitlines()
    assert ("| gpt2 | comfuse@reduce-overhead | inductor@reduce-overhead | 0.833x | 0.800x | 1.100x | 1.050x | "
            "0.500x | 2.500x |") in lines
    assert "| gpt2 | comfuse | inductor | 1.000x | - | 1.200x | 1.000x | - | - |" in lines
    assert not any(line.startswith("| gpt2 | inductor") for line in lines)


def test_the_models_report_says_how_fast_each_rows_process_launched():
    from comfuse.bench.models_report import host_lines
    rows = [{"model": "gpt2", "form": "inductor", "launch_host_us": {"start": 5.1, "timed": 5.3}},
            {"model": "gpt2", "form": "comfuse", "launch_host_us": {"start": 5.2}},
            {"model": "bert", "form": "eager", "skipped": "no GPU"}]
    lines = host_lines(rows)
    assert lines[-2:] == ["| gpt2 | inductor | 5.1 | 5.3 |", "| gpt2 | comfuse | 5.2 | - |"]
    assert host_lines(rows[2:]) == []
