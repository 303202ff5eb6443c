"""Training steps of the Hugging Face blocks under comfuse's backend against Inductor (issue 6).

Issue 6 asks that a training step (forward + backward) of the BERT-base encoder layer (batch
32, seq 512) and the Llama-style MLP (hidden 4096) be no slower than Inductor's, with
gradients within tolerance. For each block (random weights, dropout off, bf16) this script
builds one copy per candidate (eager, torch.compile default, max-autotune-no-cudagraphs,
``backend="comfuse"``), checks every candidate's output, input gradient and weight
gradients against a float64 copy, then times one step (zero grads, forward, backward with
a fixed random cotangent) with ``do_bench`` medians, in rounds whose order alternates.

    python scripts/model_train_bench.py [--models bert_layer,llama_mlp] [--rounds 2]
    python scripts/model_train_bench.py --small --device cpu        # the same, tiny, on a CPU
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comfuse  # noqa: E402,F401  (registers the backend)
from comfuse.bench.timing import measure  # noqa: E402

CANDIDATES = ("eager", "inductor", "inductor-max-autotune", "comfuse-backend")


def block(name: str, small: bool, device, dtype):
    """(module, input) for one of the issue's blocks, random weights, training mode."""
    torch.manual_seed(0)
    if name == "bert_layer":
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertLayer
        h, heads, inter, batch, seq = (64, 4, 128, 2, 16) if small else (768, 12, 3072, 32, 512)
        cfg = BertConfig(hidden_size=h, num_attention_heads=heads, intermediate_size=inter,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        cfg._attn_implementation = "sdpa"
        module, shape = BertLayer(cfg), (batch, seq, h)
    elif name == "llama_mlp":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP
        h, inter, tokens = (64, 128, 32) if small else (4096, 11008, 4096)
        module, shape = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=inter)), (tokens, h)
    else:
        raise SystemExit(f"unknown model {name!r}: bert_layer or llama_mlp")
    return module.train().to(device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)


def first(out):
    return out[0] if isinstance(out, tuple) else out


def step_fn(model, x, cot):
    """One training step's GPU work: forward, backward with cotangent ``cot``."""
    def step():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        first(model(x)).backward(cot)
    return step


def grads(model, x):
    return [x.grad] + [p.grad for p in model.parameters()]


def worst_error(got: list, ref: list) -> float:
    """The largest difference over all gradients, each relative to its tensor's largest
    float64 value, or to 1e-3 of the largest over all when that is bigger: gradients that
    are zero in exact arithmetic (an attention key bias) are rounding noise in any dtype."""
    floor = 1e-3 * max(r.abs().max().item() for r in ref)
    return max(((g.double() - r).abs().max() / max(r.abs().max().item(), floor)).item()
               for g, r in zip(got, ref))


def compiled(name, module):
    torch._dynamo.reset()
    if name == "eager":
        return module
    if name == "inductor":
        return torch.compile(module)
    if name == "inductor-max-autotune":
        return torch.compile(module, mode="max-autotune-no-cudagraphs")
    return torch.compile(module, backend="comfuse")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert_layer,llama_mlp")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU check)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/comfuse-out"))
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for model in args.models.split(","):
        base, x0 = block(model, args.small, args.device, dtype)
        cot = torch.randn_like(first(base(x0))).detach()
        ref_model = copy.deepcopy(base).double()
        xr = x0.detach().double().requires_grad_(True)
        first(ref_model(xr)).backward(cot.double())
        ref = grads(ref_model, xr)
        steps, errors = {}, {}
        for cand in args.candidates.split(","):
            module = copy.deepcopy(base)
            x = x0.detach().clone().requires_grad_(True)
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn = compiled(cand, module)
                step = step_fn(fn, x, cot)
                step()  # compiles (and, for comfuse and max-autotune, tunes)
            compile_s = time.perf_counter() - t0
            errors[cand] = worst_error(grads(module, x), ref)
            steps[cand] = step
            print(f"{model} {cand:24s} compiled in {compile_s:6.1f} s; worst gradient error "
                  f"{errors[cand]:.3g} (against float64)", flush=True)
            results.append({"model": model, "candidate": cand, "compile_s": compile_s,
                            "grad_rel_err": errors[cand], "times_ms": []})
        # a compiled step may lose accuracy only within bf16's noise: twice eager's, or 2 %
        bound = max(2 * errors.get("eager", 0.0), 2e-2 if dtype == torch.bfloat16 else 1e-4)
        for r in results:
            if r["model"] == model:
                r["ok"] = r["grad_rel_err"] <= bound
        for rnd in range(args.rounds):
            order = list(steps) if rnd % 2 == 0 else list(steps)[::-1]
            for cand in order:
                row = next(r for r in results if r["model"] == model and r["candidate"] == cand)
                if not row["ok"]:
                    continue
                tm = measure(steps[cand], device=args.device)
                row["times_ms"].append(tm.as_dict())
                print(f"  round {rnd} {cand:24s} {tm.median_ms:8.4f} ms", flush=True)
        del steps
    (out_dir / "model_train.json").write_text(json.dumps(results, indent=1))
    print("\n| training step (bf16) | candidate | grad err | median ms per round [q1..q3] | x Inductor |")
    print("|---|---|---|---|---|")
    for r in results:
        ind = next((q for q in results if q["model"] == r["model"] and q["candidate"] == "inductor"), None)
        med = [t["median_ms"] for t in r["times_ms"]]
        ind_med = [t["median_ms"] for t in ind["times_ms"]] if ind else []
        ratio = (f"{sum(med) / sum(ind_med):.3f}" if med and ind_med and len(med) == len(ind_med) else "-")
        times = "; ".join(f"{t['median_ms']:.3f} [{t['q1_ms']:.3f}..{t['q3_ms']:.3f}]" for t in r["times_ms"])
        print(f"| {r['model']} | {r['candidate']} | {r['grad_rel_err']:.2g}{'' if r['ok'] else ' WRONG'} | "
              f"{times or '-'} | {ratio} |")


if __name__ == "__main__":
    main()
