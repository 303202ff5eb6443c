"""Compiling candidates ahead of their timing: in worker processes that fill Triton's cache,
and, for a cooperative strip, once rather than twice. These compile for sm_90 on the CPU
(Triton out of interpreter mode, in a process of its own); the GPU run times them."""
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import torch

from comfuse.frontend.capture import capture
from comfuse.frontend.regions import find_regions
from comfuse.planner import plan
from comfuse.runtime.build import build

ROOT = Path(__file__).resolve().parents[1]

# launch-like arguments of a plan's kernel on contiguous tensors (dtypes stand for tensors, as
# Triton's warm-up takes them), and a stand-in driver for an sm_90 GPU
PRELUDE = textwrap.dedent("""
    import json, threading, time, torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.driver import driver
    from comfuse.frontend.capture import capture
    from comfuse.frontend.regions import find_regions
    from comfuse.planner import plan
    from comfuse.runtime import aot, workers
    from comfuse.runtime.compile_worker import TargetDriver

    TARGET = GPUTarget("cuda", 90, 32)
    driver.set_active(TargetDriver(TARGET))
    compiled_here = []
    add_stages = CUDABackend.add_stages
    def counting(self, stages, options, language):  # (called only when a compile is not a cache hit)
        compiled_here.append(1)
        return add_stages(self, stages, options, language)
    CUDABackend.add_stages = counting

    bf = torch.bfloat16
    def plans(n):
        gelu = lambda x, w, b: torch.nn.functional.gelu(x @ w + b)
        args = (torch.randn(256, 128, dtype=bf), torch.randn(128, 256, dtype=bf), torch.randn(256, dtype=bf))
        (cand,) = find_regions(capture(gelu, args))
        base = plan(cand.region, target="cuda")
        import dataclasses
        shapes = [(64, 128, 64, 4), (128, 128, 64, 8), (128, 64, 64, 4), (64, 64, 64, 4)][:n]
        return [dataclasses.replace(base, block_m=m, block_n=nn, block_k=k, num_warps=w) for m, nn, k, w in shapes]

    def warm_in_threads(jobs):
        errors = []
        def one(job):
            fn, args, options = job
            try:
                fn.warmup(*args, grid=(1,), **options)
            except Exception as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=one, args=(job,)) for job in jobs]
        for t in threads: t.start()
        for t in threads: t.join()
        return errors
""")


def run_script(body: str, tmp_path) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "COMFUSE_CACHE_DIR": str(tmp_path / "comfuse")}
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_workers_compile_what_the_jit_then_finds_in_its_cache(tmp_path):
    """Once the workers have started, candidates' first compilations started in threads run in
    them: the JIT then compiles none of them itself (each a hit in Triton's cache) and returns
    the kernels; a kernel that is not comfuse's is left to the JIT."""
    result = run_script("""
        jobs = [aot.warmup_arguments(p) for p in plans(3)]
        pool = workers.Workers(2, TARGET)
        assert pool.wait(120), pool.broken
        with workers.compiling_in(pool):
            errors = warm_in_threads(jobs)
        kernels = [fn.warmup(*args, grid=(1,), **options) for fn, args, options in jobs]
        pool.stop()
        print(json.dumps({"errors": errors, "compiled_here": len(compiled_here),
                          "kernels": sum(k is not None and bool(k.asm.get("cubin")) for k in kernels),
                          "other": workers.request_of(type("J", (), {"fn": torch.nn.functional.gelu})(), "{}") is None}))
    """, tmp_path)
    assert result == {"errors": [], "compiled_here": 0, "kernels": 3, "other": True}


def test_without_working_workers_the_jit_compiles_as_before(tmp_path):
    """Until the workers have started, or where they cannot (here: each exits at once), the
    JIT compiles the kernels in this process, correctly."""
    result = run_script("""
        import sys
        workers.worker_command = lambda: [sys.executable, "-c", "pass"]
        jobs = [aot.warmup_arguments(p) for p in plans(2)]
        pool = workers.Workers(2, TARGET)
        with workers.compiling_in(pool):  # (one after another: Python 3.11's parser races in threads)
            kernels = [fn.warmup(*args, grid=(1,), **options) for fn, args, options in jobs]
        print(json.dumps({"kernels": sum(bool(k.asm.get("cubin")) for k in kernels),
                          "compiled_here": len(compiled_here), "broken": bool(pool.broken)}))
    """, tmp_path)
    assert result == {"kernels": 2, "compiled_here": 2, "broken": True}


def test_a_cooperative_grid_is_sized_by_the_compilation_its_launch_runs(monkeypatch):
    """Sizing a cooperative grid compiles the kernel to read its registers and shared memory.
    It used to pass one slot, an integer Triton specialises as the constant 1, where the
    launch passes many: every cooperative candidate compiled twice. The warm-up now passes
    the strip count, specialised as the launch's slot count is."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    def rms(x, w, g):
        y = x @ w
        return y * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(y.dtype) * g
    args = (torch.randn(512, 64), torch.randn(64, 512), torch.randn(512))
    (cand,) = find_regions(capture(rms, args))
    p = plan(cand.region, target="cuda")
    assert p.schedule == "cooperative"
    kernel = build(p)
    warmed = []

    def warmup(*args, grid, **options):
        warmed.append(args)
        return types.SimpleNamespace(n_regs=128, metadata=types.SimpleNamespace(shared=64 * 1024))
    monkeypatch.setattr(kernel, "fn", types.SimpleNamespace(warmup=warmup))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(
        multi_processor_count=132, shared_memory_per_multiprocessor=228 * 1024))
    x, w = args[0][None], args[1][None]
    out = torch.empty(1, 512, 512)
    g = args[2].view(1, 1, 512)
    strips = 512 // p.block_m
    slots = kernel.resident_slots(torch.device("cpu"), x, w, [g], [out], {}, strips)
    groups = min(strips, slots)
    slot_param = [i for i, q in enumerate(kernel.source.params) if q.role == "groups"]
    assert slot_param and groups > 1
    (warm,) = warmed
    kind = lambda v: native_specialize_impl(BaseBackend, v, False, True, True)  # noqa: E731
    assert kind(warm[slot_param[0]]) == kind(groups)


def test_compile_workers_are_as_many_as_inductors_own(monkeypatch):
    """The workers follow Inductor's own compile parallelism (TORCHINDUCTOR_COMPILE_THREADS,
    at most 16): a user who limits Inductor's workers, or turns them off with 1, limits or
    turns off comfuse's too."""
    import contextlib

    import torch._inductor.config as inductor_config
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from comfuse.runtime import tuning, workers
    from comfuse.runtime.compile_worker import TargetDriver
    before = inductor_config.compile_threads
    started = []
    monkeypatch.setattr(workers, "start", lambda target, count: started.append((target, count)) or "pool")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(driver, "_active", TargetDriver(GPUTarget("cuda", 90, 32)))
    for threads, expected in ((1, None), (4, 4), (64, 16)):
        with inductor_config.patch(compile_threads=threads):  # (Inductor's own way: restored after)
            assert tuning.start_workers(torch.device("cuda")) == (expected and "pool")
    assert [count for _, count in started] == [4, 16]
    assert inductor_config.compile_threads == before
