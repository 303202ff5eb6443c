"""``comfuse bench --suite models``: whole Hugging Face models, compared as their users compare.

Each model is built from its config with random weights (bf16 on a GPU, fp32 on a CPU), with
labels, so its loss is part of what runs: BERT-base (``BertForMaskedLM``, 12 layers, 32 x 512
tokens), GPT-2 small (``GPT2LMHeadModel``, 12 layers, 8 x 1024) and a Llama-3-8B-shaped
block (``LlamaForCausalLM``: hidden 4096, intermediate 14336, 32 / 8 heads, vocabulary
128256, one layer, 4 x 2048). Candidates: eager; Inductor in the default,
max-autotune-no-cudagraphs and reduce-overhead modes; the comfuse backend in each of those;
and Liger-Kernel's patched model (eager, its kernels in place: Llama and Qwen2, where
``liger_kernel`` is installed).

Every (model, candidate) runs in a process of its own with empty caches (comfuse's,
Inductor's, Triton's): its first training step and first inference call from
``torch.compile`` are the cold first calls; the loss and all gradients (one vector) are
checked against eager's in that process before anything is timed; then the forward with its
loss (grad off) and the training step are timed (median and range of rounds of back-to-back
calls, host time included), with tokens a second and the peak GPU memory of each; both again
with a compiled function that returns the loss alone (an evaluation or training loop's: the
logits unused, as Liger-Kernel's patched models leave them in training), checked too. A second
process with the caches the first left gives the warm first calls. Results go to
``OUT/results.json``, the table to ``OUT/results.md``, figures beside them.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from .kernels import graph_checks, profile, regions_by_graph
from .models_report import figures, markdown

MODELS = ("bert", "gpt2", "llama8b", "llama", "qwen2", "t5", "vit")
DEFAULT_MODELS = ("bert", "gpt2", "llama8b")
DEPTH = {"bert": 12, "gpt2": 12, "llama8b": 1}  # BERT-base, GPT-2 small, one Llama-3-8B-shaped layer
MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")
FORMS = ("eager",) + tuple(f"{b}{'' if m == 'default' else '@' + m}" for b in ("inductor", "comfuse")
                           for m in MODES) + ("liger",)
LIGER = {"llama": "apply_liger_kernel_to_llama", "llama8b": "apply_liger_kernel_to_llama",
         "qwen2": "apply_liger_kernel_to_qwen2"}


def build(name: str, layers: int, small: bool = False, device: str = "cuda"):
    """(model, batch, seq, inputs(batch, seq) -> keyword arguments): at the size users run,
    or small (hidden 256, vocabulary 1024). Dropout is off, so every form computes the same."""
    import transformers as tf

    from .. import backend
    backend.quiet_library_logging()  # (GPT-2's loss then stays in its LM head's graph in every form)
    h, ff, vocab = (256, 512, 1024) if small else (None, None, None)

    def text(v):
        def inputs(batch, seq):
            ids = torch.randint(0, v, (batch, seq), device=device)
            return {"input_ids": ids, "labels": ids}
        return inputs
    if name == "gpt2":
        v = vocab or 50257
        cfg = tf.GPT2Config(n_layer=layers, n_embd=h or 768, n_head=8 if small else 12, vocab_size=v,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg), 8, 1024, text(v)
    if name == "llama":
        v = vocab or 32000
        cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=h or 2048, intermediate_size=ff or 5632,
                             num_attention_heads=8 if small else 32, num_key_value_heads=4, vocab_size=v)
        return tf.LlamaForCausalLM(cfg), 4, 2048, text(v)
    if name == "llama8b":  # a Llama-3-8B-shaped block: its widths, heads and vocabulary
        v = vocab or 128256
        cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=h or 4096, intermediate_size=ff or 14336,
                             num_attention_heads=8 if small else 32, num_key_value_heads=4 if small else 8,
                             vocab_size=v)
        return tf.LlamaForCausalLM(cfg), 4, 2048, text(v)
    if name == "qwen2":  # grouped-query attention (Qwen2-1.5B's widths)
        v = vocab or 151936
        cfg = tf.Qwen2Config(num_hidden_layers=layers, hidden_size=h or 1536, intermediate_size=ff or 8960,
                             num_attention_heads=8 if small else 12, num_key_value_heads=2, vocab_size=v)
        return tf.Qwen2ForCausalLM(cfg), 4, 2048, text(v)
    if name == "bert":
        v = vocab or 30522
        cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=h or 768, intermediate_size=ff or 3072,
                            num_attention_heads=8 if small else 12, vocab_size=v,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return tf.BertForMaskedLM(cfg), 32, 512, text(v)
    if name == "t5":
        v = vocab or 32128
        cfg = tf.T5Config(vocab_size=v, d_model=h or 512, d_kv=64, d_ff=ff or 2048, num_layers=layers,
                          num_decoder_layers=layers, num_heads=4 if small else 8, dropout_rate=0.0,
                          decoder_start_token_id=0, pad_token_id=0)
        return tf.T5ForConditionalGeneration(cfg), 8, 512, text(v)
    if name == "vit":  # no loss head: a fixed weighting of the last hidden state
        cfg = tf.ViTConfig(num_hidden_layers=layers, hidden_size=h or 768, intermediate_size=ff or 3072,
                           num_attention_heads=8 if small else 12, image_size=224, patch_size=16,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

        def pixels(batch, seq):  # (seq: the image side, a multiple of the patch)
            x = torch.randn(batch, 3, seq, seq, device=device, dtype=torch.bfloat16 if device == "cuda" else None)
            return {"pixel_values": x, "interpolate_pos_encoding": seq != cfg.image_size}
        return tf.ViTModel(cfg), 64, 224, pixels
    raise ValueError(f"unknown model {name!r}; models are gpt2, llama, llama8b, qwen2, bert, t5, vit")


def loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.dim() == 0:  # (a function that returns the loss)
        return out
    if getattr(out, "loss", None) is not None:
        return out.loss
    hidden = out.last_hidden_state
    weights = torch.linspace(-1, 1, hidden.shape[-1], device=hidden.device, dtype=hidden.dtype)
    return (hidden.float() * weights).sum() / hidden.numel()


def step(fn, model, kwargs):
    """One training step's forward and backward (no optimizer): the loss."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(fn(**kwargs))
    loss.backward()
    return loss


