"""comfuse: fuse a GEMM with the memory-intensive work after it into one kernel.

    fused = comfuse.compile(fn, example_inputs)   # call it like fn
    print(comfuse.explain(fn, example_inputs))    # what was fused, and why not

Layers, each importing only those before it: frontend (capture, region finding) and ir
(Fusion Spec IR, verifier, reference interpreter) -> planner (passes, stages, schedules,
search space) -> codegen (Triton and Gluon source) -> runtime (cache, build, launch,
autotuning, fallback) -> pipeline (every step in order) -> this API and the torch.compile
backend. settings.py and errors.py serve every layer.
"""
from __future__ import annotations

import os
import sys


def _choose_interpreter() -> None:
    # Triton decides at import time whether kernels run on a GPU or through its CPU
    # interpreter. Without a GPU, choose the interpreter so fused kernels run on CPU tensors.
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_choose_interpreter()


from . import settings  # noqa: E402


def _log_handler() -> None:
    # COMFUSE_LOG=info (or debug): progress of long work (autotuning each region: which
    # candidates, their times, the choice) on stderr, each line with the seconds since
    # comfuse was imported. Without it the "comfuse" logger follows the application's
    # logging configuration, as a library's should.
    level = settings.get().log
    if not level:
        return
    import logging
    import time
    imported = time.time()

    class Seconds(logging.Formatter):
        def format(self, record):
            record.seconds = record.created - imported
            return super().format(record)
    logger = logging.getLogger("comfuse")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(Seconds("comfuse %(seconds)6.1fs: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(getattr(logging, level.upper()))


_log_handler()

from .compiled import CompiledFunction, explain  # noqa: E402
from .errors import ComfuseWarning, FallbackWarning  # noqa: E402
from .report import RegionReport, Report  # noqa: E402

__version__ = "0.1.0"

try:  # torch.compile(model, backend="comfuse")
    from .backend import register as _register_backend
    _register_backend()
except Exception as _e:  # pragma: no cover - an old or unusual torch: comfuse.compile still works
    import warnings as _warnings
    _warnings.warn(f"comfuse: the torch.compile backend is not registered: {_e}", ComfuseWarning)


def compile(fn, example_inputs) -> CompiledFunction:  # noqa: A001 - mirrors torch.compile
    """``fn`` through torch.compile with comfuse's backend, captured, built and tuned on
    ``example_inputs`` before it returns: a callable with ``fn``'s signature whose GEMM +
    epilogue regions run as fused kernels; everything else runs as eager PyTorch."""
    return CompiledFunction(fn, example_inputs)


__all__ = ["CompiledFunction", "ComfuseWarning", "FallbackWarning", "RegionReport", "Report", "compile", "explain",
           "settings"]
