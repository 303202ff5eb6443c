"""The warp-specialised Gluon kernels run on the CPU (runtime/emulate.py): the generated
ws_stages module's and the hand-written ws_strip template's own functions, executed over torch
tensors, against the IR's float64 reference: the suite's row reductions in every form the
generator writes and both residual forms of the template, B as [K, N] and as nn.Linear's
[N, K], random epilogues, and two broken sources the emulation must catch. (The kernels
themselves run on sm_90 GPUs only; their GPU tests are in test_gpu.py.)"""
from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings as hsettings

from comfuse import settings
from comfuse.bench.workloads import SUITE
from comfuse.frontend.capture import capture
from comfuse.frontend.regions import find_regions
from comfuse.ir import canonical_shape
from comfuse.planner import plan
from comfuse.planner import NotFused
from comfuse.planner.gluon import tma_residual
from comfuse.runtime import emulate
from comfuse.runtime.launch import can_run_on
from comfuse.runtime.stages_kernel import source_text

from test_property import EXAMPLES, PROPERTY_COUNTS, build, loss_program, losses, programs

bf = torch.bfloat16
# (ws_split's combine is a Triton kernel: on the CPU it needs Triton's interpreter, which is
# off on a machine with a GPU)
needs_interpreter = pytest.mark.skipif(bool(can_run_on(torch.device("cpu"))),
                                       reason="the combine kernel runs on CPU tensors through Triton's interpreter")
FORMS = {  # name -> one form of the generated kernel, as COMFUSE_PLAN sets it
    "merged": "", "tail96": "tail=96", "32lanes-tail64": "lanes=32,tail=64", "res_tma": "res_tma=1",
    "res_tma-tail96": "res_tma=1,tail=96", "nothing_kept": "keep=0",
    # (autotuning's candidate where the region has a residual)
    "res_tma-nothing_kept-tail96": "res_tma=1,keep=0,tail=96",
    # each pass a run-time loop over its chunks (parts.chunk_view's pieces)
    "roll": "roll=1", "roll-tail96": "roll=1,tail=96", "roll-res_tma-nothing_kept-tail96": "roll=1,res_tma=1,keep=0,tail=96",
    # the last tile handed off in the B ring
    "last_in_ring-tail96": "last_in_ring=1,tail=96", "last_in_ring-roll-tail96": "last_in_ring=1,roll=1,tail=96",
    # the last tile all the mainloop warps' (its exchanges without the epilogue partition)
    "tail128": "tail=128", "last_in_ring-roll-tail128": "last_in_ring=1,roll=1,tail=128",
    "res_tma-nothing_kept-tail128": "res_tma=1,keep=0,tail=128",
    # with loops, the [M, N] inputs a chunk ahead (carried by the loop)
    "roll-lookahead": "roll=1,lookahead=1", "roll-lookahead-tail96": "roll=1,lookahead=1,tail=96",
    # (the whole last tile in the ring with it: an autotuning candidate where there is a residual)
    "last_in_ring-roll-lookahead-tail128": "last_in_ring=1,roll=1,lookahead=1,tail=128",
}


def ln_saving_statistics(x, w, b, g, be):
    """LayerNorm as a training graph's forward leaves it: the output, and the per-row mean and
    rstd saved for the backward."""
    v = x @ w + b
    mean = v.float().mean(-1, keepdim=True)
    rstd = torch.rsqrt(((v.float() - mean) ** 2).mean(-1, keepdim=True) + 1e-5)
    return ((v.float() - mean) * rstd * g + be).to(v.dtype), mean, rstd


def softmax_and_max(x, w):
    v = x @ w
    return torch.softmax(v.float(), -1).to(v.dtype), v.amax(-1)


ROW_OUTPUTS = {"ln_saving_statistics": (ln_saving_statistics, 3), "softmax_and_max": (softmax_and_max, 0)}


def region_of(fn, args):
    (cand,) = find_regions(capture(fn, args))
    return cand.region


