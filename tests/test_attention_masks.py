"""Attention masks that would bar PyTorch's fused attention kernels (last dimension of stride
!= 1) are given a dense last dimension before AOTAutograd: the same values, broadcast
dimensions kept broadcast, and the model's outputs and gradients unchanged."""
import pytest
import torch
import torch.nn.functional as F

from comfuse.attention_masks import dense_attention_masks, needs_dense_last_dim


def traced_masks(fn, *args):
    """The masks each SDPA call of ``fn``'s Dynamo graph receives after the rewrite, with the
    rewrite's notes."""
    seen = {}

    def backend(gm, example_inputs):
        seen["notes"] = dense_attention_masks(gm)
        seen["code"] = gm.code
        return gm.forward
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(*args)
    return out, seen


def attention(q, k, v, keep):
    # a padding mask broadcast as transformers 5.17 builds it under tracing: strides (0, S, 1, 0)
    b, _, s, _ = q.shape
    mask = keep[:, None].as_strided((b, 1, s, s), (0, s, 1, 0))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def trains_as_eager(compiled, length: int, seed: int) -> None:
    """``compiled`` (``attention`` compiled) on random inputs of ``length`` keys: its output,
    and the inputs' gradients as one vector, against eager's."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, 4, length, 8, requires_grad=True) for _ in range(3))
    keep = torch.rand(length) > 0.3
    keep[0] = True
    out = compiled(q, k, v, keep)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    want = attention(q, k, v, keep)
    want_grads = torch.autograd.grad((want * want).sum(), (q, k, v))
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([g.flatten() for g in grads]),
                               torch.cat([g.flatten() for g in want_grads]), rtol=1e-4, atol=1e-5)


def test_a_mask_with_a_broadcast_last_dimension_is_given_a_dense_one():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    keep = torch.rand(16) > 0.3
    keep[0] = True
    out, seen = traced_masks(attention, q, k, v, keep)
    assert len(seen["notes"]) == 1 and "(0, 16, 1, 0)" in seen["notes"][0]
    assert "contiguous" in seen["code"] and "narrow" in seen["code"]
    want = attention(q, k, v, keep)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    torch.testing.assert_close(torch.cat([g.flatten() for g in grads]),
                               torch.cat([g.flatten() for g in want_grads]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask", ["none", "dense", "positional"])
def test_masks_already_dense_or_absent_are_left_alone(mask):
    q = torch.randn(2, 4, 16, 8)
    dense = torch.rand(2, 1, 16, 16) > 0.2
    dense[..., 0] = True
    if mask == "none":
        fn = lambda q: F.scaled_dot_product_attention(q, q, q)  # noqa: E731
    elif mask == "dense":
        fn = lambda q: F.scaled_dot_product_attention(q, q, q, attn_mask=dense)  # noqa: E731
    else:
        fn = lambda q: F.scaled_dot_product_attention(q, q, q, dense)  # noqa: E731
    _, seen = traced_masks(fn, q)
    assert seen["notes"] == [] and "contiguous" not in seen["code"]


def test_a_positional_mask_with_a_broadcast_last_dimension_is_rewritten_in_place():
    q = torch.randn(1, 2, 8, 4)
    bias = torch.randn(8, 1).expand(8, 8)  # (strides (1, 0): a float mask broadcast along the keys)
    fn = lambda q, bias: F.scaled_dot_product_attention(q, q, q, bias)  # noqa: E731
    out, seen = traced_masks(fn, q, bias)
    assert len(seen["notes"]) == 1
    torch.testing.assert_close(out, fn(q, bias), rtol=1e-5, atol=1e-6)


def test_which_layouts_need_a_dense_last_dimension():
    assert needs_dense_last_dim(torch.ones(4, 1).expand(4, 4))
    assert needs_dense_last_dim(torch.ones(4, 4).t())
    assert not needs_dense_last_dim(torch.ones(4, 4))
    assert not needs_dense_last_dim(torch.ones(1, 4).expand(4, 4))  # (stride 0 on the queries only)
    assert not needs_dense_last_dim(torch.ones(4, 1))
    assert not needs_dense_last_dim(None)


def test_through_the_backend_the_rewritten_attention_trains_as_eager():
    torch._dynamo.reset()
    trains_as_eager(torch.compile(attention, backend="comfuse"), 32, seed=1)


@pytest.mark.parametrize("faster", ["rewritten", "given"])
def test_masks_not_timed_alone_have_the_whole_graph_timed_against_inductors_of_the_graph_as_given(monkeypatch,
                                                                                                   faster):
    """With the whole-graph check on, a graph that differs from Dynamo's in its masks alone,
    where the attention could not be timed alone, is timed against Inductor's compilation of
    Dynamo's graph, and the faster is kept (here the timings are stand-ins: which one wins is
    the test's choice)."""
    import comfuse.backend as backend
    import comfuse.graph_check as gc
    from comfuse import settings
    monkeypatch.setattr(backend, "dense_masks_pay", lambda gm, training: None)

    def times(calls, device):
        return {n: (1.0 if (n == "fused") == (faster == "rewritten") else 2.0) for n in calls}
    monkeypatch.setattr(gc, "_time_graphs", times)
    gc.GRAPH_CHECKS.clear()
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 4, 32, 8, requires_grad=True) for _ in range(3))
    keep = torch.rand(32) > 0.3
    keep[0] = True
    torch._dynamo.reset()
    with settings.override(graph_check="1", autotune="0"):
        out = torch.compile(attention, backend="comfuse")(q, k, v, keep)
    torch.testing.assert_close(out, attention(q, k, v, keep), rtol=1e-4, atol=1e-5)
    assert gc.GRAPH_CHECKS and gc.GRAPH_CHECKS[-1]["regions"] == 0
    assert gc.GRAPH_CHECKS[-1]["kept"] == ("fused" if faster == "rewritten" else "inductor")


