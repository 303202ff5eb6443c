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

import dataclasses
import enum
import hashlib
import io
import logging
import os
import threading

import torch

from . import settings as settings_mod
from .errors import notice_once, summary
from .runtime import cache, launch
from .runtime import replay as replay_mod
from .runtime.cache import CODEGEN_VERSION
from .runtime.replay import Replay

log = logging.getLogger("comfuse.backend")

REGISTRY: dict = {}  # id -> (module that runs the region, which arguments are tensors)
STORED: set = set()  # ids whose region is in comfuse's cache, where a later process finds it
_seen: dict = {}  # what a region computes -> how many regions computing it were registered
_lock = threading.Lock()


class RegionMissing(RuntimeError):
    """A graph calls a region that neither this process registered nor comfuse's cache holds."""


def register(module, is_tensor: list) -> int:
    """A new id for ``module``, derived from what it computes. The id is all a compiled graph
    records of its region (``comfuse::region(id, ...)``). Inductor caches compiled graphs on
    disk; before it stores one, the regions it calls are stored in comfuse's cache under their
    ids (``store``), and a later process that takes the graph from there loads them
    (``module_of``). Ids 0, 1, 2... per process would name another process's regions."""
    what = identity(module, is_tensor)
    with _lock:
        count = _seen.get(what, 0)
        _seen[what] = count + 1
        i = int(hashlib.sha256(f"{what}#{count}".encode()).hexdigest()[:15], 16)
        REGISTRY[i] = (module, tuple(is_tensor))
    return i


# what a region keeps that is state, not what it computes
_STATE = frozenset({"kernel", "separate", "tuned", "validated", "report", "training", "failed", "prefer_unfused",
                    "separate_form", "index_bounds"})


def identity(module, is_tensor: list) -> str:
    """What ``module`` computes, as text that is the same in every process: its type and
    fields (the plan and its candidates, outputs, arguments, an attention's scale and operand
    positions; not its state), its unfused ops' code and constants, and the versions of
    comfuse's source, torch and the code generator. Two regions with the same text are
    interchangeable, so a later process may load either under the other's id."""
    unfused = getattr(module, "unfused", None)
    constants = []
    if isinstance(unfused, torch.fx.GraphModule):
        for node in unfused.graph.nodes:
            value = _attribute(unfused, node.target) if node.op == "get_attr" else None
            if isinstance(value, torch.Tensor):
                constants.append((node.target, _tensor_text(value)))
    fields = {k: v for k, v in vars(module).items() if not k.startswith("_") and k not in _STATE}
    return _canonical((type(module).__qualname__, fields, tuple(is_tensor), getattr(unfused, "code", None), constants,
                       CODEGEN_VERSION, cache.source_digest(), torch.__version__))


def _tensor_text(value: torch.Tensor) -> str:
    """dtype, shape, device and a digest of the contents (unique to this process where the
    contents cannot be read: a fake or quantized tensor)."""
    try:
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        digest = hashlib.sha256(data).hexdigest()
    except Exception:
        digest = f"unread {os.urandom(8).hex()}"
    return f"{value.dtype} {tuple(value.shape)} {value.device} {digest}"


