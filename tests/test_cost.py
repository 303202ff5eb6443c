"""The cost model (planner/cost.py): which candidates a region compiles and times on a GPU."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import comfuse
from comfuse.frontend.capture import capture
from comfuse.frontend.regions import find_regions
from comfuse.kernel_node import why_plan_not_launched
from comfuse.planner import candidates, cost
from comfuse.planner.gluon import GLUON_SCHEDULES
from comfuse.runtime import prediction, tuning

from helpers import DEVICE, PostNorm

BF = torch.bfloat16
CUDA = torch.device("cuda")


def region(fn, *shapes):
    """The one region of ``fn`` on bf16 tensors of ``shapes`` (on the CPU: only sizes matter)."""
    (cand,) = find_regions(capture(fn, tuple(torch.randn(s, dtype=BF) for s in shapes)))
    return cand.region


def post_norm(x, w, r, g, b):  # BERT's attention output: GEMM, residual, LayerNorm
    return F.layer_norm(x @ w + r, (w.shape[1],), g, b)


def gelu(x, w, b):  # BERT's intermediate layer
    return F.gelu(x @ w + b)


@pytest.fixture
def an_h200(monkeypatch, tmp_path):
    """The cost model asked about a GPU its record was measured on (with no record of its
    own yet)."""
    monkeypatch.setattr(prediction, "RECORDED_GPUS", ((9, 0),))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    with comfuse.settings.override(cache_dir=tmp_path):
        yield


def test_a_row_reduction_whose_launchable_plans_never_won_is_not_tuned(an_h200):
    """BERT's attention output inside Inductor's compilation: the plans Inductor can launch
    are cooperative and row-in-CTA ones, which never beat Inductor's code for the ops on the
    H200; the region is not tuned. With its Gluon plans (comfuse's own launch) it is."""
    r = region(post_norm, (8192, 768), (768, 768), (8192, 768), (768,), (768,))
    plans = candidates(r, target="cuda")
    launchable = [p for p in plans if not why_plan_not_launched(p)]
    assert launchable and {p.schedule for p in launchable} <= {"cooperative", "row_in_cta"}
    why = prediction.predicted_loss(launchable, r, CUDA)
    assert why.startswith("predicted") and "cooperative 0.99 (the benchmark record)" in why
    assert prediction.predicted_loss(plans, r, CUDA) == ""  # (ws_stages has won: 0.69 of the ops' time)
    assert cost.may_win(plans) and not cost.may_win(launchable)


def test_the_prediction_holds_only_where_it_was_measured_and_nothing_is_forced(monkeypatch, an_h200):
    r = region(post_norm, (8192, 768), (768, 768), (8192, 768), (768,), (768,))
    launchable = [p for p in candidates(r, target="cuda") if not why_plan_not_launched(p)]
    assert prediction.predicted_loss(launchable, r, torch.device("cpu")) == ""
    with comfuse.settings.override(schedule="cooperative"):
        assert prediction.predicted_loss(launchable, r, CUDA) == ""  # (the user asked for it)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert prediction.predicted_loss(launchable, r, CUDA) == ""  # (no record on an A100)


def test_the_shortlist_keeps_the_best_estimated_tile_shapes_in_all_their_forms_and_every_gluon_plan(an_h200):
    """BERT's attention output at a width of 768: 128 x 256 tiles leave a quarter of their
    second wave idle; the shapes with the best estimates are kept, each with its TMA and
    persistent forms, and the Gluon plans all."""
    r = region(lambda x, w, b: torch.relu(x @ w + b), (8192, 768), (768, 768), (768,))
    plans = candidates(r, target="cuda")
    triton = [p for p in plans if p.schedule not in GLUON_SCHEDULES]
    shapes = {cost._shape(p) for p in triton}
    assert len(shapes) > cost.SHORTLIST
    kept = prediction.shortlisted(plans, r, CUDA)
    kept_triton = [p for p in kept if p.schedule not in GLUON_SCHEDULES]
    kept_shapes = {cost._shape(p) for p in kept_triton}
    assert len(kept_shapes) == cost.SHORTLIST
    assert kept_triton == [p for p in triton if cost._shape(p) in kept_shapes]  # (every form of a kept shape)
    assert [p for p in plans if p.schedule in GLUON_SCHEDULES] == [p for p in kept if p.schedule in GLUON_SCHEDULES]
    dropped = [p for p in triton if cost._shape(p) not in kept_shapes]
    assert max(map(cost.estimate_ms, kept_triton)) <= min(map(cost.estimate_ms, dropped))
    assert ("tile", 128, 256, 64, 8) not in kept_shapes  # (2 waves, the second 45 % full)
    assert prediction.shortlisted(plans, r, torch.device("cpu")) == plans


def test_estimates_count_waves_over_the_sms_and_the_bytes_moved():
    r = region(gelu, (8192, 768), (768, 3072), (3072,))
    (p,) = [q for q in candidates(r, target="interpreter") if q.schedule == "tile"][:1]
    p = dataclasses.replace(p, block_m=128, block_n=128)

    def at(M, N, K):
        return dataclasses.replace(p, region=r.replace(sizes=dataclasses.replace(r.sizes, M=M, N=N, K=K)))
    one_wave, one_more = at(128 * 132, 128, 4096), at(128 * 133, 128, 4096)  # 132 tiles, then 133
    mainloop = cost.estimate_ms(one_wave) - cost.moved_bytes(one_wave) / (cost.COPY_TBPS * 1e9) - cost.LAUNCH_MS
    grown = cost.estimate_ms(one_more) - cost.moved_bytes(one_more) / (cost.COPY_TBPS * 1e9) - cost.LAUNCH_MS
    assert grown == pytest.approx(2 * mainloop)  # (a second wave for one tile)
    assert cost.estimate_ms(at(8192, 3072, 1536)) > cost.estimate_ms(at(8192, 3072, 768))
    assert cost.moved_bytes(at(8192, 3072, 768)) == (8192 * 768 + 768 * 3072 + 3072 + 8192 * 3072) * 2


def test_a_region_predicted_to_lose_keeps_its_ops_without_timing_anything(monkeypatch, tmp_path):
    """Where the cost model predicts a loss, nothing is compiled or timed: the region runs
    its ops, and its report says why."""
    from comfuse import backend
    monkeypatch.setattr(prediction, "predicted_loss", lambda plans, region, device: "predicted: never won")
    monkeypatch.setattr(tuning, "decide", lambda *a, **k: pytest.fail("timed"))

    model = PostNorm().to(DEVICE)
    x, r = torch.randn(4, 32, device=DEVICE), torch.randn(4, 48, device=DEVICE)
    torch._dynamo.reset()
    with torch.no_grad(), comfuse.settings.override(cache_dir=tmp_path):
        out = torch.compile(model, backend=lambda gm, ex: backend.comfuse_backend(
            gm, ex, {"autotune": "1", "graph_check": "0"}), dynamic=False)(x, r)
    torch.testing.assert_close(out, model(x, r), rtol=1e-4, atol=1e-5)
    (reg,) = backend.REPORTS[-1].regions
    assert not reg.fused and reg.reason == "predicted: never won"


def test_a_class_measured_in_the_benchmark_record_is_predicted_at_first_sight(an_h200):
    """BERT's attention scores (a batched GEMM, 384 x 512 x 512 x 64) with a pointwise
    epilogue: tile plans of that class lost in two regions of the record, so a new GPU's first
    such region is not tuned."""
    r = region(lambda q, k: torch.relu(q @ k) * 2, (384, 512, 64), (384, 64, 512))
    plans = [p for p in candidates(r, target="cuda") if not why_plan_not_launched(p) and p.schedule == "tile"]
    assert {cost.plan_class(p) for p in plans} == {"tile/batched/16/flat"}
    assert "tile 1.10 (2 regions of its class measured)" in prediction.predicted_loss(plans, r, CUDA)


def test_this_gpus_measurements_replace_the_record_for_a_class_once_there_are_enough(an_h200, monkeypatch):
    """Autotuning adds each region's best time over its ops' per class of plan to this GPU's
    record on disk; once a class has MEASURED_ENOUGH regions, the record predicts from them:
    tile plans on batched GEMMs that lost twice are not tuned for a third region of their
    size; a class that won stays tuned; a plan that failed adds nothing."""
    monkeypatch.setattr(cost, "MEASURED_CLASSES", {})  # (this GPU's record alone)
    r = region(lambda q, k: torch.relu(q @ k) * 2, (384, 512, 64), (384, 64, 512))
    plans = [p for p in candidates(r, target="cuda") if not why_plan_not_launched(p) and p.schedule == "tile"]
    assert plans
    names = [f"plan{i}" for i in range(len(plans))]
    assert prediction.predicted_loss(plans, r, CUDA) == ""  # (tile: 0.94 in the shipped record)
    lost = {"times_ms": {tuning.UNFUSED: 0.30, **{n: 0.33 + i * 0.01 for i, n in enumerate(names)}}}
    for k in range(cost.MEASURED_ENOUGH):
        assert prediction.predicted_loss(plans, r, CUDA) == ""
        prediction.remember(plans, names, lost, f"region{k}", CUDA)
        prediction.remember(plans, names, lost, f"region{k}", CUDA)  # (the same decision read again)
    why = prediction.predicted_loss(plans, r, CUDA)
    assert f"tile 1.10 ({cost.MEASURED_ENOUGH} regions of its class measured)" in why
    (c,) = {cost.plan_class(p) for p in plans}
    assert len(prediction.measured(CUDA)[c]) == cost.MEASURED_ENOUGH
    won = {"times_ms": {tuning.UNFUSED: 0.30, names[0]: 0.27, names[1]: float("inf")}}
    prediction.remember(plans[:2], names[:2], won, "region-won", CUDA)
    assert prediction.predicted_loss(plans, r, CUDA) == ""
    bigger = region(lambda q, k: torch.relu(q @ k) * 2, (384, 2048, 64), (384, 64, 2048))  # (16 x the work)
    big_plans = [p for p in candidates(bigger, target="cuda") if p.schedule == "tile"]
    assert {cost.plan_class(p) for p in big_plans} != {c}


def test_a_damaged_record_is_ignored(an_h200, monkeypatch):
    monkeypatch.setattr(cost, "MEASURED_CLASSES", {})
    r = region(lambda q, k: torch.relu(q @ k) * 2, (384, 512, 64), (384, 64, 512))
    plans = [p for p in candidates(r, target="cuda") if not why_plan_not_launched(p)]
    path = comfuse.settings.get().cache_dir / "measured" / "record.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\xff{not json")
    assert prediction.predicted_loss(plans, r, CUDA) == ""
    prediction.remember(plans, ["a"] * len(plans), {"times_ms": {tuning.UNFUSED: 1.0, "a": 1.5}}, "k", CUDA)
    assert prediction.measured(CUDA)


