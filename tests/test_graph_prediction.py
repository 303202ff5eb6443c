"""The whole-graph check spared where the regions' own timings leave no doubt
(``GraphChoice.predicted``), and kept where they do not."""
from types import SimpleNamespace

import pytest
import torch

from comfuse import backend, graph_check
from comfuse.ir.nodes import Sizes

from helpers import DEVICE, NormPostNorm, PostNorm, assert_grads_close

pytestmark = pytest.mark.filterwarnings("ignore::comfuse.ComfuseWarning", "ignore::UserWarning")


def _region(M=1024, N=4096, K=512, side=("M", "N"), out=(("M", "N"), ("M",))):
    axes = frozenset
    return SimpleNamespace(sizes=Sizes(B=1, M=M, N=N, K=K),
                           gemm=SimpleNamespace(a=SimpleNamespace(dtype=torch.bfloat16)),
                           inputs=(SimpleNamespace(axes=axes(side), dtype=torch.bfloat16),),
                           outputs=tuple(SimpleNamespace(axes=axes(a), dtype=torch.float32) for a in out))


def test_the_boundary_charge_counts_the_activation_side_inputs_and_outputs():
    region = _region()
    want = 1024 * 512 * 2 + 1024 * 4096 * 2 + 1024 * 4096 * 4 + 1024 * 4
    assert graph_check.boundary_bytes(region) == want
    module = SimpleNamespace(region=region, report=SimpleNamespace(tuned_ms=(1.0, 1.5)))
    saved, lost = graph_check.standalone_margin([module, module])
    assert saved == pytest.approx(1.0)
    assert lost == pytest.approx(2 * 2 * want / graph_check.BOUNDARY_BYTES_PER_S * 1e3)
    untuned = SimpleNamespace(region=region, report=SimpleNamespace(tuned_ms=()))
    chain = SimpleNamespace(report=SimpleNamespace(tuned_ms=(1.0, 1.5)))  # (no single region)
    assert graph_check.standalone_margin([module, untuned]) is None
    assert graph_check.standalone_margin([chain]) is None and graph_check.standalone_margin([]) is None


@pytest.fixture
def checked(monkeypatch, fused_regions_win):
    """The backend's check in force with COMFUSE_GRAPH_CHECK left at auto (as on a GPU); the
    fused graph's own timing faked (``times``: its ms a call, the host's ms of it); every
    comparison and every compilation of the graph without regions counted."""
    from comfuse import settings
    monkeypatch.setattr(graph_check, "checks_graph", lambda gm, example_inputs: True)
    times = {"wall": 10.0, "host": 1.0}

    def time_rounds(calls, device, rounds):
        for fn in calls.values():
            fn()  # (the form runs)
        return {n: [times["wall"]] * rounds for n in calls}
    monkeypatch.setattr(graph_check, "time_rounds", time_rounds)
    monkeypatch.setattr(graph_check, "host_ms", lambda call, device: times["host"])
    seen = {"compared": 0, "plain": 0}

    def time_graphs(calls, device):
        seen["compared"] += 1
        return {"fused": 1.0, "inductor": 2.0}
    monkeypatch.setattr(graph_check, "_time_graphs", time_graphs)
    inductor = backend._inductor
    monkeypatch.setattr(backend, "_inductor", lambda *a: seen.__setitem__("plain", seen["plain"] + 1) or inductor(*a))
    with settings.override(graph_check="auto", autotune="1"):
        yield times, seen


def _run(model, grad: bool, options=None):
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32, device=DEVICE, requires_grad=grad)
    r = torch.randn(2, 5, 48, device=DEVICE)
    fn = torch.compile(model, backend="comfuse", dynamic=False, options=options)
    if not grad:
        with torch.no_grad():
            torch.testing.assert_close(fn(x, r), model(x, r), rtol=1e-4, atol=1e-5)
        return
    model(x, r).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    fn(x, r).sum().backward()
    assert_grads_close([p.grad for p in model.parameters()], want)


def test_a_graph_whose_regions_saved_far_more_than_their_boundaries_cost_is_kept_unchecked(checked):
    """Each region saved 0.5 ms alone (fused_regions_win), far more than the 1 % of a 10 ms
    call: the fused graph is kept at its first call without Inductor's compilation."""
    times, seen = checked
    _run(PostNorm().to(DEVICE), grad=False)
    assert seen == {"compared": 0, "plain": 0}
    record = graph_check.GRAPH_CHECKS[-1]
    assert record["kept"] == "fused" and record["predicted"]["alone_saved_ms"] == pytest.approx(0.5)


@pytest.mark.parametrize("why", ["host-bound", "too close"])
def test_a_graph_the_prediction_cannot_vouch_for_is_compiled_without_regions_and_timed(checked, why):
    """A host-bound call (its regions' calls then cost the graph what they cost the host), or
    a saving too small against the call: Inductor's compilation is built at the first call
    and the two are timed as before."""
    times, seen = checked
    times.update({"host": 9.5} if why == "host-bound" else {"wall": 100.0})
    _run(PostNorm().to(DEVICE), grad=False)
    assert seen == {"compared": 1, "plain": 1}
    assert "predicted" not in graph_check.GRAPH_CHECKS[-1]


def test_a_training_graph_is_kept_unchecked_only_where_its_backward_fuses_nothing(checked):
    """Training: one step lowers the backward; where it kept no fused region the two forms'
    steps differ in the forward alone, and the prediction holds; where it kept one, the
    graph is compiled without regions and timed. Gradients are one step's, as eager's."""
    times, seen = checked
    _run(PostNorm().to(DEVICE), grad=True)
    assert seen == {"compared": 0, "plain": 0}
    assert graph_check.GRAPH_CHECKS[-1]["training"] and graph_check.GRAPH_CHECKS[-1]["backward_regions"] == 0
    _run(NormPostNorm().to(DEVICE), grad=True)
    assert seen["plain"] == 1 and seen["compared"] >= 1
    assert "predicted" not in graph_check.GRAPH_CHECKS[-1]


@pytest.mark.parametrize("how", ["setting", "backend option"])
def test_a_forced_check_times_every_graph(checked, how):
    """COMFUSE_GRAPH_CHECK=1, or the backend's option graph_check="1" (in force while the
    graph compiles, not at its first call), times every graph, predictable or not."""
    from comfuse import settings
    times, seen = checked
    if how == "setting":
        with settings.override(graph_check="1"):
            _run(PostNorm().to(DEVICE), grad=False)
    else:
        _run(PostNorm().to(DEVICE), grad=False, options={"graph_check": "1"})
    assert seen == {"compared": 1, "plain": 1}
