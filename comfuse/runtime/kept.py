"""Memory a kernel keeps from one call to the next (workspaces, arrival counters, a placeholder
tile), allocated where no CUDA-graph memory pool takes it.

Inductor's CUDA-graph modes run a graph's first calls with the calling thread's allocations
routed to the graphs' memory pool, then check that every live allocation in that pool is one of
the graph's outputs: a kept tensor made there is not, and Inductor refuses that call and every
later run of the pool, its own graphs' included. A kernel makes what it keeps at its first call
for a size, which can come inside such a call (a new batch size's first call under
``mode="reduce-overhead"``). So on a CUDA device it is made on a thread of its own, whose
allocations no pool takes, and waited for before the caller goes on. Inside a stream capture
(where a CUDA graph records, and another thread's allocation may be refused) it is made as any
allocation is."""
from __future__ import annotations

import concurrent.futures
import os

import torch

_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _forget_the_thread() -> None:
    global _pool
    _pool = None  # (a forked child has none of its parent's threads)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_the_thread)


def allocate(device, make):
    """``make()`` (tensors to keep, on ``device``), made outside any CUDA-graph memory pool
    the calling thread allocates to (the module docstring)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return make()
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="comfuse-kept")
    return _pool.submit(_made, device, make).result()


def once(store: dict, key, device, make):
    """``store[key]``, made by ``allocate(device, make)`` the first time it is asked for."""
    if key not in store:
        store[key] = allocate(device, make)
    return store[key]


def _made(device, make):
    with torch.cuda.device(device):
        kept = make()
        torch.cuda.current_stream(device).synchronize()  # (zeroed before the caller's stream reads it)
    return kept