def test_an_lm_heads_split_plans_are_not_timed_where_their_class_lost(an_h200):
    """An LM head that returns its logits beside its loss (GPT-2's 8192 x 768 x 50257): the
    Triton split plans of its class lost in every region measured (1.17-1.30x the ops' time),
    so they are neither compiled nor timed; the template (ws_split) still is. Where they are
    all there is (a training forward that also saves the row max, which the template does not
    leave), the region is not tuned."""
    def head(x, w, t):
        y = x @ w
        return y, F.cross_entropy(y.float(), t, reduction="none")
    args = (torch.randn(8192, 768, dtype=BF), torch.randn(768, 50257, dtype=BF), torch.randint(0, 50257, (8192, )))
    (cand,) = find_regions(capture(head, args))
    plans = candidates(cand.region, target="cuda")
    assert {p.schedule for p in plans} >= {"split", "ws_split"}
    assert {cost.plan_class(p) for p in plans if p.schedule == "split"} == {"split/single/19/flat"}
    kept = prediction.shortlisted(plans, cand.region, CUDA)
    assert kept and {p.schedule for p in kept} == {"ws_split"}
    split_only = [p for p in plans if p.schedule == "split"]
    why = prediction.predicted_loss(split_only, cand.region, CUDA)
    assert "split 1.17 (6 regions of its class measured)" in why, why


