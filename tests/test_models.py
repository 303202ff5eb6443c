"""Hugging Face models through ``torch.compile(backend="comfuse")``, as users write them: built
from tiny configs with their defaults (caches on, SDPA attention; dropout off so that eager is
the reference), a training step's loss and every gradient (one vector) against eager's, at two
batch and sequence sizes (the second makes Dynamo recompile with dynamic shapes), and with at
least one region fused in the graphs Inductor lowered. On a GPU the same runs on CUDA tensors.
"""
import types

import pytest
import torch

import comfuse  # noqa: F401  (registers the backend)
from comfuse import inductor_pass, settings

from helpers import DEVICE

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::comfuse.ComfuseWarning")]

tf = pytest.importorskip("transformers")
V = 128  # vocabulary


def _text(batch, seq, labels=True):
    ids = torch.randint(0, V, (batch, seq), device=DEVICE)
    return {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}


def _models():
    """name -> (model, inputs(batch, seq) -> kwargs)."""
    return {
        "bert_mlm": (tf.BertForMaskedLM(tf.BertConfig(
            vocab_size=V, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), _text),
        "gpt2_lm": (tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=V, n_embd=64, n_layer=1, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), _text),
        "llama_lm": (tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4)), _text),
        "qwen2_gqa": (tf.Qwen2ForCausalLM(tf.Qwen2Config(
            vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2)), _text),
        "vit": (tf.ViTModel(tf.ViTConfig(
            image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
            lambda batch, seq: {"pixel_values": torch.randn(batch, 3, 32, 32, device=DEVICE)}),
        "t5": (tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)), _text),
    }


def _loss(out) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss
    hidden = out.last_hidden_state
    weights = torch.linspace(-1, 1, hidden.shape[-1], device=hidden.device)
    return (hidden * weights).sum() / hidden.numel()  # (not a plain sum: LayerNorm makes that constant)


def _step(fn, model, kwargs):
    model.zero_grad(set_to_none=True)
    loss = _loss(fn(**kwargs))
    loss.backward()
    # (a parameter the loss does not reach has no gradient in eager and zeros in a compiled graph)
    grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                       for p in model.parameters()])
    return loss.detach(), grads


def _check(name, mode="default", sizes=((2, 16), (3, 12))):
    torch.manual_seed(0)
    model, inputs = _models()[name]
    model = model.to(DEVICE)
    torch._dynamo.reset()
    inductor_pass.REPORTS.clear()
    compiled = torch.compile(model, backend="comfuse", mode=mode)
    for batch, seq in sizes:
        kwargs = inputs(batch, seq)
        with settings.override(strict=True):
            loss, grads = _step(compiled, model, kwargs)
        want_loss, want_grads = _step(model, model, kwargs)
        torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
        err = ((grads - want_grads).norm() / want_grads.norm()).item()
        assert err < 1e-4, f"{name} at {batch}x{seq}: gradients' relative error {err:.2e}"
    regions = [r for rep in inductor_pass.REPORTS for r in rep.regions]
    assert any(r.fused for r in regions), "\n".join(map(str, inductor_pass.REPORTS))
    return regions


@pytest.mark.parametrize("name", ["bert_mlm", "gpt2_lm", "llama_lm", "qwen2_gqa", "vit", "t5"])
def test_a_training_step_matches_eager_at_two_sizes(name):
    _check(name)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_the_other_modes_train_too(mode):
    _check("gpt2_lm", mode=mode, sizes=((2, 16),))


def test_the_backward_graph_has_regions_of_its_own():
    """The training step's backward graph is searched like the forward: its GEMMs are regions
    (the input gradients of the MLP's projections, fused or not, each with its reason)."""
    regions = _check("llama_lm", sizes=((2, 16),))
    assert any(r.anchor and "backward" in rep.function for rep in inductor_pass.REPORTS for r in rep.regions)
    assert regions


def test_berts_backward_region_computes_the_gelu_derivative_itself():
    """BERT's MLP backward multiplies ``dY @ W2`` by GELU's derivative of the saved activation.
    The region computes the derivative (erf, exp) from the activation, as Inductor's unfused
    code does inside the kernel that reads the product; read as a side input, it was a kernel
    of its own writing it for the region to read (an H100 lost 1.6 ms a BERT-base step so)."""
    _check("bert_mlm", sizes=((2, 16),))
    backward = [r for rep in inductor_pass.REPORTS if rep.function.startswith("backward") for r in rep.regions]
    gelu = [r for r in backward if any(op.startswith("erf") for op in r.ops)]
    assert gelu, "\n".join(map(str, inductor_pass.REPORTS))
    assert all(any("itself, from what they read" in t for t in r.through) for r in gelu), gelu


