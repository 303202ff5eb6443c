"""torch.compile(model, backend="comfuse") on model code: inference, training, options."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import comfuse
from comfuse import backend as backend_reports, settings

from helpers import DEVICE, NormPostNorm, PostNorm, assert_grads_close

pytestmark = pytest.mark.filterwarnings("ignore::comfuse.ComfuseWarning", "ignore::UserWarning")


def kinds(report):
    return [(r.kind, r.fused) for r in report.regions]


def last_report():
    """The report of the forward (or inference) graph the backend lowered last (None before any)."""
    forward = [r for r in backend_reports.REPORTS if not r.function.startswith("backward")]
    return forward[-1] if forward else None


def compiled(model, **kw):
    torch._dynamo.reset()
    return torch.compile(model, backend="comfuse", dynamic=False, **kw)


def test_backend_is_registered():
    assert "comfuse" in torch._dynamo.list_backends(exclude_tags=())


def test_inference_and_training_match_eager():
    model = PostNorm().to(DEVICE)
    x, r = torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE)
    cm = compiled(model)
    with torch.no_grad():
        torch.testing.assert_close(cm(x, r), model(x, r), rtol=1e-4, atol=1e-5)
    assert ("gemm_epilogue", True) in kinds(last_report())
    # (on the CPU, and under COMFUSE_CHECK everywhere, the operator launches it, and says why)
    launch = next(r.launch for r in last_report().regions if r.fused)
    assert launch.startswith("through the comfuse::region operator (") and ("CUDA" in launch or "CHECK" in launch)
    x.requires_grad_(True)
    out = cm(x, r)
    g = torch.randn_like(out)  # (not out.square().sum(): through a LayerNorm that is nearly constant)
    (out * g).sum().backward()
    gx, gw = x.grad.clone(), model.lin.weight.grad.clone()
    x.grad = None
    model.zero_grad()
    (model(x, r) * g).sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, model.lin.weight.grad, rtol=1e-4, atol=1e-5)


def test_new_batch_sizes_recompile_and_stay_correct():
    model = PostNorm().to(DEVICE)
    cm = compiled(model)
    with torch.no_grad():
        for batch in (2, 3):
            x, r = torch.randn(batch, 5, 32, device=DEVICE), torch.randn(batch, 5, 48, device=DEVICE)
            torch.testing.assert_close(cm(x, r), model(x, r), rtol=1e-4, atol=1e-5)


def test_dynamic_shapes_are_fused_per_shape_and_capped():
    """With dynamic shapes (dynamic=True, or Dynamo's second length) each new batch and
    sequence length is lowered and fused on its first call, forward and backward; past
    COMFUSE_MAX_SPECIALIZATIONS new shapes run Inductor's dynamic code, still right."""
    torch._dynamo.reset()
    model = PostNorm().to(DEVICE)
    cm = torch.compile(model, backend="comfuse", dynamic=True)
    with comfuse.settings.override(max_specializations=2):
        for batch, seq in ((2, 5), (3, 7), (2, 5)):
            x = torch.randn(batch, seq, 32, device=DEVICE, requires_grad=True)
            r = torch.randn(batch, seq, 48, device=DEVICE)
            out = cm(x, r)
            assert last_report() is not None and last_report().regions[0].fused
            torch.testing.assert_close(out, model(x, r), rtol=1e-4, atol=1e-5)
            g = torch.randn_like(out)
            (out * g).sum().backward()
            gx = x.grad.clone()
            x.grad = None
            (model(x, r) * g).sum().backward()
            torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-5)
        backend_reports.REPORTS.clear()
        with pytest.warns(comfuse.ComfuseWarning, match="dynamic code"):  # (same grad mode: no recompile)
            x = torch.randn(4, 6, 32, device=DEVICE, requires_grad=True)
            r = torch.randn(4, 6, 48, device=DEVICE)
            torch.testing.assert_close(cm(x, r), model(x, r), rtol=1e-4, atol=1e-5)
        assert last_report() is None  # (the third shape was not lowered)


def test_a_graph_inductor_cannot_compile_with_symbolic_sizes_is_compiled_per_shape(monkeypatch):
    """torch 2.11's Inductor asserts on some graphs with symbolic sizes (a ViT interpolating
    its position embeddings to a new image size; Inductor alone crashes there). The backend
    warns and compiles each new shape with concrete sizes, regions fused; beyond
    COMFUSE_MAX_SPECIALIZATIONS further shapes run eagerly, still right."""
    import comfuse.backend as backend_mod
    real = backend_mod._inductor

    def no_symbolic(gm, example_inputs, opts):
        if backend_mod.symbolic(example_inputs):
            raise AssertionError("synthetic failure on symbolic sizes")
        return real(gm, example_inputs, opts)
    monkeypatch.setattr(backend_mod, "_inductor", no_symbolic)
    torch._dynamo.reset()
    model = PostNorm().to(DEVICE)
    cm = torch.compile(model, backend="comfuse", dynamic=True)
    with comfuse.settings.override(max_specializations=2), torch.no_grad():
        with pytest.warns(comfuse.ComfuseWarning, match="dynamic shapes .*synthetic failure"):
            x, r = torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE)
            torch.testing.assert_close(cm(x, r), model(x, r), rtol=1e-4, atol=1e-5)
        assert last_report().regions[0].fused
        x, r = torch.randn(3, 7, 32, device=DEVICE), torch.randn(3, 7, 48, device=DEVICE)
        torch.testing.assert_close(cm(x, r), model(x, r), rtol=1e-4, atol=1e-5)
        with pytest.warns(comfuse.ComfuseWarning, match="further shapes run eagerly"):
            x, r = torch.randn(4, 6, 32, device=DEVICE), torch.randn(4, 6, 48, device=DEVICE)
            torch.testing.assert_close(cm(x, r), model(x, r), rtol=1e-4, atol=1e-5)
    with comfuse.settings.override(strict=True), pytest.raises(Exception, match="synthetic failure"):
        torch._dynamo.reset()
        torch.compile(model, backend="comfuse", dynamic=True)(x, r)


def test_dynamic_graphs_without_gemms_are_lowered_once(monkeypatch):
    """A graph with no GEMM region has none at any shape: after the first look, new shapes
    go straight to Inductor's dynamic code."""
    import comfuse.backend as backend_mod
    import comfuse.inductor_pass as pass_mod
    torch._dynamo.reset()
    looked = []
    real = pass_mod.lower
    monkeypatch.setattr(pass_mod, "lower", lambda *a, **k: looked.append(1) or real(*a, **k))
    backend_mod.REPORTS.clear()
    fn = torch.compile(lambda x: torch.relu(x) * 2, backend="comfuse", dynamic=True)
    for n in (5, 6, 7):
        x = torch.randn(n, 3, device=DEVICE)
        torch.testing.assert_close(fn(x), torch.relu(x) * 2)
    assert len(looked) == 1


def test_dynamic_graphs_that_fuse_nothing_are_not_lowered_again(monkeypatch):
    """Regions found but none fused at a shape (here gemm_epilogue fusion is off; on a GPU,
    autotuning leaving every region to Inductor): the next shapes run Inductor's dynamic code,
    compiled once, without a compilation each; the results stay right."""
    import comfuse.inductor_pass as pass_mod
    torch._dynamo.reset()
    looked = []
    real = pass_mod.lower
    monkeypatch.setattr(pass_mod, "lower", lambda *a, **k: looked.append(1) or real(*a, **k))
    model = PostNorm().to(DEVICE)
    cm = torch.compile(model, backend="comfuse", dynamic=True, options={"disable": "gemm_epilogue"})
    with torch.no_grad():
        for batch, seq in ((2, 5), (3, 7), (4, 6)):
            x, r = torch.randn(batch, seq, 32, device=DEVICE), torch.randn(batch, seq, 48, device=DEVICE)
            torch.testing.assert_close(cm(x, r), model(x, r), rtol=1e-4, atol=1e-5)
    assert len(looked) == 1


def test_a_frame_whose_static_graph_kept_inductors_code_runs_inductors_dynamic_code(monkeypatch):
    """A graph first compiled at static sizes where nothing fused (here gemm_epilogue fusion
    is off; on a GPU, autotuning or the whole-graph timing keeping Inductor's code): when a
    size changes and Dynamo compiles the frame again with dynamic sizes, the new sizes run
    Inductor's dynamic code without being lowered again, and the results stay right."""
    import comfuse.inductor_pass as pass_mod
    torch._dynamo.reset()
    looked = []
    real = pass_mod.lower
    monkeypatch.setattr(pass_mod, "lower", lambda *a, **k: looked.append(1) or real(*a, **k))
    model = PostNorm().to(DEVICE)
    cm = torch.compile(model, backend="comfuse", options={"disable": "gemm_epilogue"})
    with torch.no_grad():
        for batch, seq in ((2, 5), (3, 7), (4, 6)):
            x, r = torch.randn(batch, seq, 32, device=DEVICE), torch.randn(batch, seq, 48, device=DEVICE)
            torch.testing.assert_close(cm(x, r), model(x, r), rtol=1e-4, atol=1e-5)
    assert len(looked) == 1


def test_what_the_backend_kept_is_remembered_per_frame_and_grad_mode():
    """The key of ``VERDICTS``: a frame's graph with grad on (training) and off (inference)
    have the same ops but fuse differently, so each has its own; outside a Dynamo
    compilation there is none."""
    from torch._guards import CompileContext, CompileId, compile_context

    from comfuse import backend
    gm = torch.fx.symbolic_trace(PostNorm())
    opts = backend._options(None)
    assert backend._graph_key(gm, opts) is None
    with compile_context(CompileContext(CompileId(frame_id=3, frame_compile_id=0))):
        training = backend._graph_key(gm, opts)
        with torch.no_grad():
            inference = backend._graph_key(gm, opts)
    assert training is not None and training != inference and training[0] == inference[0] == 3