def test_the_8b_blocks_mlp_gemms_and_a_heads_weight_gradient_are_classes_of_their_own(an_h200):
    """A forward GEMM of 8192 x 14336 x 4096 with a pointwise epilogue (the 8B block's MLP):
    its class (flat: K below both output sides) lost in every region measured, so it is not
    tuned at first sight. A weight gradient of a like size (30522 x 768 x 16384: deep) is of
    another class, measured on its own (BERT's and GPT-2's heads), and not tuned either."""
    mlp = region(lambda x, w: F.silu(x @ w), (8192, 4096), (4096, 14336))
    plans = candidates(mlp, target="cuda")
    assert {cost.plan_class(p) for p in plans if p.schedule == "tile"} == {"tile/single/19/flat"}
    why = prediction.predicted_loss(plans, mlp, CUDA)
    assert "tile 1.11 (3 regions of its class measured)" in why, why
    grad = region(lambda g, x: g @ x * 2, (30522, 16384), (16384, 768))
    grad_plans = [p for p in candidates(grad, target="cuda") if p.schedule == "tile"]
    assert {cost.plan_class(p) for p in grad_plans} == {"tile/single/19/deep"}
    assert cost._best(grad_plans[0], {}) == (1.5226, "4 regions of its class measured")
    assert "not tuned" in prediction.predicted_loss(grad_plans, grad, CUDA)


