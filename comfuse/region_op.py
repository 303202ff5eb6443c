"""The ``comfuse::region`` operator: a fused region inside a graph that Inductor compiles.

The backend (backend.py) replaces each fused region of the graph it lowers by one call of
``comfuse::region(id, tensors, scalars)``, registered through ``torch.library`` with a fake
implementation, so the graph stays traceable, and an autograd formula: the backward
recomputes the region unfused under autograd (its original ops), so gradients match eager. A
split region (a loss over a wide row) recomputes one slice of N at a time instead
(``comfuse::split_backward``), so the backward never holds its full-width intermediate.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import threading

import torch

from . import settings as settings_mod
from .errors import notice_once, summary
from .ir import canonical_shape
from .runtime import onepass_grad
from .runtime.cache import CODEGEN_VERSION
from .runtime.launch import can_run_on

REGISTRY: dict = {}  # id -> (module that runs the region, which arguments are tensors, statistic rows carried)
_ids = itertools.count()
_lock = threading.Lock()


def register(module, is_tensor: list, carry_statistics: bool = True) -> int:
    """A new id for ``module``, derived from what it computes. The id is all a compiled graph
    records of its region (``comfuse::region(id, ...)``), and Inductor caches compiled graphs
    on disk by their text: with ids 0, 1, 2... per process, another process's region 0 (another
    version's statistics, another region) would reuse code built for this one's output shapes."""
    rows = module.carries_statistics() if carry_statistics and hasattr(module, "carries_statistics") else 0
    what = repr((getattr(module, "plan", None), getattr(module, "output_specs", None), tuple(is_tensor), rows,
                 CODEGEN_VERSION, torch.__version__))
    with _lock:
        i = int(hashlib.sha256(f"{what}#{next(_ids)}".encode()).hexdigest()[:15], 16)
        REGISTRY[i] = (module, tuple(is_tensor), rows)
        return i


def _arguments(region_id: int, tensors, scalars) -> list:
    """The region's arguments in their original order (tensors and sizes interleaved)."""
    is_tensor = REGISTRY[region_id][1]
    t, s = iter(tensors), iter(scalars)
    return [next(t) if flag else next(s) for flag in is_tensor]


@torch.library.custom_op("comfuse::region", mutates_args=())
def region_op(region_id: int, tensors: list[torch.Tensor], scalars: list[int]) -> list[torch.Tensor]:
    """Run fused region ``region_id`` (its kernel, or its original ops on fallback). A split
    region (a loss over a wide row) returns one more tensor, last: its merged per-row
    statistics for the backward ([rows, M] fp32; NaN when this call ran something else)."""
    module = REGISTRY[region_id][0]
    # (forward directly: region modules carry no hooks, and nn.Module's call path costs
    # microseconds on every call of a compiled graph)
    outs = module.forward(*_arguments(region_id, tensors, scalars))
    # a custom op's outputs must not alias its inputs nor each other (the fused path returns
    # fresh tensors; the unfused ops may return an input, a view of one, or one tensor twice)
    outs = _fresh(list(outs), tensors)
    rows = statistic_rows(region_id)
    if rows:
        stats = module.take_statistics()
        outs.append(stats if stats is not None else
                    torch.full((rows, module.region.sizes.M), float("nan"), device=tensors[0].device))
    return outs


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


def statistic_rows(region_id: int) -> int:
    return REGISTRY[region_id][2]


@region_op.register_fake
def _region_fake(region_id: int, tensors: list[torch.Tensor], scalars: list[int]) -> list[torch.Tensor]:
    module = REGISTRY[region_id][0]
    device = tensors[0].device
    outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in module.output_specs]
    rows = statistic_rows(region_id)
    if rows:
        outs.append(torch.empty((rows, module.region.sizes.M), dtype=torch.float32, device=device))
    return outs


def _setup_context(ctx, inputs, output):
    region_id, tensors, scalars = inputs
    ctx.region_id, ctx.scalars = region_id, list(scalars)
    carried = list(output[-1:]) if statistic_rows(region_id) else []
    ctx.save_for_backward(*tensors, *carried)


def _backward(ctx, grads):
    """Recompute the region unfused under autograd and pull the gradients through it; a
    split region (a loss over a wide row) recomputes one slice of N at a time instead, so
    the backward never holds its full-width intermediate (runtime/onepass_grad.py)."""
    saved = list(ctx.saved_tensors)
    carried = saved.pop() if statistic_rows(ctx.region_id) else None
    if carried is not None:
        grads = grads[:-1]  # (the statistics' own: nothing reads them)
    tensors = [t.detach().requires_grad_(t.is_floating_point()) for t in saved]
    module = REGISTRY[ctx.region_id][0]
    plan = getattr(module, "plan", None)
    if getattr(plan, "schedule", "") in ("split", "ws_split") and not plan.transposed:
        got = split_backward(ctx.region_id, saved, ctx.scalars, list(grads), carried)
        return None, [g if t.is_floating_point() else None for t, g in zip(tensors, got)], \
            [None] * len(ctx.scalars)
    with torch.enable_grad():
        outs = module.unfused(*_arguments(ctx.region_id, tensors, ctx.scalars))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt = [t for t in tensors if t.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    it = iter(got)
    return None, [next(it) if t.requires_grad else None for t in tensors], [None] * len(ctx.scalars)


region_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("comfuse::split_backward", mutates_args=())
def split_backward(region_id: int, tensors: list[torch.Tensor], scalars: list[int],
                   grads: list[torch.Tensor | None], carried: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The gradients of a split region's inputs, a slice of N at a time
    (runtime/onepass_grad.py): one opaque operator, so that the compiled backward runs it
    with eager memory behaviour (each slice's gradient written into place) rather than
    as an unrolled graph whose slices the compiler may keep alive together. ``carried``:
    the forward's merged statistics (``region_op``'s last output), used unless NaN. Integer
    inputs get an empty tensor."""
    module = REGISTRY[region_id][0]
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    ext = _arguments(region_id, leaves, scalars)
    canon = [None if g is None else g.reshape(canonical_shape(module.region, o.axes))
             for g, o in zip(grads, module.region.outputs)]
    def statistics():
        """The forward's merged statistics, else the fused statistics kernel's, else None
        (the torch pass runs)."""
        if carried is not None and not bool(torch.isnan(carried[0, 0])):  # (one sync a backward)
            return onepass_grad.unpack_statistics(module.plan.form.onepass, carried)
        if module.failed or module.region.sizes.B != 1 or settings_mod.get().disable or \
                can_run_on(ext[module.operands[0]].device):
            return None
        try:
            return module.split_statistics(ext)
        except Exception as e:  # the backward still has its own first pass
            if settings_mod.get().strict:
                raise
            notice_once(f"split-stats:{region_id}", f"comfuse: the fused statistics kernel failed in a "
                        f"backward ({summary(e)}); recomputing the statistics in torch")
            return None
    with _autograd_below_dispatch():
        onepass_grad.backward(module.plan.form.onepass, lambda: module.canonical(ext), canon, statistics=statistics)
    return [(t.grad if t.grad is not None else torch.zeros_like(t)) if t.is_floating_point()
            else t.new_empty(0) for t in leaves]


@contextlib.contextmanager
def _autograd_below_dispatch():
    """Autograd inside a custom operator's implementation: the dispatcher runs it with the
    autograd keys excluded (nothing would record a graph); lift that exclusion here."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.ADInplaceOrView):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        yield


@split_backward.register_fake
def _split_backward_fake(region_id, tensors, scalars, grads, carried=None):
    return [torch.empty_like(t) if t.is_floating_point() else t.new_empty(0) for t in tensors]