def test_a_graph_that_fails_to_lower_runs_inductors_code_with_a_warning(monkeypatch):
    import comfuse.inductor_pass as pass_mod

    def broken(*a, **k):
        raise RuntimeError("synthetic lowering failure")
    monkeypatch.setattr(pass_mod, "lower", broken)
    model = PostNorm().to(DEVICE)
    x, r = torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE)
    for dynamic in (False, True):
        torch._dynamo.reset()
        with pytest.warns(comfuse.ComfuseWarning, match="could not lower inference graph"), torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend="comfuse", dynamic=dynamic)(x, r),
                                       model(x, r), rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
    with comfuse.settings.override(strict=True), pytest.raises(Exception, match="synthetic lowering failure"):
        torch.compile(model, backend="comfuse", dynamic=False)(x, r)


def test_options_disable_kinds_and_fuel():
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)

        def forward(self, x):
            return self.b(F.gelu(self.a(x)))
    model = MLP().to(DEVICE)
    x = torch.randn(4, 32, device=DEVICE)
    with torch.no_grad():
        compiled(model)(x)
        assert ("b2b", True) in kinds(last_report())
        out = compiled(model, options={"disable": "b2b"})(x)
        assert all(kind != "b2b" for kind, _ in kinds(last_report()))
        assert ("gemm_epilogue", True) in kinds(last_report())
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
        compiled(model, options={"fuel": 0})(x)
        assert last_report() is None or not any(f for _, f in kinds(last_report()))
    with pytest.raises(Exception, match="unknown options"):
        compiled(model, options={"bogus": 1})(x)


def test_options_take_the_settings_a_backend_option_names():
    """schedule, fuel, autotune and graph_check are options too, with their COMFUSE_* variables'
    values; code-generation variants are not options (a plan's form, chosen by autotuning)."""
    from comfuse.backend import _options
    model = PostNorm().to(DEVICE)
    x, r = torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE)
    with torch.no_grad():
        out = compiled(model, options={"schedule": "cooperative", "autotune": "0"})(x, r)
        (region,) = last_report().regions
        assert region.fused and region.schedule == "cooperative"
        torch.testing.assert_close(out, model(x, r), rtol=1e-4, atol=1e-5)
    assert _options({"fuel": "2", "autotune": 0, "graph_check": "off"})["settings"] == \
        {"fuel": 2, "autotune": "0", "graph_check": "0"}
    with pytest.raises(ValueError, match="COMFUSE_FUEL='x' is not an integer"):
        _options({"fuel": "x"})
    with pytest.raises(ValueError, match="unknown options \\['ws_tail'\\]"):
        _options({"ws_tail": 96})


def test_cuda_graphs_time_tuning_as_graphs_unless_the_user_chose(monkeypatch):
    """Under reduce-overhead (CUDA graphs) tuning times candidates as graph replays, unless
    tune_timing was chosen, by its COMFUSE_TUNE_TIMING variable or an override."""
    from comfuse import settings
    from comfuse.backend import _options
    graphs = {"mode": "reduce-overhead"}
    monkeypatch.delenv("COMFUSE_TUNE_TIMING", raising=False)
    assert not settings.chosen("tune_timing")
    assert _options(graphs)["settings"] == {"tune_timing": "graph"}
    with settings.override(tune_timing="launch"):
        assert settings.chosen("tune_timing") and _options(graphs)["settings"] == {}
    monkeypatch.setenv("COMFUSE_TUNE_TIMING", "launch")
    assert settings.chosen("tune_timing") and _options(graphs)["settings"] == {}


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_torch_compile_modes_reach_inductor_and_the_tuning(mode, monkeypatch):
    """torch.compile(..., backend="comfuse", mode=...) (a TypeError before 2026-12-01): the
    code around the regions compiles in that mode, and a mode that replays CUDA graphs tunes
    the regions by graph replays (COMFUSE_TUNE_TIMING=graph) unless that variable is set."""
    import torch._inductor.compile_fx as cfx

    import comfuse.backend as backend_mod
    import comfuse.inductor_pass as pass_mod
    from comfuse import settings
    from comfuse.backend import _options
    seen = []
    real = cfx.compile_fx
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, inputs, config_patches=None, **kw:
                        seen.append(config_patches) or real(gm, inputs, config_patches=config_patches, **kw))
    timings = []
    real_lower = pass_mod.lower
    monkeypatch.setattr(pass_mod, "lower", lambda *a, **k: timings.append(settings.get().tune_timing)
                        or real_lower(*a, **k))
    backend_mod.REPORTS.clear()
    model = PostNorm().to(DEVICE)
    x, r = torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE)
    monkeypatch.delenv("COMFUSE_TUNE_TIMING", raising=False)
    with torch.no_grad():
        out = compiled(model, mode=mode)(x, r)
        torch.testing.assert_close(out, model(x, r), rtol=1e-4, atol=1e-5)
    ours = ("post_grad_custom_post_pass", "static_launch_user_defined_triton_kernels")
    assert seen and {k: v for k, v in seen[0].items() if k not in ours} == \
        dict(torch._inductor.list_mode_options(mode))
    assert seen[0].get("static_launch_user_defined_triton_kernels", True)  # (where torch has the option)
    assert isinstance(seen[0]["post_grad_custom_post_pass"], pass_mod.RegionPass)
    assert timings == ["graph" if mode == "reduce-overhead" else "launch"]
    # the option form (torch.compile takes a mode or options, not both), with other options
    assert _options({"mode": mode, "fuel": 3})["settings"] == {
        "fuel": 3, **({"tune_timing": "graph"} if mode == "reduce-overhead" else {})}
    monkeypatch.setenv("COMFUSE_TUNE_TIMING", "launch")  # a variable the caller set wins
    assert "tune_timing" not in _options({}, mode)["settings"]


def test_an_unknown_mode_is_a_clear_error():
    from comfuse.backend import _options
    with pytest.raises(ValueError, match="unknown mode 'fast'; modes are default, reduce-overhead"):
        _options(None, "fast")
    with pytest.raises(ValueError, match="disagree"):
        _options({"mode": "max-autotune"}, "reduce-overhead")


def test_explain_accepts_a_module():
    model = PostNorm().to(DEVICE)
    report = comfuse.explain(model, (torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE)))
    assert report.regions and report.regions[0].fused


transformers = pytest.importorskip("transformers", reason="transformers is part of the dev extras")


def _bert_layer():
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer
    cfg = BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    return BertLayer(cfg).eval().to(DEVICE)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _input_grads(out, eager, x):
    """x's gradient through ``out`` and through ``eager()``, for one random cotangent (not
    out.square().sum(): through a final LayerNorm that is nearly constant)."""
    g = torch.randn_like(out)
    (out * g).sum().backward()
    got, x.grad = x.grad.clone(), None
    (eager() * g).sum().backward()
    return got, x.grad


def _tiny_models():
    """Hugging Face models at a few hundred thousand parameters, default settings (caches on,
    SDPA attention), and the keyword inputs a user gives them."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    return {
        "bert": (BertModel(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=128)), {"input_ids": ids}),
        "gpt2": (GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4)),
                 {"input_ids": ids, "labels": ids}),
        "llama": (LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)),
                  {"input_ids": ids, "labels": ids}),
    }


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_explain_lists_the_regions_of_hugging_face_models(name):
    """Whole-program tracing fails on these models (cache objects, keyword inputs); explain then
    captures them as the backend does and lists every graph's regions, the backward's too (the
    parameters require grad), with no fused kernel run."""
    import re
    torch.manual_seed(0)
    model, kwargs = _tiny_models()[name]
    model = model.eval().to(DEVICE)
    report = comfuse.explain(model, (), kwargs)
    assert not report.error and report.fused, str(report)
    assert all(re.match(r"(forward|backward|inference) graph \d+: ", r.anchor) for r in report.regions)
    assert any(r.anchor.startswith("backward") for r in report.regions), str(report)
    assert all(p.grad is None for p in model.parameters())  # (gradients taken, not accumulated)
    positional = comfuse.explain(model, (kwargs["input_ids"],))
    assert not positional.error and len(positional.fused) >= 1, str(positional)


def test_explain_lists_the_backward_of_a_function_that_closes_over_a_model():
    """A training loop's loss function reaches the model's parameters through its closure, not
    its arguments: explain still takes the gradients (returned, not accumulated), so the
    backward graph's regions are listed too."""
    torch.manual_seed(0)
    model, kwargs = _tiny_models()["gpt2"]
    model = model.train().to(DEVICE)

    def loss_only(**kw):
        return model(**kw).loss
    report = comfuse.explain(loss_only, (), kwargs)
    assert not report.error and report.regions, str(report)
    assert any(r.anchor.startswith("backward") for r in report.regions), str(report)
    assert all(p.grad is None for p in model.parameters())

