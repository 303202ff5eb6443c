"""A later process: what the backend kept for a graph is stored (verdicts.py), and Inductor's
own disk caches answer for the graphs compiled with comfuse's pass, also those that call the
``comfuse::region`` operator, whose regions comfuse's cache stores under their ids."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import comfuse
from comfuse import settings

from helpers import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore::comfuse.ComfuseWarning", "ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[1]

# a training step of a small block through the backend in a process of its own; prints one JSON
# line: the loss and the gradients against eager's, how many graphs the pass was handed, and
# Inductor's cache counters
STEP = textwrap.dedent("""
    import json, sys
    import torch
    import comfuse
    from comfuse import backend
    from torch._dynamo.utils import counters

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
            self.ln = torch.nn.LayerNorm(32)

        def forward(self, x):
            return self.ln(self.down(torch.relu(self.up(x))) + x)

    if "--inductor-wins" in sys.argv:  # the whole-graph check times Inductor's graph faster
        from comfuse import graph_check
        def prefer_inductor(calls, device):
            for call in calls.values():
                call()
            return {name: 1.0 if name.startswith("inductor") else 2.0 for name in calls}
        graph_check._time_graphs = prefer_inductor

    if "--entry-whatever-the-key" in sys.argv:  # as torch 2.11: an AOTAutograd entry is made whatever the key
        from torch._functorch._aot_autograd import graph_compile
        graph_compile._should_save_cache = lambda *compiled: True

    if "--through-the-operator" in sys.argv:  # no region launched by Inductor's wrapper
        import comfuse.inductor_pass
        comfuse.inductor_pass.LAUNCH_FROM_INDUCTOR = False

    passes = []
    real = backend.RegionPass.__call__
    def handed(self, graph):
        passes.append(1)
        return real(self, graph)
    backend.RegionPass.__call__ = handed

    torch.manual_seed(0)
    device = sys.argv[2]
    model = Block().to(device)
    x = torch.randn(4, 8, 32, device=device)
    options = json.loads(sys.argv[1])
    out = torch.compile(model, backend="comfuse", options=options)(x)
    out.square().sum().backward()
    got = torch.cat([out.detach().flatten()] + [p.grad.flatten() for p in model.parameters()])
    for p in model.parameters():
        p.grad = None
    ref = model(x)
    ref.square().sum().backward()
    want = torch.cat([ref.detach().flatten()] + [p.grad.flatten() for p in model.parameters()])
    launches = [r.launch for report in backend.REPORTS for r in report.regions if r.fused]
    from comfuse import region_op
    print(json.dumps({"err": ((got - want).norm() / want.norm()).item(), "handed": len(passes), "launches": launches,
                      "regions": len(region_op.REGISTRY),
                      "fx": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}}))
