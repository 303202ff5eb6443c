"""Two products of one A in one kernel (``ir.Gemm.b2``): SwiGLU's gate and up projections.

Found in the captured graph (not a pattern): a region takes another product of its GEMM's A as
a second accumulator where its epilogue reads it. Every kernel is checked against the IR's
float64 reference interpreter (COMFUSE_CHECK=1, conftest) and the results against the program
in float64."""
import textwrap

import pytest
import torch
import torch.nn.functional as F

import comfuse
from comfuse.frontend.capture import capture
from comfuse.frontend.regions import find_chains, find_regions
from comfuse.ir import IRError, Op, evaluate, verify
from comfuse.planner import plan
from comfuse.planner.candidates import candidates
from comfuse.planner.cost import gemm_ms
from comfuse.planner.records import NotFused
from comfuse.planner.schedules import gluon_offers
from comfuse.runtime import build as kernel_mod

from helpers import DEVICE, assert_matches_reference, quiet_notices, randn, weight
from test_backend import compiled, last_report
from test_codegen import run_compiler_script


def swiglu(x, wg, wu):
    return F.silu(x @ wg) * (x @ wu)


def regions_of(fn, *args):
    return find_regions(capture(fn, args))


def test_gate_and_up_are_one_region_that_writes_only_their_product():
    cands = regions_of(swiglu, torch.randn(8, 16), torch.randn(16, 24), torch.randn(16, 24))
    (cand,) = cands  # (the up projection is no region of its own)
    region = verify(cand.region)
    assert region.dual and region.gemm.b2.name == "wu_1"
    assert [n.arg for n in region.nodes if n.op is Op.ACC] == [None, 1]
    assert len(region.outputs) == 1 and not region.inputs  # neither product goes to memory
    assert any("mainloop" in t for t in cand.through)
    assert len(cand.operands) == 3


def test_a_product_read_elsewhere_is_written_too():
    def f(x, wg, wu):
        u = x @ wu
        return F.silu(x @ wg) * u, u
    (cand,) = regions_of(f, torch.randn(8, 16), torch.randn(16, 24), torch.randn(16, 24))
    region = cand.region
    assert region.dual and len(region.outputs) == 2
    assert {region.nodes[o.node].arg for o in region.outputs if region.nodes[o.node].op is Op.ACC} == {1}


def test_products_of_other_operands_or_dtypes_stay_side_inputs():
    other_a = lambda x, y, wg, wu: F.silu(x @ wg) * (y @ wu)  # noqa: E731
    cands = regions_of(other_a, torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 24), torch.randn(16, 24))
    assert not any(c.region.dual for c in cands if c.region is not None)
    mixed = lambda x, wg, wu: F.silu(x @ wg) * (x.double() @ wu).float()  # noqa: E731
    cands = regions_of(mixed, torch.randn(8, 16), torch.randn(16, 24), torch.randn(16, 24, dtype=torch.float64))
    assert not any(c.region.dual for c in cands if c.region is not None)


def test_a_region_with_two_products_is_no_chain_link():
    def mlp(x, wg, wu, wd):
        return (F.silu(x @ wg) * (x @ wu)) @ wd
    cands = regions_of(mlp, torch.randn(8, 16), torch.randn(16, 32), torch.randn(16, 32), torch.randn(32, 16))
    assert cands[0].region.dual
    assert find_chains(cands) == []


def test_the_verifier_wants_the_second_operand_for_a_second_accumulator():
    (cand,) = regions_of(swiglu, torch.randn(8, 16), torch.randn(16, 24), torch.randn(16, 24))
    region = cand.region
    with pytest.raises(IRError, match="product 1"):
        verify(region.replace(gemm=region.gemm.__class__(region.gemm.a, region.gemm.b, False, region.gemm.out_dtype)))


def test_reference_interpreter_multiplies_the_second_b():
    x, wg, wu = torch.randn(8, 16), torch.randn(16, 24), torch.randn(16, 24)
    (cand,) = regions_of(swiglu, x, wg, wu)
    (out,) = evaluate(cand.region, x[None].double(), wg[None].double(), [wu[None].double()])
    torch.testing.assert_close(out[0], swiglu(x.double(), wg.double(), wu.double()))
    with pytest.raises(ValueError, match="second product"):
        evaluate(cand.region, x[None], wg[None], [])