def test_fake_inputs_keep_requires_grad():
    """Capture sees what the call will need: attention saves its log-sum-exp for a backward
    only when an input requires grad, and Inductor's backward then reads it."""
    from comfuse.pipeline import fake_inputs
    x, w, ids = torch.randn(4, 8).requires_grad_(), torch.randn(8, 8), torch.arange(4)
    fx_, fw, fids, n = fake_inputs((x, w, ids, 3))
    assert fx_.requires_grad and not fw.requires_grad and not fids.requires_grad and n == 3
    assert fx_.shape == x.shape and fx_.stride() == x.stride() and fids.dtype == ids.dtype


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_hf_gpt2_trains_through_the_backend():
    """GPT-2 with its defaults (dropout, caches on) and labels: a training step compiles with
    the fused regions in the graph (Inductor traces it again, where a view the capture chose
    met other strides); without dropout, the loss and all gradients equal eager's."""
    from transformers import GPT2Config, GPT2LMHeadModel
    ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4)).to(DEVICE)
    with settings.override(strict=True):
        torch._dynamo.reset()
        torch.compile(model, backend="comfuse")(input_ids=ids, labels=ids).loss.backward()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0)).to(DEVICE)
    with settings.override(strict=True):
        torch._dynamo.reset()
        backend_reports.REPORTS.clear()
        loss = torch.compile(model, backend="comfuse")(input_ids=ids, labels=ids).loss
        loss.backward()
    assert any(r.fused for r in backend_reports.REPORTS), "\n".join(map(str, backend_reports.REPORTS))
    got = _grads(model)
    model.zero_grad()
    want = model(input_ids=ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, _grads(model), rtol=1e-4, atol=1e-5)


def test_hf_bert_layer_inference_and_training():
    torch.manual_seed(0)
    layer = _bert_layer()
    x = torch.randn(2, 16, 64, device=DEVICE)
    cm = compiled(layer)
    with torch.no_grad():
        torch.testing.assert_close(_first(cm(x)), _first(layer(x)), rtol=1e-4, atol=1e-4)
    x.requires_grad_(True)
    gx, expect = _input_grads(_first(cm(x)), lambda: _first(layer(x)), x)
    torch.testing.assert_close(gx, expect, rtol=1e-3, atol=1e-4)


def test_hf_bert_layer_keeps_its_fusions_when_the_sequence_length_changes():
    """Default torch.compile: the second length makes Dynamo recompile with dynamic shapes;
    every length still runs fused regions and matches eager, forward and backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = _bert_layer()
    cm = torch.compile(layer, backend="comfuse")
    for seq in (16, 24, 32):
        x = torch.randn(2, seq, 64, device=DEVICE, requires_grad=True)
        backend_reports.REPORTS.clear()
        out = _first(cm(x))
        report = last_report()
        assert report is not None and any(r.fused for r in report.regions), str(report)
        assert all(r.fused or r.reason.startswith("no epilogue") for r in report.regions), str(report)
        torch.testing.assert_close(out, _first(layer(x)), rtol=1e-4, atol=1e-4)
        gx, expect = _input_grads(out, lambda: _first(layer(x)), x)
        torch.testing.assert_close(gx, expect, rtol=1e-4, atol=1e-4)


def test_hf_llama_mlp_computes_gate_and_up_in_one_kernel_and_the_decoder_layer_runs():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP, LlamaRotaryEmbedding
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                      head_dim=16)
    cfg._attn_implementation = "eager"
    x = torch.randn(2, 16, 64, device=DEVICE)
    mlp = LlamaMLP(cfg).eval().to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(compiled(mlp)(x), mlp(x), rtol=1e-4, atol=1e-5)
    report = last_report()  # silu(gate) * up: both products in one mainloop, neither written
    assert any(r.fused and r.found.dual and len(r.outputs) == 1 for r in report.regions), str(report)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval().to(DEVICE)
    rope = LlamaRotaryEmbedding(cfg).to(DEVICE)
    pos = torch.arange(16, device=DEVICE)[None].expand(2, 16)
    cos_sin = rope(x, pos)
    with torch.no_grad():
        torch.testing.assert_close(_first(compiled(layer)(x, position_embeddings=cos_sin)),
                                   _first(layer(x, position_embeddings=cos_sin)), rtol=1e-4, atol=1e-4)


def test_classification_head_softmax_and_lm_head_cross_entropy():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 10).to(DEVICE)
    x = torch.randn(8, 64, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(compiled(lambda x: torch.softmax(head(x), -1))(x),
                                   torch.softmax(head(x), -1), rtol=1e-4, atol=1e-6)
    lm = torch.nn.Linear(64, 100, bias=False).to(DEVICE)
    t = torch.randint(0, 100, (8,), device=DEVICE)
    loss_fn = lambda x, t: F.cross_entropy(lm(x), t)  # noqa: E731
    x.requires_grad_(True)
    loss = compiled(loss_fn)(x, t)
    loss.backward()
    gx = x.grad.clone()
    x.grad = None
    ref = loss_fn(x, t)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("schedule", ["", "split"], ids=["planned", "split"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_after_a_gemm_trains_like_eager(reduction, schedule):
    """Linear + cross-entropy over the vocabulary in the forward graph: the region writes what
    Inductor's backward saves (the logits and their row statistics; as a split region, the
    logits from the slices and the statistics from the combine); the gradients equal
    eager's, ignore_index included."""
    torch.manual_seed(0)
    lm = torch.nn.Linear(64, 1000, bias=False).to(DEVICE)
    x = torch.randn(24, 64, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 1000, (24,), device=DEVICE)
    t[3] = -100

    def fn(x, t):
        return F.cross_entropy(lm(x), t, reduction=reduction)
    loss = compiled(fn, options={"schedule": schedule} if schedule else None)(x, t)
    assert ("gemm_epilogue", True) in kinds(last_report())
    if schedule:
        assert "split" in [r.schedule for r in last_report().regions if r.fused]
    loss.sum().backward()
    gx, gw = x.grad.clone(), lm.weight.grad.clone()
    x.grad = None
    lm.zero_grad()
    fn(x, t).sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw, lm.weight.grad, rtol=1e-4, atol=1e-6)


def test_an_lm_head_inductor_padded_trains_as_one_region_over_the_vocabulary():
    """GPT-2's head as Inductor's pad_mm leaves it (the weight's columns zero-padded for
    alignment, the logits sliced back): the forward's region is the product with the weight
    itself over the 57 columns and the loss, and the gradients are eager's."""
    import comfuse.inductor_pass as pass_mod
    aten = torch.ops.aten

    def head(x, w, t):
        y = aten.mm(x, aten.constant_pad_nd(w.t(), [0, 7]))[:, :-7]
        return y, F.cross_entropy(y.float(), t)
    torch.manual_seed(0)
    x = torch.randn(64, 32, device=DEVICE)
    w = torch.randn(57, 32, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 57, (64,), device=DEVICE)
    y, loss = compiled(head, options={"schedule": "split", "autotune": "0"})(x, w, t)
    forward = [r for r in pass_mod.REPORTS if r.function.startswith("forward")][-1]
    assert [(r.fused, r.schedule) for r in forward.regions] == [(True, "split")], str(forward)
    assert "N=57" in forward.regions[0].ir.splitlines()[0]
    loss.backward()
    got = w.grad.clone()
    w.grad = None
    y2, want = head(x, w, t)
    want.backward()
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert ((got - w.grad).norm() / w.grad.norm()).item() < 1e-5


@pytest.mark.parametrize("schedule", ["split", "cooperative"])
def test_an_lm_head_inductor_padded_trains_with_the_loss_alone_returned(schedule):
    """A training forward that returns only the loss saves the padded product for its backward
    (its slices are views, recomputed there): the region writes it whole, its padded columns
    zeros, and the gradients are eager's."""
    import comfuse.inductor_pass as pass_mod
    aten = torch.ops.aten

    def head(x, w, t):
        return F.cross_entropy(aten.mm(x, aten.constant_pad_nd(w.t(), [0, 7]))[:, :-7].float(), t)
    torch.manual_seed(0)
    x = torch.randn(64, 32, device=DEVICE)
    w = torch.randn(57, 32, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 57, (64,), device=DEVICE)
    loss = compiled(head, options={"schedule": schedule, "autotune": "0"})(x, w, t)
    forward = [r for r in pass_mod.REPORTS if r.function.startswith("forward")][-1]
    assert [(r.fused, r.schedule) for r in forward.regions] == [(True, schedule)], str(forward)
    assert "mm" in forward.regions[0].outputs, str(forward)  # (the padded product, saved)
    loss.backward()
    got = w.grad.clone()
    w.grad = None
    want = head(x, w, t)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert ((got - w.grad).norm() / w.grad.norm()).item() < 1e-5


def test_a_linear_heads_loss_alone_through_inductors_own_padding_trains_fused(monkeypatch):
    """The graph Inductor's ``pad_mm`` leaves a training forward that returns only the loss of
    an ``nn.Linear`` head over an unaligned vocabulary (GPT-2's), made here on a CPU by letting
    ``pad_mm`` pad a CPU GEMM: the padded product is what the backward saves, and the region
    still takes the head and its loss, with eager's loss and gradients."""
    import comfuse.inductor_pass as pass_mod
    pad_mm = pytest.importorskip("torch._inductor.fx_passes.pad_mm")
    if not all(hasattr(pad_mm, f) for f in ("check_device", "has_triton")):
        pytest.skip("this torch's pad_mm has another form")
    monkeypatch.setattr(pad_mm, "check_device", lambda a, b: True)
    monkeypatch.setattr(pad_mm, "has_triton", lambda: True)
    monkeypatch.setattr(torch._inductor.config, "force_shape_pad", True)
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 1027, bias=False)
    x = torch.randn(64, 32, requires_grad=True)
    t = torch.randint(0, 1027, (64,))
    loss = compiled(lambda x, t: F.cross_entropy(head(x).float(), t), options={"autotune": "0"})(x, t)
    forward = [r for r in pass_mod.REPORTS if r.function.startswith("forward")][-1]
    (region,) = forward.regions
    assert region.fused and "mm" in region.outputs, str(forward)
    loss.backward()
    got = torch.cat([x.grad.flatten(), head.weight.grad.flatten()])
    x.grad = head.weight.grad = None
    want = F.cross_entropy(head(x).float(), t)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    expected = torch.cat([x.grad.flatten(), head.weight.grad.flatten()])
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5

