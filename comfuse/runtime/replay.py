"""A fused region's call replayed as its kernels' launches alone.

A region called from a compiled graph runs the same launches on every call: the region module
works out canonical views of its tensors, allocates its outputs, and each kernel fills the
call's tensors into a launch it bound at its first call (launch.py). That Python cost 44-50 us
a call on the GPU machines' hosts (2026-12-06), three or four times one Inductor launch. Once a
region has settled (tuned, checked, its kernel bound), two of its calls are recorded
(``launch.recording``): each launch's launcher and arguments. Where the two agree, each
argument is one of the call's tensors (found by its data pointer: the canonical views start
where the tensors do), one of its outputs, a TMA descriptor over either, or the same value in
both (sizes, strides, the kernels' own workspaces and descriptors over them), and ``Replay`` repeats them: outputs
allocated as the call allocated them, the call's tensors put in their places, the launchers
called, after one check that the tensors' layout (shapes, strides, dtypes, devices, 16-byte
alignment) is the one recorded. Anything else is not replayed, and the region module runs
as before: a launch through Triton's JIT (its first for a layout), a tensor argument that is
neither a call's tensor nor one its kernel holds (a copy made for the call), two call tensors
at one address, an output its kernels do not write, or a difference between the two calls.
"""
from __future__ import annotations

import dataclasses

import torch

from .launch import layout_key

_IN, _OUT, _KEPT = "in", "out", "kept"


class NotReplayable(Exception):
    """Why a region's recorded calls cannot be replayed (``record``, ``build``)."""


@dataclasses.dataclass
class Replay:
    """The launches of a region's call, to repeat on another call's tensors (module docstring)."""
    layout: tuple  # the TF32 setting and the call's tensors' layout_key
    outputs: tuple  # (elements of its storage, shape, stride, storage offset, dtype, device) per output
    launches: tuple  # (launcher, argument template, ((position, source, descriptor or None), ...))
    settings: object = None  # the comfuse settings it was recorded under (the caller's to compare)

    def __post_init__(self):
        self._allocate = tuple(_allocator(*o) for o in self.outputs)

    def __call__(self, tensors) -> list | None:
        """The outputs of the region on ``tensors``, or None where their layout is not the one
        recorded (the module then runs the call)."""
        if (torch.backends.cuda.matmul.allow_tf32, layout_key(tensors)) != self.layout:
            return None
        outs = [allocate() for allocate in self._allocate]
        sources = (*tensors, *outs)
        for run, template, fills in self.launches:
            args = list(template)
            for j, i, descriptor in fills:
                if descriptor is None:
                    args[j] = sources[i]
                else:  # (a TMA descriptor holds its tensor: the recorded one's fields over this call's)
                    d = object.__new__(type(descriptor))
                    d.__dict__.update(descriptor.__dict__)
                    d.base = sources[i]
                    args[j] = d
            run(*args)
        return outs


def _allocator(numel, shape, stride, offset, dtype, device):
    """A function allocating an output as recorded: where its storage is exactly the extent of
    its strides from offset 0, through the allocation Inductor's generated code uses (one call,
    about a quarter of an empty tensor's Python time viewed with ``as_strided``)."""
    def general():
        return torch.empty(numel, dtype=dtype, device=device).as_strided(shape, stride, offset)
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
    fast = getattr(torch._C._dynamo.guards, f"_empty_strided_{device.type}", None)
    if offset or numel != extent or fast is None:
        return general
    if device.type == "cpu":
        return lambda: fast(shape, stride, dtype)
    current = getattr(torch._C, f"_{device.type}_getDevice", None)
    if current is None or device.index is None:
        return general
    index = device.index  # (it allocates on the current device: where that is another, the general way)
    return lambda: fast(shape, stride, dtype) if current() == index else \
        torch.empty_strided(shape, stride, dtype=dtype, device=device)


def held_tensors(obj, depth: int = 5) -> set:
    """ids of the tensors ``obj`` (a region's kernel) holds: its workspaces and counters, which
    a replay may pass as they are."""
    found = set()

    def walk(x, d):
        if isinstance(x, torch.Tensor):
            found.add(id(x))
        elif d <= 0 or isinstance(x, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
            return
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, d - 1)
        elif isinstance(x, (list, tuple, set, frozenset)):
            for v in x:
                walk(v, d - 1)
        elif hasattr(x, "__dict__") and not callable(x) and not isinstance(x, torch.nn.Module):
            for v in vars(x).values():
                walk(v, d - 1)
    walk(obj, depth)
    return found


def _allocation(t: torch.Tensor) -> tuple:
    """How a replay allocates an output like ``t``: a storage of as many elements, viewed as
    ``t`` is (a region may return a view of a wider allocation: logits in rows padded to 16
    bytes)."""
    numel, left = divmod(t.untyped_storage().nbytes(), t.element_size())
    if left or not t.numel():
        raise NotReplayable("an output is empty or not a whole number of its elements")
    return numel, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device


@dataclasses.dataclass
class Recording:
    """One call's launches with each argument classified: (_IN | _OUT, index), (_IN | _OUT,
    index, descriptor type, its other fields) or (_KEPT, value); no tensor of the call kept."""
    layout: tuple
    outputs: list  # (elements of its storage, shape, stride, storage offset, dtype, device)
    tensors: int  # how many the call had
    launches: list  # (launcher, [classified argument])