""")


def run_step(tmp_path, options: dict, device: str = "cpu", *flags, **env_vars) -> dict:
    env = dict(os.environ, COMFUSE_CACHE_DIR=str(tmp_path / "comfuse"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PYTHONPATH=str(ROOT), **env_vars)
    script = tmp_path / "step.py"
    script.write_text(STEP)
    done = subprocess.run([sys.executable, str(script), json.dumps(options), device, *flags], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_later_process_takes_the_graphs_from_inductors_cache_where_they_call_no_region(tmp_path):
    """Regions found and none fused (fuel 0): the graphs are Inductor's code, stored by
    Inductor's FX graph cache under the pass's key; a second process is handed no graph to
    lower and trains the same."""
    first = run_step(tmp_path, {"fuel": 0})
    assert first["handed"] == 2 and first["fx"].get("fxgraph_cache_miss") == 2 and first["err"] < 1e-5
    second = run_step(tmp_path, {"fuel": 0})
    assert second["handed"] == 0 and second["err"] < 1e-5
    verdicts = list((tmp_path / "comfuse" / "verdicts").glob("*.json"))
    assert [json.loads(v.read_text())["kept"] for v in verdicts] == ["unfused"]


@pytest.mark.skipif(DEVICE != "cpu", reason="regions of CPU tensors fuse only where Triton's interpreter is on, "
                    "which it is not on a GPU machine; the GPU's own case is the gpu test below")
@pytest.mark.parametrize("entries", ["keyed", "whatever-the-key"])
def test_a_graph_that_calls_a_region_comes_from_inductors_cache_in_a_later_process(tmp_path, entries):
    """On the CPU a fused region runs through the ``comfuse::region`` operator, whose id names
    a region this process registered and stored in comfuse's cache: Inductor stores the graph,
    and a second process is handed no graph to lower, loads the regions the cached graphs call
    from comfuse's cache, and trains the same. Also where AOTAutograd makes a cache entry
    whether or not the compiled graphs have a key, and asserts that they do (torch 2.11)."""
    flags = ["--entry-whatever-the-key"] if entries == "whatever-the-key" else []
    first = run_step(tmp_path, {}, "cpu", *flags)
    assert first["handed"] == 2 and first["err"] < 1e-5 and first["launches"]
    stored = list((tmp_path / "comfuse" / "regions").glob("*.pt"))
    assert len(stored) == first["regions"] > 0
    second = run_step(tmp_path, {}, "cpu", *flags)
    assert second["handed"] == 0 and second["err"] < 1e-5
    assert second["fx"].get("fxgraph_cache_hit") and second["regions"] > 0


@pytest.mark.skipif(DEVICE != "cpu", reason="regions of CPU tensors fuse only where Triton's interpreter is on, "
                    "which it is not on a GPU machine; the GPU's own case is the gpu test below")
def test_a_cached_graph_whose_region_cannot_be_loaded_is_compiled_again(tmp_path):
    """A stored region damaged (or gone) after Inductor cached the graph that calls it: the
    later process's lookup is a miss, the graph is lowered again, the region stored anew, and
    the step trains the same; the process after that takes the graphs from the cache again."""
    first = run_step(tmp_path, {}, "cpu")
    assert first["handed"] == 2 and first["launches"]
    for path in (tmp_path / "comfuse" / "regions").glob("*.pt"):
        path.write_bytes(b"not a region")
    second = run_step(tmp_path, {}, "cpu")
    assert second["handed"] >= 1 and second["err"] < 1e-5
    assert second["fx"].get("fxgraph_cache_miss")
    third = run_step(tmp_path, {}, "cpu")
    assert third["handed"] == 0 and third["err"] < 1e-5


@pytest.mark.skipif(DEVICE != "cpu", reason="regions of CPU tensors fuse only where Triton's interpreter is on, "
                    "which it is not on a GPU machine; the GPU's own case is the gpu test below")
def test_a_graph_whose_check_kept_inductors_code_is_inductors_cached_graph_later(tmp_path):
    """The whole-graph check kept Inductor's compilation without regions: a second process
    builds that compilation alone, and Inductor's cache answers for it (the check compiled it
    the same way), the forward's and the backward's. (The fused graph lost its forward's
    timing, so its backward was never lowered: the pass saw the forward alone.)"""
    options = {"graph_check": "1"}
    first = run_step(tmp_path, options, "cpu", "--inductor-wins")
    assert first["handed"] == 1 and first["err"] < 1e-5
    second = run_step(tmp_path, options, "cpu", "--inductor-wins")
    assert second["handed"] == 0 and second["fx"] == {"fxgraph_cache_hit": 2} and second["err"] < 1e-5


@pytest.mark.gpu
def test_a_later_process_takes_graphs_whose_kernels_inductor_launches_from_its_cache(tmp_path):
    """On a GPU a region's one-launch Triton kernel becomes Inductor's own kernel node, whose
    source Inductor copies into the graph's code: such graphs are stored, and a second process
    is handed no graph to lower and trains the same (autotuning off: the planner's plans run
    fused, each checked at its first launch; no COMFUSE_CHECK, which keeps regions in Python)."""
    options = {"autotune": "0", "graph_check": "0"}
    first = run_step(tmp_path, options, "cuda", COMFUSE_CHECK="0")
    assert first["handed"] == 2 and first["err"] < 1e-4
    assert first["launches"] and all(how.startswith("Inductor's wrapper") for how in first["launches"])
    second = run_step(tmp_path, options, "cuda", COMFUSE_CHECK="0")
    assert second["handed"] == 0 and second["err"] < 1e-4


@pytest.mark.gpu
def test_a_later_process_takes_graphs_whose_regions_run_through_the_operator_from_its_cache(tmp_path):
    """On a GPU, regions run through the ``comfuse::region`` operator (as the Gluon kernels
    do): the graphs are stored, and a second process is handed no graph to lower, loads the
    regions from comfuse's cache and trains the same."""
    options = {"autotune": "0", "graph_check": "0"}
    first = run_step(tmp_path, options, "cuda", "--through-the-operator", COMFUSE_CHECK="0")
    assert first["handed"] == 2 and first["err"] < 1e-4
    assert first["launches"] and all(how.startswith("through the comfuse::region") for how in first["launches"])
    second = run_step(tmp_path, options, "cuda", "--through-the-operator", COMFUSE_CHECK="0")
    assert second["handed"] == 0 and second["err"] < 1e-4 and second["regions"] > 0


class PostNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.ln = torch.nn.Linear(32, 48), torch.nn.LayerNorm(48)

    def forward(self, x, r):
        return self.ln(self.lin(x) + r)


def test_a_graph_whose_fused_form_lost_runs_inductors_compilation_at_once_later(monkeypatch, fused_regions_win):
    """The whole-graph check kept Inductor's compilation: the verdict is stored, and the same
    graph compiled again (a later process, here after Dynamo's reset) builds Inductor's
    compilation alone: nothing lowered, nothing timed."""
    import comfuse.inductor_pass as pass_mod
    from comfuse import graph_check
    monkeypatch.setattr(graph_check, "_time_graphs", lambda calls, device: {"fused": 2.0, "inductor": 1.0})
    lowered = []
    real = pass_mod.lower
    monkeypatch.setattr(pass_mod, "lower", lambda *a, **k: lowered.append(1) or real(*a, **k))
    model = PostNorm().to(DEVICE)
    x, r = torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE)
    options = {"autotune": "1", "graph_check": "1"}
    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(model, backend="comfuse", dynamic=False, options=options)(x, r)
        assert lowered == [1]
        (stored,) = (settings.get().cache_dir / "verdicts").glob("*.json")
        assert json.loads(stored.read_text())["kept"] == "inductor"
        monkeypatch.setattr(graph_check, "_time_graphs", lambda calls, device: pytest.fail("timed"))
        torch._dynamo.reset()
        out = torch.compile(model, backend="comfuse", dynamic=False, options=options)(x, r)
    assert lowered == [1]
    torch.testing.assert_close(out, model(x, r), rtol=1e-4, atol=1e-5)


def test_a_damaged_verdict_is_decided_again(monkeypatch):
    """A verdict that does not parse is not trusted: the graph is lowered as if none were
    stored, and the verdict is written anew. (Inductor's FX graph cache off: it would give
    the graph back without the pass.)"""
    import comfuse.inductor_pass as pass_mod
    lowered = []
    real = pass_mod.lower
    monkeypatch.setattr(pass_mod, "lower", lambda *a, **k: lowered.append(1) or real(*a, **k))
    model = PostNorm().to(DEVICE)
    x, r = torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE)
    # (config.patch, not monkeypatch: undoing a monkeypatch deletes the config entry)
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        torch.compile(model, backend="comfuse", dynamic=False)(x, r)
        (stored,) = (settings.get().cache_dir / "verdicts").glob("*.json")
        stored.write_bytes(b"\xff{not json")
        torch._dynamo.reset()
        out = torch.compile(model, backend="comfuse", dynamic=False)(x, r)
    assert len(lowered) == 2 and json.loads(stored.read_text())["kept"] in ("fused", "unfused")
    torch.testing.assert_close(out, model(x, r), rtol=1e-4, atol=1e-5)


def test_the_pass_names_what_inductor_caches_by():
    """The pass's key for Inductor's caches changes with the settings, the kinds and the
    cache's generation (a cleared cache builds its graphs anew); a pass whose reports are read
    asks for no caching."""
    from comfuse.inductor_pass import RegionPass
    from comfuse.runtime import cache
    base = RegionPass().uuid()
    assert base and base == RegionPass().uuid()
    assert RegionPass(kinds={"b2b"}).uuid() != base
    assert RegionPass(settings={"fuel": 1}).uuid() != base
    assert RegionPass(cacheable=False).uuid() is None
    cache.new_generation()
    assert RegionPass().uuid() != base