def test_a_padded_product_returned_whole_has_zeros_in_its_padded_columns():
    """The region writes the product over its own columns and zeros in the padded ones, as
    the GEMM on the padded operand gives them, fused and unfused alike."""
    aten = torch.ops.aten

    def head(x, w, t):
        p = aten.mm(x, aten.constant_pad_nd(w.t(), [0, 7]))
        return p, F.cross_entropy(p[:, :-7].float(), t, reduction="none")
    x, w = torch.randn(16, 32), torch.randn(57, 32)
    t = torch.randint(0, 57, (16,))
    for options in ({}, {"disable": True}):
        with settings.override(**options):
            fn = comfuse.compile(head, (x, w, t))
            got = fn(x, w, t)
        assert fn.report.regions[0].fused and "mm" in fn.report.regions[0].outputs, str(fn.report)
        assert got[0].shape == (16, 64) and not got[0][:, 57:].any()
        for g, want in zip(got, head(x, w, t)):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)

SPLIT_GRADS = {
    "ce_ignore": lambda x, w, t: F.cross_entropy(x @ w, t, ignore_index=3),
    "logsumexp": lambda x, w, t: torch.logsumexp(x @ w, -1).sum(),
    "max_min_sum": lambda x, w, t: ((x @ w).amax(-1) - (x @ w).amin(-1) + (x @ w).relu().sum(-1)).sum(),
    "var_mean": lambda x, w, t: sum(v.square().sum() for v in torch.var_mean(x @ w + 3.0, -1)),
}


@pytest.mark.parametrize("name", list(SPLIT_GRADS))
def test_every_row_statistic_after_a_gemm_trains_like_eager(name):
    """Sums, log-sum-exps, maxima, minima and moments over a GEMM's rows: Inductor's backward,
    from what the fused forward wrote, gives eager's gradients."""
    torch.manual_seed(0)
    x = torch.randn(24, 32, device=DEVICE, requires_grad=True)
    w = (torch.randn(32, 200, device=DEVICE) / 6).requires_grad_(True)
    t = torch.randint(0, 200, (24,), device=DEVICE)
    fn = SPLIT_GRADS[name]
    compiled(fn)(x, w, t).backward()
    assert any(r.fused for r in last_report().regions), str(last_report())
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    fn(x, w, t).backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-5)


def test_a_maximum_among_ties_gets_eager_gradient():
    """Two equal columns hold every row's maximum, far apart in a fused region's row. The
    fused GEMM may round the two products differently (other tiles, other summation orders:
    under the interpreter, NumPy's), which breaks the tie; Inductor's backward then gives one
    column what eager splits between them. The pair's total and every other gradient are
    eager's."""
    torch.manual_seed(0)
    x = torch.randn(24, 32, device=DEVICE).abs().requires_grad_(True)
    w0 = torch.randn(32, 200, device=DEVICE) / 6
    w0[:, 5] = w0[:, 150] = 1.0  # the same column twice, far above the others
    w = w0.requires_grad_(True)
    fn = lambda x, w: (x @ w).amax(-1).sum()  # noqa: E731
    # (Inductor's backward of amax saves the mask ``x @ w == max``, an output of the region: an
    # equality of rounded values, which the float64 reference of COMFUSE_CHECK cannot judge;
    # the gradients against eager's below do)
    with settings.override(check=False):
        compiled(fn)(x, w).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    fn(x, w).backward()
    others = [j for j in range(200) if j not in (5, 150)]
    assert gw[:, 5].abs().sum() + gw[:, 150].abs().sum() > 0
    torch.testing.assert_close(gw[:, 5] + gw[:, 150], w.grad[:, 5] + w.grad[:, 150], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw[:, others], w.grad[:, others], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-5)

@pytest.mark.parametrize("winner", ["unfused", "fused"])
def test_compile_time_autotuning_leaves_losing_regions_to_inductor(monkeypatch, winner):
    """The backend tunes each region on Dynamo's example inputs while it compiles; a region
    whose unfused ops win goes back into the graph as plain ops (Inductor fuses them with
    their neighbours), a winning one stays a comfuse::region call."""
    from comfuse.runtime import tuning

    def decide(names, run_fused, run_unfused, device, tol=None, exact=None):
        return {"choice": tuning.UNFUSED if winner == "unfused" else names[0],
                "times_ms": {tuning.UNFUSED: 1.0, **{n: 2.0 if winner == "unfused" else 0.5 for n in names}},
                "rejected": {}}
    monkeypatch.setattr(tuning, "decide", decide)
    monkeypatch.setattr(tuning, "load", lambda k: None)
    monkeypatch.setattr(tuning, "store", lambda k, d: None)
    import comfuse.inductor_pass as pass_mod
    seen = []  # comfuse::region calls in each graph comfuse's pass hands back to Inductor
    real_lower = pass_mod.lower

    def spy(*a, **k):
        lowered = real_lower(*a, **k)
        gm = lowered.gm
        seen.append(0 if gm is None else sum(n.target is torch.ops.comfuse.region.default for n in gm.graph.nodes))
        return lowered
    monkeypatch.setattr(pass_mod, "lower", spy)
    model = PostNorm().to(DEVICE)
    x, r = torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE)
    with torch.no_grad():
        out = compiled(model, options={"autotune": "1"})(x, r)
        torch.testing.assert_close(out, model(x, r), rtol=1e-4, atol=1e-5)
    assert seen == [0 if winner == "unfused" else 1]


def test_cross_entropy_backward_with_every_target_ignored_gives_zero_gradients():
    """Every target ignored: the loss's gradient is zero (its mean is NaN, as eager's), no
    statistic carries a gradient, and every slice of the weight's gradient is still written."""
    torch.manual_seed(0)
    lm = torch.nn.Linear(16, 300, bias=False).to(DEVICE)
    x = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    t = torch.full((8,), -100, device=DEVICE)

    def fn(x, t):
        return F.cross_entropy(lm(x), t, reduction="sum")
    loss = compiled(fn)(x, t)
    assert ("gemm_epilogue", True) in kinds(last_report())
    loss.backward()
    assert torch.equal(lm.weight.grad, torch.zeros_like(lm.weight))
    assert torch.equal(x.grad, torch.zeros_like(x))


from hypothesis import given, settings as hsettings, strategies as st  # noqa: E402

from helpers import PROPERTY_COUNTS  # noqa: E402


@hsettings(max_examples=4, deadline=None, derandomize=True)
@given(lengths=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 9)), min_size=2, max_size=5),
       cap=st.integers(1, 3), norm=st.sampled_from(["layer", "rms"]))
def test_random_length_sequences_stay_correct_and_bounded(lengths, cap, norm):
    """Random sequences of (batch, length) through a dynamic-shape compile: every call matches
    eager, every lowered shape is fused, and no graph lowers more than
    COMFUSE_MAX_SPECIALIZATIONS shapes."""
    import comfuse.backend as backend_mod
    PROPERTY_COUNTS["random length sequences (dynamic shapes)"] += 1
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24).to(DEVICE)
    scale = torch.rand(24, device=DEVICE) + 0.5

    def block(x, r):
        h = lin(x) + r
        if norm == "layer":
            return F.layer_norm(h, (24,), scale)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    lowered = []
    real = backend_mod.PerShape._build
    try:
        def build(self, key, args):
            compiled = real(self, key, args)
            lowered.append((id(self), key, self.reports[key]))
            return compiled
        backend_mod.PerShape._build = build
        cm = torch.compile(block, backend="comfuse", dynamic=True)
        with comfuse.settings.override(max_specializations=cap), torch.no_grad():
            for b, n in lengths:
                x, r = torch.randn(b, n, 16, device=DEVICE), torch.randn(b, n, 24, device=DEVICE)
                torch.testing.assert_close(cm(x, r), block(x, r), rtol=1e-4, atol=1e-5)
    finally:
        backend_mod.PerShape._build = real
    # (Dynamo compiles a graph of its own where a size is 0 or 1: the cap holds per graph)
    for graph in {g for g, _, _ in lowered}:
        keys = [k for g, k, _ in lowered if g == graph]
        assert len(keys) <= cap and len(set(keys)) == len(keys)
    assert all(report is not None and report.regions[0].fused for _, _, report in lowered), lowered


class StoredRegion(torch.nn.Module):
    """A region module as the registry holds one: a plan, plain fields, its unfused ops."""

    def __init__(self, plan, scale=0.125, constant=1.0):
        super().__init__()
        self.plan, self.scale, self.axes = plan, scale, frozenset({"B", "M", "N"})
        self.output_specs = [((4, 8), torch.float32)]
        g = torch.fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(torch.mul, (x, g.get_attr("c"))))
        root = torch.nn.Module()
        root.c = torch.full((8,), constant)
        self.unfused = torch.fx.GraphModule(root, g)


