"""GPU-only checks at real shapes (skipped without CUDA). The rest of the suite also runs on
the GPU when CUDA is present (helpers.DEVICE), so these add only what needs a big GPU."""
import warnings

import pytest
import torch

import comfuse
from comfuse.bench.workloads import SUITE

from helpers import as_tuple, assert_matches_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", list(SUITE))
@pytest.mark.parametrize("shape", [(8192, 1024, 1024), (8191, 1024, 768), (1000, 512, 1000)],
                         ids=["paper", "odd_M_N768", "N1000"])
def test_suite_at_real_shapes(name, shape):
    wl = SUITE[name]
    args = wl.inputs(*shape, dtype=torch.bfloat16, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = comfuse.compile(wl.fn, args)
        out = compiled(*args)
    assert all(r.fused for r in compiled.report.regions), str(compiled.report)
    assert_matches_reference(wl.fn, args, out)


def test_fp32_is_exact_without_tf32():
    assert not torch.backends.cuda.matmul.allow_tf32
    wl = SUITE["ln_postnorm"]
    args = wl.inputs(2048, 512, 1024, dtype=torch.float32, device="cuda")
    compiled = comfuse.compile(wl.fn, args)
    assert_matches_reference(wl.fn, args, compiled(*args), tol=1e-4)


def test_repeated_launches_are_deterministic():
    wl = SUITE["multi_stage"]
    args = wl.inputs(4096, 1024, 1024, dtype=torch.bfloat16, device="cuda")
    compiled = comfuse.compile(wl.fn, args)
    first = as_tuple(compiled(*args))
    for _ in range(5):
        for a, b in zip(first, as_tuple(compiled(*args))):
            assert torch.equal(a, b)