def _gelu_grad(a):
    return 0.5 * (1 + torch.erf(a * 0.7071067811865476)) + a * torch.exp(-0.5 * a * a) * 0.3989422804014327


@pytest.mark.parametrize("tokens, best", [(8192, "split 1.08"), (16384, "split 1.18")], ids=["gpt2", "bert"])
def test_gelus_backward_with_its_derivative_computed_in_the_region_is_not_tuned(an_h200, tokens, best):
    """GELU's backward after ``dY @ W2`` with the bias gradient's column sum, the derivative
    computed in the region from the saved activation (GPT-2's 8192 and BERT's 16384 tokens,
    3072 x 768): every split plan measured there lost to Inductor's code, so the region's ops
    go to Inductor untimed (2.6-2.9 s of a first step's tuning)."""
    def gelu_backward(dy, w2, a):
        g = (dy @ w2) * _gelu_grad(a.float()).to(dy.dtype)
        return g, g.sum(0)
    r = region(gelu_backward, (tokens, 768), (768, 3072), (tokens, 3072))
    plans = candidates(r, target="cuda")
    assert "split" in {p.schedule for p in plans}
    why = prediction.predicted_loss(plans, r, CUDA)
    assert "not tuned" in why and f"{best} (2 regions of its class measured)" in why, why


def test_a_deep_gemm_of_a_class_never_measured_goes_by_its_sizes_record(an_h200):
    """Attention's backward (dV = P^T dO: 384 x 512 x 512 x 64, deep) with a pointwise
    epilogue: no deep region of its size was measured, so the flat ones of its size (the
    forward's scores, 1.10 and 1.31) predict it, as before the classes told the shapes apart."""
    r = region(lambda p, d: torch.relu(p @ d) * 2, (384, 512, 512), (384, 512, 64))
    plans = [p for p in candidates(r, target="cuda") if not why_plan_not_launched(p) and p.schedule == "tile"]
    assert {cost.plan_class(p) for p in plans} == {"tile/batched/16/deep"}
    assert "tile 1.10 (2 regions of its size measured)" in prediction.predicted_loss(plans, r, CUDA)


def test_the_8b_heads_split_plans_and_its_down_projection_are_left_out(an_h200):
    """At the 8B block's sizes: the LM head (8192 x 4096 x 128256, returning its logits) keeps
    the template alone, its Triton split plans' class having reached 0.997 and 1.020 of the
    ops' time on the H200 and an H100; the down projection with its residual (8192 x 14336 x
    4096, deep) is not tuned, its warp-specialised kinds having reached 0.978 at best (a kind
    must have been 3 % faster). The regions are the small ones' structure at those sizes."""
    def head(x, w, t):
        y = x @ w
        return y, F.cross_entropy(y.float(), t, reduction="none")
    args = (torch.randn(64, 32, dtype=BF), torch.randn(32, 256, dtype=BF), torch.randint(0, 256, (64, )))
    (cand,) = find_regions(capture(head, args))
    big = dataclasses.replace(cand.region, sizes=dataclasses.replace(cand.region.sizes, M=8192, N=128256, K=4096))
    plans = candidates(big, target="cuda")
    assert {cost.plan_class(p) for p in plans if p.schedule == "split"} == {"split/single/21/flat"}
    assert {p.schedule for p in prediction.shortlisted(plans, big, CUDA)} == {"ws_split"}
    down = region(lambda x, w, r: x @ w + r, (64, 128), (128, 32), (64, 32))
    down = dataclasses.replace(down, sizes=dataclasses.replace(down.sizes, M=8192, N=4096, K=14336))
    tile = next(p for p in candidates(down, target="cuda") if p.schedule == "tile")
    stages = dataclasses.replace(tile, schedule="ws_stages")  # (its class: what the record holds)
    assert cost.plan_class(stages) == "ws_stages/single/19/deep"
    assert cost._best(stages, {}) == (0.9781, "4 regions of its class measured")
    assert not cost.may_win([stages], {})


def test_gpt2s_mlp_up_projection_is_not_tuned(an_h200):
    """GPT-2's MLP up projection with its GELU (8192 x 768 x 3072): its class lost in both
    graphs measured (1.03 and 1.38 of the ops' time), so it goes to Inductor at first sight."""
    up = region(lambda x, w: F.gelu(x @ w, approximate="tanh"), (8192, 768), (768, 3072))
    plans = [p for p in candidates(up, target="cuda") if not why_plan_not_launched(p)]
    assert {cost.plan_class(p) for p in plans if p.schedule == "tile"} == {"tile/single/17/flat"}
    assert "tile 1.03 (2 regions of its class measured)" in prediction.predicted_loss(plans, up, CUDA)
