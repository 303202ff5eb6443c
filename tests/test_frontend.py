"""Capture and region finding."""
import pytest
import torch
import torch.nn.functional as F

import comfuse
from comfuse.frontend.capture import capture
from comfuse.frontend.regions import find_regions
from comfuse.ir import REDUCE, Op, verify

from helpers import randn

aten = torch.ops.aten


def targets(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def regions_of(fn, *args):
    gm = capture(fn, args)
    return gm, find_regions(gm)


def test_capture_decomposes_composites_into_primitives():
    def f(x, w, g, b):
        y = x @ w
        return F.layer_norm(y, (y.shape[-1],), g, b), torch.softmax(y, -1), F.gelu(y), F.silu(y)
    gm = capture(f, (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16), torch.randn(16)))
    t = targets(gm)
    for composite in (aten.native_layer_norm.default, aten._softmax.default, aten.gelu.default,
                      aten.silu.default, aten.var_mean.correction):
        assert composite not in t
    assert aten.mm.default in t and aten.amax.default in t and aten.erf.default in t


def test_capture_merges_duplicate_gemms():
    f = lambda x, w: (torch.softmax(x @ w, -1), torch.log_softmax(x @ w, -1))  # noqa: E731
    gm = capture(f, (torch.randn(4, 8), torch.randn(8, 16)))
    assert sum(n.target is aten.mm.default for n in gm.graph.nodes) == 1


def test_post_norm_block_is_one_region_writing_one_output():
    def f(x, w, b, r, g, be):
        return F.layer_norm(x @ w + b + r, (16,), g, be)
    args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16), torch.randn(4, 16),
            torch.randn(16), torch.randn(16))
    _, (cand,) = regions_of(f, *args)
    assert not cand.reason and not cand.notes
    region = verify(cand.region)
    assert len(region.outputs) == 1
    assert [i.axes for i in region.inputs] == [{"N"}, {"M", "N"}, {"N"}, {"N"}]
    assert sum(n.op is Op.SUM for n in region.nodes) == 2  # mean, then variance of deviations


def test_variance_is_two_pass_never_mean_of_squares_minus_square_of_mean():
    f = lambda x, w: torch.var_mean(x @ w, -1)  # noqa: E731
    _, (cand,) = regions_of(f, torch.randn(4, 8), torch.randn(8, 16))
    nodes = cand.region.nodes
    sums = [i for i, n in enumerate(nodes) if n.op is Op.SUM]
    second_input = nodes[nodes[sums[1]].src[0]]
    assert second_input.op is Op.MUL
    deviation = nodes[second_input.src[0]]
    assert deviation.op is Op.SUB and deviation.src[0] == 0  # (acc - mean)^2


def test_pre_norm_returns_both_the_sum_and_its_norm():
    def f(x, w, r, g):
        h = x @ w + r
        return h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    _, (cand,) = regions_of(f, torch.randn(4, 8), torch.randn(8, 16), torch.randn(4, 16), torch.randn(16))
    assert len(cand.region.outputs) == 2


def test_3d_linear_views_stay_in_the_region():
    f = lambda x, W, b: F.layer_norm(F.linear(x, W, b), (16,))  # noqa: E731
    _, (cand,) = regions_of(f, torch.randn(2, 5, 8), torch.randn(16, 8), torch.randn(16))
    assert not cand.notes
    assert cand.region.sizes.M == 10 and cand.region.sizes.N == 16
    assert cand.outputs[0].shape == (2, 5, 16)


def test_batched_matmul_keeps_batch_axis():
    f = lambda q, k: torch.softmax(q @ k.transpose(1, 2), -1)  # noqa: E731
    _, (cand,) = regions_of(f, torch.randn(3, 4, 8), torch.randn(3, 6, 8))
    assert cand.region.gemm.batched and cand.region.sizes.B == 3