def grads(model) -> torch.Tensor:
    """Every parameter's gradient as one vector (zeros where a parameter got none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().flatten()
                      for p in model.parameters()])


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _sync(device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def time_ms(call, rounds: int, device: str = "cuda") -> tuple:
    """(median, min, max) ms per call over ``rounds`` rounds of back-to-back calls."""
    return time_side_by_side({"call": call}, rounds, device)["call"]


def time_side_by_side(calls: dict, rounds: int, device: str = "cuda") -> dict:
    """name -> (median, min, max) ms per call, over ``rounds`` rounds of back-to-back calls of
    each, the rounds interleaved and their order rotating: a drift of the GPU's speed over the
    run falls on every call alike, not on the one timed last."""
    from ..graph_check import time_rounds
    return {n: (statistics.median(t), min(t), max(t)) for n, t in time_rounds(calls, device, rounds).items()}


def launch_host_us(device: str = "cuda", calls: int = 2000) -> float:
    """Host microseconds of one small in-place op on ``device``, back to back with the device
    idle: how fast this process launches at that moment (compare rows: a process slowed by
    what ran in it before shows here, not in its kernels)."""
    t = torch.zeros(256, device=device)
    sync = _sync(device)
    for _ in range(50):
        t.add_(1)
    sync()
    began = time.perf_counter()
    for _ in range(calls):
        t.add_(1)
    sync()
    return round((time.perf_counter() - began) / calls * 1e6, 2)


def peak_gib(call, device: str = "cuda") -> float | None:
    """The most GPU memory allocated during one ``call``, in GiB (None off the GPU)."""
    if device != "cuda":
        call()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return round(torch.cuda.max_memory_allocated() / 2**30, 3)


def why_not(name: str, form: str, device: str) -> str:
    """Why ``form`` does not apply to ``name`` here ('' where it does)."""
    if form.endswith("reduce-overhead") and device != "cuda":
        return "CUDA graphs need a GPU"
    if form == "liger":
        if name not in LIGER:
            return "Liger-Kernel patches Llama-family models only"
        if device != "cuda":
            return "Liger-Kernel's kernels need a GPU"
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return "liger_kernel is not installed"
    return ""


def measure(name: str, form: str, layers: int, small: bool, rounds: int, device: str,
            first_calls_only: bool = False, profile_dir: str | None = None) -> dict:
    """One (model, form) in this process: first calls, checks against eager, times, memory;
    with ``profile_dir`` (a GPU), each call's kernels too (``kernels.profile``)."""
    import comfuse  # noqa: F401  (registers the backend)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, batch, seq, inputs = build(name, layers, small, device)
    model = model.to(device, dtype)
    if small:
        batch, seq = 2, (64 if name == "vit" else 128)
    kwargs = inputs(batch, seq)
    row = {"model": name, "form": form, "layers": layers, "batch": batch, "seq": seq, "small": small,
           "dtype": str(dtype).removeprefix("torch.")}
    want = step(model, model, kwargs).float()
    want_grads = grads(model)
    if form == "liger":
        import liger_kernel.transformers as liger
        getattr(liger, LIGER[name])()  # (patches the model's classes, as its users do, before building)
        state = model.state_dict()
        model = build(name, layers, small, device)[0].to(device, dtype)
        model.load_state_dict(state)
    def loss_only(**kw):  # a training loop's step: the loss alone leaves the function, not the logits
        return loss_of(model(**kw))
    sync = _sync(device)
    row["launch_host_us"] = {"start": launch_host_us(device)}
    began = time.perf_counter()
    if form in ("eager", "liger"):
        run, run_loss = model, loss_only
    else:
        backend, _, mode = form.partition("@")
        options = {"backend": backend, **({"mode": mode} if mode else {})}
        run, run_loss = torch.compile(model, **options), torch.compile(loss_only, **options)
    loss = step(run, model, kwargs).detach().float()
    sync()
    row["first_step_s"] = round(time.perf_counter() - began, 2)
    row["loss_rel_err"] = float((loss - want).abs() / want.abs())
    row["grads_rel_err"] = rel(grads(model), want_grads)
    began = time.perf_counter()
    with torch.no_grad():
        run(**kwargs)
    sync()
    row["first_forward_s"] = round(time.perf_counter() - began, 2)
    if first_calls_only:
        return row
    row["launch_host_us"]["timed"] = launch_host_us(device)  # (after the first calls: compilation, tuning)
    with torch.no_grad():
        row["forward_ms"] = time_ms(lambda: run(**kwargs), rounds, device)
        row["forward_peak_gib"] = peak_gib(lambda: run(**kwargs), device)
    row["step_ms"] = time_ms(lambda: step(run, model, kwargs), rounds, device)
    row["step_peak_gib"] = peak_gib(lambda: step(run, model, kwargs), device)
    with torch.no_grad():  # (an evaluation loop's call: the loss alone, no gradient)
        row["loss_forward_ms"] = time_ms(lambda: run_loss(**kwargs), rounds, device)
    loss = step(run_loss, model, kwargs).detach().float()
    row["loss_step_rel_err"] = [float((loss - want).abs() / want.abs()), rel(grads(model), want_grads)]
    row["loss_step_ms"] = time_ms(lambda: step(run_loss, model, kwargs), rounds, device)
    row["loss_step_peak_gib"] = peak_gib(lambda: step(run_loss, model, kwargs), device)
    if profile_dir and device == "cuda":
        tag = f"{name}-{form}"
        with torch.no_grad():
            row["profile"] = {"forward": profile(f"{tag}-forward", lambda: run(**kwargs), profile_dir)}
        row["profile"]["step"] = profile(f"{tag}-step", lambda: step(run, model, kwargs), profile_dir)
        row["profile"]["loss_step"] = profile(f"{tag}-loss-step", lambda: step(run_loss, model, kwargs), profile_dir)
    if form.startswith("comfuse"):
        row["regions"], row["graph_checks"] = regions_by_graph(), graph_checks()
    return row


