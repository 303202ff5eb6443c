"""Whole Hugging Face models through ``torch.compile(backend="comfuse")`` against Inductor, on a GPU.

For each model (built from a config, random weights, bf16, labels given so the loss is part of
the graph): eager's loss and gradients as the reference; then Inductor's default mode and
comfuse's backend, each compiled afresh: the first call's seconds (forward and backward), the
loss and all gradients as one vector against eager's, the forward (with loss) and the training
step in ms (median of rounds of back-to-back calls, host time included) and, for comfuse, the
regions fused in the forward and backward graphs. One JSON line per model and form goes to
``$OUT/models_check.jsonl``, the table to ``$OUT/results.md`` and, last, to stdout.

    python scripts/models_check.py [--models gpt2,llama,bert] [--layers 2] [--rounds 5]
        [--forms inductor,comfuse,comfuse-op]
    python scripts/models_check.py --report models_check.jsonl   # the table again
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402,F401  (registers the backend)
from comfuse import inductor_pass  # noqa: E402


def build(name: str, layers: int):
    import transformers as tf
    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg), (8, 1024), 50257
    if name == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=2048, intermediate_size=5632,
                             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
        return tf.LlamaForCausalLM(cfg), (4, 2048), 32000
    if name == "bert":
        cfg = tf.BertConfig(num_hidden_layers=layers, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return tf.BertForMaskedLM(cfg), (32, 512), cfg.vocab_size
    raise ValueError(name)


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def step(fn, model, ids):
    model.zero_grad(set_to_none=True)
    loss = fn(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def time_ms(call, rounds: int) -> tuple:
    call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    reps = max(3, min(20, int(0.3 / max(time.perf_counter() - t0, 1e-6))))
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(out), min(out), max(out)


def run(name: str, layers: int, rounds: int, out, forms) -> list:
    torch.manual_seed(0)
    model, (batch, seq), vocab = build(name, layers)
    model = model.to("cuda", torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    ref_loss = step(model, model, ids).float()
    ref_grads = grads(model)
    rows = []
    for form in forms:
        torch._dynamo.reset()
        inductor_pass.REPORTS.clear()
        inductor_pass.LAUNCH_FROM_INDUCTOR = form != "comfuse-op"
        backend = "inductor" if form == "inductor" else "comfuse"
        row = {"model": name, "layers": layers, "tokens": batch * seq, "form": form}
        try:
            cm = torch.compile(model, backend=backend)
            t0 = time.perf_counter()
            loss = step(cm, model, ids).float()
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - t0, 1)
            got = grads(model)
            row["loss_rel_err"] = float((loss - ref_loss).abs() / ref_loss.abs())
            row["grads_rel_err"] = float((got - ref_grads).norm() / ref_grads.norm())
            with torch.no_grad():
                cm(input_ids=ids, labels=ids)  # (the inference graph compiles here)
                row["forward_ms"] = time_ms(lambda: cm(input_ids=ids, labels=ids), rounds)
            row["step_ms"] = time_ms(lambda: step(cm, model, ids), rounds)
            if form != "inductor":
                row["regions"] = [f"{r.function}: {sum(x.fused for x in r.regions)}/{len(r.regions)} fused, "
                                  f"{sum(x.fused and x.launch.startswith('Inductor') for x in r.regions)} "
                                  "launched by Inductor" for r in inductor_pass.REPORTS if r.regions]
                row["schedules"] = sorted({x.schedule for r in inductor_pass.REPORTS for x in r.regions if x.fused})
                row["graph_checks"] = list(comfuse.backend.GRAPH_CHECKS)
        except Exception as e:  # reported, not hidden
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), file=out, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--report", default="", help="only write the table of this JSONL file to stdout")
    ap.add_argument("--forms", default="inductor,comfuse",
                    help="inductor, comfuse, comfuse-op (every region through the comfuse::region operator)")
    args = ap.parse_args()
    if args.report:
        print(markdown([json.loads(line) for line in open(args.report) if line.strip()]), end="")
        return
    out_dir = Path(os.environ.get("OUT", "/tmp/comfuse-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(out_dir / "models_check.jsonl", "a") as out:
        for name in args.models.split(","):
            rows += run(name, args.layers, args.rounds, out, args.forms.split(","))
    table = markdown(rows)
    (out_dir / "results.md").write_text(table)
    print(table)


def markdown(rows: list) -> str:
    """The rows as a table (what ``--report`` writes again from a JSONL file)."""
    lines = ["| model | form | first call s | forward ms [range] | step ms [range] | loss rel err | "
             "grads rel err | regions |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda t: f"{t[0]:.3f} [{t[1]:.3f}..{t[2]:.3f}]" if t else "-"  # noqa: E731
        note = r.get("error") or "; ".join(r.get("regions", []))
        if r.get("schedules"):
            note += f" (schedules: {', '.join(r['schedules'])})"
        lines.append(f"| {r['model']} | {r['form']} | {r.get('first_call_s', '-')} | {fmt(r.get('forward_ms'))} | "
                     f"{fmt(r.get('step_ms'))} | {r.get('loss_rel_err', float('nan')):.2e} | "
                     f"{r.get('grads_rel_err', float('nan')):.2e} | {note} |")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