def test_growth_stops_at_full_reduction_with_a_note():
    f = lambda x, w, t: (torch.relu(x @ w) - t).pow(2).mean()  # noqa: E731
    _, (cand,) = regions_of(f, torch.randn(4, 8), torch.randn(8, 16), torch.randn(4, 16))
    assert any("full reduction" in n for n in cand.notes)
    assert len(cand.region.outputs) == 1  # the squared error; the mean runs after the kernel


def test_growth_stops_at_permute_and_batch_reduction():
    f = lambda x, w: (x @ w).t().relu()  # noqa: E731
    _, (cand,) = regions_of(f, torch.randn(4, 8), torch.randn(8, 16))
    assert any("permute" in n or "not an epilogue op" in n for n in cand.notes)
    g = lambda q, k: (q @ k).sum(0)  # noqa: E731
    _, (cand,) = regions_of(g, torch.randn(3, 4, 8), torch.randn(3, 8, 6))
    assert any("batch axis" in n for n in cand.notes)


def test_side_input_that_depends_on_the_region_is_not_absorbed():
    def f(x, w):
        y = x @ w
        s = torch.cumsum(y, 1)  # not an epilogue op: runs outside
        return y + s
    _, (cand,) = regions_of(f, torch.randn(4, 8), torch.randn(8, 16))
    assert any("runs outside the region" in n for n in cand.notes)


def test_unsupported_anchor_dtype_has_a_reason():
    f = lambda x, w: torch.softmax(x @ w, -1)  # noqa: E731
    _, (cand,) = regions_of(f, torch.randn(4, 8, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64))
    assert "float64" in cand.reason


def test_explain_reports_fields():
    f = lambda x, w, b: torch.softmax(x @ w + b, -1)  # noqa: E731
    report = comfuse.explain(f, (randn(4, 8), randn(8, 16), randn(16)))
    (r,) = report.regions
    assert r.fused and r.reason == "" and r.kind == "gemm_epilogue"
    assert r.stages == 3 and r.schedule == "row_in_cta"
    assert "rmax[N]" in r.ir and "sum[N]" in r.ir
    assert "fused, 3 stage(s)" in str(report)


def test_explain_plain_gemm_is_not_fused():
    report = comfuse.explain(lambda x, w: x @ w, (torch.randn(4, 8), torch.randn(8, 16)))
    (r,) = report.regions
    assert not r.fused and "no epilogue" in r.reason


def test_a_widening_cast_read_only_outside_is_left_to_its_readers():
    """A region's last cast to a wider dtype, read only after the region, would write a wider
    copy of its value; the region writes the narrower value and its readers cast it (a saved
    bf16 LM head's logits and their fp32 copy for the loss held twice the memory of the logits
    alone). A cast the region itself reads stays inside."""
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    gm, (cand,) = regions_of(lambda x, w: ((x @ w) * 2, ((x @ w) * 2).float()), x, w)
    assert [m.target for m in cand.members] == [aten.mm.default, aten.mul.Tensor]
    assert [o.node.target for o in cand.outputs] == [aten.mul.Tensor]
    assert any("widening cast" in note for note in cand.notes)
    gm, (cand,) = regions_of(lambda x, w: torch.relu((x @ w).float()), x, w)
    assert len(cand.members) == 3 and cand.outputs[0].node.target is aten.relu.default


