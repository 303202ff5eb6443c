"""The warp-specialised Gluon template (ws_strip): which regions it computes, how the planner
offers it, and that every variant compiles for sm_90. Gluon does not run in Triton's CPU
interpreter, so its results are checked on the H200 (tests/test_gpu.py)."""
import textwrap

import pytest
import torch
import torch.nn.functional as F

from comfuse import settings
from comfuse.bench.workloads import SUITE
from comfuse.frontend.capture import capture
from comfuse.frontend.regions import find_regions
from comfuse.planner import plan
from comfuse.planner import NotFused, candidates
from comfuse.planner.template import fits, match, match_lse

from helpers import training_forward_head
from test_codegen import run_compiler_script

bf = torch.bfloat16


def region_of(fn, *args):
    (cand,) = find_regions(capture(fn, args))
    p = plan(cand.region, target="cuda")
    return p.region


def suite_region(name, M=256, K=64, N=1024):
    wl = SUITE[name]
    return region_of(wl.fn, *wl.inputs(M, K, N, dtype=bf, device="cpu"))


@pytest.mark.parametrize("name, expect", [
    ("ln_postnorm", "LayerNorm(x @ W + bias + residual, eps=1e-05) * gamma + beta"),
    ("rmsnorm", "RMSNorm(x @ W, eps=1e-06) * gamma"),
    ("mblr", "relu(LayerNorm(x @ W + bias, eps=1e-05) * gamma + beta)"),
    ("softmax", "softmax(x @ W, dim=N)"),
])
def test_the_template_matches_the_suites_norms(name, expect):
    t, why = match(suite_region(name))
    assert why == "" and t.describe() == expect


@pytest.mark.parametrize("name", ["multi_stage", "linear_ce"])
def test_the_template_refuses_what_it_does_not_compute(name):
    t, why = match(suite_region(name))
    assert t is None and why


def test_roles_follow_the_math_not_the_argument_order():
    """gamma passed before the bias, LayerNorm written out by hand, nn.Linear's weight layout."""
    def f(x, g, w, b, be):
        v = F.linear(x, w, b)
        mu = v.float().mean(-1, keepdim=True)
        var = ((v.float() - mu) ** 2).mean(-1, keepdim=True)
        return ((v.float() - mu) / torch.sqrt(var + 1e-6) * g + be).to(bf)
    args = (torch.randn(128, 64, dtype=bf), torch.randn(512, dtype=bf), torch.randn(512, 64, dtype=bf),
            torch.randn(512, dtype=bf), torch.randn(512, dtype=bf))
    region = region_of(f, *args)
    t, why = match(region)
    assert why == "", why
    names = [i.name for i in region.inputs]
    assert (names[t.gamma], names[t.bias], names[t.beta]) == ("g_1", "b_1", "be_1"), (names, t)
    assert t.eps == 1e-6 and region.gemm.b.major == "K"


def test_a_near_miss_is_not_matched():
    """LayerNorm with the variance over N - 1 (unbiased) is not the template's math."""
    def f(x, w, r):
        v = (x @ w + r).float()
        return ((v - v.mean(-1, keepdim=True)) / torch.sqrt(v.var(-1, keepdim=True) + 1e-5)).to(bf)
    t, why = match(region_of(f, torch.randn(128, 64, dtype=bf), torch.randn(64, 512, dtype=bf),
                             torch.randn(128, 512, dtype=bf)))
    assert t is None and "not LayerNorm or RMSNorm" in why


def test_the_planner_offers_the_template_on_cuda_only_and_at_whole_tiles():
    region = suite_region("ln_postnorm")
    ws = [p for p in candidates(region, target="cuda") if p.schedule == "ws_strip"]
    assert [p.form.residual_tma for p in ws] == [False, True]
    assert "warp-specialised Gluon template computing LayerNorm" in ws[0].describe()
    assert ws[0].tiles_n == 4
    assert not [p for p in candidates(suite_region("ln_postnorm", M=200), target="cuda")
                if p.schedule == "ws_strip"]
    assert "whole 128x256x64 tiles" in fits(200, 1024, 64)
    with settings.override(schedule="ws_strip"):
        refused = plan(region, target="interpreter")
    assert isinstance(refused, NotFused) and "interpreter" in refused.reason