def test_cost_counts_both_products():
    x, wg, wu = torch.randn(64, 32), torch.randn(32, 48), torch.randn(32, 48)
    (dual,) = regions_of(swiglu, x, wg, wu)
    (single,) = regions_of(lambda x, wg, u: F.silu(x @ wg) * u, x, wg, torch.randn(64, 48))
    assert gemm_ms(dual.region) == pytest.approx(2 * gemm_ms(single.region))


def test_only_the_triton_kernels_take_two_products():
    x, wg, wu = torch.randn(64, 32), torch.randn(32, 48), torch.randn(32, 48)
    (cand,) = regions_of(lambda x, wg, wu: torch.softmax(swiglu(x, wg, wu), -1), x, wg, wu)
    offers = dict(gluon_offers(cand.region))
    assert all("one product" in why for why in offers.values()), offers
    (col,) = regions_of(lambda x, wg, wu: torch.softmax(swiglu(x, wg, wu), 0), x, wg, wu)
    p = plan(col.region, target="interpreter")
    assert isinstance(p, NotFused) and "second product" in p.reason
    with comfuse.settings.override(schedule="split"):
        p = plan(cand.region, target="cuda")
    assert isinstance(p, NotFused) and "one product" in p.reason
    plans = candidates(cand.region, "cuda")
    assert any(p.mainloop == "tma" for p in plans) and all(p.block_m * p.block_n <= 128 * 128 for p in plans)


def test_generated_kernel_multiplies_twice_a_step():
    (cand,) = regions_of(swiglu, torch.randn(8, 16), torch.randn(16, 24), torch.randn(16, 24))
    text = kernel_mod.build(plan(cand.region, target="interpreter")).source.text
    assert "acc2 = tl.dot(a, b2, acc2" in text and text.count("tl.store(") == 1
    assert "b2_ptr,  # wu_1: the second product's B" in text


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [(1, 16, 16), (37, 29, 50), (64, 40, 130)], ids=["M1", "odd", "wide"])
def test_swiglu_matches_the_reference(dtype, shape):
    m, k, n = shape
    args = (randn(m, k, dtype=dtype), weight(k, n, dtype=dtype), weight(k, n, dtype=dtype))
    with quiet_notices():
        fn = comfuse.compile(swiglu, args)
        out = fn(*args)
    (r,) = fn.report.regions
    assert r.fused and r.found.dual, str(fn.report)
    assert_matches_reference(swiglu, args, out)


@pytest.mark.parametrize("form", ["mainloop=tma", "mainloop=tma,persistent=1", "prefetch=1"])
def test_swiglu_in_other_kernel_forms_matches_the_reference(form):
    """Tensor descriptors for both B operands (an nn.Linear weight is K-major), a persistent grid."""
    f = lambda x, wg, wu, r: F.silu(F.linear(x, wg)) * F.linear(x, wu) + r  # noqa: E731
    args = (randn(40, 32, dtype=torch.bfloat16), weight(96, 32, dtype=torch.bfloat16),
            weight(96, 32, dtype=torch.bfloat16), randn(40, 96, dtype=torch.bfloat16))
    with quiet_notices(), comfuse.settings.override(plan=form):
        fn = comfuse.compile(f, args)
        out = fn(*args)
    (r,) = fn.report.regions
    assert r.fused and r.found.dual and r.found.gemm.b2.major == "K", str(fn.report)
    assert ("tma mainloop" in r.plan) == ("tma" in form), r.plan
    assert_matches_reference(f, args, out)


def test_two_products_then_a_row_norm_match_the_reference():
    def f(x, wg, wu, g):
        h = swiglu(x, wg, wu)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    for n in (40, 130):  # one program a row, then a strip of tiles that exchange partials
        args = (randn(24, 32), weight(32, n), weight(32, n), randn(n))
        with quiet_notices():
            fn = comfuse.compile(f, args)
            out = fn(*args)
        (r,) = fn.report.regions
        assert r.fused and r.found.dual and r.schedule in ("row_in_cta", "cooperative"), str(fn.report)
        assert_matches_reference(f, args, out)


def _llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
                      head_dim=16)
    return LlamaMLP(cfg).to(DEVICE)