def test_inductors_online_softmax_prim_is_taken_apart_into_a_region():
    """On a GPU Inductor's post-grad passes (which run before the backend's) rewrite softmax,
    log-softmax and cross-entropy into ``prims.prepare_softmax_online`` (a row's max and sum
    of exponentials in one op). The region finder knows no such op: on the H200 a GEMM +
    softmax graph reached the pass as a plain GEMM and nothing fused. It is decomposed now,
    and the region (softmax and a cross-entropy from the same statistics) fuses and matches."""
    import comfuse
    import torch._inductor.inductor_prims  # noqa: F401  (registers the prim)

    def f(x, w, t):
        y = (x @ w).float()
        m, s = torch.ops.prims.prepare_softmax_online(y, 1)
        loss = (m + s.log()).squeeze(1) - y.gather(1, t[:, None]).squeeze(1)
        return torch.exp(y - m) / s, loss.mean()
    from helpers import DEVICE
    x, w = torch.randn(16, 32, device=DEVICE), torch.randn(32, 100, device=DEVICE)
    t = torch.randint(0, 100, (16,), device=DEVICE)
    with comfuse.settings.override(autotune="0"):
        compiled = comfuse.compile(f, (x, w, t))
        out = compiled(x, w, t)
    (region,) = compiled.report.regions
    assert region.fused and "amax" in region.ops and "exp" in " ".join(region.ops), str(compiled.report)
    for got, want in zip(out, f(x.double(), w.double(), t)):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)


def _padded_head(pad=(0, 7), value=0.0, start=0, keep=None):
    """Inductor's pad_mm form of an LM head: B's columns zero-padded for alignment, the
    product's extra columns sliced off; then the loss."""
    aten = torch.ops.aten

    def head(x, w, t):
        b = aten.constant_pad_nd(w.t(), list(pad), value)
        y = aten.mm(x, b)[:, start:keep or w.shape[0]]
        return y, F.cross_entropy(y.float(), t, reduction="none")
    return head