def record(launches: list, tensors, outputs, held: set) -> Recording:
    """``launches`` (a ``launch.recording()`` of one call on ``tensors``, which returned
    ``outputs``) classified; NotReplayable where the call cannot be replayed (module
    docstring). ``held``: ``held_tensors`` of the region's kernel."""
    if not launches:
        raise NotReplayable("no bound launch was made")
    if any(x is None for x in launches):
        raise NotReplayable("a launch went through Triton's JIT")
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        raise NotReplayable("an output is not a tensor")
    allocations = [_allocation(o) for o in outputs]
    own = {o.untyped_storage().data_ptr() for o in outputs}  # (each output its storage, no input's)
    if len(own) < len(outputs) or own & {t.untyped_storage().data_ptr() for t in tensors if t.numel()}:
        raise NotReplayable("an output shares its storage with another tensor of the call")
    where = {}
    for i, t in enumerate(tensors):
        if t.numel():
            where[t.data_ptr()] = (_IN, i) if t.data_ptr() not in where else None  # (None: two at one address)
    for k, o in enumerate(outputs):  # (each of its own storage, checked above)
        where[o.data_ptr()] = (_OUT, k)
    written = set()
    classified_launches = []
    for run, args in launches:
        classified = []
        for a in args:
            base = getattr(a, "base", None) if not isinstance(a, torch.Tensor) else None
            tensor = a if isinstance(a, torch.Tensor) else base if isinstance(base, torch.Tensor) else None
            if tensor is None:
                classified.append((_KEPT, a))
                continue
            source = where.get(tensor.data_ptr()) if tensor.numel() else None
            if source is None:
                if id(tensor) not in held:  # (a copy made for this call)
                    raise NotReplayable("a launch takes a tensor that is neither the call's nor its kernel's")
                if tensor.untyped_storage().data_ptr() in own:
                    raise NotReplayable("an output is a view of its kernel's workspace")
                classified.append((_KEPT, a))  # (a workspace, or a descriptor over one, made anew each call)
                continue
            if source[0] == _OUT:
                written.add(source[1])
            if base is not None:
                if not hasattr(a, "__dict__"):
                    raise NotReplayable(f"a {type(a).__name__} over a call's tensor has no fields to copy")
                classified.append((*source, type(a), _fields(a)))
            else:
                classified.append(source)
        classified_launches.append((run, classified))
    if written != set(range(len(outputs))):
        raise NotReplayable("an output is written by no launch")
    return Recording((torch.backends.cuda.matmul.allow_tf32, layout_key(tensors)),
                     allocations, len(tensors),
                     classified_launches)


def _same(x, y) -> bool:
    if x is y:
        return True
    if isinstance(getattr(x, "base", None), torch.Tensor) and not isinstance(x, torch.Tensor):
        # a descriptor over a kernel's workspace, made anew each call: the same workspace and fields
        return (type(x) is type(y) and hasattr(x, "__dict__") and x.base is getattr(y, "base", None)
                and _same(_fields(x), _fields(y)))
    try:
        return bool(x == y)
    except Exception:  # (values that do not compare: not the same)
        return False


def _fields(descriptor) -> dict:
    return {k: v for k, v in vars(descriptor).items() if k != "base"}


def build(first: Recording, second: Recording) -> Replay:
    """A Replay of the region's calls where ``first`` and ``second`` (two recorded calls of it)
    agree; NotReplayable where they do not."""
    if first.layout != second.layout or first.outputs != second.outputs:
        raise NotReplayable("the two calls' layouts or outputs differ")
    if len(first.launches) != len(second.launches):
        raise NotReplayable("the two calls made different numbers of launches")
    launches = []
    for (run, args), (run2, args2) in zip(first.launches, second.launches):
        if run is not run2 or len(args) != len(args2):
            raise NotReplayable("the two calls ran different launchers")
        template, fills = [], []
        for j, (x, y) in enumerate(zip(args, args2)):
            if x[0] != y[0] or (x[0] == _KEPT and not _same(x[1], y[1])) or (x[0] != _KEPT and x[1] != y[1]):
                raise NotReplayable(f"argument {j} of a launch differs between the two calls")
            if x[0] == _KEPT:
                template.append(x[1])
                continue
            if len(x) > 2 and not (x[2] is y[2] and _same(x[3], y[3])):
                raise NotReplayable(f"the descriptor at argument {j} of a launch differs between the two calls")
            template.append(None)
            index = x[1] if x[0] == _IN else first.tensors + x[1]
            fills.append((j, index, _descriptor(x[2], x[3]) if len(x) > 2 else None))
        launches.append((run, tuple(template), tuple(fills)))
    return Replay(first.layout, tuple(first.outputs), tuple(launches))


def _descriptor(kind, fields: dict):
    """A descriptor of ``kind`` with ``fields`` and no tensor yet (``Replay`` gives each call's)."""
    d = object.__new__(kind)
    d.__dict__.update(fields)
    d.base = None
    return d
