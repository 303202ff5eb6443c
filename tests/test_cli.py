"""The comfuse command: demo, explain FILE.py:FUNC, cache."""
import re
import textwrap

import pytest

from comfuse.cli import main

from helpers import DEVICE


def test_demo_runs_checks_and_ends_with_a_verdict(capsys):
    code = main(["demo", "--device", DEVICE, "--only", "softmax,multi_stage,linear_ce"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "== multi_stage" in out and re.search(r"plan: (row_in_cta|cooperative)", out)
    assert out.strip().splitlines()[-1].startswith("verdict: PASS: 3/3 workloads match")


def test_demo_rejects_unknown_workloads(capsys):
    assert main(["demo", "--device", DEVICE, "--only", "nope"]) == 2
    assert "unknown workloads" in capsys.readouterr().out


def test_explain_file_function(tmp_path, capsys):
    src = tmp_path / "model.py"
    src.write_text(textwrap.dedent(f"""
        import torch
        def block(x, w, b):
            return torch.softmax(x @ w + b, -1)
        def block_inputs():
            return [torch.randn(*s, device="{DEVICE}") for s in [(8, 16), (16, 24), (24,)]]
        def other(x, w):
            return torch.relu(x @ w)
        example_inputs = {{"other": (torch.randn(4, 8, device="{DEVICE}"), torch.randn(8, 8, device="{DEVICE}"))}}
    """))
    assert main(["explain", f"{src}:block", "--forms", "--source"]) == 0
    out = capsys.readouterr().out
    assert "1 fused" in out and "schedule row_in_cta" in out
    assert "form 'simplified'" in out and "@triton.jit" in out
    assert main(["explain", f"{src}:other"]) == 0
    assert "schedule tile" in capsys.readouterr().out


def test_explain_compiles_for_the_h200(tmp_path, capfd):
    src = tmp_path / "model.py"
    src.write_text("import torch\n"
                   "def f(x, w):\n    return torch.softmax(x @ w, -1)\n"
                   "example_inputs = (torch.randn(64, 64, dtype=torch.bfloat16), "
                   "torch.randn(64, 128, dtype=torch.bfloat16))\n")
    assert main(["explain", f"{src}:f", "--sm90"]) == 0
    out = capfd.readouterr().out
    assert "compiled for sm_90" in out and re.search(r"wgmma [1-9]", out) and "shared memory" in out
    assert "registers/thread" in out and "bytes/thread of spills" in out


def test_explain_compiles_a_b2b_chain_for_the_h200(tmp_path, capfd):
    """A chain on CPU tensors is not run, but --sm90 still plans it for the H200 and compiles
    its one kernel."""
    src = tmp_path / "mlp.py"
    src.write_text("import torch\n"
                   "def f(x, w1, w2):\n    return torch.relu(x @ w1) @ w2\n"
                   "bf = torch.bfloat16\n"
                   "example_inputs = (torch.randn(256, 64, dtype=bf), torch.randn(64, 128, dtype=bf), "
                   "torch.randn(128, 64, dtype=bf))\n")
    assert main(["explain", f"{src}:f", "--sm90"]) == 0
    out = capfd.readouterr().out
    assert re.search(r"region 0 compiled for sm_90 \(b2b: 2 GEMMs", out), out[-2000:]


def test_explain_errors_are_clear(tmp_path):
    src = tmp_path / "bare.py"
    src.write_text("def f(x):\n    return x\n")
    with pytest.raises(SystemExit, match="must define f_inputs or example_inputs"):
        main(["explain", f"{src}:f"])
    with pytest.raises(SystemExit, match="defines no 'g'"):
        main(["explain", f"{src}:g"])
    with pytest.raises(SystemExit, match="expected FILE.py:FUNC"):
        main(["explain", str(src)])
    broken = tmp_path / "broken.py"
    broken.write_text("def f(x):\n    return x +\n")
    with pytest.raises(SystemExit, match=r"broken.py:2: invalid syntax"):
        main(["explain", f"{broken}:f"])
    failing = tmp_path / "failing.py"
    failing.write_text("raise ValueError('no data here')\n")
    with pytest.raises(SystemExit, match="running .*failing.py failed: ValueError: no data here"):
        main(["explain", f"{failing}:f"])
    bare = tmp_path / "tensor.py"
    bare.write_text("import torch\ndef f(x):\n    return x\nf_inputs = torch.ones(8, 4)\n")
    with pytest.raises(SystemExit, match="f_inputs must be a tuple or list of arguments, got Tensor"):
        main(["explain", f"{bare}:f"])


def test_cache_info_and_clear(capsys, tmp_path):
    from comfuse import settings
    from comfuse.runtime import cache
    with settings.override(cache_dir=tmp_path):
        for sub, name in (("kernels", "k.py"), ("tuning", "d.json"), ("measured", "m.json"), ("verdicts", "v.json"),
                          ("regions", "r.pt")):
            (tmp_path / sub).mkdir()
            (tmp_path / sub / name).write_text("{}")
        token = cache.generation()
        assert main(["cache", "info"]) == 0
        assert "1 kernel sources, 1 autotuning decisions, 1 records of measured plans, 1 graph verdicts, " \
            "1 fused regions of Inductor's cached graphs" in capsys.readouterr().out
        assert main(["cache", "clear"]) == 0
        assert "removed 5 files" in capsys.readouterr().out
        assert cache.generation() != token  # (Inductor's graphs built with the pass are not reused)
        assert main(["cache", "info"]) == 0
        assert "0 kernel sources, 0 autotuning decisions, 0 records of measured plans, 0 graph verdicts, " \
            "0 fused regions of Inductor's cached graphs" in capsys.readouterr().out
