"""comfuse.compile end to end on the CPU (Triton interpreter); COMFUSE_CHECK=1 (conftest) also
checks every kernel launch against the IR's float64 reference interpreter."""
import inspect
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import comfuse
from comfuse import settings
from comfuse.bench.workloads import SUITE
from comfuse.runtime import build as build_mod, kernel as kernel_mod, region as region_mod

from helpers import DEVICE, as_tuple, assert_matches_reference, quiet_notices, randn, weight

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 16, 16), (37, 29, 50), (64, 16, 130)]  # M=1, odd sizes, N past a power of two


def compile_and_run(fn, args):
    with quiet_notices():
        compiled = comfuse.compile(fn, args)
        out = compiled(*args)
    return compiled, out


@pytest.mark.parametrize("name", list(SUITE))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["M1", "odd", "wide"])
def test_suite_matches_reference(name, dtype, shape):
    wl = SUITE[name]
    args = wl.inputs(*shape, dtype=dtype, device=DEVICE, seed=zlib.crc32(f"{name}{shape}".encode()) % 1000)
    compiled, out = compile_and_run(wl.fn, args)
    assert all(r.fused for r in compiled.report.regions), str(compiled.report)
    assert_matches_reference(wl.fn, args, out)
    eager = as_tuple(wl.fn(*args))
    for o, e in zip(as_tuple(out), eager):
        assert o.shape == e.shape and o.dtype == e.dtype


def test_column_strip_reductions():
    fns = {
        "softmax_dim0": lambda x, w: torch.softmax(x @ w, dim=0),
        "layer_norm_over_M": lambda x, w, g: (lambda y: (y - y.mean(0)) * torch.rsqrt(y.var(0, unbiased=False) + 1e-5) * g)(x @ w),
    }
    for name, fn in fns.items():
        args = (randn(40, 24), weight(24, 33)) + ((randn(33),) if "layer" in name else ())
        compiled, out = compile_and_run(fn, args)
        (r,) = compiled.report.regions
        assert r.fused and "column strip" in r.plan, name
        assert_matches_reference(fn, args, out)


def test_batched_and_3d_inputs():
    fn = lambda q, k, v_bias: torch.softmax(q @ k.transpose(1, 2) / 8.0 + v_bias, -1)  # noqa: E731
    args = (randn(3, 17, 16), randn(3, 21, 16), randn(21))
    compiled, out = compile_and_run(fn, args)
    assert compiled.report.regions[0].fused
    assert_matches_reference(fn, args, out)
    lin = lambda x, W, b, r: F.layer_norm(F.linear(x, W, b) + r, (24,))  # noqa: E731
    args = (randn(2, 7, 16), randn(24, 16), randn(24), randn(2, 7, 24))
    compiled, out = compile_and_run(lin, args)
    assert compiled.report.regions[0].fused and out.shape == (2, 7, 24)
    assert_matches_reference(lin, args, out)


def test_multi_output_pre_norm_block():
    def block(x, w, r, g):
        h = x @ w + r
        return h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    args = (randn(20, 16, dtype=torch.bfloat16), weight(16, 40, dtype=torch.bfloat16),
            randn(20, 40, dtype=torch.bfloat16), randn(40, dtype=torch.bfloat16))
    compiled, out = compile_and_run(block, args)
    assert len(compiled.report.regions[0].outputs) == 2
    assert_matches_reference(block, args, out)


def test_non_contiguous_and_transposed_inputs():
    def f(x, w, b, r):
        return F.layer_norm(x @ w + b + r, (w.shape[1],))
    x = randn(24, 40)[:, ::2]            # strided rows
    w = randn(36, 20).t()                # transposed weight
    b = randn(72)[::2]                   # strided bias
    r = randn(36, 24).t()                # transposed residual
    args = (x, w, b, r)
    compiled, out = compile_and_run(f, args)
    assert compiled.report.regions[0].fused
    assert_matches_reference(f, args, out)


def test_wide_unaligned_rows_are_returned_aligned():
    """An output whose rows are wide and not a whole number of 16-byte units (GPT-2's 50257
    logits a row) is allocated with its rows padded to one, as Inductor's pad_mm lays them out,
    so TMA and vectorised stores can write them; narrow rows stay packed; values are eager's."""
    from comfuse.runtime.operands import output_strides
    assert output_strides((8, 1024, 50257), torch.bfloat16) == (1024 * 50264, 50264, 1)
    assert output_strides((4, 1025), torch.float32) == (1028, 1)
    assert output_strides((16, 57), torch.bfloat16) == (57, 1)
    assert output_strides((16, 1024), torch.bfloat16) == (1024, 1)
    assert output_strides((1105, ), torch.bfloat16) == (1, )
    assert output_strides((2, 1025), torch.float32, rows=False) == (1025, 1)  # (per-row: [batch, sequence])

    def f(x, w, t):
        y = x @ w
        return y, F.cross_entropy(y, t, reduction="none")
    args = (randn(32, 16), randn(16, 1105), torch.randint(0, 1105, (32, )))
    compiled, out = compile_and_run(f, args)
    assert compiled.report.regions[0].fused
    assert out[0].stride() == (1108, 1), out[0].stride()
    assert_matches_reference(f, args, out)

    def per_row(x, w, t):  # a per-row output [batch, sequence] of 1025 stays packed
        return F.cross_entropy((x @ w).flatten(0, 1), t.flatten(), reduction="none").view(t.shape)
    args = (randn(2, 1025, 16), randn(16, 40), torch.randint(0, 40, (2, 1025)))
    compiled, out = compile_and_run(per_row, args)
    assert compiled.report.regions[0].fused, str(compiled.report)
    assert out.stride() == (1025, 1), out.stride()
    assert_matches_reference(per_row, args, out)


