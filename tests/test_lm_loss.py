"""An LM head and its cross-entropy computed together (lm_loss.py, runtime/linear_ce.py): the
loss and every gradient as eager computes them, over several chunks of rows, through the
backend on hand-written and Hugging Face losses; left alone where the logits are wanted."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import comfuse
from comfuse import lm_loss
from comfuse.runtime import linear_ce, tuning


@pytest.fixture
def small_heads(monkeypatch):
    """Every LM head counts as large, and a chunk holds 8 rows."""
    monkeypatch.setattr(tuning, "MEMORY_FIRST_BYTES", 0)
    monkeypatch.setattr(linear_ce, "MIN_CHUNK_ROWS", 8)
    monkeypatch.setattr(linear_ce, "CHUNK_BYTES", 1)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("rows_by", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_loss_and_its_gradients_are_eagers_over_several_chunks(small_heads, monkeypatch, rows_by, reduction, bias):
    if rows_by == "torch":  # (the form CPU tensors take where Triton's interpreter is off)
        monkeypatch.setattr(linear_ce, "interpreting", lambda: False)
    torch.manual_seed(0)
    M, K, V = 37, 16, 300  # 5 chunks, the last of 5 rows; 300 columns: a partial block
    h = torch.randn(M, K, requires_grad=True)
    w = torch.randn(V, K, requires_grad=True)
    b = torch.randn(V, requires_grad=True) if bias else None
    t = torch.randint(0, V, (M,))
    t[::4] = -100
    loss, dh, dw, db = torch.ops.comfuse.linear_cross_entropy(h, w, b, t, -100, reduction, torch.float32,
                                                              [True, True, bias])
    leaves = [h, w] + ([b] if bias else [])
    ref = F.cross_entropy(F.linear(*(x.double() for x in leaves[:2]), b.double() if bias else None), t,
                          reduction=reduction)
    grads = torch.autograd.grad(ref, [h, w] + ([b] if bias else []))
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for got, want in zip((dh, dw, db), grads):
        assert _rel(got, want) < 1e-5


def test_a_row_kernel_that_fails_leaves_its_rows_to_torch_ops(small_heads, monkeypatch):
    class Broken:  # (a kernel whose launch fails, for any grid)
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no kernel")
            return launch
    monkeypatch.setattr(linear_ce, "_rows", Broken())
    monkeypatch.setattr(linear_ce, "_FAILED", [])
    h, w, t = torch.randn(13, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True), torch.randint(0, 20, (13,))
    with pytest.warns(comfuse.FallbackWarning, match="row kernel failed"):
        loss, dh, dw, _ = torch.ops.comfuse.linear_cross_entropy(h, w, None, t, -100, "mean", torch.float32,
                                                                 [True, True, False])
    ref = F.cross_entropy(F.linear(h, w), t)
    gh, gw = torch.autograd.grad(ref, [h, w])
    assert abs(loss.item() - ref.item()) < 1e-5 and _rel(dh, gh) < 1e-5 and _rel(dw, gw) < 1e-5
    assert linear_ce._FAILED == ["RuntimeError: no kernel"]


def test_a_target_outside_the_vocabulary_is_an_error():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    t = torch.tensor([1, 2, 10, -100])
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.comfuse.linear_cross_entropy(h, w, None, t, -100, "mean", torch.float32, [False, False, False])


class Head(torch.nn.Module):
    """A causal LM's head and shifted loss, written as users write it."""

    def __init__(self, hidden=32, vocab=200, bias=False):
        super().__init__()
        self.body = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=bias)

    def forward(self, x, labels, smoothing=0.0):
        logits = self.head(torch.tanh(self.body(x))).float()
        shifted = logits[:, :-1, :].contiguous()
        return F.cross_entropy(shifted.view(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1),
                               label_smoothing=smoothing)


def _step(fn, model, *args):
    model.zero_grad(set_to_none=True)
    loss = fn(*args)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("bias", [False, True])
def test_the_backend_trains_a_shifted_loss_without_its_logits(small_heads, bias):
    torch.manual_seed(0)
    model = Head(bias=bias)
    x, labels = torch.randn(3, 9, 32), torch.randint(0, 200, (3, 9))
    labels[0, :4] = -100
    torch._dynamo.reset()
    report = comfuse.explain(model, (x,), {"labels": labels})  # (keyword inputs: captured as the backend does)
    assert len(report.notes) == 1 and "no [24, 200] logits" in report.notes[0], str(report)
    want, want_grads = _step(model, model, x, labels)
    compiled = torch.compile(model, backend="comfuse")
    for batch in (3, 5):  # (the second size: Dynamo's dynamic graph, compiled per shape)
        x2, l2 = torch.randn(batch, 9, 32), torch.randint(0, 200, (batch, 9))
        want, want_grads = _step(model, model, x2, l2)
        got, got_grads = _step(compiled, model, x2, l2)
        assert abs(got.item() - want.item()) <= 1e-4 * abs(want.item())
        assert _rel(got_grads, want_grads) < 1e-4