def test_the_region_calls_a_graphs_code_makes_are_read_or_refused():
    """The ids a compiled graph's code calls, read from Inductor's Python wrapper; where the
    operator is named in a way they do not account for (a C++ wrapper), none is trusted, and
    the graph is neither stored nor taken from the cache."""
    from comfuse.inductor_pass import called_regions
    python = ("buf0 = torch.ops.comfuse.region.default(51205777183241373, [arg0_1, arg1_1], [])\n"
              "assert_size_stride(buf1, (64, 48), (48, 1), 'torch.ops.comfuse.region.default')\n"
              "# buffer buf1 (op: torch.ops.comfuse.region.default) is assumed to be not aligned\n")
    assert called_regions(python) == [51205777183241373]
    assert called_regions("buf0 = triton_poi_fused_0.run(arg0_1)\n") == []
    assert called_regions(python + 'aoti_torch_call_dispatcher("comfuse::region", "", args)\n') is None
    direct = ("from comfuse.region_op import call as comfuse_region\n"
              "        buf0 = comfuse_region(586065165221144773, [arg0_1, arg1_1], [])\n"
              "        buf2 = comfuse_region(12, [buf1], [64])\n"
              "        assert_size_stride(buf3, (64, 64), (64, 1), 'torch.ops.comfuse.region.default')\n")
    assert called_regions(direct) == [586065165221144773, 12]
    assert called_regions(direct + "        buf4 = comfuse_region(*args)\n") is None


def test_inductors_code_calls_a_region_without_the_dispatcher(tmp_path, monkeypatch):
    """Inductor's generated Python calls a fused region as a plain function (region_op.call)
    rather than through ``torch.ops.comfuse.region``: the same result, the region run once
    per call that way, and no operator call in the graph's code. (On a GPU the region is kept
    from Inductor's own launch, as a Gluon kernel is.)"""
    from torch._inductor.codecache import PyCodeCache
    from comfuse import inductor_pass, region_op
    monkeypatch.setattr(inductor_pass, "LAUNCH_FROM_INDUCTOR", False)
    m = nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48)).to(DEVICE)
    x = torch.randn(16, 32, device=DEVICE)
    before = set(map(id, PyCodeCache.modules))
    torch._dynamo.reset()
    with torch.no_grad(), comfuse.settings.override(cache_dir=tmp_path, autotune="0", graph_check="0"):
        compiled = torch.compile(m, backend="comfuse")
        compiled(x)
        runs = []
        run = region_op._run
        monkeypatch.setattr(region_op, "_run", lambda *a: runs.append(a[0]) or run(*a))
        out = compiled(x)
        torch.testing.assert_close(out, m(x), rtol=1e-4, atol=1e-5)
    assert len(runs) == 1 and runs[0] in region_op.REGISTRY
    sources = [open(mod.__file__).read() for mod in list(PyCodeCache.modules) if id(mod) not in before]
    assert any(f"comfuse_region({runs[0]}, " in src for src in sources)
    assert not any("torch.ops.comfuse.region.default(" in src for src in sources)

def test_the_backends_options_hold_at_a_regions_later_calls(tmp_path, monkeypatch):
    """The backend's options are the settings of the compilation and of its regions' calls:
    a region compiled with autotuning off reads it off at a later call made outside any
    override (where the process's own settings would autotune it at that call on a GPU), and
    its decisions go to the cache the compilation used."""
    from comfuse import inductor_pass
    from comfuse.runtime import tuning
    monkeypatch.setattr(inductor_pass, "LAUNCH_FROM_INDUCTOR", False)
    monkeypatch.delenv("COMFUSE_AUTOTUNE", raising=False)
    m = nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48)).to(DEVICE)
    x = torch.randn(16, 32, device=DEVICE)
    seen = []
    enabled = tuning.enabled
    monkeypatch.setattr(tuning, "enabled", lambda device, s=None: seen.append(
        ((s or comfuse.settings.get()).autotune, comfuse.settings.get().cache_dir)) or enabled(device, s))
    torch._dynamo.reset()
    with torch.no_grad():
        with comfuse.settings.override(cache_dir=tmp_path):
            compiled = torch.compile(m, backend="comfuse", options={"autotune": "0", "graph_check": "0"})
            compiled(x)
        seen.clear()
        out = compiled(x)
    torch.testing.assert_close(out, m(x), rtol=1e-4, atol=1e-5)
    assert seen and set(seen) == {("0", tmp_path)}, seen