def test_nan_and_inf_propagate_as_in_eager():
    def f(x, w, b):
        return torch.softmax(x @ w + b, -1), torch.relu(x @ w) + b
    x, w, b = randn(8, 16), weight(16, 24), randn(24)
    x[2, 3] = float("nan")
    b[5] = float("inf")
    compiled, out = compile_and_run(f, (x, w, b))
    eager = f(x, w, b)
    for o, e in zip(out, eager):
        assert torch.equal(o.isnan(), e.isnan())
        assert torch.equal(o.isinf(), e.isinf())
        finite = ~(e.isnan() | e.isinf())
        torch.testing.assert_close(o[finite], e[finite], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("M,K,N", [(0, 8, 16), (8, 0, 16), (8, 16, 0)])
def test_zero_size_dimensions(M, K, N):
    def f(x, w, b):
        return torch.relu(x @ w + b) * 2.0, F.layer_norm(x @ w, (N,))
    args = (randn(M, K), weight(K, N), randn(N))
    _, out = compile_and_run(f, args)
    for o, e in zip(out, f(*args)):
        assert o.shape == e.shape
        torch.testing.assert_close(o, e, equal_nan=True)


def test_new_shapes_dtypes_and_devices_respecialise():
    fn = SUITE["ln_postnorm"].fn
    wl = SUITE["ln_postnorm"]
    f32 = torch.float32
    compiled, _ = compile_and_run(fn, wl.inputs(16, 16, 32, dtype=f32, device=DEVICE))
    for args in [wl.inputs(9, 16, 32, dtype=f32, device=DEVICE), wl.inputs(16, 24, 48, dtype=f32, device=DEVICE),
                 wl.inputs(16, 16, 32, dtype=torch.bfloat16, device=DEVICE)]:
        with quiet_notices():
            out = compiled(*args)
        assert_matches_reference(fn, args, out)
    assert len(compiled._graphs) == 4


@pytest.mark.skipif("recompile_limit" not in inspect.signature(torch.compile).parameters,
                    reason="this torch.compile takes no recompile_limit of a function's own")
def test_max_specializations_caps_the_graphs_of_a_function():
    """COMFUSE_MAX_SPECIALIZATIONS is Dynamo's recompile limit for the function (read when it
    is compiled): beyond it, calls run eagerly, with eager's result."""
    wl = SUITE["softmax"]
    with settings.override(max_specializations=2):
        compiled, _ = compile_and_run(wl.fn, wl.inputs(8, 16, 24, device=DEVICE))
    for m in (9, 10, 11):
        args = wl.inputs(m, 16, 24, device=DEVICE)
        with quiet_notices():
            torch.testing.assert_close(compiled(*args), wl.fn(*args))
    assert len(compiled._graphs) == 2


def test_keyword_arguments_and_signature():
    def f(x, w, scale=2.0):
        return torch.tanh(x @ w) * scale
    args = (randn(4, 8), weight(8, 16))
    compiled, _ = compile_and_run(f, args)
    assert compiled.__name__ == "f"
    out = compiled(x=args[0], w=args[1])
    assert_matches_reference(f, args, out)


def test_compilation_failure_falls_back_with_a_warning(monkeypatch):
    from comfuse import pipeline
    def boom(plan):
        raise RuntimeError("synthetic code generator failure")
    monkeypatch.setattr(pipeline, "build", boom)
    fn = SUITE["softmax"].fn
    args = SUITE["softmax"].inputs(8, 16, 24, device=DEVICE)
    with pytest.warns(comfuse.ComfuseWarning, match="synthetic code generator failure"):
        compiled = comfuse.compile(fn, args)
    (r,) = compiled.report.regions
    assert not r.fused and "compilation failed" in r.reason
    torch.testing.assert_close(compiled(*args), fn(*args))
    with settings.override(strict=True), pytest.raises(RuntimeError, match="synthetic"):
        comfuse.compile(fn, args)


def test_kernel_failure_at_launch_falls_back_with_a_warning(monkeypatch):
    fn = SUITE["rmsnorm"].fn
    args = SUITE["rmsnorm"].inputs(8, 16, 24, device=DEVICE)
    compiled = comfuse.compile(fn, args)

    def broken(self, *a, **k):
        raise RuntimeError("synthetic launch failure")
    monkeypatch.setattr(kernel_mod.Kernel, "launch", broken)
    with pytest.warns(comfuse.FallbackWarning, match="synthetic launch failure"):
        out = compiled(*args)
    torch.testing.assert_close(out, fn(*args))
    assert not compiled.report.regions[0].fused
    # (an unexpected fallback fails a test: conftest turns FallbackWarning into an error; the
    # example inputs' call inside comfuse.compile is the first launch)
    with pytest.raises(comfuse.FallbackWarning, match="synthetic launch failure"):
        comfuse.compile(fn, SUITE["rmsnorm"].inputs(10, 16, 24, device=DEVICE))
    with settings.override(strict=True), pytest.raises(RuntimeError, match="synthetic launch"):
        comfuse.compile(fn, SUITE["rmsnorm"].inputs(9, 16, 24, device=DEVICE))


def test_inputs_requiring_grad_train_through_the_backend():
    """Inputs that require grad: the call goes through torch.compile with comfuse's backend
    (fused forward, Inductor's backward), with a notice; the gradients are eager's."""
    from comfuse import inductor_pass
    fn = SUITE["softmax"].fn
    x, w = randn(4, 8), weight(8, 16)
    compiled = comfuse.compile(fn, (x, w))
    w.requires_grad_(True)
    inductor_pass.REPORTS.clear()
    with pytest.warns(comfuse.ComfuseWarning, match="trains through torch.compile"):
        out = compiled(x, w)
    assert any(r.fused for rep in inductor_pass.REPORTS for r in rep.regions), inductor_pass.REPORTS
    (out * torch.arange(16.0, device=DEVICE)).sum().backward()
    got = w.grad.clone()
    w.grad = None
    (fn(x, w) * torch.arange(16.0, device=DEVICE)).sum().backward()
    torch.testing.assert_close(got, w.grad)


class _Block(torch.nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.proj, self.drop, self.norm = torch.nn.Linear(16, 32), torch.nn.Dropout(p), torch.nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.drop(self.proj(x)))


def test_trainable_parameters_train():
    """A module whose parameters require grad trains through torch.compile with comfuse's
    backend: its forward region fused, Inductor's backward, every gradient eager's (none may
    be silently lost). The example call compiles the forward, the first backward the backward."""
    model, x = _Block().to(DEVICE), randn(8, 16)
    with pytest.warns(comfuse.ComfuseWarning, match="parameters require grad"):
        compiled = comfuse.compile(model, (x,))
    assert any(r.fused for r in compiled.report.regions), str(compiled.report)
    assert all(r.anchor.startswith("forward graph") for r in compiled.report.regions)
    out = compiled(x)
    (out * torch.arange(32.0, device=DEVICE)).sum().backward()
    assert any(r.anchor.startswith("backward graph") for r in compiled.report.regions), str(compiled.report)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    (model(x) * torch.arange(32.0, device=DEVICE)).sum().backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (got - want).norm() / want.norm() < 1e-5  # (all gradients as one vector; fp32 sums reordered)


def test_example_inputs_compile_before_comfuse_compile_returns():
    """The example call captures, builds and runs the graph inside comfuse.compile: the report
    and the fused modules are there at once, and a call with the same inputs builds nothing."""
    fn = SUITE["softmax"].fn
    args = SUITE["softmax"].inputs(8, 16, 24, device=DEVICE)
    with quiet_notices():
        compiled = comfuse.compile(fn, args)
    assert compiled.report.regions[0].fused and len(compiled.fused_regions()) == 1, str(compiled.report)
    assert len(compiled._graphs) == 1
    with quiet_notices():
        assert_matches_reference(fn, args, compiled(*args))
    assert len(compiled._graphs) == 1
    with pytest.raises(TypeError, match="tuple or list"):
        comfuse.compile(fn, args[0])
    with pytest.raises(TypeError, match="expects a callable"):
        comfuse.compile(None, args)


def test_the_example_call_leaves_the_random_state_as_it_found_it():
    model, x = _Block(p=0.5).to(DEVICE).train(), randn(8, 16)
    with torch.no_grad():
        torch.manual_seed(1)
        with quiet_notices():
            compiled = comfuse.compile(model, (x,))
            got = compiled(x)
        torch.manual_seed(1)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)


