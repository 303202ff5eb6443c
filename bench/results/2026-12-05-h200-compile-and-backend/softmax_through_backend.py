"""The paper suite's GEMM + softmax (16 x 16 x 100, bf16) through torch.compile(backend="comfuse")
with COMFUSE_STRICT=1: what the backend's pass found and decided, and any failure.
Run from the repository's root on a GPU: python bench/results/2026-12-05-h200-compile-and-backend/softmax_through_backend.py"""
import logging
import traceback
import warnings

import torch

import comfuse  # noqa: F401  (registers the backend)
from comfuse import backend, settings
from comfuse.bench.workloads import SUITE
from comfuse.runtime import tuning

logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
wl = SUITE["softmax"]
args = wl.inputs(16, 16, 100, device="cuda")
seen = []
real = tuning.decide
tuning.decide = lambda *a, **k: seen.append(settings.get().tune_timing) or real(*a, **k)
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as w, settings.override(autotune="1", strict=True), torch.no_grad():
    try:
        torch.compile(wl.fn, backend="comfuse", dynamic=False)(*args)
    except Exception:
        traceback.print_exc()
    for x in w:
        print("WARNING:", str(x.message)[:400])
print("decide calls:", seen)
print(backend.REPORTS[-1] if backend.REPORTS else "no report")
