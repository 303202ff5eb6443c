"""A settled region's calls replayed as its kernels' launches (runtime/replay.py, region_op.py).

The launches here are Python functions standing in for compiled kernels' launchers (bound
through ``launch._recorded`` as ``launch_direct`` binds a compiled one), so that what a replay
repeats, and what it refuses, is checked on the CPU; the GPU test runs real kernels."""
import dataclasses

import pytest
import torch

from comfuse import region_op, settings
from comfuse.runtime import launch, replay


def _axpy(x, y, out, ws, scale):
    """A stand-in launcher: out = scale * x + y + ws[0] (a held workspace read too)."""
    out.copy_(scale * x + y + ws[0])


def _desc_axpy(xd, y, out, ws, scale):
    """The same, its first operand through a TMA-like descriptor (``.base`` and fields)."""
    assert xd.block == (4,)
    out.copy_(scale * xd.base + y + ws[0])


def _held_desc_axpy(x, y, out, wsd, scale):
    """The same, its workspace through a descriptor made anew each call."""
    out.copy_(scale * x + y + wsd.base[0])


@dataclasses.dataclass(eq=False)
class Descriptor:
    base: object
    block: tuple


class Kernel:
    def __init__(self, fn):
        self.run = launch._recorded(fn)
        self._scratch = {"cpu": (torch.full((1,), 0.5),)}


class Region(torch.nn.Module):
    """A region module as region_op runs one: ``settled`` once its first call is made, then
    allocating its output and launching; ``how`` changes what a call does."""
    kind = "region"

    def __init__(self, how: str = "plain"):
        super().__init__()
        self.how = how
        self.kernel = Kernel({"descriptor": _desc_axpy, "held descriptor": _held_desc_axpy}.get(how, _axpy))
        self.calls = 0
        self.report = type("Report", (), {"anchor": "test"})()

    def settled(self, device, settings) -> bool:
        return self.calls > 0 and not settings.disable

    def forward(self, x, y):
        self.calls += 1
        out = torch.empty(x.shape, dtype=x.dtype)
        if self.how == "padded":  # a view of a wider allocation (logits in padded rows)
            out = torch.empty(x.numel() + 4, dtype=x.dtype)[2:2 + x.numel()]
        ws = self.kernel._scratch["cpu"][0]
        if self.how == "copy":  # a copy made for the call: not replayable
            x = x.clone()
        if self.how == "jit":  # a launch through the JIT: not replayable
            launch.unrecorded()
        scale = float(self.calls) if self.how == "counter" else 2.0  # a value that changes per call
        first = Descriptor(x, (4,)) if self.how == "descriptor" else x
        if self.how == "held descriptor":
            ws = Descriptor(ws, (1,))
        self.kernel.run(first, y, out, ws, scale)
        if self.how == "unwritten":  # an output no launch writes
            return out, torch.zeros(3)
        return (out,)


def _register(module) -> int:
    return region_op.register(module, [True, True])


def _want(x, y):
    return 2.0 * x + y + 0.5


@pytest.mark.parametrize("how", ["plain", "descriptor", "held descriptor", "padded"])
def test_a_settled_region_is_replayed_on_new_tensors(how):
    """Two recorded calls that agree become the replay: later calls run its launches alone
    (the module's forward is not called) on each call's tensors, into fresh outputs."""
    module = Region(how)
    i = _register(module)
    for _ in range(3):  # the first call settles it; two are recorded
        x, y = torch.randn(4), torch.randn(4)
        (out,) = region_op.call(i, [x, y], [])
        torch.testing.assert_close(out, _want(x, y))
    assert isinstance(module.__dict__["_replay"], replay.Replay) and module.calls == 3
    assert module.report.replayed == "its settled calls, as their 1 launch(es)"
    x, y = torch.randn(4), torch.randn(4)
    outs = region_op.call(i, [x, y], [])
    again = region_op.call(i, [x, y], [])
    assert module.calls == 3  # (replayed)
    torch.testing.assert_close(outs[0], _want(x, y))
    assert outs[0].data_ptr() != again[0].data_ptr()  # (each call's output its own)
    if how == "padded":  # (allocated as the module allocates it)
        assert outs[0].storage_offset() == 2 and outs[0].untyped_storage().nbytes() == 8 * outs[0].element_size()
    # tensors of another layout run the module, and the replay stays for the recorded one
    x2, y2 = torch.randn(2, 4)[:, 0], torch.randn(2)
    torch.testing.assert_close(region_op.call(i, [x2, y2], [])[0], _want(x2, y2))
    assert module.calls == 4 and isinstance(module.__dict__["_replay"], replay.Replay)
    region_op.call(i, [x, y], [])
    assert module.calls == 4


@pytest.mark.parametrize("how, why", [("copy", "neither the call's nor its kernel's"), ("jit", "Triton's JIT"),
                                      ("counter", "argument 4 of a launch differs"),
                                      ("unwritten", "written by no launch")])