def test_a_replaced_parameter_or_submodule_gives_eagers_result():
    model, x = _Block().to(DEVICE).eval(), randn(8, 16)
    with torch.no_grad(), quiet_notices():
        compiled = comfuse.compile(model, (x,))
        assert compiled.report.regions and compiled.report.regions[0].fused, str(compiled.report)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        model.proj.weight = torch.nn.Parameter(weight(16, 32).T.contiguous())
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        model.proj = torch.nn.Linear(16, 32).to(DEVICE)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            model.norm.weight.mul_(2.0)  # (in place: the next call reads it)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        assert compiled.report.regions[0].fused, str(compiled.report)


def test_train_after_compiling_in_eval_mode_applies_dropout():
    model, x = _Block(p=1.0).to(DEVICE).eval(), randn(8, 16)
    with torch.no_grad(), quiet_notices():
        compiled = comfuse.compile(model, (x,))
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        model.train()  # (dropout with p=1 zeroes its input: the norm's output is its bias)
        torch.testing.assert_close(compiled(x), model.norm.bias.expand(8, 32))
        model.eval()
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


SQUASH = True


def _squashed(x, w):
    return torch.tanh(x @ w) if SQUASH else torch.sigmoid(x @ w) * 3.0


class _Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.gate = torch.nn.Linear(16, 32), True

    def forward(self, x):
        h = self.proj(x)
        return torch.relu(h) if self.gate else torch.softmax(h, -1)