def test_region_ids_follow_what_the_region_computes_and_name_it_in_comfuses_cache(monkeypatch, tmp_path):
    """Inductor caches compiled graphs on disk by their text, where a region is only its id:
    the same registration order in another process must give the same id to the same region
    and never to another; a region stored in comfuse's cache under it is what a later process
    that takes the graph from Inductor's cache loads (an id it cannot load is a clear error)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from comfuse import region_op, settings
    root = Path(__file__).resolve().parents[1]

    def first_id(*args):
        monkeypatch.setattr(region_op, "_seen", {})  # as in a fresh process
        i = region_op.register(StoredRegion(*args), [True, False])
        assert region_op.store([i])
        region_op.REGISTRY.pop(i)
        return i
    with settings.override(cache_dir=tmp_path):
        assert first_id("plan A") == first_id("plan A") != first_id("plan B")
        # (fields, the unfused ops' constants: never one id for two computations)
        assert len({first_id("plan A"), first_id("plan A", 0.1), first_id("plan A", 0.125, 2.0)}) == 3
        i = first_id("plan B")
        module, is_tensor = region_op.module_of(i)  # (loaded from the cache)
        region_op.REGISTRY.pop(i)
        assert module.plan == "plan B" and is_tensor == (True, False) and region_op.loadable([i])
        region_op.REGISTRY.pop(i)
        with pytest.raises(region_op.RegionMissing, match="cannot give back"):
            region_op.module_of(12345)
        assert not region_op.loadable([12345])
    # the same text in a process with another hash seed (sets print in another order there)
    script = ("import torch, sys; sys.path.insert(0, %r); from comfuse import region_op; "
              "print(region_op._canonical({'axes': frozenset('BMNK'), 'names': {'x', 'y', 'z'}}))" % str(root))
    texts = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONHASHSEED=seed)).stdout for seed in ("1", "2", "3")}
    assert len(texts) == 1 and "'B', 'K', 'M', 'N'" in texts.pop()


@pytest.mark.parametrize("winner", ["fused", "inductor"])
def test_the_whole_graph_is_timed_against_inductors_and_the_faster_kept(monkeypatch, fused_regions_win, winner):
    """A region that wins its own timing can still cost the model (host time, fusions cut
    around it): the backend times the inference graph with its fused regions against
    Inductor's compilation of the graph without them and keeps the faster."""
    from comfuse import backend, graph_check, region_op  # noqa: F401
    timed = []

    def time_graphs(calls, device):
        timed.append(sorted(calls))
        outs = {n: fn() for n, fn in calls.items()}  # both forms run, and agree
        torch.testing.assert_close(outs["fused"], outs["inductor"], rtol=1e-4, atol=1e-5)
        return {"fused": 1.0 if winner == "fused" else 2.0, "inductor": 1.5}
    monkeypatch.setattr(graph_check, "_time_graphs", time_graphs)
    region_calls = []
    arguments = region_op._arguments
    monkeypatch.setattr(region_op, "_arguments", lambda *a: region_calls.append(1) or arguments(*a))
    model = PostNorm().to(DEVICE)
    x, r = torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE)
    with torch.no_grad():
        fn = compiled(model, options={"autotune": "1", "graph_check": "1"})
        out = fn(x, r)
        torch.testing.assert_close(out, model(x, r), rtol=1e-4, atol=1e-5)
        region_calls.clear()
        fn(x, r)
    assert timed == [["fused", "inductor"]]
    assert backend.GRAPH_CHECKS[-1]["kept"] == winner and backend.GRAPH_CHECKS[-1]["regions"] == 1
    assert bool(region_calls) == (winner == "fused")


def _training_check(monkeypatch, model, fused_step_ms: float, fused_forward_ms: float = 1.0):
    """One training step of ``model`` compiled with the whole-graph check, its timings faked
    (the fused forward ``fused_forward_ms`` against 1.5, the fused step ``fused_step_ms``
    against 2.0; both forms run and agree): which of them were timed (True: a step), and the
    check's record."""
    from comfuse import backend, graph_check
    timed = []

    def time_graphs(calls, device):
        outs = {n: fn() for n, fn in calls.items()}
        step = isinstance(outs["fused"], tuple)  # gradients
        timed.append(step)
        if step:
            assert_grads_close(outs["fused"], outs["inductor"])
        return {"fused": fused_step_ms if step else fused_forward_ms, "inductor": 2.0 if step else 1.5}
    monkeypatch.setattr(graph_check, "_time_graphs", time_graphs)
    torch.manual_seed(0)
    x, r = torch.randn(2, 5, 32, device=DEVICE, requires_grad=True), torch.randn(2, 5, 48, device=DEVICE)
    model(x, r).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    out = compiled(model, options={"autotune": "1", "graph_check": "1"})(x, r)
    out.sum().backward()  # the timing's steps left no gradient behind: one step's worth
    assert_grads_close([p.grad for p in model.parameters()], want)
    return timed, backend.GRAPH_CHECKS[-1]


@pytest.mark.parametrize("step_wins", [True, False])
def test_a_training_graph_keeps_the_fused_form_only_if_its_forward_and_step_both_win(monkeypatch, fused_regions_win,
                                                                                   step_wins):
    """Grad on, a backward that fuses too: the forward alone and forward + backward
    (gradients returned, not accumulated into ``.grad``) are both timed; a fused graph that
    loses either goes to Inductor."""
    timed, check = _training_check(monkeypatch, NormPostNorm().to(DEVICE), 1.0 if step_wins else 3.0)
    assert timed == [False, True] and check["training"]
    assert check["kept"] == ("fused" if step_wins else "inductor")


def test_a_training_step_is_not_timed_where_the_backward_is_inductors_in_both(monkeypatch, fused_regions_win):
    """The pass runs after AOTAutograd split the graph: where the fused graph's backward keeps
    no fused region, both forms run the same backward, and the step (whose timing compiles
    that backward twice) is not timed; a forward that loses is not followed by a step either."""
    from comfuse import graph_check
    timed, check = _training_check(monkeypatch, PostNorm().to(DEVICE), 3.0)
    assert timed == [False] and check["training"] and check["kept"] == "fused" and "fused_step_ms" not in check
    timed, check = _training_check(monkeypatch, NormPostNorm().to(DEVICE), 1.0, fused_forward_ms=2.0)
    assert timed == [False] and check["kept"] == "inductor"

    monkeypatch.setattr(graph_check, "_time_graphs", lambda calls, device: pytest.fail("timed"))
    with torch.no_grad():
        compiled(PostNorm().to(DEVICE), options={"autotune": "0", "graph_check": "0"})(
            torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE))


class NormThenCumsum(torch.nn.Module):
    """A forward whose GEMM has no epilogue comfuse fuses (cumsum), and a backward whose GEMM
    into the LayerNorm's input gradient has one (LayerNorm's backward row reductions)."""
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 48) / 6)

    def forward(self, x):
        return torch.cumsum(F.layer_norm(x, (32,)) @ self.w, -1)


@pytest.mark.parametrize("winner", ["fused", "inductor"])
def test_a_backward_that_fuses_where_the_forward_did_not_is_timed_against_inductors(monkeypatch, fused_regions_win,
                                                                                   winner):
    """The forward kept no fused region, its backward (lowered at the first backward) keeps
    one: the first call runs a step to lower the backward, then times the graph's steps (not
    its forward, the same in both) against Inductor's compilation without regions and keeps
    the faster; the gradients are one step's, as eager's."""
    from comfuse import backend, graph_check
    timed = []

    def time_graphs(calls, device):
        outs = {n: fn() for n, fn in calls.items()}
        step = isinstance(outs["fused"], tuple)
        timed.append(step)
        if step:
            assert_grads_close(outs["fused"], outs["inductor"])
        return {"fused": 1.0 if winner == "fused" else 3.0, "inductor": 2.0}
    monkeypatch.setattr(graph_check, "_time_graphs", time_graphs)
    torch.manual_seed(0)
    model = NormThenCumsum().to(DEVICE)
    x = torch.randn(2, 5, 32, device=DEVICE, requires_grad=True)
    passes = []
    torch._dynamo.reset()
    cm = torch.compile(model, dynamic=False, backend=lambda gm, ex: backend.comfuse_backend(
        gm, ex, {"autotune": "1", "graph_check": "1"}, passes=passes))
    cm(x).square().sum().backward()
    assert [r.regions[0].fused for r in passes[0].reports] == [False, False] and passes[0].fused == 1
    assert timed == [True]  # (the forwards are the same graph: only the steps are timed)
    assert backend.GRAPH_CHECKS[-1]["kept"] == winner and backend.GRAPH_CHECKS[-1]["training"]
    got = (x.grad.clone(), model.w.grad.clone())
    x.grad = model.w.grad = None
    model(x).square().sum().backward()
    assert_grads_close(got, (x.grad, model.w.grad))


@pytest.mark.parametrize("cudagraphs", [False, True])
def test_a_training_graph_under_cuda_graphs_is_timed_by_its_steps_alone(monkeypatch, cudagraphs):
    """Under CUDA graphs a training graph's forward, called without its backward, does not
    run as a replay: its times are not a training loop's (BERT under reduce-overhead: 65 ms
    against 49, where the steps ran 33 against 58). There the check times the steps alone
    and keeps the graph whose step is faster; elsewhere a forward that lost keeps Inductor's
    without timing the steps (their backward compiled twice)."""
    from comfuse import graph_check
    timed = []

    def time_graphs(calls, device):
        outs = {n: fn() for n, fn in calls.items()}
        step = isinstance(outs["fused"], tuple)
        timed.append("step" if step else "forward")
        return {"fused": 1.0, "inductor": 2.0} if step else {"fused": 3.0, "inductor": 2.0}
    monkeypatch.setattr(graph_check, "_time_graphs", time_graphs)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def fused(w, x):
        return x @ w

    def plain(w, x):
        return x @ w
    choice = graph_check.GraphChoice(fused, plain, 1, cudagraphs=cudagraphs)
    kept = choice.decide([w, x])
    assert timed == (["step"] if cudagraphs else ["forward"])
    assert kept is (fused if cudagraphs else plain)
    assert graph_check.GRAPH_CHECKS[-1]["kept"] == ("fused" if cudagraphs else "inductor")