def _child(args: list, env: dict, log: Path | None = None, limit: float = 0) -> dict:
    """One ``measure`` in a process of its own: its row, or {"error": the exception's line}.
    ``log``: where its stderr goes (comfuse's log, warnings, a traceback). ``limit``: seconds
    after which the process and its own (compile workers) are stopped (0: none)."""
    child = subprocess.Popen([sys.executable, "-m", "comfuse.bench.models", *args], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    stopped = False
    try:
        stdout, stderr = child.communicate(timeout=limit or None)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
        stopped = True
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(stderr)
    if stopped:
        return {"error": f"stopped after {limit:g} s (the row limit)"}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if child.returncode or not lines:
        return {"error": error_line(stderr)}
    return json.loads(lines[-1])


def error_line(stderr: str) -> str:
    """What a failed child raised: the exception's line after its last traceback (what
    follows it, such as a debugging hint, is left out), else the last line printed."""
    lines = stderr.strip().splitlines() or ["no output"]
    last = max((i for i, line in enumerate(lines) if line.startswith("Traceback")), default=len(lines))
    raised = [line for line in lines[last + 1:] if re.match(r"[\w.]+(Error|Exception|Interrupt|Exit)\b", line)]
    return " ".join((raised[0] if raised else lines[-1]).split())[:300]


def run(models=DEFAULT_MODELS, forms=FORMS, out_dir="bench/results/latest", layers: int | None = None,
        small: bool = False, rounds: int = 5, warm: bool = True, device: str = "auto", progress=print,
        resume: bool = False, row_limit: float = 0, profile: bool = False) -> dict:
    """Every (model, form) in processes of their own (``measure``), cold then warm; the results,
    also written to ``out_dir``/results.json after each, each process's log to
    ``out_dir``/logs/ (comfuse's at COMFUSE_LOG=info unless set). ``resume``: keep the rows
    of ``out_dir``/results.json that ran without error (measured on the same GPU and
    software), run only the others asked for, and keep the earlier rows of models and forms
    not asked for, so that a long suite can run as several shorter commands.
    ``row_limit``: seconds a process may take (0: no limit); one stopped is a row with that error.
    ``profile``: each call's kernels too, tables in ``out_dir``/profiles/ (a GPU)."""
    from .env import environment
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise SystemExit(f"unknown candidates {unknown} for --suite models; choose from {', '.join(FORMS)}")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise SystemExit(f"unknown models {unknown} for --suite models; choose from {', '.join(MODELS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {"meta": dict(environment(device), suite="models", small=small, rounds=rounds), "rows": []}
    done = _resumed(out / "results.json", results["meta"]) if resume else {}
    depths = {name: layers or (1 if small else DEPTH.get(name, 2)) for name in models}
    asked = {(name, form, depths[name]) for name in models for form in forms}
    results["rows"] = [row for key, row in done.items() if key not in asked]  # (other models' and forms')
    for name in models:
        depth = depths[name]
        for form in forms:
            row = {"model": name, "form": form, "layers": depth}
            if (name, form, depth) in done:
                results["rows"].append(done[name, form, depth])
                continue
            why = why_not(name, form, device)
            if why:
                results["rows"].append({**row, "skipped": why})
                continue
            caches = out / "caches" / f"{name}-{form}"
            shutil.rmtree(caches, ignore_errors=True)
            env = dict(os.environ, COMFUSE_CACHE_DIR=str(caches / "comfuse"), TRITON_CACHE_DIR=str(caches / "triton"),
                       TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"))
            env.setdefault("COMFUSE_LOG", "info")
            log = out / "logs" / f"{name}-{form.replace('@', '-')}"
            args = ["--child", name, "--form", form, "--layers", str(depth), "--rounds", str(rounds),
                    "--device", device] + (["--small"] if small else [])
            progress(f"{name} ({depth} layer{'' if depth == 1 else 's'}), {form}: cold ...")
            row.update(_child(args + (["--profile-dir", str(out)] if profile else []), env, log.with_suffix(".log"),
                              row_limit))
            if warm and form not in ("eager", "liger") and "error" not in row:
                progress(f"{name}, {form}: warm, in a new process ...")
                again = _child(args + ["--first-calls-only"], env, log.with_name(log.name + "-warm.log"), row_limit)
                row["warm"] = {k: again[k] for k in ("first_step_s", "first_forward_s", "error") if k in again}
            shutil.rmtree(caches, ignore_errors=True)
            results["rows"].append(row)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def _resumed(path: Path, meta: dict) -> dict:
    """(model, form, layers) -> row, for the rows of an earlier run at ``path`` that ran
    without error; SystemExit where it ran on another GPU or other software, or at other
    sizes or rounds (its rows would not compare with this run's)."""
    if not path.exists():
        return {}
    before = json.loads(path.read_text())
    then = before.get("meta", {})
    differ = [k for k in ("gpu", "torch", "triton", "small", "rounds") if then.get(k) != meta.get(k)]
    if differ:
        raise SystemExit(f"--resume: {path} was measured with other {', '.join(differ)} "
                         f"({', '.join(str(then.get(k)) for k in differ)}); choose another --out")
    return {(r["model"], r["form"], r["layers"]): r for r in before.get("rows", [])
            if "error" not in r and "skipped" not in r}


def write(results: dict, out_dir) -> list:
    out = Path(out_dir)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    return [out / "results.json", out / "results.md", *figures(results, out)]


def _main(argv: list) -> None:
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", required=True)
    parser.add_argument("--form", required=True)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--first-calls-only", action="store_true")
    parser.add_argument("--profile-dir", default=None)
    a = parser.parse_args(argv)
    print(json.dumps(measure(a.child, a.form, a.layers, a.small, a.rounds, a.device, a.first_calls_only,
                             a.profile_dir)), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