def test_calls_that_launches_alone_cannot_repeat_are_not_replayed(how, why, caplog):
    """A copy of an input made for the call, a launch through Triton's JIT, a launch value that
    changes between calls, or an output no launch writes: the module runs every call, and
    after RECORD_TRIES recordings its calls are no longer recorded, with the reason logged."""
    caplog.set_level("INFO", logger="comfuse.backend")
    module = Region(how)
    i = _register(module)
    for n in range(region_op.RECORD_TRIES + 3):
        x, y = torch.randn(4), torch.randn(4)
        outs = region_op.call(i, [x, y], [])
        if how != "counter":
            torch.testing.assert_close(outs[0], _want(x, y))
    assert module.calls == region_op.RECORD_TRIES + 3
    assert module.__dict__["_replay"] is False
    assert why in caplog.text  # (the reason logged once, when recording stops)
    assert module.report.replayed.startswith("no: ") and why in module.report.replayed  # (and in its report)


def test_two_tensors_at_one_address_are_not_replayed():
    """The same tensor given twice: a later call may give two, so its launches are not kept."""
    module = Region()
    i = _register(module)
    for _ in range(region_op.RECORD_TRIES + 2):
        x = torch.randn(4)
        torch.testing.assert_close(region_op.call(i, [x, x], [])[0], _want(x, x))
    assert module.__dict__["_replay"] is False


def test_other_settings_record_the_region_again():
    """A replay recorded under one set of comfuse settings is not used under another: the
    module decides there (here, disabled: it does not settle, and runs every call)."""
    module = Region()
    i = _register(module)
    for _ in range(3):
        region_op.call(i, [torch.randn(4), torch.randn(4)], [])
    with settings.override(disable=True):
        for _ in range(3):
            x, y = torch.randn(4), torch.randn(4)
            torch.testing.assert_close(region_op.call(i, [x, y], [])[0], _want(x, y))
    assert module.calls == 6


def test_a_stored_region_leaves_its_replay_behind(tmp_path):
    """What a later process loads of a region (its state) holds no replay of this one's."""
    from comfuse.runtime.fused import Fused
    module = Fused(torch.nn.Identity(), None)
    module.__dict__["_replay"] = replay.Replay((), (), ())
    assert "_replay" not in module.__getstate__()


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["cooperative", "ws_stages", "ws_split"])
def test_compiled_regions_are_replayed_on_the_gpu(schedule, tmp_path, caplog):
    """Through torch.compile on a GPU: a Triton region (cooperative GEMM + LayerNorm), a
    warp-specialised Gluon one (ws_stages) and the LM head's template with its loss
    (ws_split) settle, are replayed, and stay equal to eager's result on new inputs, call
    after call, their replays launching into fresh outputs."""
    import warnings

    import comfuse
    from comfuse import inductor_pass
    torch.manual_seed(0)
    if schedule == "ws_split":
        w = (torch.randn(8192, 1024, device="cuda") / 32).to(torch.bfloat16)

        def fn(x, t):
            return torch.nn.functional.cross_entropy((x @ w.t()).float(), t)

        def ref(x, t):
            return torch.nn.functional.cross_entropy(x.double() @ w.double().t(), t)
        inputs = lambda: (torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16),  # noqa: E731
                          torch.randint(0, 8192, (1024,), device="cuda"))
        tol = 2e-2
    else:
        lin, ln = torch.nn.Linear(1024, 1024).cuda().bfloat16(), torch.nn.LayerNorm(1024).cuda().bfloat16()

        def fn(x, r):
            return ln(lin(x) + r)

        def ref(x, r):
            y = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double()) + r.double()
            return torch.nn.functional.layer_norm(y, (1024,), ln.weight.double(), ln.bias.double())
        inputs = lambda: (torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16),  # noqa: E731
                          torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16))
        tol = 3e-2
    torch._dynamo.reset()
    caplog.set_level("INFO", logger="comfuse.backend")
    before = set(region_op.REGISTRY)
    # (the settings hold for the calls as for the compilation: a region's calls read them)
    with torch.no_grad(), settings.override(cache_dir=tmp_path, check=False, schedule=schedule, autotune="0",
                                            graph_check="0"), warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        saved = inductor_pass.LAUNCH_FROM_INDUCTOR  # (a Triton region kept a region call, not Inductor's launch)
        inductor_pass.LAUNCH_FROM_INDUCTOR = False
        try:
            cm = torch.compile(fn, backend="comfuse", dynamic=False)
            for _ in range(6):
                args = inputs()
                got, want = cm(*args), ref(*args)
                assert ((got.double() - want).norm() / want.norm()).item() < tol
        finally:
            inductor_pass.LAUNCH_FROM_INDUCTOR = saved
    modules = [region_op.REGISTRY[i][0] for i in set(region_op.REGISTRY) - before]
    assert modules and all(m.plan.schedule == schedule for m in modules if hasattr(m, "plan"))
    assert any(isinstance(m.__dict__.get("_replay"), replay.Replay) for m in modules), (
        [(type(m).__name__, getattr(m, "kernel", None) is not None, getattr(m, "tuned", None),
          getattr(m, "validated", None), getattr(m, "prefer_unfused", None), getattr(m, "failed", None),
          m.__dict__.get("_replay")) for m in modules], caplog.text[-3000:])