def test_a_backward_that_fails_to_lower_with_regions_runs_inductors_compilation(monkeypatch, fused_regions_win):
    """Inductor lowers the backward at the first backward, after the pass, where comfuse's
    pass cannot catch what fails (on the H200 a kernel node's metadata failed Inductor's own
    rewrite of it, and BERT's first backward crashed). The first call's step meets it: the
    graph then runs Inductor's compilation without regions, with a warning, and the
    gradients are eager's."""
    from comfuse import backend, inductor_pass
    real = inductor_pass.RegionPass.__call__

    def failing(self, graph):
        real(self, graph)
        if inductor_pass.graph_kind(graph) == "backward":
            raise RuntimeError("Inductor's lowering failed after the pass")
    monkeypatch.setattr(inductor_pass.RegionPass, "__call__", failing)
    torch.manual_seed(0)
    model = NormThenCumsum().to(DEVICE)
    x = torch.randn(2, 5, 32, device=DEVICE, requires_grad=True)
    torch._dynamo.reset()
    cm = torch.compile(model, dynamic=False, backend=lambda gm, ex: backend.comfuse_backend(
        gm, ex, {"autotune": "1", "graph_check": "1"}))
    with pytest.warns(comfuse.errors.FallbackWarning, match="lowering the backward with comfuse's regions failed"):
        cm(x).square().sum().backward()
    got = (x.grad.clone(), model.w.grad.clone())
    x.grad = model.w.grad = None
    cm(x).square().sum().backward()  # (and again, from the compilation kept)
    again = (x.grad.clone(), model.w.grad.clone())
    x.grad = model.w.grad = None
    model(x).square().sum().backward()
    assert_grads_close(got, (x.grad, model.w.grad))
    assert_grads_close(again, got)


@pytest.mark.parametrize("fuses", ["inference", "forward", "backward only"])
def test_inductors_graph_is_compiled_for_the_check_as_inductor_alone_compiles_it(monkeypatch, fused_regions_win,
                                                                               fuses):
    """The graph the whole-graph check times against the fused one, and keeps where it wins,
    is Inductor's own compilation: in Dynamo's fake mode, with each input's sizes as Dynamo
    recorded them, as Inductor alone compiles, also when it is compiled at the first call,
    after Dynamo's compilation ended and forgot them (with sizes of AOTAutograd's own,
    symbolic, BERT's decoder GEMM lost Inductor's padding on the H200 and the user got a
    step 13 % slower than Inductor's); Dynamo's tracing context itself is left as the fused
    graph's backward will find it."""
    from comfuse import backend, graph_check
    seen = {}
    inductor = backend._inductor

    def recorded(gm, example_inputs, opts):
        context = torch._guards.TracingContext.try_get()
        seen.setdefault("plain", []).append((context.fake_mode, context))
        # every input with the sizes Dynamo gave it (static here), not sizes of AOTAutograd's own
        assert all(t in context.tensor_to_context for t in example_inputs if isinstance(t, torch.Tensor))
        return inductor(gm, example_inputs, opts)
    monkeypatch.setattr(backend, "_inductor", recorded)
    monkeypatch.setattr(graph_check, "_time_graphs", lambda calls, device: {n: 1.0 for n in calls})

    def comfuse(gm, example_inputs):
        context = torch._guards.TracingContext.try_get()
        seen["dynamo"] = (context.fake_mode, context)
        return backend.comfuse_backend(gm, example_inputs, {"autotune": "1", "graph_check": "1"}, passes=[])
    if fuses == "backward only":
        model, args = NormThenCumsum().to(DEVICE), (torch.randn(2, 5, 32, device=DEVICE, requires_grad=True),)
    else:
        model = PostNorm().to(DEVICE)
        args = (torch.randn(2, 5, 32, device=DEVICE, requires_grad=fuses == "forward"),
                torch.randn(2, 5, 48, device=DEVICE))
    torch._dynamo.reset()
    # (as for a registered backend: Dynamo forgets its inputs' symbolic contexts when done)
    with torch.set_grad_enabled(fuses != "inference"), \
            torch._dynamo.config.patch(invalidate_compile_context_weakrefs=True):
        out = torch.compile(model, dynamic=False, backend=comfuse)(*args)
        if fuses != "inference":
            out.square().sum().backward()
    assert backend.GRAPH_CHECKS[-1]["kept"] == "inductor"  # (timed equal: the fused graph must win by 1 %)
    assert len(seen["plain"]) == 1
    (fake_mode, context), = seen["plain"]
    assert fake_mode is seen["dynamo"][0] and context is not seen["dynamo"][1]


def test_a_backward_that_fuses_nothing_costs_no_compilation_more(monkeypatch):
    """The forward and the backward keep no fused region (gemm_epilogue fusion off): after
    the first step, the graph runs as compiled; Inductor's compilation without regions is
    never built and nothing is timed."""
    from comfuse import graph_check
    monkeypatch.setattr(graph_check, "_time_graphs", lambda calls, device: pytest.fail("timed"))
    monkeypatch.setattr(graph_check.GraphChoice, "__init__", lambda *a: pytest.fail("a second compilation"))
    model = NormThenCumsum().to(DEVICE)
    x = torch.randn(2, 5, 32, device=DEVICE, requires_grad=True)
    cm = compiled(model, options={"graph_check": "1", "disable": "gemm_epilogue"})
    cm(x).sum().backward()
    want = x.grad.clone()
    x.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(want, x.grad, rtol=1e-4, atol=1e-5)


def test_graph_timing_rounds_are_bounded_and_interleaved():
    """The whole-graph timing: three rounds of 3 to 20 calls per form (fewer the slower a
    call), each round starting with another form."""
    import time as time_mod
    from comfuse import backend, graph_check, region_op  # noqa: F401
    order = []

    def form(name, seconds):
        def call():
            order.append(name)
            time_mod.sleep(seconds)
        return call
    times = graph_check._time_graphs({"a": form("a", 0.0), "b": form("b", 0.05)}, torch.device("cpu"))
    assert times["b"] > times["a"] and 40 < times["b"] < 200
    per_form = (len(order) - 4) // 6  # 2 untimed calls per form, then 3 rounds of both
    assert len(order) == 4 + 6 * per_form and 3 <= per_form <= 6  # 0.3 s / 0.05 s a call
    rounds = [order[4 + i * per_form] for i in range(6)]
    assert rounds == ["a", "b", "b", "a", "a", "b"]


def test_the_graph_timing_leaves_the_random_state_as_it_found_it(monkeypatch, fused_regions_win):
    """The first call's timing runs the graph many times; dropout in it must not shift the
    random numbers the caller's own first call draws: with Inductor's graph kept, the first
    output equals Inductor alone's under the same seed."""
    from comfuse import backend, graph_check, region_op  # noqa: F401

    def time_graphs(calls, device):
        for fn in calls.values():
            fn()  # draws random numbers
        return {"fused": 2.0, "inductor": 1.0}
    monkeypatch.setattr(graph_check, "_time_graphs", time_graphs)

    class Dropped(PostNorm):
        def forward(self, x, r):
            return F.dropout(self.ln(self.lin(x) + r), 0.5, training=True)
    model = Dropped().to(DEVICE)
    x, r = torch.randn(2, 5, 32, device=DEVICE), torch.randn(2, 5, 48, device=DEVICE)
    with torch.no_grad():
        torch._dynamo.reset()
        alone = torch.compile(model, dynamic=False)
        torch.manual_seed(7)
        want = alone(x, r)
        cm = compiled(model, options={"autotune": "1", "graph_check": "1"})
        torch.manual_seed(7)
        got = cm(x, r)
    assert backend.GRAPH_CHECKS[-1]["kept"] == "inductor"
    assert torch.equal(got, want)


def test_a_graph_whose_region_saves_a_vocabulary_sized_tensor_is_not_timed_against_inductors(monkeypatch):
    """Linear + cross-entropy over a vocabulary stays fused for memory (a training step's peak
    at most half of Inductor's) even where slower; the whole-graph check must not undo that,
    nor allocate the logits Inductor's graph would hold by timing it."""
    from comfuse import graph_check, inductor_pass
    from comfuse.runtime import tuning
    monkeypatch.setattr(tuning, "MEMORY_FIRST_BYTES", 1)  # this small vocabulary counts as huge
    lowered = []
    real_lower = inductor_pass.lower
    monkeypatch.setattr(inductor_pass, "lower", lambda *a, **k: lowered.append(real_lower(*a, **k)) or lowered[-1])
    monkeypatch.setattr(graph_check, "_time_graphs", lambda calls, device: pytest.fail("timed"))
    lm = torch.nn.Linear(64, 100, bias=False).to(DEVICE)
    x, t = torch.randn(8, 64, device=DEVICE), torch.randint(0, 100, (8,), device=DEVICE)
    loss_fn = lambda x, t: F.cross_entropy(lm(x), t)  # noqa: E731
    with torch.no_grad():
        loss = compiled(loss_fn, options={"autotune": "0", "graph_check": "1"})(x, t)
    assert lowered and lowered[-1].saves_memory
    torch.testing.assert_close(loss, loss_fn(x, t), rtol=1e-5, atol=1e-6)