def test_explain_lists_the_masks_the_backend_rewrote():
    import comfuse
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    keep = torch.ones(16, dtype=torch.bool)
    torch._dynamo.reset()
    report = comfuse.explain(attention, (q, k, v), {"keep": keep})
    assert not report.error
    assert any("dense last dimension" in note for note in report.notes)
    assert "dense last dimension" in str(report)


def test_a_new_length_recompiled_with_dynamic_sizes_keeps_the_dense_mask(caplog):
    """The second length makes Dynamo recompile with symbolic sizes; the mask's last stride is
    still a plain 0, so that graph is rewritten too, and every length trains as eager."""
    import logging
    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="comfuse")
    with caplog.at_level(logging.INFO, logger="comfuse.backend"):
        for length in (32, 48, 40):
            trains_as_eager(compiled, length, seed=length)
    rewrites = [r.getMessage() for r in caplog.records if "dense last dimension" in r.getMessage()]
    assert len(rewrites) >= 2 and any("(0, 32, 1, 0)" in m for m in rewrites)
    assert any("(0, 32, 1, 0)" not in m for m in rewrites)  # (the dynamic graph's, of symbolic strides)


def compiled_graphs(monkeypatch) -> list:
    """The code of each graph the backend hands Inductor with comfuse's pass, as it is handed."""
    import comfuse.backend as backend
    seen, compile_ = [], backend._compile_with_regions

    def recording(gm, *args, **kwargs):
        seen.append(gm.code)
        return compile_(gm, *args, **kwargs)
    monkeypatch.setattr(backend, "_compile_with_regions", recording)
    return seen


@pytest.mark.parametrize("faster", ["dense", "given"])
def test_dense_masks_are_kept_only_where_their_attention_runs_faster_timed_alone(monkeypatch, caplog, faster):
    """The attention is timed alone with each form of its mask (stand-in times: the test
    chooses the winner); no whole-graph check is run for the masks, the graph keeps the
    winner's form, and trains as eager."""
    import logging

    import comfuse.attention_masks as am
    import comfuse.graph_check as gc
    from comfuse import settings
    timed = []

    def times(calls, device, rounds):
        timed.append(sorted(calls))
        return {n: [1.0 if n == faster else 2.0] * rounds for n in calls}
    monkeypatch.setattr(am, "time_rounds", times)
    monkeypatch.setattr(am, "MASK_TIMES", {})
    graphs = compiled_graphs(monkeypatch)
    gc.GRAPH_CHECKS.clear()
    with settings.override(graph_check="1", autotune="0"), caplog.at_level(logging.INFO, logger="comfuse.backend"):
        for _ in range(2):  # (the same call in a second compilation: its times are known)
            torch._dynamo.reset()
            trains_as_eager(torch.compile(attention, backend="comfuse"), 32, seed=3)
    assert timed == [["dense", "given"]]  # (one call, timed once in the process)
    assert gc.GRAPH_CHECKS == []
    assert graphs and ("contiguous" in graphs[0]) == (faster == "dense")
    said = [r.getMessage() for r in caplog.records if "timed alone" in r.getMessage()]
    assert len(said) == 2 and ("dense masks kept" if faster == "dense" else "the masks kept as given") in said[1]
    assert "with their backward" in said[0] and said[0] == said[1]


