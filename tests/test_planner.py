"""The planner: reduction axis, passes, stages, schedule choice."""
import dataclasses

import torch

from comfuse import settings
from comfuse.frontend.capture import capture
from comfuse.frontend.regions import find_regions
from comfuse.ir import Node, Op, Output, evaluate, structural_key, verify
from comfuse.planner import NotFused, Plan, cse, dce, one_hot_counts, partition, plan, reduction_axis, transpose

from test_ir import MN, NONE, layer_norm_region


def region_of(fn, *args):
    (cand,) = find_regions(capture(fn, args))
    return verify(cand.region)


def x_w(M=6, K=5, N=9):
    return torch.randn(M, K), torch.randn(K, N)


def test_reduction_axis():
    assert reduction_axis(region_of(lambda x, w: torch.softmax(x @ w, -1), *x_w()))[0] == "N"
    assert reduction_axis(region_of(lambda x, w: torch.softmax(x @ w, 0), *x_w()))[0] == "M"
    assert reduction_axis(region_of(lambda x, w: torch.relu(x @ w), *x_w()))[0] is None
    mixed = region_of(lambda x, w: (x @ w) - (x @ w).amax(0) - (x @ w).sum(1, keepdim=True), *x_w())
    axis, why = reduction_axis(mixed)
    assert axis is None and "both M" in why and "and N" in why


def test_mixed_axes_are_not_fused_with_the_reason():
    mixed = region_of(lambda x, w: (x @ w) - (x @ w).amax(0) - (x @ w).sum(1, keepdim=True), *x_w())
    result = plan(mixed)
    assert isinstance(result, NotFused) and "no strip of tiles holds both" in result.reason


def test_a_bias_alone_is_left_to_cublas():
    """A linear layer's bias is added by cuBLAS inside the GEMM (Inductor's addmm): nothing
    is left to fuse. A bias followed by anything, a residual, or a bias in a wider dtype
    still fuses, as does a per-row vector."""
    x, w = x_w()
    b, r = torch.randn(9), torch.randn(6, 9)
    alone = plan(region_of(lambda x, w, b: (x @ w + b).view(2, 3, 9), x, w, b))
    assert isinstance(alone, NotFused) and "beyond a bias" in alone.reason
    for fn in (lambda x, w, b: torch.relu(x @ w + b), lambda x, w, b: x @ w + b + r,
               lambda x, w, b: x @ w + x[:, :1], lambda x, w, b: (x @ w + b) * 2):
        assert isinstance(plan(region_of(fn, x, w, b)), Plan)
    x16, w16 = x.half(), w.half()
    assert isinstance(plan(region_of(lambda x, w, b: (x @ w).float() + b, x16, w16, b)), Plan)
    assert isinstance(plan(region_of(lambda x, w, b: x @ w + b, x16, w16, b.half())), NotFused)


def test_stage_counts_follow_the_reduction_chain():
    ln = region_of(lambda x, w: torch.nn.functional.layer_norm(x @ w, (9,)), *x_w())
    sm = region_of(lambda x, w: torch.softmax(x @ w, -1), *x_w())
    act = region_of(lambda x, w: torch.nn.functional.gelu(x @ w), *x_w())
    assert len(partition(dce(ln))) == 3  # mean | variance of deviations | normalise
    assert len(partition(dce(sm))) == 3  # max | sum of exp | divide
    assert len(partition(dce(act))) == 1


def test_independent_reductions_share_a_boundary():
    r = dce(region_of(lambda x, w: ((x @ w).sum(-1), ((x @ w) * (x @ w)).sum(-1)), *x_w()))
    stages = partition(r)
    assert len(stages) == 1 and len(stages[0].reductions) == 2  # terminal: both end stage 0


def test_leaves_load_in_the_stage_that_first_uses_them():
    r = dce(layer_norm_region())
    stages = partition(r)
    gamma = next(i for i, n in enumerate(r.nodes) if n.op is Op.INPUT and n.arg == 1)
    assert gamma in stages[-1].nodes


def test_transpose_is_an_involution_and_preserves_meaning():
    r = region_of(lambda x, w, c: torch.softmax((x @ w) * c, 0), *x_w(M=6, K=5, N=9), torch.randn(6, 1))
    t = transpose(r)
    assert structural_key(transpose(t)) == structural_key(r)
    assert t.sizes.M == r.sizes.N and all(n.arg == "N" for n in t.nodes if n.op is Op.SUM)
    x, w, c = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 9, dtype=torch.float64), \
        torch.randn(6, 1, dtype=torch.float64)
    (orig,) = evaluate(r, x[None], w[None], [c.view(1, 6, 1)])
    (flip,) = evaluate(t, w.t()[None], x.t()[None], [c.view(1, 1, 6)])
    torch.testing.assert_close(flip.transpose(1, 2), orig)