def test_a_linear_layer_no_region_took_keeps_its_bias_inside_the_gemm(monkeypatch):
    """Region finding decomposes every addmm into a product and a bias add; in the graph that
    goes back to Inductor, an addmm that no region took is an addmm again (cuBLAS adds the
    bias inside the GEMM), where a region elsewhere in the graph was kept."""
    from comfuse import inductor_pass
    lowered = []
    real_lower = inductor_pass.lower
    monkeypatch.setattr(inductor_pass, "lower", lambda *a, **k: lowered.append(real_lower(*a, **k)) or lowered[-1])
    lin, head = torch.nn.Linear(64, 64).to(DEVICE), torch.nn.Linear(64, 100, bias=False).to(DEVICE)
    x, t = torch.randn(8, 64, device=DEVICE), torch.randint(0, 100, (8,), device=DEVICE)

    def f(x, t):
        h = lin(x)  # (returned too: no chain with the head)
        return F.cross_entropy(head(h), t), h
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        loss, h = compiled(f, options={"autotune": "0", "graph_check": "0"})(x, t)
    gm = lowered[-1].gm
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.comfuse.region.default in targets, gm.graph
    assert torch.ops.aten.addmm.default in targets and torch.ops.aten.mm.default not in targets, gm.graph
    want_loss, want_h = f(x, t)
    torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("schedule", ["row_in_cta", "cooperative"])
def test_inductor_launches_one_launch_triton_kernels_itself(mode, schedule):
    """A region whose kernel is one Triton launch (here forced to the row-in-CTA schedule, or
    to a cooperative strip with its scratch as graph buffers) becomes Inductor's own user-kernel node: its wrapper launches the kernel as it launches its
    own (no comfuse::region call), CUDA graphs capture it, and forward and training match eager."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    model = PostNorm(d=256, h=512).cuda()
    x = torch.randn(4, 96, 256, device="cuda", requires_grad=True)
    r = torch.randn(4, 96, 512, device="cuda")
    counters.clear()
    with settings.override(check=False, schedule=schedule):
        backend_reports.REPORTS.clear()
        cm = compiled(model, mode=mode)
        out, codes = run_and_get_code(lambda: cm(x, r))
        g = torch.randn_like(out)
        (out * g).sum().backward()
        # (CUDA-graph outputs, the gradients among them, are overwritten by the next replay)
        out, gx, gw = out.detach().clone(), x.grad.clone(), model.lin.weight.grad.clone()
        with torch.no_grad():  # many calls: a strip's fresh counters each time, never a hang or a race
            again = [cm(x, r).clone() for _ in range(30)]
    report = last_report()
    assert any(reg.fused and reg.launch.startswith("Inductor's wrapper") for reg in report.regions), str(report)
    assert any(f"comfuse_{schedule}" in code for code in codes) and not any("comfuse.region" in c for c in codes)
    assert not counters["inductor"].get("cudagraph_skips")
    x.grad = None
    model.zero_grad()
    ref = model(x, r)
    (ref * g).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    got, want = torch.cat([gx.flatten(), gw.flatten()]), torch.cat([x.grad.flatten(), model.lin.weight.grad.flatten()])
    assert (got - want).norm() / want.norm() < 1e-4
    assert all(torch.equal(a, again[0]) for a in again)
    torch.testing.assert_close(again[0], ref.detach(), rtol=1e-4, atol=1e-4)


def test_an_rmsnorm_written_with_mean_fuses_after_its_gemm():
    """Inductor's graphs keep ``aten.mean.dim`` (Llama's RMSNorm: ``x.pow(2).mean(-1)``); the
    pass captures each graph again with comfuse's decompositions, so the mean is a sum over N
    divided by N and the norm joins the output projection's region, forward and training."""
    class ProjNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 48, bias=False)
            self.weight = torch.nn.Parameter(torch.rand(48) + 0.5)

        def forward(self, x, r):
            h = (self.lin(x) + r).float()
            return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.manual_seed(0)
    model = ProjNorm().to(DEVICE)
    x, r = torch.randn(2, 5, 32, device=DEVICE, requires_grad=True), torch.randn(2, 5, 48, device=DEVICE)
    with torch.no_grad():
        backend_reports.REPORTS.clear()
        out = compiled(model)(x, r)
        (region,) = last_report().regions
        assert region.fused and "rsqrt" in region.ir and "sum[N]" in region.ir, region.ir
        torch.testing.assert_close(out, model(x, r), rtol=1e-4, atol=1e-5)
    cm = compiled(model)
    g = torch.randn(2, 5, 48, device=DEVICE)
    (cm(x, r) * g).sum().backward()
    got = torch.cat([x.grad.flatten(), model.lin.weight.grad.flatten(), model.weight.grad.flatten()])
    x.grad, model.lin.weight.grad, model.weight.grad = None, None, None
    (model(x, r) * g).sum().backward()
    want = torch.cat([x.grad.flatten(), model.lin.weight.grad.flatten(), model.weight.grad.flatten()])
    assert (got - want).norm() / want.norm() < 1e-4


def test_inside_inductor_only_plans_its_wrapper_launches_are_timed(monkeypatch):
    """Of a region's candidates for the GPU, the backend times only the Triton plans
    Inductor launches itself (no Gluon, TMA or persistent plan), unless none is, the
    region is kept fused for memory (a loss over a vocabulary), or its GEMM is long enough
    that the operator's host time does not count (an LM head)."""
    from comfuse.frontend import capture, find_regions
    from comfuse.kernel_node import launchable, why_plan_not_launched
    from comfuse.planner import candidates
    from comfuse.runtime import tuning
    bf = torch.bfloat16
    x, w, r = torch.randn(256, 128, dtype=bf), torch.randn(128, 512, dtype=bf), torch.randn(256, 512, dtype=bf)
    (region,) = find_regions(capture(lambda x, w, r: F.layer_norm(x @ w + r, (512,)), (x, w, r)))
    plans = candidates(region.region, target="cuda")
    kept = launchable(plans, region.region)
    assert kept and len(kept) < len(plans)
    assert all(p.schedule in ("tile", "row_in_cta", "cooperative", "split") and p.mainloop == "pointer" for p in kept)
    dropped = [p for p in plans if p not in kept]
    assert {p.schedule for p in dropped} & {"ws_stages", "ws_strip"} and any(p.mainloop == "tma" for p in dropped)
    assert all(why_plan_not_launched(p) for p in dropped)
    gluon_only = [p for p in plans if p.schedule.startswith("ws_")]
    assert launchable(gluon_only, region.region) == gluon_only  # nothing launchable: all stay
    monkeypatch.setattr(tuning, "MEMORY_FIRST_BYTES", 1)  # a per-row output over a "huge" row
    t = torch.randint(0, 512, (256,))
    (ce,) = find_regions(capture(lambda x, w, t: F.cross_entropy(x @ w, t), (x, w, t)))
    ce_plans = candidates(ce.region, target="cuda")
    assert launchable(ce_plans, ce.region) == ce_plans
    # a split plan (the slices' kernel, then the combine kernel) is two kernel nodes Inductor launches
    monkeypatch.setattr(tuning, "MEMORY_FIRST_BYTES", 1 << 40)
    split = [p for p in launchable(ce_plans, ce.region) if p.schedule == "split"]
    assert split and all(p.mainloop == "pointer" for p in split)
    from comfuse import kernel_node
    monkeypatch.setattr(kernel_node, "HEAVY_MS", 1e-6)  # this small head counts as an 8192 x 32000 one
    assert launchable(ce_plans, ce.region) == ce_plans and launchable(plans, region.region) == plans


@pytest.mark.gpu
def test_checked_regions_replay_in_cuda_graphs():
    """COMFUSE_CHECK compares each launch with the reference in Python, so the region runs
    through the region operator; under CUDA-graph capture it launches without comparing (no
    host copy or synchronisation may be captured), and the replays match eager."""
    torch.manual_seed(0)
    model = PostNorm(d=256, h=512).cuda()
    x, r = torch.randn(4, 96, 256, device="cuda"), torch.randn(4, 96, 512, device="cuda")
    with settings.override(check=True, schedule="row_in_cta"), torch.no_grad():
        cm = compiled(model, mode="reduce-overhead")
        outs = [cm(x, r).clone() for _ in range(5)]
        ref = model(x, r)
    report = last_report()
    assert any(reg.fused for reg in report.regions), str(report)
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_a_region_fed_by_another_is_tuned_at_compile_time(monkeypatch):
    """Two regions in a row (a GEMM + LayerNorm whose output is the next GEMM's operand): the
    pass runs each on random inputs shaped like its arguments, the second's first argument
    being the first region's output, and the graph matches eager."""
    from comfuse.runtime import tuning
    monkeypatch.setattr(tuning, "load", lambda k: None)
    monkeypatch.setattr(tuning, "store", lambda k, d: None)
    ran = []
    real_decide = tuning.decide
    monkeypatch.setattr(tuning, "decide", lambda names, *a, **k: ran.append(len(names)) or real_decide(names, *a, **k))
    torch.manual_seed(0)
    w1, w2 = torch.randn(32, 48, device=DEVICE), torch.randn(48, 40, device=DEVICE)

    def fn(x):
        h = F.layer_norm(x @ w1, (48,))
        return torch.softmax(h @ w2, -1)
    x = torch.randn(16, 32, device=DEVICE)
    with settings.override(strict=True), torch.no_grad():
        out = compiled(fn, options={"autotune": "1", "graph_check": "0", "disable": "b2b"})(x)
    assert len(ran) == 2, str(last_report())  # (both decided now; on the interpreter the ops win)
    torch.testing.assert_close(out, fn(x), rtol=1e-4, atol=1e-5)