def test_the_attention_is_timed_alone_on_its_arguments_layouts():
    """``dense_masks_pay`` times real calls: on this CPU it returns a verdict, and the calls it
    times take tensors of the graph's sizes and strides, the mask's values kept by ``dense_like``."""
    from comfuse.attention_masks import _found, _timed_call, dense_like, dense_masks_pay
    keep = torch.ones(8, dtype=torch.bool)
    mask = keep[:, None].as_strided((2, 1, 8, 8), (0, 8, 1, 0))
    dense = dense_like(mask)
    assert dense.stride(-1) == 1 and dense.stride(0) == 0 and torch.equal(dense, mask)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    torch.compile(attention, backend=backend)(q, q, q, keep)
    (gm,) = graphs
    assert dense_masks_pay(gm, training=True) in (True, False)
    from comfuse import attention_masks
    assert any(key[2] is True for key in attention_masks.MASK_TIMES)  # (training's times, kept)
    node, _, mask_node, value = _found(gm)[0]
    _timed_call(node, mask_node, True, True)()  # (runs: forward and backward on the layouts)
    assert tuple(value.stride()) == (0, 8, 1, 0)


class MaskedAttentionThenNorm(torch.nn.Module):
    """Attention with a broadcast padding mask, then a linear layer, a residual and a
    LayerNorm: a region to fuse beside the mask to rewrite."""

    def __init__(self, d=32, h=48):
        super().__init__()
        self.lin = torch.nn.Linear(d, h)
        self.ln = torch.nn.LayerNorm(h)

    def forward(self, q, keep, r):
        b, heads, s, dh = q.shape
        x = attention(q, q, q, keep).transpose(1, 2).reshape(b, s, heads * dh)
        return self.ln(self.lin(x) + r)


@pytest.mark.parametrize("faster", ["dense", "given"])
def test_the_whole_graph_checks_baseline_keeps_the_dense_masks_that_paid(monkeypatch, fused_regions_win, faster):
    """Where a region is fused beside a rewritten mask, the whole-graph check times the fused
    graph against Inductor's compilation of the graph with the masks as the attention's own
    timing left them: dense where they paid, so the check judges the regions alone."""
    import comfuse.attention_masks as am
    import comfuse.graph_check as gc
    from comfuse import backend
    monkeypatch.setattr(am, "time_rounds",
                        lambda calls, device, rounds: {n: [1.0 if n == faster else 2.0] * rounds for n in calls})
    monkeypatch.setattr(am, "MASK_TIMES", {})
    monkeypatch.setattr(gc, "_time_graphs", lambda calls, device: {n: 1.0 for n in calls})
    baselines, inductor = [], backend._inductor

    def recorded(gm, example_inputs, opts):
        baselines.append(gm.code)
        return inductor(gm, example_inputs, opts)
    monkeypatch.setattr(backend, "_inductor", recorded)
    gc.GRAPH_CHECKS.clear()
    torch.manual_seed(4)
    model = MaskedAttentionThenNorm()
    q, r = torch.randn(2, 4, 16, 8), torch.randn(2, 16, 48)
    keep = torch.rand(16) > 0.3
    keep[0] = True

    def comfuse_with_checks(gm, example_inputs):
        return backend.comfuse_backend(gm, example_inputs, {"autotune": "1", "graph_check": "1"})
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=comfuse_with_checks)(q, keep, r)
        want = model(q, keep, r)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    assert gc.GRAPH_CHECKS and gc.GRAPH_CHECKS[-1]["regions"] > 0
    assert len(baselines) == 1 and ("contiguous" in baselines[0]) == (faster == "dense")