@pytest.mark.parametrize("keep", [None, -7], ids=["end", "negative_end"])
def test_a_product_with_padded_columns_sliced_off_is_the_product_with_the_unpadded_operand(keep):
    """The region multiplies B itself over its own columns (the padded ones are zeros nobody
    reads), so the loss joins it; its result matches the reference. (Inductor slices with a
    negative end.)"""
    head = _padded_head(keep=keep)
    args = (randn(16, 32), randn(57, 32), torch.randint(0, 57, (16,)))
    (cand,) = find_regions(capture(head, args))
    assert cand.region is not None and cand.region.sizes.N == 57, cand.reason
    assert cand.region.gemm.b.name == "t" and any("padded" in n for n in cand.through), cand.through
    assert any(n.op in REDUCE for n in cand.region.nodes)  # (the loss joined the region)
    compiled = comfuse.compile(head, args)
    for got, want in zip(compiled(*args), head(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    text = str(compiled.report)
    assert "read through mm: the product with" in text and "stopped at mm:" not in text, text


def test_a_padded_products_unfused_ops_pad_the_one_b_the_region_reads():
    """The ops autotuning times against (``extract``) take the same arguments as the fused
    region: B before padding, padded by the pad inside them, not a padded B of its own (a
    separate random tensor would disagree with every plan)."""
    import torch.fx as fx
    from comfuse.rewrite import extract
    head = _padded_head()
    args = (randn(16, 32), randn(57, 32), torch.randint(0, 57, (16,)))
    gm = capture(head, args)
    (cand,) = find_regions(gm)
    unfused = extract(gm, cand)
    assert not any(e.target is torch.ops.aten.constant_pad_nd.default for e in cand.externals), cand.externals
    run = fx.Interpreter(gm, garbage_collect_values=False)
    run.run(*args)
    for got, want in zip(unfused(*(run.env[e] for e in cand.externals)), head(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padding_that_is_not_only_zero_columns_sliced_off_stays_as_it_is():
    """A pad with another value, a slice that does not start at column 0, or one that keeps a
    padded column: the product is taken as written (the region stops at the slice)."""
    args = (randn(16, 32), randn(57, 32), torch.randint(0, 50, (16,)))
    for head in (_padded_head(value=1.0), _padded_head(start=1), _padded_head(keep=60)):
        (cand,) = find_regions(capture(head, args))
        assert cand.region.sizes.N == 64 and not any("padded" in n for n in cand.through), cand.through


def _gelu_grad(a):
    """GELU's derivative, as Inductor's decomposition of its backward computes it."""
    return 0.5 * (1 + torch.erf(a * 0.7071067811865476)) + a * torch.exp(-0.5 * a * a) * 0.3989422804014327


def test_a_side_input_computed_for_the_epilogue_alone_is_computed_by_the_region():
    """A GELU backward after ``dY @ W``: the derivative, elementwise ops of the saved
    activation that only the epilogue reads, is computed by the region from the activation
    (read once, in its own dtype) rather than written by a kernel of its own and read back;
    the unfused ops autotuning times against compute it too, as Inductor does in the model."""
    import torch.fx as fx
    from comfuse.rewrite import extract

    def backward(dy, w, a):
        dh = (dy @ w) * _gelu_grad(a.float())
        return dh, dh.sum(0)
    args = (randn(24, 16), randn(16, 40), randn(24, 40))
    gm = capture(backward, args)
    (cand,) = find_regions(gm)
    ops = {m.target for m in cand.members}
    assert aten.erf.default in ops and aten.exp.default in ops, [m.name for m in cand.members]
    assert [i.name for i in cand.region.inputs] == ["a_1"], cand.region.inputs
    assert any("itself, from what they read" in t for t in cand.through), cand.through
    run = fx.Interpreter(gm, garbage_collect_values=False)
    run.run(*args)
    for got, want in zip(extract(gm, cand)(*(run.env[e] for e in cand.externals)), backward(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with comfuse.settings.override(autotune="0"):
        compiled = comfuse.compile(backward, args)
        out = compiled(*args)
    (region,) = compiled.report.regions
    assert region.fused and "erf" in region.ops, str(compiled.report)
    for got, want in zip(out, backward(*(a.double() for a in args))):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_a_side_input_read_elsewhere_too_is_read_from_memory():
    """Where the value has another reader (here an output), it is written anyway: the region
    reads it rather than computing it a second time."""
    def backward(dy, w, a):
        d = _gelu_grad(a)
        return (dy @ w) * d, d
    args = (randn(24, 16), randn(16, 40), randn(24, 40))
    (cand,) = find_regions(capture(backward, args))
    assert aten.erf.default not in {m.target for m in cand.members}
    assert not any("itself" in t for t in cand.through), cand.through


def test_a_gathers_index_computed_for_it_alone_stays_a_side_input():
    """gather takes its index from outside the region: the elementwise ops computing the
    index (ignored targets mapped to 0) are not drawn in, and the loss still joins."""
    args = (randn(16, 32), randn(57, 32), torch.randint(0, 57, (16,)))
    (cand,) = find_regions(capture(_padded_head(), args))
    names = {m.name for m in cand.members}
    assert "gather" in names and "where_1" in names, cand.notes  # (where_1: the loss's, after the gather)
    assert not {"where", "unsqueeze"} & names, names  # (the index's)


def test_a_graph_retraced_keeps_each_nodes_origin_for_inductors_kernel_names():
    # (Inductor names its kernels after the aten ops their nodes came from, and profiles show
    # those names: a graph comfuse hands back must keep them, decomposed composites included)
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, g, b):
        return F.layer_norm(x @ w, (8,), g, b), torch.sigmoid(x).sum()
    args = (randn(4, 8), randn(8, 8), randn(8), randn(8))
    given = make_fx(f)(*args)
    for node in given.graph.nodes:
        if node.op == "call_function":
            node.meta.update(original_aten=node.target, stack_trace=f"line of {node.name}")
    gm = capture(given, args)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert any(n.target == torch.ops.aten.sigmoid.default for n in ops)
    assert len(ops) > 5  # (layer_norm decomposed after the GEMM)
    for node in ops:
        assert node.meta.get("stack_trace", "").startswith("line of "), node
        assert isinstance(node.meta.get("original_aten"), torch._ops.OpOverload), node
    sigmoid = next(n for n in ops if n.target == torch.ops.aten.sigmoid.default)
    assert str(sigmoid.meta["original_aten"]) == "aten.sigmoid.default"