def test_the_head_is_left_alone_where_its_logits_are_wanted_or_no_gradient_is(small_heads):
    model = Head()
    x, labels = torch.randn(2, 5, 32), torch.randint(0, 200, (2, 5))

    def with_logits(x):
        logits = model.head(x)
        return F.cross_entropy(logits.view(-1, 200), labels.view(-1)), logits
    torch._dynamo.reset()
    report = comfuse.explain(with_logits, (), {"x": x})
    assert len(report.notes) == 1 and "keep their [10, 200] logits" in report.notes[0], str(report)
    torch._dynamo.reset()
    with pytest.warns(comfuse.ComfuseWarning, match="compile a function that returns the loss alone"):
        loss, logits = torch.compile(with_logits, backend="comfuse")(x)
    torch.testing.assert_close(loss, with_logits(x)[0])
    torch._dynamo.reset()
    report = comfuse.explain(model, (), {"x": x, "labels": labels, "smoothing": 0.1})
    assert report.regions and not report.notes, str(report)
    torch._dynamo.reset()
    assert comfuse.explain(model, (), {"x": x, "labels": labels}).notes
    with torch.no_grad():
        torch._dynamo.reset()
        assert not comfuse.explain(model, (), {"x": x, "labels": labels}).notes


@pytest.mark.parametrize("name", ["gpt2_lm", "llama_lm", "bert_mlm"])
def test_hugging_face_losses_train_without_their_logits(small_heads, name):
    """A training step that returns the loss (the logits go unused): the head and loss are
    rewritten, and the loss and all gradients are eager's."""
    import transformers as tf
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 12))
    labels = ids.clone()
    if name == "gpt2_lm":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, resid_pdrop=0.0,
                                                 embd_pdrop=0.0, attn_pdrop=0.0))
    elif name == "llama_lm":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=256))
    else:
        model = tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                                 num_attention_heads=2, vocab_size=256, hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0))
        labels[:, ::3] = -100

    def loss(input_ids, labels):
        return model(input_ids=input_ids, labels=labels).loss
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        report = comfuse.explain(loss, (), {"input_ids": ids, "labels": labels})
        assert len(report.notes) == 1, str(report)
        want, want_grads = _step(loss, model, ids, labels)
        torch._dynamo.reset()
        got, got_grads = _step(torch.compile(loss, backend="comfuse"), model, ids, labels)
    assert abs(got.item() - want.item()) <= 1e-4 * abs(want.item())
    assert _rel(got_grads, want_grads) < 1e-4


def test_the_rewrite_needs_a_large_head():
    model = Head()
    torch._dynamo.reset()
    report = comfuse.explain(model, (), {"x": torch.randn(2, 5, 32), "labels": torch.randint(0, 200, (2, 5))})
    assert report.regions and not report.notes
    assert lm_loss.linear_ce.chunk_rows(8192, 128256, 2) == 1024


def test_comfuse_compile_trains_the_head_without_its_logits(small_heads):
    torch.manual_seed(0)
    model = Head()
    x, labels = torch.randn(2, 7, 32), torch.randint(0, 200, (2, 7))
    want, want_grads = _step(model, model, x, labels)
    compiled = comfuse.compile(model, (x, labels))
    got, got_grads = _step(compiled, model, x, labels)
    assert any("no [12, 200] logits" in note for note in compiled.report.notes), str(compiled.report)
    assert abs(got.item() - want.item()) <= 1e-4 * abs(want.item())
    assert _rel(got_grads, want_grads) < 1e-4


def test_under_autocast_the_head_computes_in_autocasts_dtype(small_heads):
    """Mixed precision (fp32 parameters, the head's GEMM in bf16 under autocast): the rewrite
    casts its inputs as autocast does, and the gradients reach the fp32 parameters in fp32."""
    torch.manual_seed(0)
    model = Head()
    x, labels = torch.randn(2, 9, 32), torch.randint(0, 200, (2, 9))

    def loss(x, labels):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x, labels)
    want, want_grads = _step(loss, model, x, labels)
    torch._dynamo.reset()
    assert comfuse.explain(loss, (), {"x": x, "labels": labels}).notes
    got, got_grads = _step(torch.compile(loss, backend="comfuse"), model, x, labels)
    assert got_grads.dtype == torch.float32
    assert abs(got.item() - want.item()) <= 2e-2 * abs(want.item())
    assert _rel(got_grads, want_grads) < 3e-2
