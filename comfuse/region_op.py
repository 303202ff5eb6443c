"""The ``comfuse::region`` operator: a fused region inside a graph that Inductor compiles.

comfuse's pass in Inductor (inductor_pass.py) replaces each fused region of a graph Inductor
lowers, forward or backward, by one call of ``comfuse::region(id, tensors, scalars)``,
registered through ``torch.library`` with a fake implementation; Inductor lowers it as an extern
kernel. It needs no autograd formula: AOTAutograd has differentiated the graph before the pass
runs. (Regions whose kernel Inductor can launch itself become Inductor's own kernel nodes
instead: kernel_node.py.)
"""
from __future__ import annotations

import hashlib
import itertools
import threading

import torch

from .runtime.cache import CODEGEN_VERSION

REGISTRY: dict = {}  # id -> (module that runs the region, which arguments are tensors)
_ids = itertools.count()
_lock = threading.Lock()


def register(module, is_tensor: list) -> int:
    """A new id for ``module``, derived from what it computes. The id is all a compiled graph
    records of its region (``comfuse::region(id, ...)``), and Inductor caches compiled graphs
    on disk by their text: with ids 0, 1, 2... per process, another process's region 0 (another
    version's statistics, another region) would reuse code built for this one's output shapes."""
    what = repr((getattr(module, "plan", None), getattr(module, "output_specs", None), tuple(is_tensor),
                 CODEGEN_VERSION, torch.__version__))
    with _lock:
        i = int(hashlib.sha256(f"{what}#{next(_ids)}".encode()).hexdigest()[:15], 16)
        REGISTRY[i] = (module, tuple(is_tensor))
        return i


def _arguments(region_id: int, tensors, scalars) -> list:
    """The region's arguments in their original order (tensors and sizes interleaved)."""
    is_tensor = REGISTRY[region_id][1]
    t, s = iter(tensors), iter(scalars)
    return [next(t) if flag else next(s) for flag in is_tensor]


# The op needs no autograd formula (it runs in graphs AOTAutograd has differentiated already)
# and returns no alias of its inputs. It takes its tensors in their stride order with any
# strides (``needs_fixed_stride_order``; a custom op's default is exact strides), so Inductor
# may hand it a buffer whose rows it padded for alignment without copying it first, and need
# not leave the buffer unpadded for the other ops that read it.
@torch.library.custom_op("comfuse::region", mutates_args=(), tags=(torch.Tag.needs_fixed_stride_order,))
def region_op(region_id: int, tensors: list[torch.Tensor], scalars: list[int]) -> list[torch.Tensor]:
    """Run fused region ``region_id`` (its kernel, or its original ops on fallback)."""
    module = REGISTRY[region_id][0]
    # (forward directly: region modules carry no hooks, and nn.Module's call path costs
    # microseconds on every call of a compiled graph)
    outs = module.forward(*_arguments(region_id, tensors, scalars))
    # a custom op's outputs must not alias its inputs nor each other (the fused path returns
    # fresh tensors; the unfused ops may return an input, a view of one, or one tensor twice)
    return _fresh(list(outs), tensors)


def _fresh(outs: list, tensors) -> list:
    """``outs`` with a copy in place of each output that shares storage with an input or
    with an earlier output."""
    taken = {x.untyped_storage().data_ptr() for x in tensors if isinstance(x, torch.Tensor) and x.numel()}
    for i, o in enumerate(outs):
        if not o.numel():
            continue
        ptr = o.untyped_storage().data_ptr()
        if ptr in taken:
            outs[i] = o = o.clone()
            ptr = o.untyped_storage().data_ptr()
        taken.add(ptr)
    return outs


@region_op.register_fake
def _region_fake(region_id: int, tensors: list[torch.Tensor], scalars: list[int]) -> list[torch.Tensor]:
    module = REGISTRY[region_id][0]
    device = tensors[0].device
    return module.empty_outputs(device)