def _fake_cuda_graph(monkeypatch, fn):
    """(``fn`` traced on fake CUDA tensors x [64, 2000], w [2000, 128], r [64, 128], bf16, as a
    graph Inductor would lower; the inputs), on a CPU that plays an H200 (132 SMs)."""
    import functools

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    import comfuse.pipeline as pipeline_mod
    from comfuse.runtime import launch
    monkeypatch.setattr(launch, "_cuda_available", lambda: True)
    monkeypatch.setattr(pipeline_mod, "sm_count", functools.cache(lambda device=None: 132))
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = [torch.empty(*s, device="cuda", dtype=torch.bfloat16) for s in ((64, 2000), (2000, 128), (64, 128))]
        return make_fx(fn)(*inputs), inputs


def test_a_kernel_inductor_launches_asks_for_the_exact_strides_it_was_built_for(monkeypatch):
    """A fused region's kernel launched from Inductor's wrapper takes its tensors' strides as
    constants; its node carries the values it was built for (``eager_input_vals``), so that
    Inductor hands it buffers with exactly those strides rather than any buffer of the same
    stride order (rows of 2000 bf16 elements, which Inductor may pad for alignment). Built
    for CUDA tensors on the CPU: fake tensors, the kernel generated, not run."""
    from comfuse.inductor_pass import lower
    gm, inputs = _fake_cuda_graph(monkeypatch, lambda x, w, r: torch.relu(x @ w + r))

    def tuned(fused):  # (as if its first call on the GPU had checked it)
        for n in fused.graph.nodes:
            if n.op == "call_module":
                fused.get_submodule(n.target).tuned.add(torch.device("cuda", 0))
    with comfuse.settings.override(check=False, autotune="0", schedule="tile"):
        lowered = lower(gm, inputs, tune=tuned)
    assert lowered.report.regions[0].launch == "Inductor's wrapper launches the kernel"
    (node,) = [n for n in lowered.gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    args, kwargs = node.meta["eager_input_vals"]
    assert args == () and set(kwargs) == set(node.kwargs)
    # in fx's immutable containers, as Dynamo records them: Inductor's rewrites of the node
    # match their structure against the node's own (plain dicts failed BERT's lowering on the
    # H200: "Type mismatch; expected immutable_dict, but got dict")
    from torch.fx.immutable_collections import immutable_dict
    assert type(kwargs) is immutable_dict and type(kwargs["kwargs"]) is immutable_dict
    assert kwargs["kernel_idx"] is None  # (what is not a node carries no value)
    built = {name: (v.shape, v.stride()) for name, v in kwargs["kwargs"].items()}
    graph = {name: (n.meta["val"].shape, n.meta["val"].stride()) for name, n in node.kwargs["kwargs"].items()}
    assert built == graph and (torch.Size([64, 2000]), (2000, 1)) in built.values()


@pytest.mark.parametrize("shape,strides,dtype", [
    ((16384, 30522), (30522, 1), torch.bfloat16), ((30522, 16384), (1, 30522), torch.bfloat16),
    ((512, 2000), (2000, 1), torch.bfloat16), ((512, 768), (768, 1), torch.bfloat16),
    ((12, 512, 1000), (512000, 1000, 1), torch.bfloat16), ((8, 1031, 1500), (1546500, 1500, 1), torch.float32),
    ((4, 300), (300, 1), torch.float32), ((2000, 3), (1, 2000), torch.float16)])
def test_the_strides_inductor_pads_a_buffer_to_are_predicted(shape, strides, dtype):
    """``kernel_node.padded_strides`` gives what Inductor's own comprehensive padding gives a
    buffer of that shape, stride order and dtype."""
    from torch._inductor.ir import Layout

    from comfuse.kernel_node import padded_strides
    want = tuple(Layout._pad_strides(list(strides), list(shape), dtype))
    assert padded_strides(shape, strides, dtype.itemsize) == want


def test_a_region_reading_a_buffer_inductor_pads_runs_through_the_operator(monkeypatch):
    """A region whose A operand is computed in the graph with rows Inductor pads for alignment
    (2000 bf16 elements) is not handed to Inductor's wrapper, which would copy the buffer to the
    strides the kernel was built for before every launch: the region operator takes it as laid
    out, and the report says why. Autotuning's random inputs get the padded strides. Built for
    CUDA tensors on the CPU: fake tensors, the kernel generated, not run."""
    from comfuse.inductor_pass import lower
    from comfuse.kernel_node import inductor_strides, padded_by_inductor
    gm, inputs = _fake_cuda_graph(monkeypatch, lambda x, w, r: torch.relu((x * 2 + 1) @ w + r))
    seen = []

    def tuned(fused):  # (as if its first call on the GPU had checked it)
        for n in fused.graph.nodes:
            if n.op == "call_module":
                seen.extend(a for a in n.args if padded_by_inductor(a))
                fused.get_submodule(n.target).tuned.add(torch.device("cuda", 0))
    with comfuse.settings.override(check=False, autotune="0", schedule="tile"):
        lowered = lower(gm, inputs, tune=tuned)
    (region,) = lowered.report.regions
    assert region.fused and region.launch.startswith("through the comfuse::region operator (Inductor pads"), \
        region.launch
    assert [inductor_strides(a.meta["val"]) for a in seen] == [(2048, 1)]
    assert any(n.target is torch.ops.comfuse.region.default for n in lowered.gm.graph.nodes)


def test_only_whole_buffers_are_predicted_padded():
    """Broadcasts, slices and anything dense already aligned keep their strides; a transposed
    buffer is padded along its rows as Inductor pads the buffer it views."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from comfuse.kernel_node import inductor_strides
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(64, 2000, device="cuda", dtype=torch.bfloat16)
        assert inductor_strides(x) == (2048, 1)
        assert inductor_strides(x.t()) == (1, 2048)
        sliced = torch.empty_strided((64, 1000), (2000, 1), device="cuda", dtype=torch.bfloat16)
        assert inductor_strides(sliced) is None  # (a slice: not a buffer's own layout)
        assert inductor_strides(torch.empty_strided((64, 2000), (0, 1), device="cuda")) is None  # (a broadcast)
        assert inductor_strides(torch.empty(64, 2048, device="cuda", dtype=torch.bfloat16)) is None
        assert inductor_strides(torch.empty(64, 2000)) is None  # (Inductor pads on a GPU only)


def test_autotunings_random_inputs_hold_masks_both_ways():
    """The random tensors a region is tuned on inside the backend: normal floats, zero indices
    (valid anywhere) and booleans of both values. An all-false mask (cross-entropy's
    ``target != ignore_index``) zeroes the loss in kernel and ops alike, so comparing them
    would check nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from comfuse.inductor_pass import random_like
    with FakeTensorMode():
        fakes = (torch.empty(4096, dtype=torch.bool), torch.empty(64, 32), torch.empty(64, dtype=torch.int64))
    mask, x, index = (random_like(v) for v in fakes)
    assert 0 < int(mask.sum()) < mask.numel()
    assert x.std() > 0.5 and not torch.equal(x, torch.zeros_like(x))
    assert int(index.abs().sum()) == 0
    assert random_like(3) == 3


@pytest.mark.parametrize("fallback", ["disabled", "kernel fails"])
def test_a_region_running_its_ops_lays_out_wide_rows_as_its_kernel_does(fallback, monkeypatch):
    """An LM head whose vocabulary is no multiple of the row alignment (GPT-2's 50257): its
    kernel writes the logits in rows padded for alignment, and Inductor compiles the graph for
    those strides. Where the ops run in the kernel's place (comfuse disabled, or the kernel
    failing at a call), their packed logits are laid out the same way, not a crash on
    Inductor's stride assertion."""
    from comfuse.runtime.region import FusedRegion

    def head(x, w, t):
        logits = x @ w
        return logits, F.cross_entropy(logits.float(), t)
    x, w = torch.randn(16, 32, device=DEVICE), torch.randn(32, 1027, device=DEVICE) / 8
    t = torch.randint(0, 1027, (16,), device=DEVICE)
    want = head(x, w, t)
    if fallback == "kernel fails":
        def broken(self, *a, **k):
            raise RuntimeError("launch failed")
        monkeypatch.setattr(FusedRegion, "run", broken)
    with comfuse.settings.override(disable=fallback == "disabled"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = compiled(head)(x, w, t)
    assert last_report().regions[0].anchor == "mm"
    assert fallback == "disabled" or any("launch failed" in str(x.message) for x in seen)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,first", [((5, 3, 12), 9), ((70, 8), 1), ((6,), 4), ((2, 1, 4, 40), 3)])
def test_a_padded_products_columns_are_zeroed_by_a_launch_of_their_own(shape, first):
    """The padded columns of a product a region writes whole are zeroed by a bound kernel (so a
    replay repeats it with the region's launches): exactly those columns, whatever the leading
    dimensions, and a view whose rows have no single stride by the tensor's own method."""
    from comfuse.runtime.pad_columns import zero_columns
    t = torch.randn(shape, device=DEVICE)
    want = t.clone()
    want[..., first:] = 0
    zero_columns(t, first)
    assert torch.equal(t, want)
    strided = torch.randn(4, 6, 10, device=DEVICE).transpose(0, 1)  # (rows at two strides)
    want = strided.clone()
    want[..., first % 10:] = 0
    zero_columns(strided, first % 10)
    assert torch.equal(strided, want)