def test_binding_another_layout_keeps_nothing_new(monkeypatch):
    """The LM head's template binds a launch per layout of its tensors, and keeps that launch's
    layout-free arguments (workspace, dummy tile, counters). Those must be the tensors made once
    for its sizes: a tensor allocated at a later bind (a layout first seen inside Inductor's
    CUDA-graph warm-up) stays in the graphs' memory pool untracked, and Inductor then refuses
    every later run of that pool, its own graph's too (GPT-2 under reduce-overhead, 2026-12-06).
    The JIT launch is stood in for: what is bound and kept is checked, not the kernel."""
    import torch.nn.functional as F

    from comfuse.planner import plan
    from comfuse.runtime import build, strip_kernel
    from test_template import ce_region
    with settings.override(schedule="ws_split"):
        p = plan(ce_region(lambda x, w, t: F.cross_entropy(x @ w, t, reduction="none")), target="cuda")
    kernel = build.build(p)
    bound = []

    def fake_launch(fn, grid, args, options, fresh):
        bound.append([None if j in fresh else v for j, v in enumerate(args)])
        return (lambda *a: None), bound[-1]
    for name, stand_in in (("sm90_only", lambda *a: None), ("sm_count", lambda d: 132),
                           ("launch_direct", fake_launch)):
        monkeypatch.setattr(strip_kernel, name, stand_in)
    M, K, N = 256, 64, 1024
    a, targets = torch.randn(M, K, dtype=torch.bfloat16), torch.randint(0, N, (M,))
    b = torch.randn(K, N, dtype=torch.bfloat16)
    b_strided = torch.randn(K, N + 64, dtype=torch.bfloat16)[:, :N]  # (another layout: rows of N + 64)
    for operand in (b, b_strided):
        kernel.bind(a, operand, targets, None)
    kept = [[v for v in args if isinstance(v, torch.Tensor)] for args in bound]
    assert len(kept[0]) == 2 and all(x is y for x, y in zip(kept[0], kept[1], strict=True))
    assert {id(t) for t in kept[0]} <= replay.held_tensors(kernel)


def test_kept_memory_is_made_on_a_thread_of_its_own_for_cuda(monkeypatch):
    """What a kernel keeps (``runtime.kept.allocate``) is made on the caller's thread for a CPU,
    and for a CUDA device on a thread of its own (whose allocations no CUDA-graph pool takes),
    returned to the caller; inside a stream capture, on the caller's thread. (The GPU test
    ``test_kept_memory_stays_out_of_a_cuda_graph_pool`` checks the pool itself.)"""
    import threading

    from comfuse.runtime import kept
    here = threading.current_thread()
    made_on = []

    def make():
        made_on.append(threading.current_thread())
        return torch.zeros(2)
    assert kept.allocate("cpu", make).tolist() == [0.0, 0.0] and made_on == [here]
    monkeypatch.setattr(kept, "_made", lambda device, fn: fn())  # (no CUDA here: the thread is what is checked)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    kept.allocate("cuda:0", make)
    assert made_on[-1] is not here
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    kept.allocate("cuda:0", make)
    assert made_on[-1] is here


@pytest.mark.parametrize("numel, shape, stride, offset", [
    (12, (3, 4), (4, 1), 0),  # contiguous: the storage is the strides' extent
    (12, (3, 4), (1, 3), 0),  # column-major
    (16, (3, 4), (5, 1), 0),  # rows padded, the storage wider than the last row's end
    (14, (3, 4), (4, 1), 2),  # a view into its storage
    (15, (3, 4), (5, 1), 0),  # padded rows ending at the extent
])
def test_a_replay_allocates_each_output_as_recorded(numel, shape, stride, offset):
    """Every output a replay allocates has the recorded shape, strides, offset, storage size,
    dtype and device, by whichever allocation it takes."""
    record = (numel, shape, stride, offset, torch.float16, torch.device("cpu"))
    run = replay.Replay((torch.backends.cuda.matmul.allow_tf32, launch.layout_key([])), (record,), ())
    (out,) = run([])
    assert (tuple(out.shape), out.stride(), out.storage_offset(), out.dtype, out.device) == \
        (shape, stride, offset, torch.float16, torch.device("cpu"))
    assert out.untyped_storage().nbytes() == numel * 2


def test_a_regions_report_says_whether_its_calls_are_replayed():
    from comfuse.report import RegionReport
    report = RegionReport(0, "mm", "gemm_epilogue", True, "", 1, "tile", "")
    assert "replayed" not in str(report)  # (not yet settled, or outside Inductor)
    report.replayed = "its settled calls, as their 2 launch(es)"
    assert "\n  replayed: its settled calls, as their 2 launch(es)" in str(report)