def operands(region, seed=0):
    """Random bf16 operands in canonical 3-D layout (the weight scaled as a layer's); integer
    inputs (a loss's targets) in [0, N), every fifth -100 (ignored); boolean ones (which rows
    count) mostly true."""
    g = torch.Generator().manual_seed(seed)
    s = region.sizes
    a3 = torch.randn(1, s.M, s.K, generator=g).to(bf)
    b3 = (torch.randn(1, s.K, s.N, generator=g) / s.K ** 0.5).to(bf)
    ins = []
    for i in region.inputs:
        shape = canonical_shape(region, i.axes)
        if i.dtype.is_floating_point:
            ins.append(torch.randn(shape, generator=g).to(i.dtype))
        elif i.dtype == torch.bool:
            ins.append(torch.rand(shape, generator=g) > 0.2)
        else:
            t = torch.randint(0, s.N, shape, generator=g)
            t.view(-1)[::5] = -100
            ins.append(t)
    return a3, b3, ins


def ws_plan(region, form: str = ""):
    with settings.override(schedule="ws_stages", plan=form):
        return plan(region, target="cuda")


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("name", ["multi_stage", "ln_postnorm", "rmsnorm", "softmax", "mblr"])
@pytest.mark.parametrize("N", [768, 1024, 3072])
def test_the_generated_epilogue_computes_the_region(name, N, form):
    """Strips of 3, 4 and 12 tiles (6, 8 and 24 at 128 wide), 2 strips; a strip's tiles and one
    more as programs (5 at least), so that some programs hold two tiles and some one, and the
    last tile is shared where the form shares it; two launches on the same counters."""
    region = region_of(SUITE[name].fn, SUITE[name].inputs(256, 64, N, dtype=bf, device="cpu"))
    p = ws_plan(region, FORMS[form])
    if "res_tma" in form and tma_residual(region) is None:  # the form needs a residual to add into the tile
        assert isinstance(p, NotFused) and "res_tma" in p.reason, p
        return
    assert not isinstance(p, NotFused), p.reason
    assert p.tiles_n == N // p.block_n
    for c in emulate.check(p, *operands(region), programs=max(5, p.tiles_n + 1), launches=2):
        assert c.ok, f"{name} N={N} {form}: {c}"


@pytest.mark.parametrize("name", ["log1p", "expm1"])
def test_log1p_and_expm1_keep_small_values_exact(name):
    """log1p and expm1 in the generated kernel (strip.py's Kahan forms, as the Triton
    kernels' helpers), on small values (about 1e-3 and below)."""
    def fn(x, w):
        v = (x @ w) * 1e-3
        return torch.softmax((torch.log1p(v.abs()) if name == "log1p" else torch.expm1(v)) * 1e3, -1)
    args = (torch.randn(256, 64).to(bf), torch.randn(64, 1024).to(bf))
    region = region_of(fn, args)
    p = ws_plan(region)
    assert not isinstance(p, NotFused), p.reason
    assert f"{name}(" in source_text(p, "k")
    for c in emulate.check(p, *operands(region), programs=4):
        assert c.ok, f"{name}: {c}"