@pytest.mark.parametrize("name", ["bert_mlm", "gpt2_lm", "llama_lm", "qwen2_gqa", "vit", "t5"])
def test_comfuse_compile_trains_each_model_as_eager_does(name):
    """``comfuse.compile`` on a user's function of the model (its inputs by position): the
    loss and every gradient, one vector, against eager's."""
    torch.manual_seed(0)
    model, inputs = _models()[name]
    model = model.to(DEVICE)
    kwargs = inputs(2, 16)
    keys = list(kwargs)

    def loss_of(*tensors):
        return _loss(model(**dict(zip(keys, tensors))))
    torch._dynamo.reset()
    with settings.override(strict=True):
        compiled = comfuse.compile(loss_of, tuple(kwargs.values()))
        loss, grads = _step(lambda **kw: types.SimpleNamespace(loss=compiled(*kw.values())), model, kwargs)
    want_loss, want_grads = _step(model, model, kwargs)
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
    err = ((grads - want_grads).norm() / want_grads.norm()).item()
    assert err < 1e-4, f"{name}: gradients' relative error {err:.2e}"
    assert any(r.regions for r in compiled.reports), compiled.reports


def test_dropout_draws_the_same_numbers_as_inductors():
    """GPT-2 with its default dropout, training: under one seed the backend's step gives the
    loss and gradients Inductor's own step gives (comfuse's regions, its autotuning and its
    whole-graph check draw no random numbers of the caller's)."""
    ids = torch.randint(0, V, (2, 16), device=DEVICE)
    results = []
    for backend in ("inductor", "comfuse"):
        torch.manual_seed(0)
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=1, n_head=4)).to(DEVICE)
        model.train()
        torch._dynamo.reset()
        inductor_pass.REPORTS.clear()
        compiled = torch.compile(model, backend=backend)
        torch.manual_seed(1)
        with settings.override(strict=True):
            results.append(_step(compiled, model, {"input_ids": ids, "labels": ids}))
    (loss, grads), (want_loss, want_grads) = results[1], results[0]
    assert any(r.fused for rep in inductor_pass.REPORTS for r in rep.regions)
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
    err = ((grads - want_grads).norm() / want_grads.norm()).item()
    assert err < 1e-4, f"gradients' relative error {err:.2e}"


def test_gpt2s_loss_stays_in_the_graph_of_its_lm_head():
    """GPT-2's loss_function warns (through transformers' ``Logger.warning_once``) when the
    config names no loss type, from inside the model's forward; Dynamo would split the graph
    there and the loss would run apart from the LM head. comfuse makes those helpers no-ops in
    traced code: one forward graph, whose LM head region holds the loss's row maximum."""
    import logging

    from comfuse.backend import LIBRARY_LOGGING
    torch.manual_seed(0)
    model, inputs = _models()["gpt2_lm"]
    model = model.to(DEVICE).eval()
    assert getattr(model.config, "loss_type", None) is None  # (the case that warns)
    report = comfuse.explain(model, (), inputs(2, 16))
    assert all(getattr(logging.Logger, n) in torch._dynamo.config.ignore_logging_functions
               for n in LIBRARY_LOGGING if hasattr(logging.Logger, n))
    graphs = {r.anchor.split(":")[0] for r in report.regions}
    assert graphs == {"forward graph 0", "backward graph 1"}, graphs
    assert any(r.fused and "rmax" in r.ir for r in report.regions if r.anchor.startswith("forward")), report
    assert torch._dynamo.explain(model)(**inputs(2, 16)).graph_count == 1


def test_ignored_logging_functions_do_not_break_dynamos_metrics_record(monkeypatch):
    """Dynamo records its configuration with each compilation's metrics; torch 2.11 sorts and
    serialises ``ignore_logging_functions`` there, which fails on a set of functions (an error
    logged at every compilation). Where the record fails so, it sees the set as empty; the
    tracing still reads the real set."""
    import json

    import torch._dynamo.utils as dynamo_utils

    from comfuse import backend

    def record_as_in_torch_2_11():  # (the 2.11 recorder: every set sorted, then JSON)
        config = torch._dynamo.config.get_config_copy()
        return json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in config.items()
                           if k == "ignore_logging_functions"})
    monkeypatch.setattr(dynamo_utils, "_get_dynamo_config_for_logging", record_as_in_torch_2_11)
    monkeypatch.setattr(backend, "_METRICS_PROBED", False)  # (this process's torch was probed at import)
    with torch._dynamo.config.patch(ignore_logging_functions=set()):  # (a config entry: not monkeypatch's)
        backend.quiet_library_logging()
        ignored = set(torch._dynamo.config.ignore_logging_functions)
        if len(ignored) < 2:
            pytest.skip("transformers' logging helpers are not loaded")
        assert json.loads(dynamo_utils._get_dynamo_config_for_logging()) == {"ignore_logging_functions": []}
        assert torch._dynamo.config.ignore_logging_functions == ignored
        backend.quiet_library_logging()  # (wrapped once)
        assert dynamo_utils._get_dynamo_config_for_logging.__wrapped__ is record_as_in_torch_2_11