def test_every_variant_compiles_for_sm90_without_spilling_much():
    """LayerNorm (residual by TMA or by the epilogue, nn.Linear's B), RMSNorm, MBLR, softmax, a strip
    of 12 tiles (not a power of two), and the terminal log-sum-exp kind at 128 tiles a row (with the logits; with the row maxima and no target pick): 12 warps at <= 168 registers, <= 227 KB of shared memory,
    the two partitions' register budgets (setmaxnreg) as planned."""
    script = textwrap.dedent("""
        import json, re
        from comfuse.codegen.gluon import strip as S
        from comfuse.runtime.aot import resources
        cfgs = {"ln_tma": (S.StripConfig(kind=1, has_bias=True, residual=2, has_gamma=True, has_beta=True), 1024),
                "ln_ldg_kmajor": (S.StripConfig(kind=1, has_bias=True, residual=1, has_gamma=True, has_beta=True,
                                                b_kmajor=True), 3072),
                "rms": (S.StripConfig(kind=2, residual=0, has_gamma=True), 4096),
                "mblr": (S.StripConfig(kind=1, has_bias=True, residual=0, has_gamma=True, has_beta=True,
                                       relu=True), 2048),
                "softmax": (S.StripConfig(kind=3, residual=0), 1024),
                "lse_kmajor": (S.StripConfig(kind=4, residual=0, group_m=8, b_kmajor=True), 32768),
                "lse_logits": (S.StripConfig(kind=4, residual=0, group_m=8, b_kmajor=True, lse_out=True), 32768),
                "lse_logits_partial": (S.StripConfig(kind=4, residual=0, group_m=8, b_kmajor=True, lse_out=True),
                                       50257),
                "lse_logits_max": (S.StripConfig(kind=4, residual=0, group_m=8, b_kmajor=True, lse_out=True,
                                                 exact_max=True, pick=False), 50257)}
        out = {}
        for name, (cfg, n) in cfgs.items():
            k = S.compile_sm90(cfg, N=n)
            regs = sorted(set(int(v) for v in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+);",
                                                          k.asm["ptx"])))
            out[name] = dict(resources(k.asm["cubin"]), smem=k.metadata.shared, warps=k.metadata.num_warps,
                             setmaxnreg=regs)
        print(json.dumps(out))
    """)
    result = run_compiler_script(script)
    for name, info in result.items():
        assert info["smem"] <= 227 * 1024, (name, info)
        assert 152 in info["setmaxnreg"], (name, info)  # the epilogue partition's budget
        if "reg" in info:
            assert info["reg"] <= 168 and info["stack"] <= 64, (name, info)


def test_later_calls_launch_with_the_arguments_the_jit_would_get(monkeypatch):
    """After the first call per layout, runtime/strip_kernel.py assembles the launch itself
    (new descriptors and tensors, the layout's statics): for new tensors it must equal what
    ``strip.arguments`` gives the JIT. (The launch is recorded, not run: no GPU here.)"""
    from comfuse.codegen.gluon import strip
    from comfuse.runtime import strip_kernel
    from comfuse.runtime.build import build
    region = suite_region("ln_postnorm", M=256, K=64, N=512)
    (ws,) = [p for p in candidates(region, target="cuda") if p.schedule == "ws_strip" and not p.form.residual_tma]
    kernel = build(ws)
    launched = []
    scratch = (torch.empty(strip.workspace_numel(256, 512)), torch.zeros(2, dtype=torch.int64))

    def bind(self, a, b, out, bias, residual, gamma, beta):  # the JIT's launch, minus the GPU
        grid, args, options = strip.arguments(strip_kernel.config(self.plan), a, b, out, bias=bias,
                                              residual=residual, gamma=gamma, beta=beta, eps=self.plan.form.template.eps,
                                              ws=scratch[0], counters=scratch[1])
        statics = [None] * strip.PER_CALL + args[strip.PER_CALL:]
        return (lambda *full: launched.append(full)), statics, strip_kernel.config(self.plan)
    monkeypatch.setattr(strip_kernel.StripKernel, "bind", bind)

    def call(seed):
        x, w, b, r, g, be = SUITE["ln_postnorm"].inputs(256, 64, 512, dtype=bf, seed=seed)
        ins = [v.reshape(1, 1, -1) if v.dim() == 1 else v.unsqueeze(0) for v in (b, r, g, be)]
        out = torch.empty(1, 256, 512, dtype=bf)
        kernel.launch(x.unsqueeze(0), w.unsqueeze(0), ins, [out])
        return x, w, b, r, g, be, out[0]
    call(0)
    assert not launched  # (the first call binds)
    x, w, b, r, g, be, out = call(1)
    (got,) = launched
    _, want, _ = strip.arguments(strip_kernel.config(ws), x, w, out, bias=b, residual=r, gamma=g, beta=be,
                                 eps=ws.form.template.eps, ws=scratch[0], counters=scratch[1])
    assert len(got) == len(want)
    for j, (u, v) in enumerate(zip(got, want)):
        if j < 3:  # descriptors
            assert (u.base.data_ptr(), u.shape, u.strides, u.block_shape) == \
                (v.base.data_ptr(), v.shape, v.strides, v.block_shape), j
        elif isinstance(v, torch.Tensor):
            assert u.data_ptr() == v.data_ptr(), j
        else:
            assert u == v, j