@pytest.mark.parametrize("residual_tma", [False, True], ids=["residual_by_chunk", "residual_by_tma"])
@pytest.mark.parametrize("name", ["ln_postnorm", "rmsnorm", "softmax", "mblr"])
@pytest.mark.parametrize("N", [768, 1024, 3072])
def test_the_template_computes_the_region(name, N, residual_tma):
    """The hand-written template (ws_strip): its residual read by the epilogue chunk by chunk
    (RES 1) or TMA-loaded into the hand-off buffer during the mainloop (RES 2; residual_tma)."""
    region = region_of(SUITE[name].fn, SUITE[name].inputs(256, 64, N, dtype=bf, device="cpu"))
    with settings.override(schedule="ws_strip"):
        p = plan(region, target="cuda")
    assert not isinstance(p, NotFused), p.reason
    if residual_tma and p.form.template.residual is None:
        with settings.override(schedule="ws_strip", plan="residual_tma=1"):
            refused = plan(region, target="cuda")
        assert isinstance(refused, NotFused) and "residual" in refused.reason
        return
    p = dataclasses.replace(p, form=dataclasses.replace(p.form, residual_tma=residual_tma))
    for c in emulate.check(p, *operands(region), programs=max(5, N // 256 + 1), launches=2):
        assert c.ok, f"{name} N={N} residual_tma={residual_tma}: {c}"


@needs_interpreter
@pytest.mark.parametrize("N", [1024, 2560, 1105])
@pytest.mark.parametrize("name", ["linear_ce", "lse", "logits_and_ce", "training_forward"])
def test_the_terminal_template_and_its_combine_compute_the_loss(name, N):
    """The template's terminal kind (ws_split: each tile's log-sum-exp per row and the logit at
    the row's target, in grouped tile order) and the combine kernel after it (Triton's
    interpreter), for cross-entropy (ignored targets included) and the log-sum-exp; and with
    the logits as an output beside the loss (a language model returns both), which the
    template then writes too; and a training forward's head (the logits, the row max and the
    log-sum saved for the backward, the loss), for which it stores each tile's row max."""
    import torch.nn.functional as F
    from helpers import training_forward_head
    fns = {"linear_ce": lambda x, w, t: F.cross_entropy(x @ w, t, reduction="none"),
           "lse": lambda x, w, t: torch.logsumexp(x @ w, -1),
           "logits_and_ce": lambda x, w, t: (x @ w, F.cross_entropy((x @ w).float(), t, reduction="none")),
           "training_forward": lambda x, w, t: training_forward_head(x @ w, t)}
    args = (torch.randn(256, 64).to(bf), torch.randn(64, N).to(bf), torch.randint(0, N, (256, )))
    region = region_of(fns[name], args)
    with settings.override(schedule="ws_split"):
        p = plan(region, target="cuda")
    assert not isinstance(p, NotFused), p.reason
    assert (p.form.template.logits is not None) == (name in ("logits_and_ce", "training_forward"))
    assert p.form.template.exact_max == (name == "training_forward")
    checks = emulate.check(p, *operands(region), programs=7)
    assert len(checks) == len(region.outputs)
    for c in checks:
        assert c.ok, f"{name} N={N}: {c}"


@pytest.mark.parametrize("schedule", ["ws_stages", "ws_strip"])
def test_both_kernels_take_nn_linear_weights(schedule):
    """B K-major ([N, K], nn.Linear's weight): the mainloop's B_KMAJOR form."""
    import torch.nn.functional as F

    def fn(x, w, b, r, g, be):
        return F.layer_norm(F.linear(x, w, b) + r, (768, ), g, be, 1e-5)
    args = (torch.randn(256, 64).to(bf), torch.randn(768, 64).to(bf), torch.randn(768).to(bf),
            torch.randn(256, 768).to(bf), torch.randn(768).to(bf), torch.randn(768).to(bf))
    region = region_of(fn, args)
    assert region.gemm.b.major == "K"
    with settings.override(schedule=schedule):
        p = plan(region, target="cuda")
    assert not isinstance(p, NotFused), p.reason
    for c in emulate.check(p, *operands(region), programs=4, launches=2):
        assert c.ok, f"{schedule}: {c}"


@hsettings(max_examples=max(EXAMPLES // 4, 10))
@given(programs(), st.sampled_from([256, 768, 1024]), st.sampled_from(sorted(FORMS)))
def test_random_epilogues_the_generator_takes_are_what_it_computes(program, N, form):
    """Random epilogues with row reductions (test_property's generator), bf16, 256 rows: the
    generator either refuses with its reason or writes a kernel whose epilogue gives the
    float64 reference."""
    PROPERTY_COUNTS["random epilogues (ws_stages emulated)"] += 1
    program = dataclasses.replace(program, dtype=bf, M=256, K=64, N=N, axis=-1)
    fn = build(program)
    g = torch.Generator().manual_seed(program.seed)
    args = (torch.randn(256, 64, generator=g).to(bf), torch.randn(64, N, generator=g).to(bf),
            *[torch.randn(*s, generator=g).to(bf) if s else torch.tensor(1.5, dtype=bf)
              for s in program.side_shapes()])
    found = find_regions(capture(fn, args))
    if len(found) != 1 or found[0].region.kind != "gemm_epilogue":
        return
    p = ws_plan(found[0].region, FORMS[form])
    if isinstance(p, NotFused):
        assert p.reason.startswith(("ws_stages: ", "forced schedule 'ws_stages'", "COMFUSE_PLAN")), p.reason
        return
    PROPERTY_COUNTS["random epilogues (ws_stages emulated): generated"] += 1
    # (one program more than a strip's tiles)
    for c in emulate.check(p, *operands(p.region, program.seed), programs=N // p.block_n + 1):
        assert c.ok, f"{program} {form}: {c}"


@pytest.mark.parametrize("name", sorted(ROW_OUTPUTS))
@pytest.mark.parametrize("form", ["merged", "tail96", "roll-tail96"])
def test_per_row_outputs(name, form):
    """Per-row [M] outputs (a training graph's saved statistics), written by each strip's
    first tile, beside the [M, N] one."""
    fn, vectors = ROW_OUTPUTS[name]
    N = 1024
    args = (torch.randn(256, 64).to(bf), (torch.randn(64, N) / 8).to(bf), *[torch.randn(N).to(bf)] * vectors)
    region = region_of(fn, args[:2 + vectors] if vectors else args[:2])
    assert any(o.axes == frozenset("M") for o in region.outputs)
    p = ws_plan(region, FORMS[form])
    assert not isinstance(p, NotFused), p.reason
    for c in emulate.check(p, *operands(region), programs=5, launches=2):
        assert c.ok, f"{name} {form}: {c}"


@needs_interpreter
@hsettings(max_examples=max(EXAMPLES // 4, 10))
@given(losses().map(lambda c: dict(c, loss=("lse", "cross_entropy", c["loss"])[c["seed"] % 3])))
def test_random_losses_the_terminal_template_takes_are_what_it_computes(case):
    """Random losses over x @ W (test_property's generator, two thirds of them the
    log-sum-exp or cross-entropy the terminal kind computes; bf16, whole tiles) through the
    emulated terminal kind and its combine: each one the matcher accepts gives the float64
    reference; the others are refused with the reason."""
    PROPERTY_COUNTS["random losses (ws_split emulated)"] += 1
    N = 256 * (1 + case["seed"] % 3)
    g = torch.Generator().manual_seed(case["seed"])
    args = (torch.randn(128, 64, generator=g).to(bf), torch.randn(64, N, generator=g).to(bf),
            torch.randn(N, generator=g).to(bf), torch.randn(128, N, generator=g).to(bf),
            torch.randint(0, N, (128, ), generator=g))
    found = find_regions(capture(loss_program(case), args))
    if len(found) != 1 or found[0].region.kind != "gemm_epilogue":
        return
    with settings.override(schedule="ws_split"):
        p = plan(found[0].region, target="cuda")
    if isinstance(p, NotFused):
        assert p.reason.startswith("ws_split: "), p.reason
        return
    PROPERTY_COUNTS["random losses (ws_split emulated): accepted"] += 1
    for c in emulate.check(p, *operands(p.region, case["seed"]), programs=3):
        assert c.ok, f"{case}: {c}"


def test_the_emulation_catches_a_wrong_statistic_and_a_wrong_arrival_count():
    """Two deliberately broken sources: every tile of a strip publishing its partials into
    the first tile's slot (an indexing slip: wrong statistics), and a shared tile's part
    arriving as a whole tile (the strip's counter off)."""
    region = region_of(SUITE["ln_postnorm"].fn, SUITE["ln_postnorm"].inputs(256, 64, 1024, dtype=bf, device="cpu"))
    p = ws_plan(region)
    text = source_text(p, "k")
    assert text.count("* TILES_N + tn) * BM") == 2
    (c,) = emulate.check(p, *operands(region), source=text.replace("* TILES_N + tn) * BM", "* TILES_N + 0) * BM"))
    assert not c.ok
    shared = ws_plan(region, "tail=96")
    text = source_text(shared, "k")
    assert "c_lo=(BM - 96) // MC, c_hi=BM // MC, share=1," in text
    broken = text.replace("c_hi=BM // MC, share=1,", "c_hi=BM // MC, share=2,")  # the mainloop warps' share
    with pytest.raises(RuntimeError, match="counter|did not finish"):
        emulate.run(shared, *operands(region), programs=5, source=broken, timeout=5)
