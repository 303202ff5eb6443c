"""A worker process that compiles Triton kernels into Triton's on-disk cache.

Started by ``workers.py`` as ``python -m comfuse.runtime.compile_worker``. It reads requests
from stdin and answers on stdout, each a length-prefixed pickle:

- first, the GPU target of the parent's device (``triton.backends.compiler.GPUTarget``);
- then per request ``(module, path, function, specialization, cache_dir)``: the kernel's
  module name and source file, the JIT function's name in it, the specialization Triton's
  JIT recorded for the compilation it was about to run (``jit_cache_hook``'s
  ``specialization_data``), and the parent's Triton cache directory. The worker compiles
  it with ``JITFunction.preload``, which builds the same source and options, so the result
  lands under the key the parent's JIT looks up; the answer is ``(True, seconds)`` or
  ``(False, why)``.

The worker needs no GPU: a stand-in driver reports the parent's target. It never runs
the parent's ``__main__`` (which a ``multiprocessing`` spawn would import).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import struct
import sys
import time


def send(stream, value) -> None:
    data = pickle.dumps(value)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def receive(stream):
    """The next message, or None at the end of the stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


class TargetDriver:
    """The parts of Triton's driver a compilation reads: device 0 of the parent's target."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def kernel_function(module: str, path: str | None, function: str):
    """The JIT function ``function`` of ``module``, imported from ``path`` where it is a
    generated source file (imported under the parent's module name: Triton's cache key
    reads the function's source and what it calls, not where it was loaded from)."""
    loaded = sys.modules.get(module)
    if loaded is None:
        if path:
            spec = importlib.util.spec_from_file_location(module, path)
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[module] = loaded  # (Triton's JIT reads the source through inspect)
            spec.loader.exec_module(loaded)
        else:
            loaded = importlib.import_module(module)
    return getattr(loaded, function)


def compile_one(request) -> float:
    """Compile one request into Triton's cache; its seconds."""
    from triton import knobs
    module, path, function, specialization, cache_dir = request
    began = time.perf_counter()
    knobs.cache.dir = cache_dir
    kernel_function(module, path, function).preload(specialization)
    return time.perf_counter() - began


def main() -> None:
    channel_in = sys.stdin.buffer
    channel_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # (anything printed goes to stderr; stdout carries the answers only)
    os.environ["TRITON_INTERPRET"] = "0"
    target = receive(channel_in)
    if target is None:
        return
    from triton.runtime.driver import driver
    driver.set_active(TargetDriver(target))
    # what every generated kernel's module imports (torch among them: seconds), loaded before
    # the worker says it is ready rather than at its first request
    import triton.compiler  # noqa: F401

    import comfuse.codegen.triton.helpers  # noqa: F401
    send(channel_out, (True, "ready"))
    while True:
        request = receive(channel_in)
        if request is None:
            return
        try:
            send(channel_out, (True, compile_one(request)))
        except Exception as e:  # the parent compiles it itself and meets the error there
            send(channel_out, (False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"))


if __name__ == "__main__":
    main()