# ---- the terminal kind (ws_split): cross-entropy's statistics -------------------------------

CE_FORMS = {
    "ce_mean": lambda x, w, t: F.cross_entropy(x @ w, t),
    "ce_float_none_ignore": lambda x, w, t: F.cross_entropy((x @ w).float(), t, ignore_index=3, reduction="none"),
    "ce_sum_linear": lambda x, w, t: F.cross_entropy(F.linear(x, w.t().contiguous()), t, reduction="sum"),
    "logsumexp": lambda x, w, t: torch.logsumexp((x @ w).float(), -1),
    "training_forward": lambda x, w, t: training_forward_head(x @ w, t),
}



def ce_region(fn, M=256, K=64, N=1024):
    args = (torch.randn(M, K, dtype=bf), torch.randn(K, N, dtype=bf), torch.randint(0, N, (M, )))
    return region_of(fn, *args)


@pytest.mark.parametrize("name", list(CE_FORMS))
def test_the_terminal_kind_matches_cross_entropy_and_log_sum_exp(name):
    t, why = match_lse(ce_region(CE_FORMS[name]))
    assert why == "", why
    assert t.lse and (t.pick is None) == (name == "logsumexp")
    assert t.exact_max == (name == "training_forward")


def test_the_terminal_kind_writes_the_logits_beside_the_loss_and_nothing_else():
    """A language model's head returns x @ W (bf16) and the loss: the kind writes both. A
    full tile other than x @ W itself (scaled logits) is refused."""
    t, why = match_lse(ce_region(lambda x, w, t: (x @ w, F.cross_entropy((x @ w).float(), t))))
    assert why == "" and t.logits == 0 and "x @ W itself" in t.describe()
    t, why = match_lse(ce_region(lambda x, w, t: ((x @ w) * 2, F.cross_entropy((x @ w).float(), t))))
    assert t is None and "x @ W itself" in why


@pytest.mark.parametrize("fn, why", [
    (lambda x, w, t: F.cross_entropy((x @ w).float(), t, label_smoothing=0.1), "is not the log-sum-exp"),
    (lambda x, w, t: torch.logsumexp(torch.relu(x @ w).float(), -1), "is not the log-sum-exp"),
    (lambda x, w, t: (x @ w).float().amax(-1), "needs a log-sum-exp"),
], ids=["label_smoothing", "lse_of_relu", "max_alone"])
def test_the_terminal_kind_refuses_other_statistics(fn, why):
    """Label smoothing (a plain sum of the logits), a log-sum-exp of something else, and a max
    without a log-sum-exp are not the kind's statistics."""
    t, reason = match_lse(ce_region(fn))
    assert t is None and why in reason, reason


def test_a_max_the_outputs_need_makes_the_template_store_the_row_maxima():
    """A max used only as a shift (log_softmax's) has the log-sum-exp stand in; one the outputs
    need (a training forward returns the row max for its backward) is the row max itself,
    from per-tile maxima the template stores beside its log-sum-exps."""
    t, why = match_lse(ce_region(lambda x, w, t: F.cross_entropy((x @ w).float(), t)))
    assert why == "" and not t.shifts or not t.exact_max
    t, why = match_lse(ce_region(lambda x, w, t: ((x @ w).float().amax(-1),
                                                  torch.logsumexp((x @ w).float(), -1))))
    assert why == "" and t.shifts and t.exact_max and "its max" in t.describe()


