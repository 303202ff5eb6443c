"""The ``comfuse::region`` operator: a fused region inside a graph that Inductor compiles.

comfuse's pass in Inductor (inductor_pass.py) replaces each fused region of a graph Inductor
lowers, forward or backward, by one call of ``comfuse::region(id, tensors, scalars)``,
registered through ``torch.library`` with a fake implementation; Inductor lowers it as an extern
kernel. It needs no autograd formula: AOTAutograd has differentiated the graph before the pass
runs. (Regions whose kernel Inductor can launch itself become Inductor's own kernel nodes
instead: kernel_node.py.) Each region is stored in comfuse's cache under its id, so a graph
that Inductor's own disk cache gives a later process runs its region calls there too.
"""
from __future__ import annotations

import hashlib
import io
import logging
import threading

import torch

from . import settings as settings_mod
from .errors import summary
from .runtime import cache
from .runtime.cache import CODEGEN_VERSION

log = logging.getLogger("comfuse.backend")

REGISTRY: dict = {}  # id -> (module that runs the region, which arguments are tensors)
STORED: set = set()  # ids whose region is in comfuse's cache, where a later process finds it
_seen: dict = {}  # what a region computes -> how many regions computing it were registered
_lock = threading.Lock()


class RegionMissing(RuntimeError):
    """A graph calls a region that neither this process registered nor comfuse's cache holds."""


def register(module, is_tensor: list) -> int:
    """A new id for ``module``, derived from what it computes, and the module stored in
    comfuse's cache under it. The id is all a compiled graph records of its region
    (``comfuse::region(id, ...)``). Inductor caches compiled graphs on disk, and a later
    process that takes one from there loads its regions by their ids (``module_of``); ids
    0, 1, 2... per process would name another process's regions (other statistics, other
    output shapes)."""
    what = identity(module, is_tensor)
    with _lock:
        count = _seen.get(what, 0)
        _seen[what] = count + 1
        i = int(hashlib.sha256(f"{what}#{count}".encode()).hexdigest()[:15], 16)
        REGISTRY[i] = (module, tuple(is_tensor))
    _store(i, module, is_tensor)
    return i


def identity(module, is_tensor: list) -> str:
    """What ``module`` computes, as text: its type, plan, outputs, arguments, its plain fields
    (an attention's scale and operand positions), its unfused ops' code and constants, and
    the versions. Two regions with the same text are interchangeable, so a later process may
    load either under the other's id."""
    unfused = getattr(module, "unfused", None)
    constants = []
    if isinstance(unfused, torch.fx.GraphModule):
        for node in unfused.graph.nodes:
            value = _attribute(unfused, node.target) if node.op == "get_attr" else None
            if isinstance(value, torch.Tensor):
                data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                constants.append((node.target, str(value.dtype), tuple(value.shape), hashlib.sha256(data).hexdigest()))
    fields = sorted((k, v) for k, v in vars(module).items()
                    if isinstance(v, (bool, int, float, str, tuple, torch.Size)) and not k.startswith("_"))
    return repr((type(module).__name__, getattr(module, "plan", None), getattr(module, "output_specs", None),
                 tuple(is_tensor), getattr(module, "cand_inputs", None), getattr(module, "operands", None), fields,
                 getattr(unfused, "code", None), constants, CODEGEN_VERSION, torch.__version__))


def _attribute(owner, target: str):
    for name in target.split("."):
        owner = getattr(owner, name, None)
    return owner


def _path(i: int):
    return settings_mod.get().cache_dir / "regions" / f"{i:x}.pt"


def _store(i: int, module, is_tensor: list) -> None:
    """``module`` written to comfuse's cache under id ``i`` (``STORED`` then holds ``i``):
    without its built kernel, timings or checks, which the process that loads it makes again
    from the stored decisions. Where it cannot be written, a graph that calls it is not stored
    in Inductor's cache (inductor_pass.keep_unstored_regions_out_of_inductors_cache)."""
    try:  # (written each time: a damaged file under the id is replaced)
        data = io.BytesIO()
        torch.save({"module": module, "is_tensor": tuple(is_tensor)}, data)
        cache.atomic_write(_path(i), data.getvalue())
        STORED.add(i)
    except Exception as e:  # (the graph is compiled again by a later process instead)
        log.info("backend: region %x could not be stored in comfuse's cache (%s): a graph that calls it "
                 "is not kept in Inductor's cache", i, summary(e))


def module_of(region_id: int) -> tuple:
    """(module, which arguments are tensors) of region ``region_id``: registered in this
    process, or loaded from comfuse's cache (a graph Inductor's cache gave back)."""
    entry = REGISTRY.get(region_id)
    if entry is not None:
        return entry
    with _lock:
        if region_id in REGISTRY:
            return REGISTRY[region_id]
        path = _path(region_id)
        try:
            stored = torch.load(path, weights_only=False)
            entry = (stored["module"], tuple(stored["is_tensor"]))
        except Exception as e:
            raise RegionMissing(f"comfuse: a compiled graph calls region {region_id:x}, which comfuse's cache "
                                f"cannot give back ({path}: {summary(e)})") from e
        REGISTRY[region_id] = entry
        STORED.add(region_id)
        return entry


def loadable(ids) -> bool:
    """Whether every region of ``ids`` is registered here or can be loaded from comfuse's cache."""
    try:
        for i in ids:
            module_of(i)
    except RegionMissing as e:
        log.info("backend: %s; the graph is compiled again", e)
        return False
    return True


def _arguments(region_id: int, tensors, scalars) -> list:
    """The region's arguments in their original order (tensors and sizes interleaved)."""
    is_tensor = module_of(region_id)[1]
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
    module = module_of(region_id)[0]
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
    module = module_of(region_id)[0]
    device = tensors[0].device
    return module.empty_outputs(device)

