"""Where kernels can run, and launching them cheaply.

On CUDA tensors a kernel runs through Triton's JIT. On CPU tensors it runs through Triton's
interpreter, which must be chosen before Triton is imported (``comfuse`` does that on machines
without a GPU). ``launch_direct`` launches a compiled kernel without the JIT's per-call work
once a layout of the tensors has been seen: for kernels of tens of microseconds, Python's time
per call matters.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton

from ..errors import UnsupportedLayout


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter in this process."""
    return bool(triton.knobs.runtime.interpret)


@functools.cache
def _cuda_available() -> bool:  # (asked on every fused call; it does not change in a process)
    return torch.cuda.is_available()


def can_run_on(device: torch.device) -> str:
    """'' when a kernel can run on ``device``, else the reason it cannot."""
    if device.type == "cuda":
        return "" if _cuda_available() else "CUDA is not available"
    if device.type == "cpu":
        if interpreting():
            return ""
        return ("CPU tensors need Triton's interpreter, which is off in this process; set "
                "TRITON_INTERPRET=1 before importing comfuse (or triton) to run fused kernels "
                "on the CPU")
    return f"no kernels for {device.type} tensors"


def target_of(device: torch.device) -> str:
    """The planner's target for tensors on ``device``: "cuda" or "interpreter"."""
    return "cuda" if device.type == "cuda" and not interpreting() else "interpreter"


@functools.cache
def sm_count(device: torch.device | None = None) -> int:
    """Multiprocessors of ``device`` (132 on an H200; 132 for CPU tensors, the planner's default)."""
    if device is None or device.type != "cuda" or not _cuda_available():
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def layout_key(tensors) -> tuple:
    """What a direct launch depends on besides the data: each tensor's shape, strides, dtype,
    device and 16-byte alignment (Triton specialises on alignment too)."""
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors)


def launch_direct(fn, grid, args: list, options: dict, fresh: set):
    """Launch ``fn[grid](*args, **options)`` through Triton's JIT once; return (run,
    statics): ``run(*full)`` launches the compiled kernel directly, ``statics`` its full
    argument list with None at the positions in ``fresh`` (each call's own tensors). Later
    calls with the same layout skip the JIT's argument binding and specialisation (about
    half the Python time of a launch). The layout must include each tensor's 16-byte
    alignment, which Triton specialises on."""
    unrecorded()
    compiled = fn[grid](*args, **options)
    names = fn.arg_names[len(args):]
    if compiled is None or any(n not in options for n in names):  # pragma: no cover
        run = lambda *a: unrecorded() or fn[grid](*a, **options)  # noqa: E731
        full = list(args)
    else:
        run = _recorded(compiled[(*grid, 1, 1)[:3]])  # (its launcher takes three grid sizes)
        full = list(args) + [options[n] for n in names]  # the launcher takes constexprs too
    return run, [None if j in fresh else v for j, v in enumerate(full)]  # scratch stays referenced


_thread = threading.local()  # .launches: the recording in progress on this thread (``recording``)


@contextlib.contextmanager
def recording():
    """A list of the (launcher, arguments) of every launch this thread makes through a bound
    launch (``launch_direct``) inside the block, or None in it where some launch went through
    Triton's JIT instead (its first call for a layout), which a replay could not repeat
    (runtime/replay.py)."""
    launches: list = []
    _thread.launches = launches
    try:
        yield launches
    finally:
        _thread.launches = None


def _recorded(run):
    """``run`` (a compiled kernel's launcher), adding each launch to this thread's recording."""
    def launch(*args):
        launches = getattr(_thread, "launches", None)
        if launches is not None:
            launches.append((run, args))
        return run(*args)
    launch.launcher = run
    return launch


def unrecorded() -> None:
    """A launch that is not a bound one (Triton's JIT, a tensor op): this thread's recording
    cannot be replayed."""
    launches = getattr(_thread, "launches", None)
    if launches is not None:
        launches.append(None)


def bind_tensors(fn, grid, args: list, options: dict, tensors, fresh=()) -> tuple:
    """``launch_direct`` of a launch whose arguments include some of ``tensors`` (a call's own,
    by identity): (run, statics, slots), ``slots`` the (argument, tensor) positions that
    ``filled`` puts a later call's tensors at; ``fresh``: further per-call positions."""
    ids = {id(t): i for i, t in enumerate(tensors)}
    slots = [(j, ids[id(v)]) for j, v in enumerate(args) if id(v) in ids]
    run, statics = launch_direct(fn, grid, args, options, {j for j, _ in slots} | set(fresh))
    return run, statics, slots


def filled(statics: list, slots: list, tensors) -> list:
    """A bound launch's arguments with this call's ``tensors`` in their ``slots``."""
    args = list(statics)
    for j, i in slots:
        args[j] = tensors[i]
    return args


def tma_ready(t: torch.Tensor, what: str, schedule: str = "ws_strip") -> torch.Tensor:
    """``t``, when a TMA descriptor can address it: unit inner stride and 16-byte aligned rows."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
        raise UnsupportedLayout(f"{schedule}: {what} needs unit inner stride and 16-byte aligned rows; "
                                f"got strides {t.stride()}")
    return t


def sm90_only(device: torch.device, schedule: str) -> None:
    """Raise UnsupportedLayout unless ``device`` is an sm_90 (Hopper) GPU."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        raise UnsupportedLayout(f"{schedule}: the Gluon kernels run on sm_90 (Hopper) GPUs only")


def wide_index(*tensors: torch.Tensor) -> bool:
    """Whether some tensor spans 2**31 elements or more (indices then need 64 bits)."""
    limit = 2**31 - 1
    for t in tensors:
        span = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)
        if span >= limit:
            return True
    return False
