"""Property tests: random epilogue DAGs, fused and compared with float64 PyTorch.

Each example draws a dtype, M, N, K (1 and sizes that are not multiples of 16
included), a reduction axis (rows or columns), a schedule (the planner's choice, or
the cooperative strip forced, whose tiles exchange partials) and a program of elementwise ops,
broadcast side inputs and at least two chained reductions, sometimes with an
extra output. It must be fused, and its result must match the same program run
in float64 (and, through COMFUSE_CHECK, the IR's reference interpreter).
"""
import dataclasses
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings, strategies as st

import comfuse
from comfuse.frontend.capture import capture
from comfuse.frontend.regions import find_regions
from comfuse.ir import evaluate, verify
from comfuse.planner import cse, dce, transpose

from helpers import DEVICE, PROPERTY_COUNTS, assert_matches_reference, as_tuple

pytestmark = pytest.mark.filterwarnings("ignore:var\\(\\)")  # var over one element: NaN, as eager

EXAMPLES = int(os.environ.get("COMFUSE_PROPERTY_EXAMPLES", "200"))
settings.register_profile("comfuse", max_examples=EXAMPLES, deadline=None,
                          derandomize=bool(os.environ.get("CI")),
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("comfuse")

UNARY = {
    "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "gelu": F.gelu,
    "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "silu": F.silu, "neg": torch.neg,
    "abs": torch.abs, "exp_tanh": lambda v: torch.exp(torch.tanh(v)),
    "log1p_abs": lambda v: torch.log1p(v.abs()), "sqrt_abs1": lambda v: torch.sqrt(v.abs() + 1),
    "clamp": lambda v: torch.clamp(v, -2.0, 2.0), "square": lambda v: torch.clamp(v, -3, 3) ** 2,
    "leaky": lambda v: F.leaky_relu(v, 0.1), "rsqrt_sq1": lambda v: torch.rsqrt(v * v + 1),
}
BINARY = {  # (name, side input kind)
    "add_row": "row", "mul_row": "row", "sub_col": "col", "add_full": "full", "max_full": "full",
    "where_full": "full", "scale": "scalar", "add_prev": None,
    "mul_gemm": "weight",  # v * (x @ w2): the region's second product of x (row strips only)
}
# what elementwise ops compute a side input from before the epilogue reads it (the region
# computes it itself: regions._prologue); "" reads the side input as given
PROLOGUES = {
    "": None,
    "gelu_grad": lambda s: 0.5 * (1 + torch.erf(s * 0.7071067811865476)) + s * torch.exp(-0.5 * s * s) * 0.3989422804014327,
    "sigmoid_scaled": lambda s: torch.sigmoid(s) * 2.0,
    "square_plus_one": lambda s: s * s + 1.0,
}
CHAINED = ["softmax", "log_softmax", "layer_norm", "rms_norm", "sub_max", "div_abs_sum",
           "mul_mean", "sub_logsumexp"]
TERMINAL = ["sum", "amax", "mean", "var"]


@dataclasses.dataclass(frozen=True)
class Program:
    dtype: torch.dtype
    M: int
    K: int
    N: int
    axis: int  # -1: reductions along N (row strip); 0: along M (column strip)
    steps: tuple
    extra_output: int  # index of an intermediate also returned, or -1
    terminal: str  # a reduction whose result is an output, or ""
    seed: int
    schedule: str = ""  # "" lets the planner choose; "cooperative" forces the exchanging strip
    prologue: str = ""  # PROLOGUES: elementwise ops computing each side input (a weight's aside) first

    def side_shapes(self):
        shapes = {"row": (self.N,), "col": (self.M, 1), "full": (self.M, self.N), "scalar": (),
                  "weight": (self.K, self.N)}
        return [shapes[kind] for op, kind in self.steps if op in BINARY and BINARY[op]]


def _reduce(op: str, v: torch.Tensor, d: int) -> torch.Tensor:
    if op == "softmax":
        return torch.softmax(v, d)
    if op == "log_softmax":
        return torch.log_softmax(v, d)
    if op == "layer_norm":
        return (v - v.mean(d, keepdim=True)) * torch.rsqrt(v.var(d, keepdim=True, unbiased=False) + 1e-5)
    if op == "rms_norm":
        return v * torch.rsqrt(v.pow(2).mean(d, keepdim=True) + 1e-5)
    if op == "sub_max":
        return v - v.amax(d, keepdim=True)
    if op == "div_abs_sum":
        return v / (v.abs().sum(d, keepdim=True) + 1.0)
    if op == "mul_mean":  # + 0.5: after layer_norm the mean is zero up to rounding, and a
        # factor of tanh(+-1e-17) made where(v > 0, ...) downstream pick by rounding noise
        return v * torch.tanh(v.mean(d, keepdim=True) + 0.5)
    if op == "sub_logsumexp":
        return v - torch.logsumexp(v, d, keepdim=True)
    raise AssertionError(op)


def build(program: Program):
    def fn(x, w, *side):
        v = x @ w
        values = [v]
        side = list(side)
        for op, _kind in program.steps:
            if op in UNARY:
                v = UNARY[op](v)
            elif op in CHAINED:
                v = _reduce(op, v, program.axis)
            elif op == "add_prev":
                v = v + values[len(values) // 2]
            else:
                s = side.pop(0)
                if PROLOGUES[program.prologue] is not None and op != "mul_gemm":
                    s = PROLOGUES[program.prologue](s)
                if op in ("add_row", "add_full"):
                    v = v + s
                elif op == "mul_row":
                    v = v * s
                elif op == "sub_col":
                    v = v - s
                elif op == "max_full":
                    v = torch.maximum(v, s)
                elif op == "where_full":
                    v = torch.where(v > 0, v, s)
                elif op == "scale":
                    v = v * s
                elif op == "mul_gemm":
                    v = v * (x @ s)
            values.append(v)
        outs = [v]
        if program.extra_output >= 0:
            outs.append(values[min(program.extra_output, len(values) - 1)])
        if program.terminal == "sum":
            outs.append(v.sum(program.axis))
        elif program.terminal == "amax":
            outs.append(v.amax(program.axis))
        elif program.terminal == "mean":
            outs.append(v.mean(program.axis, keepdim=True))
        elif program.terminal == "var":
            outs.append(v.var(program.axis))
        return tuple(outs) if len(outs) > 1 else outs[0]
    return fn


def make_inputs(program: Program):
    g = torch.Generator().manual_seed(program.seed)
    x = torch.randn(program.M, program.K, generator=g)
    w = torch.randn(program.K, program.N, generator=g) / max(program.K, 1) ** 0.5
    side = [torch.randn(*s, generator=g) if s else torch.tensor(1.5) for s in program.side_shapes()]
    side = [t / max(program.K, 1) ** 0.5 if kind == "weight" else t
            for t, kind in zip(side, [k for op, k in program.steps if op in BINARY and BINARY[op]])]
    return tuple(t.to(dtype=program.dtype, device=DEVICE) for t in (x, w, *side))


SIZES = st.one_of(st.sampled_from([1, 2, 15, 16, 17, 33]), st.integers(1, 40))


@st.composite
def programs(draw):
    n_red = draw(st.integers(2, 3))
    others = draw(st.lists(st.sampled_from(sorted(UNARY) + sorted(BINARY)), min_size=0, max_size=5))
    reds = draw(st.lists(st.sampled_from(CHAINED), min_size=n_red, max_size=n_red))
    ops = draw(st.permutations(others + reds))
    axis = draw(st.sampled_from([-1, 0]))
    ops = [op for op in ops if op != "mul_gemm"]
    if axis == -1 and draw(st.booleans()):  # (a column strip multiplies the other way round: no
        # second product of A there)
        ops.insert(draw(st.integers(0, len(ops))), "mul_gemm")
    steps = tuple((op, BINARY.get(op)) for op in ops)
    return Program(
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        M=draw(SIZES), K=draw(SIZES), N=draw(SIZES), axis=axis,
        steps=steps, extra_output=draw(st.integers(-1, len(steps))),
        terminal=draw(st.sampled_from([""] + TERMINAL)), seed=draw(st.integers(0, 2**16)),
        schedule=draw(st.sampled_from(["", "cooperative"])), prologue=draw(st.sampled_from(sorted(PROLOGUES))))


@pytest.mark.timeout(900)  # (on the GPU each example compiles its kernels for sm_90)
@given(programs())
@example(Program(torch.bfloat16, 17, 9, 40, -1, (("relu", None), ("mul_gemm", "weight"), ("softmax", None),
                                                 ("layer_norm", None)), 1, "sum", 3, "cooperative"))
@example(Program(torch.bfloat16, 33, 16, 24, 0, (("add_full", "full"), ("layer_norm", None), ("add_row", "row"),
                                                 ("softmax", None)), -1, "sum", 5, "", "gelu_grad"))
def test_random_epilogues_fuse_and_match_float64(program):
    PROPERTY_COUNTS["random epilogues (fused vs float64)"] += 1
    torch._dynamo.reset()  # (every example compiles build's fn: Dynamo caches at most 256 graphs of one code)
    fn, args = build(program), make_inputs(program)
    reduced = program.N if program.axis == -1 else program.M
    schedule = program.schedule if reduced > 1 else ""  # reductions over one element vanish
    with warnings.catch_warnings(), comfuse.settings.override(schedule=schedule):
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = comfuse.compile(fn, args)
        out = compiled(*args)
    (region,) = compiled.report.regions
    assert region.fused, f"{program}\n{compiled.report}"
    if region.found.dual:
        PROPERTY_COUNTS["random epilogues with a second product of x (fused vs float64)"] += 1
    if any("itself, from what they read" in t for t in region.through):
        PROPERTY_COUNTS["random epilogues computing a side input themselves (fused vs float64)"] += 1
    assert_matches_reference(fn, args, out)
    assert [o.shape for o in as_tuple(out)] == [e.shape for e in as_tuple(fn(*args))]


@settings(max_examples=max(EXAMPLES // 2, 10))
@given(programs())
def test_planner_passes_preserve_meaning(program):
    PROPERTY_COUNTS["planner passes (IR interpreter)"] += 1
    fn, args = build(program), make_inputs(program)
    (cand,) = find_regions(capture(fn, args))
    region = verify(cand.region)
    g = torch.Generator().manual_seed(program.seed)
    s = region.sizes
    a = torch.randn(1, s.M, s.K, generator=g, dtype=torch.float64)
    b = torch.randn(1, s.K, s.N, generator=g, dtype=torch.float64)
    ins = [torch.randn(*[s.of(ax) if ax in i.axes else 1 for ax in "BMN"], generator=g,
                       dtype=torch.float64) if i.dtype.is_floating_point else
           torch.ones(*[s.of(ax) if ax in i.axes else 1 for ax in "BMN"], dtype=i.dtype)
           for i in region.inputs]
    if region.dual:  # (the second product's B after the side inputs)
        ins.append(torch.randn(1, s.K, s.N, generator=g, dtype=torch.float64))
    expect = evaluate(region, a, b, ins)
    simple = verify(cse(dce(region)))
    for e, o in zip(expect, evaluate(simple, a, b, ins)):
        torch.testing.assert_close(o, e, equal_nan=True)
    if region.dual:
        return
    flipped = verify(transpose(simple))
    outs = evaluate(flipped, b.transpose(1, 2), a.transpose(1, 2), [t.transpose(1, 2) for t in ins])
    for e, o in zip(expect, outs):
        torch.testing.assert_close(o.transpose(1, 2), e, equal_nan=True)


LOSSES = {
    "lse": lambda v, t: torch.logsumexp(v, -1),
    "cross_entropy": lambda v, t: F.cross_entropy(v, t, reduction="none"),
    "sum_max_min": lambda v, t: (v.sum(-1), v.amax(-1), v.amin(-1)),
    "mean_var": lambda v, t: (v.mean(-1), v.var(-1, unbiased=False)),
    "nll_plus_mean": lambda v, t: -torch.log_softmax(v, -1).gather(1, t[:, None])[:, 0] + v.mean(-1),
    "centered_square_sum": lambda v, t: ((v - v.mean(-1, keepdim=True)) ** 2).sum(-1),
}
PREFIX = ["relu", "tanh", "gelu", "add_row", "mul_row", "add_full", "scale", "abs", "exp_tanh"]


LOSS_STEPS = {"relu": lambda v, r, f: torch.relu(v), "tanh": lambda v, r, f: torch.tanh(v),
              "gelu": lambda v, r, f: F.gelu(v), "add_row": lambda v, r, f: v + r,
              "mul_row": lambda v, r, f: v * r, "add_full": lambda v, r, f: v + f,
              "scale": lambda v, r, f: v * 1.7, "abs": lambda v, r, f: v.abs(),
              "exp_tanh": lambda v, r, f: torch.exp(torch.tanh(v))}
assert set(LOSS_STEPS) == set(PREFIX)


def loss_program(case):
    """fn(x, w, row, full, t): the case's prefix of steps over x @ w, then its loss."""
    def fn(x, w, row, full, t):
        v = x @ w
        for step in case["prefix"]:
            v = LOSS_STEPS[step](v, row, full)
        return LOSSES[case["loss"]](v, t)
    return fn


@st.composite
def losses(draw):
    return dict(dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
                M=draw(SIZES), K=draw(SIZES), N=draw(st.integers(2, 90)),
                prefix=draw(st.lists(st.sampled_from(PREFIX), max_size=3)),
                loss=draw(st.sampled_from(sorted(LOSSES))), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=max(EXAMPLES // 4, 10))
@given(losses())
def test_random_losses_the_terminal_template_accepts_are_what_it_computes(case):
    """The Gluon template's terminal kind (ws_split) on random losses (bf16, whole tiles): the
    matcher accepts only regions whose statistics are the log-sum-exp, max (a shift, or stored) and
    target pick of x @ W. Every accepted one must give the float64 reference from the
    workspace the template would leave (its combine kernel run by the interpreter); the
    others are refused with the reason. (The template itself runs on the H200 only.)"""
    from test_template import lse_combine_against_reference
    from comfuse.planner import plan
    from comfuse.planner.schedules import NotFused
    PROPERTY_COUNTS["random losses (terminal template matcher)"] += 1
    M, K, N = 128, 64, 256 * (1 + case["seed"] % 3)
    bf = torch.bfloat16
    args = (torch.randn(M, K, dtype=bf), torch.randn(K, N, dtype=bf), torch.randn(N, dtype=bf),
            torch.randn(M, N, dtype=bf), torch.randint(0, N, (M, )))
    fn = loss_program(case)
    found = find_regions(capture(fn, args))
    if len(found) != 1 or found[0].region.kind != "gemm_epilogue":
        return
    with comfuse.settings.override(schedule="ws_split"):
        p = plan(found[0].region, target="cuda")
    if isinstance(p, NotFused):
        assert p.reason.startswith("ws_split: "), p.reason
        return
    PROPERTY_COUNTS["random losses (terminal template matcher): accepted"] += 1
    lse_combine_against_reference(p, M, K, N, seed=case["seed"])


@settings(max_examples=max(EXAMPLES // 2, 10))
@given(losses())
def test_random_per_row_losses_run_split(case):
    """Per-row outputs over the whole row (losses) in the split schedule: one-pass statistics
    over slices of N, merged, then combined; against float64."""
    PROPERTY_COUNTS["random losses (split schedule)"] += 1
    torch._dynamo.reset()  # (as above)
    g = torch.Generator().manual_seed(case["seed"])
    M, K, N, dt = case["M"], case["K"], case["N"], case["dtype"]
    x = torch.randn(M, K, generator=g)
    w = torch.randn(K, N, generator=g) / K ** 0.5
    row, full = torch.randn(N, generator=g), torch.randn(M, N, generator=g)
    t = torch.randint(0, N, (M,), generator=g)
    args = tuple(a.to(dtype=dt, device=DEVICE) for a in (x, w, row, full)) + (t.to(DEVICE),)
    fn = loss_program(case)
    with warnings.catch_warnings(), comfuse.settings.override(schedule="split"):
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = comfuse.compile(fn, args)
        out = compiled(*args)
    (region,) = compiled.report.regions
    assert region.fused and region.schedule == "split", f"{case}\n{compiled.report}"
    assert_matches_reference(fn, args, out)