def _canonical(value, depth: int = 0) -> str:
    """``value`` as text independent of the process: sets sorted, dataclasses and objects by
    their fields, tensors by ``_tensor_text``, no memory addresses."""
    if depth > 12:
        return "..."
    nested = lambda v: _canonical(v, depth + 1)  # noqa: E731
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.Size)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return _tensor_text(value)
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(nested(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(nested(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{nested(k)}: {nested(v)}" for k, v in value.items())) + "}"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if dataclasses.is_dataclass(value):
        return f"{type(value).__qualname__}" + nested({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, torch.nn.Module):
        return f"{type(value).__qualname__} module"  # (a region's ops: their code is in the text already)
    if hasattr(value, "__dict__") and not callable(value):
        return f"{type(value).__qualname__}" + nested(vars(value))
    return getattr(value, "__qualname__", None) or type(value).__qualname__


def _attribute(owner, target: str):
    for name in target.split("."):
        owner = getattr(owner, name, None)
    return owner


def _path(i: int):
    return settings_mod.get().cache_dir / "regions" / f"{i:x}.pt"


def store(ids) -> bool:
    """Whether every region of ``ids`` (registered here) is in comfuse's cache, written now
    where it is not yet: without its built kernel or compiled ops, which the process that
    loads it builds again. Where one cannot be written, a graph that calls it is not stored
    in Inductor's cache (inductor_pass.keep_region_calls_out_of_inductors_cache)."""
    for i in ids:
        if i in STORED:
            continue
        entry = REGISTRY.get(i)
        try:
            if entry is None:
                raise RegionMissing(f"region {i:x} is not registered in this process")
            data = io.BytesIO()
            torch.save({"module": entry[0], "is_tensor": entry[1]}, data)
            cache.atomic_write(_path(i), data.getvalue())
            STORED.add(i)
        except Exception as e:  # (the graph is compiled again by a later process instead)
            notice_once(f"store:{type(e).__name__}", f"comfuse: a fused region could not be stored in comfuse's "
                        f"cache ({summary(e)}): a graph that calls it is compiled again in each process")
            return False
    return True


def module_of(region_id: int) -> tuple:
    """(module, which arguments are tensors) of region ``region_id``: registered in this
    process, or loaded from comfuse's cache (a graph Inductor's cache gave back)."""
    entry = REGISTRY.get(region_id)
    if entry is not None:
        return entry
    path = _path(region_id)
    try:
        stored = torch.load(path, weights_only=False)
        module, is_tensor = stored["module"], tuple(stored["is_tensor"])
        if not (isinstance(module, torch.nn.Module) and all(isinstance(t, bool) for t in is_tensor)):
            raise TypeError(f"not a region: {type(module).__name__}")
    except Exception as e:
        raise RegionMissing(f"comfuse: a compiled graph calls region {region_id:x}, which comfuse's cache "
                            f"cannot give back ({path}: {summary(e)})") from e
    with _lock:
        STORED.add(region_id)
        return REGISTRY.setdefault(region_id, (module, is_tensor))


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


def call(region_id: int, tensors: list, scalars: list) -> list:
    """Run fused region ``region_id`` (its kernel, or its original ops on fallback): what
    Inductor's generated code calls for a region (inductor_pass.call_regions_directly), a
    plain Python call without the dispatcher's and ``custom_op``'s layers (38-85 us a call
    on the GPU machines' hosts, 2026-12-06), recorded as ``comfuse::region`` while a
    profiler runs."""
    if torch._C._autograd._profiler_enabled():
        with torch.profiler.record_function("comfuse::region"):
            return _run(region_id, tensors, scalars)
    return _run(region_id, tensors, scalars)


RECORD_TRIES = 4  # settled calls recorded, at most, before a region that cannot be replayed is left to run


def _run(region_id: int, tensors, scalars) -> list:
    entry = REGISTRY.get(region_id)
    # a region module's ``_replay`` (runtime/replay.py): its Replay, the recordings of its calls
    # so far (a list), or False once it is not replayed (its report's ``replayed`` says why)
    replay = entry[0].__dict__.get("_replay") if entry is not None else None
    if replay.__class__ is Replay:
        if replay.settings is settings_mod.get(getattr(entry[0], "pinned", ())):
            outs = replay(tensors)
            if outs is not None:
                return outs
            replay = False  # (tensors of another layout: this call runs the module)
        else:
            replay = None  # (other settings: recorded again)
    module = module_of(region_id)[0]
    args = _arguments(region_id, tensors, scalars)
    if replay is False:
        # (forward directly: region modules carry no hooks, and nn.Module's call path costs
        # microseconds on every call of a compiled graph)
        outs = module.forward(*args)
    else:
        outs = _recorded(module, args, tensors)
    # a custom op's outputs must not alias its inputs nor each other (the fused path returns
    # fresh tensors; the unfused ops may return an input, a view of one, or one tensor twice)
    return _fresh(list(outs), tensors)


def _recorded(module, args, tensors):
    """``module``'s call on ``args``, recorded where it may be replayed (``Fused.settled``):
    two recordings that agree become its Replay; a region none of whose first RECORD_TRIES
    settled calls could be replayed runs as a module from then on."""
    settings = settings_mod.get(getattr(module, "pinned", ()))
    device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)
    settled = getattr(module, "settled", None)
    if device is None or settled is None or not settled(device, settings):
        return module.forward(*args)
    with launch.recording() as launches:
        outs = module.forward(*args)
    recordings = module.__dict__.get("_replay")  # (the calls recorded: the last one kept)
    if recordings.__class__ is not list:  # (none yet, or a replay built under other settings)
        recordings = module.__dict__["_replay"] = []
    recording = built = None
    why = "no two calls agreed"
    try:
        recording = replay_mod.record(launches, tensors, outs, replay_mod.held_tensors(module.kernel))
        if recordings and recordings[-1] is not None:
            built = replay_mod.build(recordings[-1], recording)
    except replay_mod.NotReplayable as e:
        why = str(e)
    if built is not None:
        built.settings = settings
        module.__dict__["_replay"] = built
        module.report.replayed = f"its settled calls, as their {len(built.launches)} launch(es)"
        log.info("backend: %s at %s is replayed as its %d launch(es)", module.kind, module.report.anchor,
                 len(built.launches))
        return outs
    recordings[:] = [None] * len(recordings) + [recording]  # (counted; the last kept)
    if len(recordings) >= RECORD_TRIES:
        module.__dict__["_replay"] = False
        module.report.replayed = f"no: {why}"
        log.info("backend: %s at %s is not replayed: %s", module.kind, module.report.anchor, why)
    return outs


# The op needs no autograd formula (it runs in graphs AOTAutograd has differentiated already)
# and returns no alias of its inputs. It takes its tensors in their stride order with any
# strides (``needs_fixed_stride_order``; a custom op's default is exact strides), so Inductor
# may hand it a buffer whose rows it padded for alignment without copying it first, and need
# not leave the buffer unpadded for the other ops that read it. It is what graphs hold;
# Inductor's generated code calls ``call`` in its place.
@torch.library.custom_op("comfuse::region", mutates_args=(), tags=(torch.Tag.needs_fixed_stride_order,))
def region_op(region_id: int, tensors: list[torch.Tensor], scalars: list[int]) -> list[torch.Tensor]:
    """Run fused region ``region_id`` (its kernel, or its original ops on fallback)."""
    return _run(region_id, tensors, scalars)


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