def test_a_changed_python_branch_gives_eagers_result():
    """A branch on a global or on a module's attribute: Dynamo guards what it read."""
    global SQUASH
    x, w = randn(8, 16), weight(16, 32)
    with quiet_notices():
        compiled = comfuse.compile(_squashed, (x, w))
        assert_matches_reference(_squashed, (x, w), compiled(x, w))
        try:
            SQUASH = False
            assert_matches_reference(_squashed, (x, w), compiled(x, w))
        finally:
            SQUASH = True
        model = _Gated().to(DEVICE).eval()
        with torch.no_grad():
            compiled = comfuse.compile(model, (x,))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
            model.gate = False
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert compiled.report.regions[0].fused and compiled.report.regions[0].schedule, str(compiled.report)


def test_a_grad_mode_switch_gives_eagers_result():
    """Compiled without grad, a module trains once grad is on (and its gradients are eager's);
    back under no_grad it runs comfuse's graph again, without an autograd graph."""
    model, x = _Block().to(DEVICE), randn(8, 16)
    with torch.no_grad(), quiet_notices():
        compiled = comfuse.compile(model, (x,))
        assert not compiled(x).requires_grad
    assert compiled.fused_regions() and compiled.report.regions[0].fused
    with quiet_notices():
        out = compiled(x)
    assert out.requires_grad
    out.sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad(), quiet_notices():
        out = compiled(x)
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    assert not out.requires_grad
    assert len(compiled._graphs) == 2  # (the no-grad graph again: Dynamo's cache still has it)


def test_every_graph_of_a_graph_break_gets_its_regions():
    def two(x, w1, w2):
        h = torch.relu(x @ w1)
        torch._dynamo.graph_break()
        return torch.softmax(h @ w2, -1)
    args = (randn(8, 16), weight(16, 24), weight(24, 12))
    compiled, out = compile_and_run(two, args)
    assert_matches_reference(two, args, out)
    assert len(compiled._graphs) == 2
    for built in compiled._graphs:
        assert [r.fused for r in built.report.regions] == [True], str(built.report)
    assert "exp" in compiled.report.regions[0].ir, str(compiled.report)  # (the last graph's: the softmax)


def test_default_arguments_take_their_defaults():
    def f(x, w, eps=1e-5, scale=2.0):
        return torch.nn.functional.layer_norm(x @ w, (w.shape[1],), eps=eps) * scale
    x, w = randn(8, 16), weight(16, 32)
    compiled, out = compile_and_run(f, (x, w))
    assert compiled.report.regions[0].fused, str(compiled.report)
    assert_matches_reference(f, (x, w), out)
    with quiet_notices():
        assert_matches_reference(lambda x, w: f(x, w, scale=3.0), (x, w), compiled(x, w, scale=3.0))
        if torch.__version__ >= "2.13":  # (Dynamo 2.11 does not guard the defaults of a function it inlines)
            f.__defaults__ = (1e-5, 0.5)
            assert_matches_reference(f, (x, w), compiled(x, w))
            torch.testing.assert_close(compiled(x, w), f(x, w))


def test_fp16_products_beyond_the_range_stay_finite_in_the_epilogue():
    """As the README says: x @ w = 160000 overflows fp16, so eager's softmax is NaN; the fused
    epilogue runs in fp32 and returns the float64 reference's (finite) softmax."""
    def f(x, w):
        return torch.softmax(x @ w, -1)
    x = torch.full((8, 16), 100.0, dtype=torch.float16, device=DEVICE)
    w = torch.full((16, 32), 100.0, dtype=torch.float16, device=DEVICE)
    w[:, 1] = 1.0
    with settings.override(validate="0"):  # (the kernel's numbers, not the first call's check)
        compiled, out = compile_and_run(f, (x, w))
    assert compiled.report.regions[0].fused, str(compiled.report)
    assert f(x, w).isnan().all() and out.isfinite().all()
    torch.testing.assert_close(out.double(), f(x.double(), w.double()), rtol=0, atol=1e-3)


def test_unsupported_graphs_run_unfused_with_a_reason():
    cases = {
        "both axes": lambda x, w: (x @ w) - (x @ w).amax(0) - (x @ w).sum(1, keepdim=True),
        "float64": lambda x, w: torch.softmax(x.double() @ w.double(), -1),
    }
    for expect, fn in cases.items():
        args = (randn(6, 8), weight(8, 10))
        report = comfuse.explain(fn, args)
        assert not report.regions[0].fused and expect.split()[0] in report.regions[0].reason, str(report)
        compiled, out = compile_and_run(fn, args)
        torch.testing.assert_close(out, fn(*args))


