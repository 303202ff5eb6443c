"""Candidates' kernels compiled in worker processes, while the candidates' first calls wait.

Autotuning compiles a region's candidates in threads (``tuning.compile_ahead``), but about
40 % of a Triton compilation holds Python's lock (a busy thread beside one kept 0.57-0.61 of
its pace, CPU, 2026-12-05), so threads compiling together wait on one another. Here, while
those first calls run, each compilation Triton's JIT is about to start for a comfuse kernel
is first run by a worker process (``compile_worker.py``) with the same specialization; the
worker writes Triton's on-disk cache and the JIT, resuming, finds the kernel there. A worker
that fails, or a pool that cannot start, only means the JIT compiles as before.

The workers start once per process (``start``, when the backend first tunes on a GPU), are
reused by every region, and stop with the process.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from ..errors import notice_once
from .compile_worker import receive, send

log = logging.getLogger("comfuse.tuning")

MAX_WORKERS = 16
WAIT_S = 600  # a compilation taking longer is left to the JIT
GENERATED = "comfuse_kernels."  # the module names of generated kernels (cache.load_source)
OWN = "comfuse."  # and of the hand-written Gluon template


def worker_command() -> list:
    return [sys.executable, "-m", "comfuse.runtime.compile_worker"]


class Workers:
    """``count`` compile workers for GPU ``target``, each served by a thread of this process
    that hands it requests from one queue."""

    def __init__(self, count: int, target):
        self.target = target
        self.jobs: queue.Queue = queue.Queue()
        self.broken = ""  # why the workers stopped, once they have
        self.started = 0  # workers that have started (imports done)
        self._count_lock = threading.Lock()
        self.threads = [threading.Thread(target=self._serve, name=f"comfuse-worker-{i}", daemon=True)
                        for i in range(count)]
        for thread in self.threads:
            thread.start()

    @property
    def ready(self) -> bool:
        """Whether every worker has started (a Python with torch and Triton: ~10 s on the
        H200's host, longer than a region's candidates take in threads)."""
        return self.started == len(self.threads) and not self.broken

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every worker to start; whether they have."""
        end = time.monotonic() + timeout
        while not self.ready and not self.broken and time.monotonic() < end:
            time.sleep(0.05)
        return self.ready

    def submit(self, request) -> Future:
        future: Future = Future()
        if self.broken:
            future.set_exception(RuntimeError(self.broken))
        else:
            self.jobs.put((future, request))
        return future

    def stop(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)

    def _serve(self) -> None:
        env = dict(os.environ, TRITON_INTERPRET="0",
                   PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        try:
            proc = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, env=env)
            send(proc.stdin, self.target)
            if receive(proc.stdout) != (True, "ready"):
                raise RuntimeError("a compile worker did not start")
            with self._count_lock:
                self.started += 1
        except Exception as e:
            self._fail(f"{type(e).__name__}: {e}")
            return
        try:
            while True:
                job = self.jobs.get()
                if job is None:
                    break
                future, request = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    send(proc.stdin, request)
                    answer = receive(proc.stdout)
                except Exception as e:
                    answer = None
                    future.set_exception(e)
                if answer is None:
                    if not future.done():
                        future.set_exception(RuntimeError("a compile worker stopped"))
                    self._fail("a compile worker stopped")
                    break
                ok, value = answer
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(RuntimeError(value))
        finally:
            with contextlib.suppress(Exception):
                proc.stdin.close()
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)

    def _fail(self, why: str) -> None:
        """Stop handing out work: every queued and later request fails at once (the JIT then
        compiles it in this process)."""
        self.broken = self.broken or why
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and job[0].set_running_or_notify_cancel():
                job[0].set_exception(RuntimeError(self.broken))


_pool: list = []  # [Workers], once started
_lock = threading.Lock()
_parse_lock = threading.Lock()


def start(target, count: int | None = None) -> Workers:
    """The process's compile workers for ``target`` (started at the first call)."""
    with _lock:
        if not _pool or _pool[0].target != target or _pool[0].broken:
            if _pool:
                _pool.pop().stop()
            _pool.append(Workers(count or min(MAX_WORKERS, os.cpu_count() or 1), target))
        return _pool[0]


def request_of(jit_function, specialization: str):
    """What a worker needs to compile ``jit_function`` as the JIT is about to, or None for a
    kernel that is not comfuse's (left to the JIT)."""
    from triton import knobs
    fn = getattr(jit_function, "fn", None)
    module = getattr(fn, "__module__", "") or ""
    if not (module.startswith(GENERATED) or module.startswith(OWN)):
        return None
    path = fn.__code__.co_filename if module.startswith(GENERATED) else None
    return module, path, fn.__name__, specialization, knobs.cache.dir


@contextlib.contextmanager
def compiling_in(pool: Workers):
    """While in force, a compilation Triton's JIT starts for a comfuse kernel (in any thread)
    is run by ``pool`` first, the JIT waiting for it and then finding it in Triton's cache;
    until every worker has started, the JIT compiles as before (on the H200's host a region's
    8 candidates took 3.3 s in threads, 12.7 s when they waited for the workers to start, and
    1.8 s in started workers against 2.7 s in threads for a later region)."""
    from triton import knobs
    before = knobs.runtime.jit_cache_hook

    def hook(**kw):
        jit_function = kw["fn"].jit_function
        request = request_of(jit_function, kw["compile"]["specialization_data"])
        if request is not None and pool.ready:
            # the JIT's cache key parses the kernel's source once; Python 3.11's parser is not
            # safe in two threads at once ("AST constructor recursion depth mismatch")
            with _parse_lock:
                jit_function.cache_key  # noqa: B018
            try:
                pool.submit(request).result(timeout=WAIT_S)
            except Exception as e:  # the JIT compiles it here and reports what is wrong
                log.debug("autotuning: a compile worker did not compile %s (%s)", request[2], e)
                if pool.broken:
                    notice_once("compile-workers", f"comfuse: compile workers stopped ({pool.broken}); "
                                "candidates compile in this process")
        return before(**kw) if before else None
    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = before
