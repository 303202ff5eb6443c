"""Shared test set-up.

- comfuse is imported first: on a machine without a GPU it switches Triton to its
  CPU interpreter, which must happen before anything imports triton.
- COMFUSE_CHECK=1: every kernel launch is compared with the IR's float64 reference
  interpreter and raises KernelMismatch beyond tolerance.
- Kernel sources go to a fresh temporary cache directory; each test starts a new
  generation of it (no graph verdict or Inductor-cached graph of an earlier test is reused).
- COMFUSE_AUTOTUNE=0: the planner's choice is tested (autotuning has its own tests).
- Tests marked ``gpu`` are skipped (with the reason) where CUDA is unavailable.
- A fallback (``FallbackWarning``: something comfuse built runs unfused) fails the test
  unless the test expects it (``pytest.warns``); notices are given afresh in every test.
"""
import os
import tempfile
import warnings

os.environ.setdefault("COMFUSE_CHECK", "1")
os.environ.setdefault("COMFUSE_AUTOTUNE", "0")  # the planner's choice; tests/test_tuning.py turns it on
os.environ.setdefault("COMFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="comfuse-test-cache-"))

import comfuse  # noqa: E402,F401  (must precede triton)
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import PROPERTY_COUNTS  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the H200 (see docs/gpu.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    for name, count in sorted(PROPERTY_COUNTS.items()):
        terminalreporter.write_line(f"property test {name}: {count} generated examples ran")


@pytest.fixture(autouse=True)
def fallbacks_fail():
    """A region that silently runs unfused must not pass as fused (the filter lasts the test)."""
    from comfuse.errors import FallbackWarning, forget_notices
    forget_notices()
    warnings.filterwarnings("error", category=FallbackWarning)
    yield


@pytest.fixture(autouse=True)
def graphs_decided_afresh():
    """Each test's graphs are lowered and decided anew: no verdict stored by an earlier test,
    and no graph Inductor cached with comfuse's pass for one, answers for them (the tests of
    that reuse arrange their own)."""
    from comfuse.runtime import cache
    cache.new_generation()
    yield


@pytest.fixture
def fused_regions_win(monkeypatch):
    """Every region's autotuning picks its first fused plan (no timing, nothing stored)."""
    from comfuse.runtime import tuning

    def decide(names, run_fused, run_unfused, device, tol=None, exact=None):
        return {"choice": names[0], "times_ms": {tuning.UNFUSED: 1.0, **{n: 0.5 for n in names}}, "rejected": {}}
    monkeypatch.setattr(tuning, "decide", decide)
    monkeypatch.setattr(tuning, "load", lambda k: None)
    monkeypatch.setattr(tuning, "store", lambda k, d: None)


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def no_prediction(monkeypatch):
    """The cost model (runtime/prediction.py) predicts for no GPU unless a test asks for it
    (tests/test_cost.py): the tests of autotuning's mechanics tune regions, at toy sizes,
    of kinds it would leave untuned on an H200."""
    from comfuse.runtime import prediction
    monkeypatch.setattr(prediction, "RECORDED_GPUS", ())