def test_the_planner_offers_the_terminal_kind_for_losses_on_cuda_only():
    region = ce_region(CE_FORMS["ce_mean"])
    (p, ) = [p for p in candidates(region, target="cuda") if p.schedule == "ws_split"]
    assert p.tiles_n == 4 and "no [M, N] output" in p.describe()
    with settings.override(schedule="ws_split"):
        refused = plan(region, target="interpreter")
    assert isinstance(refused, NotFused) and "interpreter" in refused.reason
    assert not [p for p in candidates(ce_region(CE_FORMS["ce_mean"], M=200), target="cuda")
                if p.schedule == "ws_split"]


def lse_combine_against_reference(p, M: int, K: int, N: int, seed: int = 1) -> None:
    """Run a ws_split plan's combine kernel on the workspace its Gluon template would leave
    for random operands (each tile's log-sum-exp of x @ W per row, the logit at each row's
    target where the target is a column, NaN elsewhere: never read; each tile's row max where
    the plan stores them; the logits where it writes them) and compare the outputs with the
    region's float64 reference; targets outside [0, N) (ignored rows) included."""
    from comfuse.ir.interpret import canonical_shape, evaluate
    from comfuse.runtime.build import build
    kernel = build(p)
    region = p.region
    gen = torch.Generator().manual_seed(seed)
    a3 = torch.randn(1, M, K, generator=gen).to(bf)
    b3 = (torch.randn(1, K, N, generator=gen) / K ** 0.5 * 3).to(bf)
    ins = []
    for inp in region.inputs:
        shape = canonical_shape(region, inp.axes)
        if inp.dtype == torch.bool:
            ins.append(torch.rand(shape, generator=gen) > 0.2)
        elif not inp.dtype.is_floating_point:
            t = torch.randint(0, N, shape, generator=gen)
            t[0, ::5] = -100
            t[0, 1::9] = 3
            ins.append(t)
        else:
            ins.append((torch.rand(shape, generator=gen) + 0.5).to(inp.dtype))
    refs = evaluate(region, a3, b3, ins)
    v = a3[0].double() @ b3[0].double()
    tiles = N // 256
    exact_max = p.form.template.exact_max
    ws = torch.full((((2 if exact_max else 1) * tiles + 1) * M, ), float("nan"), dtype=torch.float32)
    ws[:tiles * M] = torch.logsumexp(v.view(M, tiles, 256), 2).t().reshape(-1).float()
    if exact_max:
        ws[(tiles + 1) * M:] = v.view(M, tiles, 256).amax(2).t().reshape(-1).float()
    if p.form.template.target is not None:
        target = ins[p.form.template.target].reshape(-1)
        inside = ((target >= 0) & (target < N)).nonzero()[:, 0]
        ws[tiles * M + inside] = v[inside, target[inside]].float()
    outs = [torch.full(canonical_shape(region, o.axes), float("nan"), dtype=o.dtype) for o in region.outputs]
    if p.form.template.logits is not None:  # as the template leaves them (the combine reads the target's)
        outs[p.form.template.logits].view(M, N).copy_(v)
    kernel.combine(a3, b3, ins, outs, ws)
    for k, (out, ref) in enumerate(zip(outs, refs)):
        if k == p.form.template.logits:  # (written by the template, not the combine)
            continue
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        ok = ~torch.isnan(ref)
        err = (out.double()[ok] - ref[ok]).abs().max().item() if ok.any() else 0.0
        # (a bf16 loss: 1.5 of its ulps at most; a target's logit read from the bf16 logits: half an ulp)
        tol = 1e-4 if out.dtype == torch.float32 and p.form.template.logits is None else 2.0 ** -7
        assert err <= tol * max(1.0, ref[ok].abs().max().item() if ok.any() else 1.0), err


@pytest.mark.parametrize("name", ["ce_float_none_ignore", "ce_mean", "logsumexp", "training_forward"])
def test_the_terminal_combine_turns_the_templates_workspace_into_the_outputs(name):
    """The contract between the Gluon template's KIND_LSE (GPU only) and the generated combine
    kernel (run here by Triton's interpreter), at 5 tiles a row (not a power of two)."""
    M, K, N = 256, 64, 1280
    with settings.override(schedule="ws_split"):
        (cand,) = find_regions(capture(CE_FORMS[name], (torch.randn(M, K, dtype=bf), torch.randn(K, N, dtype=bf),
                                                        torch.randint(0, N, (M, )))))
        p = plan(cand.region, target="cuda")
    lse_combine_against_reference(p, M, K, N)
