"""Back-to-back GEMM chains: GEMM1 -> F -> GEMM2 (-> F2 -> GEMM3) in one kernel."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings as hsettings, strategies as st

import comfuse
from comfuse.frontend.capture import capture
from comfuse.frontend.regions import find_chains, find_regions

from helpers import DEVICE, PROPERTY_COUNTS, assert_matches_reference, quiet_notices, randn, weight

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run(fn, args):
    with quiet_notices():
        compiled = comfuse.compile(fn, args)
        return compiled, compiled(*args)


def dlrm(x, w1, w2, w3):
    return torch.relu(torch.relu(torch.relu(x @ w1) @ w2) @ w3)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("M", [1, 33, 70])
def test_three_gemm_mlp_is_one_kernel(dtype, M):
    args = (randn(M, 24, dtype=dtype), weight(24, 40, dtype=dtype), weight(40, 20, dtype=dtype),
            weight(20, 16, dtype=dtype))
    compiled, out = run(dlrm, args)
    (r,) = compiled.report.regions
    assert r.kind == "b2b" and r.fused and "3 GEMMs" in r.plan, str(compiled.report)
    assert "comfuse_region0" in compiled.report.graph and "mm" not in compiled.report.graph.replace("comfuse", "")
    assert_matches_reference(dlrm, args, out)


@pytest.mark.parametrize("act", ["gelu", "silu", "relu_bias_scale"])
def test_linear_mlp_with_3d_activations(act):
    f1 = {"gelu": F.gelu, "silu": F.silu, "relu_bias_scale": lambda h: torch.relu(h) * 0.5}[act]

    def mlp(x, W1, b1, W2, b2):
        return F.linear(f1(F.linear(x, W1, b1)), W2, b2)
    bf = torch.bfloat16
    args = (randn(2, 9, 24, dtype=bf), randn(40, 24, dtype=bf, scale=0.2), randn(40, dtype=bf),
            randn(16, 40, dtype=bf, scale=0.15), randn(16, dtype=bf))
    compiled, out = run(mlp, args)
    assert compiled.report.regions[0].kind == "b2b" and compiled.report.regions[0].fused
    assert out.shape == (2, 9, 16)
    assert_matches_reference(mlp, args, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_target_attention_softmax_stays_resident(dtype):
    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
    args = (randn(2, 3, 5, 16, dtype=dtype), randn(2, 3, 20, 16, dtype=dtype), randn(2, 3, 20, 16, dtype=dtype))
    compiled, out = run(attn, args)
    (r,) = compiled.report.regions
    assert r.kind == "b2b" and r.fused, str(compiled.report)
    assert_matches_reference(attn, args, out)


def test_operands_read_once_are_loaded_with_evict_first_and_shared_weights_are_not():
    """Each batch of target attention has one program, so its K and V are read once: their
    loads carry the eviction hint (1.49x -> 1.55x on the H200). An MLP's weights are read by
    every program and must stay in L2: no hint."""
    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
    attention = (randn(4, 16, 16), randn(4, 32, 16), randn(4, 32, 16))
    mlp = (randn(70, 24), weight(24, 40), weight(40, 20), weight(20, 16))
    for fn, args, hinted in ((attn, attention, True), (dlrm, mlp, False)):
        compiled, out = run(fn, args)
        (r,) = compiled.report.regions
        assert r.kind == "b2b" and r.fused, str(compiled.report)
        loads = [line for line in open(r.kernel_path).read().splitlines() if "tl.load(" in line]
        assert loads and all(('eviction_policy="evict_first"' in line) == hinted for line in loads), loads
        assert_matches_reference(fn, args, out)


def test_views_that_change_nothing_are_dropped_from_the_call():
    """Batched matmuls are captured with expand and view of each operand to its own sizes;
    each costs a dispatch on every call (target attention's call, not its kernel, was the
    bottleneck on the H200), so they go. A view that changes something, or one the function
    returns, stays."""
    def attn(q, k, v):
        return (torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v, q.view(q.shape))
    args = (randn(6, 5, 16), randn(6, 20, 16), randn(6, 20, 16))
    compiled, (out, q_view) = run(attn, args)
    graph = compiled.report.graph
    assert "comfuse_region0" in graph and "expand" not in graph, graph
    assert "transpose" in graph and "view" in graph, graph  # (k's transpose; the returned view)
    assert q_view is not args[0] and torch.equal(q_view, args[0])
    assert_matches_reference(lambda q, k, v: attn(q, k, v)[0], args, out)


def _attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v


@pytest.mark.parametrize("case", ["attention", "dlrm_k_loop", "dlrm_gpu_plans"])
def test_every_chain_candidate_matches_the_reference(monkeypatch, case):
    """Each plan autotuning may pick (warps, program height, chunk width) computes the same
    chain: one chunk and one K step (attention), several chunks with a K loop (a three-GEMM
    MLP), and the GPU's plans for such an MLP (64- and 128-row programs, 64- and 128-column
    chunks, GEMM2's operand loaded before GEMM1's K loop, GEMM1's rows loaded once over all of
    K, chunks and K steps in one loop, later GEMMs padded to 64 columns) run through the interpreter."""
    from comfuse.planner import chain as planner_chain
    from comfuse.planner.chain import chain_candidates
    from comfuse import pipeline
    from comfuse.runtime.chain import build_chain
    if case == "attention":
        fn, args = _attention, (randn(2, 3, 5, 16), randn(2, 3, 20, 16), randn(2, 3, 20, 16))
    elif case == "dlrm_k_loop":
        fn, args = dlrm, (randn(40, 80), weight(80, 72), weight(72, 24), weight(24, 16))
    else:
        real = planner_chain.plan_chain
        monkeypatch.setattr(pipeline, "plan_chain", lambda regions, links, writes, target: real(
            regions, links, writes, "cuda"))
        fn, args = dlrm, (randn(130, 96), weight(96, 300), weight(300, 40), weight(40, 24))
    compiled, _ = run(fn, args)
    chain = next(m for m in compiled.fused_regions() if m.__class__.__name__ == "FusedChain")
    plans = chain_candidates(chain.plan)
    assert len(plans) >= 2
    if case == "dlrm_gpu_plans":
        assert {p.stream_n for p in plans} >= {64, 128} and {p.block_m for p in plans} == {64, 128}
        assert {p.early_w for p in plans} == {False, True}
        # GEMM1's rows loaded once, K = 96 padded to 128 (masked), 130 rows (a partial program)
        assert {p.resident_a for p in plans} == {False, True}
        # GEMM1's chunks and K steps in one loop: 3 chunks of 128 over N0 = 300, 2 K steps over 96
        assert {p.flat for p in plans} == {False, True}
    seen, forward = [], chain.forward  # the chain's own arguments (views, constants)
    chain.forward = lambda *ext: seen.append(ext) or forward(*ext)
    compiled(*args)
    ext = seen[-1]
    for plan in plans:
        chain.kernel = build_chain(plan)
        (out,) = chain.run(ext, ext[chain.a_ext].device, check=False)
        assert_matches_reference(fn, args, out)


def _gpu_chain_plan(monkeypatch, args):
    """The chain plan a GPU would get for ``dlrm`` on ``args`` (planned, not run)."""
    from comfuse.planner import chain as planner_chain
    from comfuse import pipeline
    real = planner_chain.plan_chain
    monkeypatch.setattr(pipeline, "plan_chain", lambda regions, links, writes, target: real(regions, links, writes,
                                                                                            "cuda"))
    (r,) = comfuse.explain(dlrm, args).regions
    assert r.kind == "b2b" and r.fused, r.reason
    return r.planned


def test_resident_rows_are_candidates_only_where_they_fit_shared_memory(monkeypatch):
    """GEMM1's A rows are held for every chunk only when they fit beside two pipeline stages
    in the 227 KB a program may have: at the DLRM bottom MLP's K = 512 the 128-row form in
    chunks of 32 takes 224 KB (the fastest on the H200); at K = 2048 no form fits."""
    from comfuse.planner.chain import SMEM_LIMIT, resident_candidates, resident_smem
    bf = torch.bfloat16
    dlrm_like = _gpu_chain_plan(monkeypatch, (torch.empty(256, 512, dtype=bf), torch.empty(512, 512, dtype=bf),
                                              torch.empty(512, 256, dtype=bf), torch.empty(256, 128, dtype=bf)))
    forms = {(p.block_m, p.stream_n, p.num_warps, p.num_stages) for p in resident_candidates(dlrm_like)}
    assert (128, 32, 8, 2) in forms and all(p.resident_a and p.block_k == 512 for p in resident_candidates(dlrm_like))
    assert resident_smem(dlrm_like, 128, 32, 2) == 2 * (128 * 512 + 2 * (512 * 32 + 32 * 256)) <= SMEM_LIMIT
    assert "A rows loaded once" in resident_candidates(dlrm_like)[0].describe()
    long_k = _gpu_chain_plan(monkeypatch, (torch.empty(256, 2048, dtype=bf), torch.empty(2048, 512, dtype=bf),
                                           torch.empty(512, 256, dtype=bf), torch.empty(256, 128, dtype=bf)))
    assert resident_candidates(long_k) == []


def test_an_intermediate_read_elsewhere_is_not_a_link():
    def f(x, w1, w2):
        h = torch.relu(x @ w1)
        return h @ w2, h.sum()
    gm = capture(f, (randn(8, 16), weight(16, 24), weight(24, 8)))
    assert find_chains(find_regions(gm)) == []
    args = (randn(8, 16), weight(16, 24), weight(24, 8))
    _, out = run(f, args)
    assert_matches_reference(f, args, out)


def test_wide_second_gemm_is_not_chained_and_says_why():
    def mlp(x, w1, w2):
        return F.gelu(x @ w1) @ w2
    args = (randn(16, 32), weight(32, 64), weight(64, 300))
    report = comfuse.explain(mlp, args)
    chain = next(r for r in report.regions if r.kind == "b2b")
    assert not chain.fused and "wider than one program holds" in chain.reason
    assert any(r.kind == "gemm_epilogue" and r.fused for r in report.regions)  # GELU still fuses
    _, out = run(mlp, args)
    assert_matches_reference(mlp, args, out)


def test_long_self_attention_is_routed_to_sdpa():
    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
    args = (randn(2, 2, 300, 16), randn(2, 2, 300, 16), randn(2, 2, 300, 16))
    compiled, out = run(attn, args)
    (chain,) = compiled.report.regions
    assert chain.kind == "b2b" and chain.fused and chain.schedule == "sdpa"
    assert "scaled_dot_product_attention" in chain.plan
    assert_matches_reference(attn, args, out)


DEFERRED = {
    "softmax": lambda x, w1, g, b, w2: torch.softmax(x @ w1 + b, dim=-1) @ w2,
    "layer_norm": lambda x, w1, g, b, w2: F.layer_norm(x @ w1, (w1.shape[1],), g, b) @ w2,
    "layer_norm_offset": lambda x, w1, g, b, w2: F.layer_norm(x @ w1 + 20.0, (w1.shape[1],), g, b) @ w2,
    "rms_norm": lambda x, w1, g, b, w2: ((lambda y: y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * g)(
        x @ w1)) @ w2,
    "log_softmax_relu": lambda x, w1, g, b, w2: torch.relu(torch.log_softmax(x @ w1, -1) + 6.0) @ w2,
}


@pytest.mark.parametrize("name", list(DEFERRED))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_long_reductions_before_the_second_gemm_are_deferred(name, dtype):
    fn = DEFERRED[name]
    N1 = 300  # more than one chunk: the reduction cannot finish before GEMM2 starts
    args = (randn(21, 16, dtype=dtype), weight(16, N1, dtype=dtype), randn(N1, dtype=dtype),
            randn(N1, dtype=dtype), weight(N1, 24, dtype=dtype))
    compiled, out = run(fn, args)
    chain = next(r for r in compiled.report.regions if r.kind == "b2b")
    if name == "log_softmax_relu":  # relu of a shifted log-probability: not a deferrable form
        assert not chain.fused and "cannot be deferred" in chain.reason
    else:
        assert chain.fused and "deferred" in chain.plan, str(compiled.report)
    assert_matches_reference(fn, args, out)


UNARY = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh,
         "sigmoid": torch.sigmoid, "identity": lambda v: v}


@st.composite
def chains(draw):
    sizes = st.integers(1, 40)
    return dict(dtype=draw(st.sampled_from(DTYPES)), M=draw(sizes), K=draw(sizes), N1=draw(sizes),
                N2=draw(st.integers(1, 64)), f1=draw(st.sampled_from(sorted(UNARY))),
                f2=draw(st.sampled_from(sorted(UNARY))), bias=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


@hsettings(max_examples=40, deadline=None)
@given(chains())
def test_random_two_gemm_chains(c):
    PROPERTY_COUNTS["random GEMM -> F -> GEMM chains"] += 1
    g = torch.Generator().manual_seed(c["seed"])
    dt = c["dtype"]

    def mk(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dt, device=DEVICE)
    args = (mk(c["M"], c["K"]), mk(c["K"], c["N1"], scale=c["K"] ** -0.5),
            mk(c["N1"], c["N2"], scale=c["N1"] ** -0.5), mk(c["N1"]))
    f1, f2, bias = UNARY[c["f1"]], UNARY[c["f2"]], c["bias"]

    def fn(x, w1, w2, b):
        h = x @ w1
        return f2(f1(h + b if bias else h) @ w2)
    compiled, out = run(fn, args)
    assert any(r.kind == "b2b" and r.fused for r in compiled.report.regions), str(compiled.report)
    assert_matches_reference(fn, args, out)


NORMS = {
    "softmax": lambda h, g: torch.softmax(h, -1),
    "layer_norm": lambda h, g: F.layer_norm(h, (h.shape[-1],), g, None),
    "rms_norm": lambda h, g: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g,
}


@hsettings(max_examples=24, deadline=None)
@given(st.sampled_from(sorted(NORMS)), st.sampled_from(DTYPES), st.integers(1, 24), st.integers(1, 24),
       st.integers(257, 320), st.integers(1, 40), st.floats(-20, 20), st.integers(0, 2**16))
def test_random_deferred_chains(norm, dtype, M, K, N1, N2, offset, seed):
    """A reduction over N1 wider than one program, before GEMM2: deferred, against float64."""
    PROPERTY_COUNTS["random deferred chains (reduction before GEMM2)"] += 1
    g = torch.Generator().manual_seed(seed)

    def mk(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)
    args = (mk(M, K), mk(K, N1, scale=K ** -0.5), mk(N1), mk(N1, N2, scale=N1 ** -0.5))

    def fn(x, w1, gamma, w2):
        return NORMS[norm](x @ w1 + offset, gamma) @ w2
    compiled, out = run(fn, args)
    chain = next(r for r in compiled.report.regions if r.kind == "b2b")
    assert chain.fused and "deferred" in chain.plan, str(compiled.report)
    assert_matches_reference(fn, args, out)