def test_dce_and_cse_preserve_meaning():
    base = layer_norm_region()
    f32 = torch.float32
    extra = base.nodes + (
        Node(Op.ADD, (0, 1), f32, MN),                 # 16: duplicate of %2
        Node(Op.EXP, (16,), f32, MN),                  # 17: dead unless output
        Node(Op.CONST, (), f32, NONE, 7.0),            # 18: duplicate of %4 (N = 7)
        Node(Op.MUL, (16, 18), f32, MN),               # 19
    )
    r = verify(base.replace(nodes=extra, outputs=base.outputs + (Output(19, f32, MN, "dup"),)))
    simplified = verify(cse(dce(r)))
    assert len(simplified.nodes) < len(r.nodes)
    assert not any(n.op is Op.EXP for n in simplified.nodes)
    args = (torch.randn(1, 5, 3), torch.randn(1, 3, 7), [torch.randn(1, 1, 7), torch.randn(1, 1, 7)])
    for a, b in zip(evaluate(r, *args), evaluate(simplified, *args)):
        torch.testing.assert_close(a, b)


def test_one_hot_counts_become_per_row_bounds_with_the_same_meaning():
    """Cross-entropy's "is the target one of the N columns?" (a sum over N of iota == t)
    becomes 0 <= t < N: no tile reduction left, same values for targets inside, outside
    and at the ignore index, in row and column (transposed) form."""
    import torch.nn.functional as F
    fn = lambda x, w, t: F.cross_entropy((x @ w).float(), t, reduction="none")  # noqa: E731
    x, w = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 9, dtype=torch.float64)
    t = torch.tensor([0, 8, 3, -100, 9, 12])  # in range, ignored, out of range (N = 9)
    r = region_of(fn, x.float(), w.float(), t)
    counts = lambda reg: sum(1 for n in reg.nodes if n.op is Op.SUM and  # noqa: E731
                             reg.nodes[n.src[0]].op is Op.CAST)
    assert counts(r) == 1
    s = verify(one_hot_counts(r))
    assert counts(s) == 0 and len([n for n in s.nodes if n.op is Op.SUM]) == 2  # lse's sum, the pick
    assert one_hot_counts(s) is s  # nothing left to rewrite
    ins = [i.view(1, 6, 1) if i.dim() == 1 else i for i in (t, torch.ones(6, dtype=torch.float64), t != -100)]
    for want, got in zip(evaluate(r, x[None], w[None], ins), evaluate(s, x[None], w[None], ins)):
        torch.testing.assert_close(got, want, equal_nan=True)
    tr = transpose(r)  # the same count along M
    ins_t = [i.view(1, 1, 6) for i in ins]
    for want, got in zip(evaluate(tr, w.t()[None], x.t()[None], ins_t),
                         evaluate(verify(one_hot_counts(tr)), w.t()[None], x.t()[None], ins_t)):
        torch.testing.assert_close(got, want, equal_nan=True)


def test_schedule_choice_and_blocks():
    p = plan(region_of(lambda x, w: torch.softmax(x @ w, -1), *x_w(N=200)), target="cuda")
    assert isinstance(p, Plan) and p.schedule == "row_in_cta" and p.block_n >= 200
    p = plan(region_of(lambda x, w: torch.softmax(x @ w, -1), *x_w(N=300)), target="cuda")
    assert p.schedule == "cooperative" and p.tiles_n == 3 and p.form.exchanges == 2 and p.form.exchange_width == 1
    p = plan(region_of(lambda x, w: torch.relu(x @ w), *x_w(N=300)), target="cuda")
    assert p.schedule == "tile" and p.block_n < 300
    p = plan(region_of(lambda x, w: torch.softmax(x @ w, 0), *x_w(M=40, N=7)), target="interpreter")
    assert p.transposed and p.block_n >= 40


def test_rows_no_schedule_holds_are_not_fused(monkeypatch):
    import comfuse.planner.schedules as schedules
    monkeypatch.setattr(schedules, "ROW_BUDGET", 16 * 256)
    r = region_of(lambda x, w: torch.softmax(x @ w, -1), *x_w(N=300))
    with settings.override(schedule="row_in_cta"):
        result = plan(r)
    assert isinstance(result, NotFused) and "wider than one program holds" in result.reason
    result = plan(r, target="cuda", sm_count=2)  # 3 tiles per strip, 2 resident programs
    assert isinstance(result, NotFused) and "no schedule fits" in result.reason
    assert "more than the 2 programs" in result.reason


def test_moment_pairs_find_layer_norms_variance_and_nothing_else():
    """A row sum and the sum of squared deviations from the mean it defines are paired (one
    exchange for both); a variance around another centre, an unbiased (N - 1) mean, a sum of
    squares without centring, or a column reduction are not."""
    from comfuse.planner.reductions import moment_pairs
    F = torch.nn.functional
    ln = cse(dce(region_of(lambda x, w: F.layer_norm(x @ w, (9,)), *x_w())))
    pairs = moment_pairs(ln)
    assert len(pairs) == 1
    r1, r2 = pairs[0]
    assert ln.nodes[r1].op is Op.SUM and ln.nodes[r2].op is Op.SUM and r1 < r2

    def centred(v, d, c):
        return ((v - v.sum(d, keepdim=True) / c) ** 2).sum(d)
    assert moment_pairs(cse(dce(region_of(lambda x, w: centred(x @ w, -1, 9.0), *x_w())))) != ()
    for fn in (lambda x, w: centred(x @ w, -1, 8.0),  # mean over N - 1: not the row mean
               lambda x, w: ((x @ w - (x @ w).amax(-1, keepdim=True)) ** 2).sum(-1),  # around the max
               lambda x, w: ((x @ w) ** 2).sum(-1),  # uncentred
               ):
        assert moment_pairs(cse(dce(region_of(fn, *x_w())))) == ()
    col = cse(dce(region_of(lambda x, w: centred(x @ w, 0, 6.0), *x_w())))
    assert moment_pairs(col) == ()  # along M (the planner pairs it after transposing to rows)
    assert moment_pairs(cse(dce(transpose(col)))) != ()