def test_llama_mlp_trains_through_the_backend_with_gate_and_up_in_one_kernel():
    torch.manual_seed(0)
    mlp = _llama_mlp()
    x = torch.randn(2, 16, 64, device=DEVICE, requires_grad=True)
    with quiet_notices():
        out = compiled(mlp)(x)
    report = last_report()
    assert any(r.fused and r.found.dual for r in report.regions), str(report)
    g = torch.randn_like(out)
    params = [x, *mlp.parameters()]
    got = torch.autograd.grad((out * g).sum(), params)
    want_out = mlp(x)
    want = torch.autograd.grad((want_out * g).sum(), params)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    got, want = torch.cat([t.flatten() for t in got]), torch.cat([t.flatten() for t in want])
    assert (got - want).norm() <= 1e-4 * want.norm()


def test_two_products_compile_for_sm90_with_tensor_cores():
    """Runs in a subprocess with Triton out of interpreter mode (the test process has it on)."""
    script = textwrap.dedent("""
        import json, torch, torch.nn.functional as F
        import comfuse
        from comfuse.frontend.capture import capture
        from comfuse.frontend.regions import find_regions
        from comfuse.planner import plan
        from comfuse.runtime.aot import compile_for_gpu
        bf = torch.bfloat16
        args = (torch.randn(512, 256, dtype=bf), torch.randn(256, 1024, dtype=bf), torch.randn(256, 1024, dtype=bf))
        (cand,) = find_regions(capture(lambda x, wg, wu: F.silu(x @ wg) * (x @ wu), args))
        out = {}
        for form in ("", "mainloop=tma"):
            with comfuse.settings.override(plan=form):
                info = compile_for_gpu(plan(cand.region, target="cuda"))
            out[form or "pointer"] = {k: info[k] for k in ("wgmma", "tma", "schedule", "shared_bytes")}
        print(json.dumps(out))
    """)
    result = run_compiler_script(script)
    for info in result.values():
        assert info["wgmma"] > 0 and info["schedule"] == "tile", result
        assert info["shared_bytes"] <= 227 * 1024, result
    assert result["mainloop=tma"]["tma"] > 0, result


def test_a_region_with_two_products_is_a_class_of_its_own_for_the_cost_model():
    """The 8B MLP's single-product regions lost to their ops (MEASURED_CLASSES): that says nothing
    of a region whose ops are both GEMMs, so it is tuned, not predicted to lose."""
    from comfuse.ir import Sizes
    from comfuse.planner.cost import plan_class, why_not_tuned
    x, wg, wu = torch.randn(64, 32), torch.randn(32, 48), torch.randn(32, 48)
    (dual,) = regions_of(swiglu, x, wg, wu)
    (single,) = regions_of(lambda x, wg, u: F.silu(x @ wg) * u, x, wg, torch.randn(64, 48))
    at_8b = Sizes(B=1, M=8192, N=14336, K=4096)
    p_dual, p_single = (plan(c.region.replace(sizes=at_8b), target="cuda") for c in (dual, single))
    assert plan_class(p_dual) == "tile/dual/19/flat" and plan_class(p_single) == "tile/single/19/flat"
    assert why_not_tuned([p_single]) and not why_not_tuned([p_dual])


def test_a_region_that_writes_its_products_for_the_backward_is_another_class():
    """A training forward writes the gate and up products for the backward: the shipped record
    says such a region at the 8B MLP's widths never beat its ops, so a first step does not tune
    it; the inference form, which writes only ``silu(g) * u``, is still tuned."""
    from comfuse.ir import Sizes
    from comfuse.planner.cost import plan_class, why_not_tuned

    def training_forward(x, wg, wu):
        g, u = x @ wg, x @ wu
        return F.silu(g) * u, g, u
    x, wg, wu = torch.randn(64, 32), torch.randn(32, 48), torch.randn(32, 48)
    (saving,) = regions_of(training_forward, x, wg, wu)
    (inference,) = regions_of(swiglu, x, wg, wu)
    assert saving.region.dual and len(saving.region.outputs) == 3
    at_8b = Sizes(B=1, M=8192, N=14336, K=4096)
    p_saving, p_inference = (plan(c.region.replace(sizes=at_8b), target="cuda") for c in (saving, inference))
    assert plan_class(p_saving) == "tile/dual-writes-products/19/flat"
    assert plan_class(p_inference) == "tile/dual/19/flat"
    assert "not tuned" in why_not_tuned([p_saving]) and not why_not_tuned([p_inference])
