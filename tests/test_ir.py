"""The Fusion Spec IR: verifier, printer, structural key, reference interpreter."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from comfuse.ir import (Gemm, Input, IRError, Node, Op, Operand, Output, Region, Sizes, evaluate,
                        format_region, structural_key, verify)

MN = frozenset({"M", "N"})
M_ = frozenset({"M"})
N_ = frozenset({"N"})
NONE = frozenset()


def layer_norm_region(M=5, N=7, K=3, dtype=torch.float32, eps=1e-5):
    """LayerNorm(x @ w + b) * g, written by hand: two-pass mean and variance."""
    f32 = torch.float32
    nodes = (
        Node(Op.ACC, (), f32, MN),                       # 0
        Node(Op.INPUT, (), dtype, N_, 0),                # 1 bias
        Node(Op.ADD, (0, 1), f32, MN),                   # 2
        Node(Op.SUM, (2,), f32, M_, "N"),                # 3
        Node(Op.CONST, (), f32, NONE, float(N)),         # 4
        Node(Op.DIV, (3, 4), f32, M_),                   # 5 mean
        Node(Op.SUB, (2, 5), f32, MN),                   # 6
        Node(Op.MUL, (6, 6), f32, MN),                   # 7
        Node(Op.SUM, (7,), f32, M_, "N"),                # 8
        Node(Op.DIV, (8, 4), f32, M_),                   # 9 var
        Node(Op.CONST, (), f32, NONE, eps),              # 10
        Node(Op.ADD, (9, 10), f32, M_),                  # 11
        Node(Op.RSQRT, (11,), f32, M_),                  # 12
        Node(Op.MUL, (6, 12), f32, MN),                  # 13
        Node(Op.INPUT, (), dtype, N_, 1),                # 14 gamma
        Node(Op.MUL, (13, 14), f32, MN),                 # 15
    )
    return Region("gemm_epilogue", Gemm(Operand("x", dtype), Operand("w", dtype), False, dtype),
                  (Input("b", dtype, N_), Input("g", dtype, N_)), nodes,
                  (Output(15, dtype, MN, "out"), Output(5, f32, M_, "mean")), Sizes(1, M, N, K))


def test_verify_accepts_a_well_formed_region():
    r = layer_norm_region()
    assert verify(r) is r


@pytest.mark.parametrize("breakage, message", [
    (lambda r: r.replace(nodes=r.nodes[:2] + (Node(Op.ADD, (0, 5), torch.float32, MN),) + r.nodes[3:]),
     "not defined before"),
    (lambda r: r.replace(nodes=r.nodes[:3] + (Node(Op.SUM, (2,), torch.float32, MN, "N"),) + r.nodes[4:]),
     "drop exactly"),
    (lambda r: r.replace(nodes=r.nodes[:3] + (Node(Op.SUM, (1,), torch.float32, NONE, "M"),) + r.nodes[4:]),
     "does not vary along"),
    (lambda r: r.replace(nodes=r.nodes[:2] + (Node(Op.ADD, (0, 1), torch.float32, M_),) + r.nodes[3:]),
     "its sources give"),
    (lambda r: r.replace(outputs=(Output(15, torch.float32, M_, "narrow"),)), "narrower"),
    (lambda r: r.replace(nodes=(Node(Op.ACC, (), torch.float16, MN),) + r.nodes[1:]), "fp32"),
    (lambda r: r.replace(nodes=r.nodes[:1] + (Node(Op.INPUT, (), torch.float32, N_, 9),) + r.nodes[2:]),
     "does not exist"),
    (lambda r: r.replace(outputs=()), "at least one output"),
    (lambda r: r.replace(nodes=r.nodes + (Node(Op.WHERE, (2, 2, 2), torch.float32, MN),)), "bool condition"),
])
def test_verify_rejects_broken_regions(breakage, message):
    with pytest.raises(IRError, match=message):
        verify(breakage(layer_norm_region()))


def test_printer_shows_every_node_and_output():
    text = format_region(layer_norm_region())
    assert "%3 = sum[N] %2" in text
    assert "%12 = rsqrt %11" in text
    assert "out1   %5 (mean): f32 [M]" in text
    assert text.count("\n") == len(layer_norm_region().nodes) + 2 + 2 + 2 - 1


def test_structural_key_ignores_names_and_sizes_but_not_structure():
    a = layer_norm_region(M=5, N=7)
    b = layer_norm_region(M=9, N=7)
    renamed = a.replace(inputs=tuple(dataclasses.replace(i, name="zz") for i in a.inputs))
    assert structural_key(a) == structural_key(b) == structural_key(renamed)
    other_eps = layer_norm_region(eps=1e-6)
    other_dtype = layer_norm_region(dtype=torch.bfloat16)
    assert structural_key(a) != structural_key(other_eps)
    assert structural_key(a) != structural_key(other_dtype)


def test_reference_interpreter_matches_torch_layer_norm():
    M, N, K = 6, 11, 4
    r = layer_norm_region(M=M, N=N, K=K)
    x, w = torch.randn(M, K, dtype=torch.float64), torch.randn(K, N, dtype=torch.float64)
    b, g = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    out, mean = evaluate(r, x.unsqueeze(0), w.unsqueeze(0), [b.view(1, 1, N), g.view(1, 1, N)])
    y = x @ w + b
    expect = F.layer_norm(y, (N,), eps=1e-5) * g
    assert out.shape == (1, M, N) and mean.shape == (1, M, 1)
    torch.testing.assert_close(out[0], expect, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mean[0, :, 0], y.mean(-1), rtol=1e-10, atol=1e-10)


def test_reference_interpreter_faithful_mode_rounds_like_eager():
    M, N, K = 4, 8, 8
    bf = torch.bfloat16
    r = layer_norm_region(M=M, N=N, K=K, dtype=bf)
    x, w = torch.randn(M, K).to(bf), torch.randn(K, N).to(bf)
    b, g = torch.randn(N).to(bf), torch.randn(N).to(bf)
    exact = evaluate(r, x[None], w[None], [b.view(1, 1, N), g.view(1, 1, N)])[0]
    faithful = evaluate(r, x[None], w[None], [b.view(1, 1, N), g.view(1, 1, N)], compute_dtype=None)[0]
    assert exact.dtype == torch.float64 and faithful.dtype == bf
    assert (faithful.double() - exact).abs().max() < 0.1


def test_independent_rows_evaluate_a_slice_at_a_time_as_a_whole():
    """A region with reductions along N only is evaluated the same a slice of rows at a time
    (autotuning's float64 second opinion on an LM head's loss over a whole vocabulary); one
    that reduces along M is not row-independent."""
    from comfuse.ir import evaluate_by_rows, rows_independent
    from comfuse.runtime import tuning
    region = layer_norm_region(M=13, N=7, K=3)
    assert rows_independent(region)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(1, 13, 3, generator=gen)
    b = torch.randn(1, 3, 7, generator=gen)
    ins = [torch.randn(1, 1, 7, generator=gen), torch.randn(1, 1, 7, generator=gen)]
    for got, want in zip(evaluate_by_rows(region, a, b, ins, rows=4), evaluate(region, a, b, ins)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    column = dataclasses.replace(region, nodes=region.nodes[:3] + (Node(Op.SUM, (2,), torch.float32, N_, "M"),),
                                 outputs=(Output(3, torch.float32, N_, "colsum"),))
    assert not rows_independent(column)
    with pytest.raises(ValueError):
        evaluate_by_rows(column, a, b, ins, rows=4)
    # GPT-2's head: a float64 [8192, 50257] is past the whole-evaluation limit, its slices are not
    head = dataclasses.replace(region, sizes=Sizes(1, 8192, 50257, 768))
    rows = tuning.exact_rows(head)
    assert 1 <= rows < 8192 and rows * 50257 * 8 <= tuning.EXACT_SLICE_BYTES
    with pytest.raises(MemoryError):
        tuning.exact_rows(dataclasses.replace(column, sizes=Sizes(1, 8192, 50257, 768)))