def test_rows_wider_than_budget_run_unfused_and_say_why(monkeypatch):
    import comfuse.planner.schedules as schedules
    monkeypatch.setattr(schedules, "ROW_BUDGET", 16 * 256)
    fn = SUITE["softmax"].fn
    args = SUITE["softmax"].inputs(8, 16, 300, device=DEVICE)
    with settings.override(schedule="row_in_cta"):
        compiled, out = compile_and_run(fn, args)
    (r,) = compiled.report.regions
    assert not r.fused and "wider than one program holds" in r.reason
    torch.testing.assert_close(out, fn(*args))


def test_disable_setting_runs_everything_unfused():
    fn = SUITE["mblr"].fn
    args = SUITE["mblr"].inputs(8, 16, 24, device=DEVICE)
    compiled = comfuse.compile(fn, args)
    with settings.override(disable=True):
        torch.testing.assert_close(compiled(*args), fn(*args))


def test_every_environment_variable_reaches_the_settings_when_it_changes(monkeypatch):
    """settings.get() remembers its result per snapshot of the variables it reads: each one
    _read takes must be in that snapshot, or a change after the first call goes unseen; a bad
    value is refused with the variable's name."""
    import inspect
    import re
    read = set(re.findall(r'"(COMFUSE_[A-Z0-9_]+)"', inspect.getsource(settings._read)))
    assert read and read <= set(settings._ENV), sorted(read - set(settings._ENV))
    assert len(read) == len(settings.FIELDS)  # (one variable a setting)
    monkeypatch.setenv("COMFUSE_FUEL", "3")
    assert settings.get().fuel == 3
    monkeypatch.setenv("COMFUSE_FUEL", "4")
    assert settings.get().fuel == 4
    monkeypatch.setenv("COMFUSE_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="COMFUSE_AUTOTUNE"):
        settings.get()


def test_fuel_caps_the_number_of_fused_regions():
    def two(x, w1, w2):
        return torch.relu(x @ w1), torch.softmax(x @ w2, -1)
    args = (randn(4, 8), weight(8, 16), weight(8, 12))
    with settings.override(fuel=1):
        report = comfuse.explain(two, args)
    assert [r.fused for r in report.regions] == [True, False]
    assert "fuel" in report.regions[1].reason


def test_fused_regions_lists_what_runs():
    """CompiledFunction.fused_regions: the regions of the latest specialisation, each with its
    plan and the kernel it runs (for scripts that trace or time one region)."""
    def two(x, w1, w2):
        return torch.relu(x @ w1), torch.softmax(x @ w2, -1)
    args = (randn(4, 8), weight(8, 16), weight(8, 12))
    with settings.override(fuel=1):
        compiled = comfuse.compile(two, args)
    (region,) = compiled.fused_regions()
    assert region.plan.schedule == compiled.report.regions[0].schedule
    compiled(*args)
    # (kernels are shared by name: one built for an equal plan found another way may serve it)
    assert build_mod.kernel_name(region.kernel.plan) == build_mod.kernel_name(region.plan)
    assert comfuse.compile(lambda x: x + 1, (randn(3), )).fused_regions() == []


@pytest.mark.parametrize("name", ["ln_postnorm", "softmax", "linear_ce", "multi_stage"])
def test_tma_mainloop_matches_reference(name):
    wl = SUITE[name]
    args = wl.inputs(40, 24, 96, dtype=torch.bfloat16, device=DEVICE)
    with settings.override(plan="mainloop=tma"):
        compiled, out = compile_and_run(wl.fn, args)
    (r,) = compiled.report.regions
    assert r.fused and "tma mainloop" in r.plan, str(compiled.report)
    assert_matches_reference(wl.fn, args, out)


@pytest.mark.parametrize("schedule", ["tile", "row_in_cta", "cooperative"])
def test_side_inputs_loaded_before_the_mainloop_match_reference(schedule):
    if schedule == "tile":
        fn = lambda x, w, r: F.gelu(x @ w) + r  # noqa: E731
        args = (randn(40, 24), weight(24, 96), randn(40, 96))
    else:
        fn, args = SUITE["ln_postnorm"].fn, SUITE["ln_postnorm"].inputs(40, 24, 96, device=DEVICE)
    with settings.override(plan="prefetch=1", schedule=schedule):
        compiled, out = compile_and_run(fn, args)
    (r,) = compiled.report.regions
    assert r.fused and r.schedule == schedule and "before the mainloop" in r.plan, str(compiled.report)
    text = open(r.kernel_path).read()
    assert "loaded before the mainloop" in text
    assert_matches_reference(fn, args, out)


@pytest.mark.parametrize("mainloop", ["tma", "pointer"])
@pytest.mark.parametrize("case", ["gelu_bias_residual", "linear_bf16", "batched"])
def test_persistent_tile_plans_match_reference(case, mainloop):
    """The persistent tile form: a grid of at most one program per SM (three under the
    interpreter), each walking tiles pid, pid + PROGRAMS, ... with its tile and K loops
    fused; rows and columns not whole tiles, several tiles per program."""
    if case == "gelu_bias_residual":
        fn = lambda x, w, b, r: F.gelu(x @ w + b) + r  # noqa: E731
        args = (randn(70, 24), weight(24, 100), randn(100), randn(70, 100))
    elif case == "linear_bf16":
        fn = lambda x, W: torch.relu(F.linear(x, W))  # noqa: E731  (W read K-major)
        args = (randn(37, 32, dtype=torch.bfloat16), randn(136, 32, dtype=torch.bfloat16))
    else:
        if mainloop == "tma":
            pytest.skip("batched GEMMs use pointer loads")
        fn = lambda x, w: torch.sigmoid(torch.bmm(x, w))  # noqa: E731
        args = (randn(3, 40, 24), randn(3, 24, 72))
    with settings.override(plan=f"persistent=1,mainloop={mainloop}", schedule="tile"):
        compiled, out = compile_and_run(fn, args)
    (r,) = compiled.report.regions
    assert r.fused and "persistent grid" in r.plan, str(compiled.report)
    assert "flatten=True" in open(r.kernel_path).read()
    assert_matches_reference(fn, args, out)


def test_tma_mainloop_with_transposed_weight_and_column_strip():
    lin = lambda x, W, b: F.gelu(F.linear(x, W, b))  # noqa: E731  (W is read K-major)
    col = lambda x, w: torch.softmax(x @ w, 0)  # noqa: E731  (run transposed)
    for fn, args in [(lin, (randn(37, 24), randn(40, 24), randn(40))), (col, (randn(48, 24), weight(24, 40)))]:
        with settings.override(plan="mainloop=tma"):
            compiled, out = compile_and_run(fn, args)
        assert "tma mainloop" in compiled.report.regions[0].plan
        assert_matches_reference(fn, args, out)


def test_tma_needs_aligned_rows():
    args = (randn(8, 16, dtype=torch.bfloat16), weight(16, 50, dtype=torch.bfloat16))  # 100-byte rows
    with settings.override(plan="mainloop=tma"):
        report = comfuse.explain(SUITE["softmax"].fn, args)
    assert not report.regions[0].fused and "16-byte aligned" in report.regions[0].reason



def test_a_misaligned_call_runs_unfused_and_the_next_aligned_call_is_fused_again():
    """A TMA operand at an odd address cannot get a descriptor: that call runs the plain
    ops (a notice says so) and the region stays fused for the calls after it."""
    fn = SUITE["rmsnorm"].fn
    args = SUITE["rmsnorm"].inputs(32, 16, 64, device=DEVICE)
    with settings.override(plan="mainloop=tma"):
        compiled, out = compile_and_run(fn, args)
        x = torch.randn(32 * 16 + 1, device=DEVICE, dtype=args[0].dtype)[1:].view(32, 16)  # 2 bytes off
        with pytest.warns(comfuse.ComfuseWarning, match="16-byte aligned"):
            shifted = compiled(x, *args[1:])
        assert_matches_reference(fn, (x, *args[1:]), shifted)
        assert compiled.report.regions[0].fused, str(compiled.report)
        assert_matches_reference(fn, args, compiled(*args))
        assert compiled.report.regions[0].fused

SPLIT_CASES = {
    "ce_mean": lambda x, w, t: F.cross_entropy(x @ w, t),
    "ce_none_ignore": lambda x, w, t: F.cross_entropy((x @ w).float(), t, ignore_index=3, reduction="none"),
    "ce_sum_smoothing_free": lambda x, w, t: F.cross_entropy(x @ w, t, reduction="sum"),
    "logsumexp": lambda x, w, t: torch.logsumexp(x @ w, -1),
    "row_stats": lambda x, w, t: ((x @ w).relu().sum(-1), (x @ w).amax(-1), (x @ w).amin(-1), (x @ w).mean(-1)),
    "nll_of_log_softmax": lambda x, w, t: -torch.log_softmax(x @ w, -1).gather(1, t[:, None]).squeeze(1),
    # variance far from zero mean: E[x^2] - E[x]^2 would lose the digits; moments do not
    "var_mean_offset": lambda x, w, t: torch.var_mean(x @ w + 300.0, -1),
    "std_keepdim": lambda x, w, t: torch.std(x @ w, -1, keepdim=True),
    # an LM head's logits, which the model returns, beside the loss: the slices write the tile
    "logits_and_ce": lambda x, w, t: ((x @ w), F.cross_entropy((x @ w).float(), t, reduction="none")),
    "scaled_logits_and_lse": lambda x, w, t: ((x @ w) * 0.5, torch.logsumexp(x @ w, -1)),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_split_schedule_for_per_row_outputs(name, dtype):
    fn = SPLIT_CASES[name]
    M, K, N = 37, 24, 100
    args = (randn(M, K, dtype=dtype), weight(K, N, dtype=dtype),
            torch.randint(0, 5 if "ignore" in name else N, (M,), device=DEVICE))
    with settings.override(schedule="split"):
        compiled, out = compile_and_run(fn, args)
    (r,) = compiled.report.regions
    assert r.fused and r.schedule == "split", str(compiled.report)
    assert_matches_reference(fn, args, out)


@pytest.mark.filterwarnings("ignore::comfuse.ComfuseWarning")
@pytest.mark.parametrize("per", [1, 2, 3])
@pytest.mark.parametrize("name", ["ce_none_ignore", "var_mean_offset", "logits_and_ce"])
@pytest.mark.parametrize("N", [100, 96], ids=["N100", "N96"])
def test_split_slices_agree(monkeypatch, name, per, N):
    """Every split variant the autotuner may time (tiles per slice, groups of 2 row blocks)
    gives the planned kernel's outputs, and both match the reference, also where N is whole
    tiles but the slices pad past the last one (no column masks then would read past N)."""
    import dataclasses
    seen = {}
    real = region_mod.FusedRegion.forward
    monkeypatch.setattr(region_mod.FusedRegion, "forward",
                        lambda self, *ext: seen.setdefault("call", (self, ext)) and real(self, *ext))
    fn = SPLIT_CASES[name]
    M, K = 70, 24  # N = 96: whole tiles, but slices of 2 or 3 tiles run past the last one
    args = (randn(M, K), weight(K, N), torch.randint(0, 5, (M,), device=DEVICE))
    with settings.override(schedule="split"):
        compiled, out = compile_and_run(fn, args)
    module, ext = seen["call"]
    device = ext[module.operands[0]].device
    base = module.plan
    planned = [o.clone() for o in module.run(ext, device)]
    tiles = -(-N // base.block_n)
    variant = dataclasses.replace(base, tiles_n=tiles, group_m=2, form=dataclasses.replace(
        base.form, chunks=-(-tiles // per), tiles_per_chunk=per))
    assert variant != base
    got = module.run(ext, device, build_mod.build(variant))
    for g, w in zip(got, planned):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert_matches_reference(fn, args, out)


@pytest.mark.filterwarnings("ignore::comfuse.ComfuseWarning")
def test_split_column_test_is_exact_for_targets_beyond_32_bits(monkeypatch):
    """The kernel compares a target with its column index in 32 bits (codegen: a target
    outside [0, 2^31) becomes -1). Targets beyond 32 bits or negative give the region's
    value for a target no column equals, NaN (its count of matches, a per-row bound since
    ``one_hot_counts``, is 0), and valid ones the right loss. (The ignore mask is computed
    outside the region from the call's targets, none of them the ignore index.)"""
    seen = {}
    real = region_mod.FusedRegion.forward
    monkeypatch.setattr(region_mod.FusedRegion, "forward",
                        lambda self, *ext: seen.setdefault("call", (self, ext)) and real(self, *ext))
    fn = SPLIT_CASES["ce_none_ignore"]
    M, K, N = 8, 24, 100
    args = (randn(M, K), weight(K, N), torch.arange(10, 10 + M, device=DEVICE))
    with settings.override(schedule="split"):
        compiled, out = compile_and_run(fn, args)
    module, ext = seen["call"]
    odd = torch.tensor([5, 2**32 + 5, -1, 3, 2**31, 2**31 - 1, -2**40, 99], device=DEVICE)
    k = next(i for i, e in enumerate(ext) if isinstance(e, torch.Tensor) and e.dtype == torch.int64)
    ext = list(ext)
    ext[k] = odd.view(ext[k].shape)
    (got,) = module.run(ext, ext[module.operands[0]].device)
    got = got.reshape(-1)
    picked = -torch.log_softmax((args[0] @ args[1]).double(), -1)
    assert torch.isnan(got[[1, 2, 4, 5, 6]]).all(), got  # no column equals these targets
    torch.testing.assert_close(got[[0, 3, 7]].double(), picked[[0, 3, 7], [5, 3, 99]], rtol=1e-4, atol=1e-4)


def test_split_is_refused_for_full_tile_outputs_that_need_a_reduction():
    with settings.override(schedule="split"):
        report = comfuse.explain(SUITE["softmax"].fn, SUITE["softmax"].inputs(8, 16, 40, device=DEVICE))
    assert not report.regions[0].fused and "not one pass" in report.regions[0].reason
    assert "needs a reduction" in report.regions[0].reason


def test_split_writes_a_full_tile_that_needs_no_reduction_once_in_the_slices():
    """The LM head's logits beside its loss: the slice kernel stores the logits tile by tile
    as it reduces them; the combine kernel writes only the per-row loss."""
    wl = SUITE["lm_head_loss"]
    args = wl.inputs(37, 24, 100, dtype=torch.bfloat16, device=DEVICE)
    with settings.override(schedule="split"):
        compiled, out = compile_and_run(wl.fn, args)
    (r,) = compiled.report.regions
    assert r.fused and r.schedule == "split", str(compiled.report)
    source = open(r.kernel_path).read()
    first, combine = source.split("_combine(", 1)
    assert first.count("tl.store(out0_ptr") == 1 and "tl.store(out1_ptr" not in first
    assert "tl.store(out0_ptr" not in combine and combine.count("tl.store(out1_ptr") == 1
    assert_matches_reference(wl.fn, args, out)


def test_chained_gemms_fuse_into_one_chain():
    """A DLRM-style MLP: the three GEMMs and their ReLUs become one back-to-back kernel."""
    def mlp(x, w1, w2, w3):
        return torch.relu(torch.relu(torch.relu(x @ w1) @ w2) @ w3)
    args = (randn(33, 24), weight(24, 40), weight(40, 20), weight(20, 16))
    compiled, out = compile_and_run(mlp, args)
    assert [(r.kind, r.fused) for r in compiled.report.regions] == [("b2b", True)]
    assert_matches_reference(mlp, args, out)


def test_cross_entropy_never_writes_logits():
    wl = SUITE["linear_ce"]
    args = wl.inputs(16, 24, 40, device=DEVICE)
    compiled, out = compile_and_run(wl.fn, args)
    (r,) = compiled.report.regions
    assert r.fused and all("[M,N]" not in line for line in r.ir.splitlines() if line.strip().startswith("out"))
    assert_matches_reference(wl.fn, args, out)


def test_constants_from_scalar_tensors_and_fills():
    def f(x, w):
        y = x @ w
        return torch.where(y > 0, y, torch.zeros_like(y)) * torch.tensor(3.0) + torch.full_like(y, 0.5)
    args = (randn(5, 8), weight(8, 12))
    compiled, out = compile_and_run(f, args)
    assert compiled.report.regions[0].fused
    assert_matches_reference(f, args, out)


def test_integer_and_boolean_side_inputs():
    def f(x, w, mask, idx):
        y = (x @ w).masked_fill(mask, -math.inf)
        return torch.log_softmax(y, -1).gather(1, idx)
    x, w = randn(6, 8), weight(8, 12)
    mask = torch.zeros(6, 12, dtype=torch.bool, device=DEVICE)
    mask[:, 7:] = True
    idx = torch.randint(0, 7, (6, 1), device=DEVICE)
    compiled, out = compile_and_run(f, (x, w, mask, idx))
    assert compiled.report.regions[0].fused
    assert_matches_reference(f, (x, w, mask, idx), out)


@pytest.mark.parametrize("name", ["rmsnorm", "softmax", "ln_postnorm", "multi_stage"])
def test_one_tile_strips_run_the_gpu_form_and_match_reference(name):
    """A cooperative strip of one tile never waits for another program, so the interpreter
    runs the GPU form of the kernel itself (two slots walking four strips each way),
    including its workspace buffers and counters."""
    wl = SUITE[name]
    args = wl.inputs(200, 24, 16, device=DEVICE)
    with settings.override(schedule="cooperative"):
        compiled, out = compile_and_run(wl.fn, args)
    (r,) = compiled.report.regions
    assert r.fused and r.schedule == "cooperative", str(compiled.report)
    assert_matches_reference(wl.fn, args, out)


def test_strip_counters_pass_the_int32_limit():
    """The arrival counters only grow, so a long-lived process takes them past 2**31: they are
    int64 (an int32 counter would wrap there and its strips would wait forever). Set just
    below the limit, two more calls cross it and still match the reference."""
    wl = SUITE["softmax"]
    args = wl.inputs(200, 24, 16, device=DEVICE)
    with settings.override(schedule="cooperative"):
        compiled, out = compile_and_run(wl.fn, args)
        (region,) = compiled.fused_regions()
        (_, counters), = region.kernel._scratch.values()
        assert counters.dtype == torch.int64
        counters.fill_(2**31 - 2)
        for _ in range(2):
            out = compiled(*args)
    assert_matches_reference(wl.fn, args, out)
    assert counters.min().item() > 2**31 - 2


def test_layer_norm_exchanges_once_with_tile_moments():
    """LayerNorm's mean and variance cross the strip in one exchange: each tile publishes its
    sum and its own centred sum of squares, merged by Chan's formula; rows far from zero
    mean (|mean| / std ~ 300) and a last tile of 4 columns (N = 100 in tiles of 32) stay
    within tolerance of float64."""
    fn = lambda x, w, g, b: F.layer_norm(x @ w + 300.0, (100,), g, b)  # noqa: E731
    args = (randn(150, 24), weight(24, 100), randn(100), randn(100))
    with settings.override(schedule="cooperative"):
        compiled, out = compile_and_run(fn, args)
    (r,) = compiled.report.regions
    assert r.fused and "exchange 1 time(s)" in r.plan, r.plan
    assert_matches_reference(fn, args, out)


def test_settings_kept_from_a_compilation_sit_beneath_those_of_the_moment():
    """``overrides_now`` (what a region module keeps of the settings it was made under) holds
    at ``get(pinned)`` and inside ``beneath``, below any override set at the call."""
    default = settings.get().fuel
    with settings.override(autotune="0", fuel=3):
        pinned = settings.overrides_now()
    assert settings.get().fuel == default
    assert settings.get(pinned).autotune == "0" and settings.get(pinned).fuel == 3
    with settings.override(fuel=5):
        assert settings.get(pinned).fuel == 5 and settings.get(pinned).autotune == "0"
        with settings.beneath(pinned):
            assert settings.get().fuel == 5 and settings.get().autotune == "0"
    assert settings.get(pinned) is settings.get(pinned)  # (remembered: read on every call)