def test_autotuning_candidates_add_persistent_plans_to_tma_tile_plans_only():
    """Beside each TMA tile plan the autotuner times the same plan on a persistent grid; no
    reduction schedule gets one, and the interpreter gets no variants at all; COMFUSE_PLAN forces
    the form."""
    from comfuse.planner import candidates
    F = torch.nn.functional
    bf = torch.bfloat16
    x, w, b = torch.randn(256, 128, dtype=bf), torch.randn(128, 512, dtype=bf), torch.randn(512, dtype=bf)
    (tile,) = find_regions(capture(lambda x, w, b: F.gelu(x @ w + b), (x, w, b)))
    plans = candidates(tile.region, target="cuda")
    persistent = [p for p in plans if getattr(p.form, "persistent", False)]
    assert persistent and all(p.schedule == "tile" and p.mainloop == "tma" for p in persistent)
    for p in persistent:  # the same plan, one program per tile, is a candidate too
        assert any(q == dataclasses.replace(p, form=dataclasses.replace(p.form, persistent=False)) for q in plans)
    t = torch.randint(0, 512, (256,))
    (ce,) = find_regions(capture(lambda x, w, t: F.cross_entropy(x @ w, t), (x, w, t)))
    ce_plans = candidates(ce.region, target="cuda")
    assert ce_plans and not any(getattr(p.form, "persistent", False) for p in ce_plans)
    assert [p.schedule for p in ce_plans].count("ws_split") == 1  # (the Gluon template: persistent itself)
    assert not any(getattr(p.form, "persistent", False) for p in candidates(tile.region, target="interpreter"))
    with settings.override(plan="mainloop=tma,persistent=1"):
        forced = plan(tile.region, target="cuda")
        assert candidates(tile.region, target="cuda") == [forced]
    assert forced.form.persistent and "persistent grid" in forced.describe()
    with settings.override(schedule="row_in_cta", plan="persistent=1"):  # a tile plan's form only
        refused = plan(tile.region, target="cuda")
    assert isinstance(refused, NotFused) and "persistent" in refused.reason
    with settings.override(plan="tail=96"):  # not a field of a tile plan
        refused = plan(tile.region, target="cuda")
    assert isinstance(refused, NotFused) and "tail" in refused.reason


def test_the_one_pass_form_keeps_a_full_tile_that_needs_no_reduction_as_a_slice_output():
    """An LM head's logits beside its loss: the logits are a tile output (written by the
    slices), the loss a combine output; float64 evaluation of the form equals the region's
    on random inputs. The Gluon template's log-sum-exp kind, which writes no [M, N] output,
    is not offered."""
    from comfuse.planner.onepass import evaluate_one_pass, one_pass
    from comfuse.planner.template import match_lse
    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    M, K, N = 16, 8, 40
    x, w, t = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g), torch.randint(0, N, (M,), generator=g)

    def head(x, w, t):
        y = x @ w
        return y * 2.0, F.cross_entropy(y, t, reduction="none")
    (found,) = find_regions(capture(head, (x, w, t)))
    region = one_hot_counts(cse(dce(found.region)))
    op = one_pass(region)
    assert op.tile_outputs == (0,) and len(op.outputs) == 2
    ins = []
    for inp in region.inputs:  # [M] each: targets (one outside [0, N)), weights, a mask
        shape = (1, M, 1)
        ins.append(torch.randint(-1, N, shape, generator=g) if inp.dtype == torch.int64 else
                   torch.rand(shape, generator=g) > 0.2 if inp.dtype == torch.bool else
                   torch.rand(shape, generator=g, dtype=torch.float64))
    a, b = x.double().view(1, M, K), w.double().view(1, K, N)
    want = evaluate(region, a, b, ins)
    got = evaluate_one_pass(op, a, b, ins)
    for u, v in zip(got, want):
        torch.testing.assert_close(u.double(), v.double(), rtol=1e-9, atol=1e-9, equal_nan=True)
    (bf,) = find_regions(capture(head, (x.bfloat16(), w.bfloat16(), t)))
    assert match_lse(bf.region)[0] is None and "no [M, N] output" in match_lse(bf.region)[1]
    with settings.override(schedule="split"):
        assert plan(bf.region, target="cuda").schedule == "split"
