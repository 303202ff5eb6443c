"""Training under DistributedDataParallel or FSDP2 with torch.compile, checked against one
process and timed per rank.

Run: torchrun --nproc_per_node=2 scripts/distributed_check.py OUT_DIR [--engine ddp|fsdp2]
     [--model block|llama|gpt2] [--backend comfuse|inductor] [--steps N] [--tiny] [--device cuda|cpu]

Every rank builds the same model (one seed) and trains it for --steps SGD steps on fixed
batches, each rank on its share of every batch, so the averaged gradients are one process's
on the whole batch. FSDP2 shards each transformer layer and then the root (``fully_shard``).
Rank 0 then trains an eager copy in one process on the whole batches and compares the
parameters (gathered under FSDP2) as one vector. Each rank writes OUT_DIR/<engine>-<model>-
<backend>-rank<r>.json: the first call's seconds (compilation included), the median and range
of the later steps' milliseconds, peak memory, the last loss, and on rank 0 the parameters'
relative difference from one process's. All ranks share one kernel cache (COMFUSE_CACHE_DIR),
written atomically. Models: ``block`` (Linear-GELU-Linear + residual + LayerNorm), ``llama``
(LlamaForCausalLM, one Llama-3-8B-shaped layer: 4096 / 14336, 32 / 8 heads, vocabulary
128256, with its loss), ``gpt2`` (GPT-2 small with its loss, dropout off: the ranks would
draw other masks than one process); ``--tiny`` shrinks each to a
few hundred thousand parameters (a CPU dry run, gloo).
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import comfuse  # noqa: F401  (registers the backend)


class Block(torch.nn.Module):
    def __init__(self, d=256, h=1024):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, h), torch.nn.Linear(h, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.down(F.gelu(self.up(x)))).square().mean()


def build(name: str, tiny: bool):
    """(the model, its transformer layers (FSDP2 shards each), the batch maker: a generator ->
    the keyword inputs of one batch of the whole world, split along dim 0 by ``share``)."""
    if name == "block":
        d = 16 if tiny else 256
        model = Block(d, 4 * d)
        return model, [], lambda g: {"x": torch.randn(8 if tiny else 4096, d, generator=g)}
    import transformers
    if name == "llama":
        cfg = (dict(hidden_size=64, intermediate_size=224, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=512) if tiny else
               dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=128256))
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=1, **cfg))
        layers, vocab, seq = list(model.model.layers), cfg["vocab_size"], 16 if tiny else 2048
    elif name == "gpt2":
        cfg = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512) if tiny else dict()
        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # (ranks draw other masks)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg, **no_dropout))
        layers, vocab, seq = list(model.transformer.h), model.config.vocab_size, 16 if tiny else 1024
    else:
        raise SystemExit(f"unknown model {name!r}: block, llama or gpt2")

    def batch(g):
        ids = torch.randint(0, vocab, (4 if tiny else 8, seq), generator=g)
        return {"input_ids": ids, "labels": ids}
    return model, layers, batch


def loss_of(model, inputs):
    out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.loss


def train(model, make_batch, steps, device, share=None):
    """``steps`` SGD steps; (the losses, the seconds of each step, synchronised)."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, seconds = [], []
    for _ in range(steps):
        inputs = make_batch(g)
        if share is not None:
            rank, world = share
            inputs = {k: v.chunk(world)[rank] for k, v in inputs.items()}
        inputs = {k: v.to(device) for k, v in inputs.items()}
        t0 = time.perf_counter()
        loss = loss_of(model, inputs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, seconds


def flat(params) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().flatten()
                      for p in params])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--engine", default="ddp", choices=["ddp", "fsdp2"])
    ap.add_argument("--model", default="block", choices=["block", "llama", "gpt2"])
    ap.add_argument("--backend", default="comfuse", choices=["comfuse", "inductor"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    args = ap.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if args.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model, layers, make_batch = build(args.model, args.tiny)
    reference = None
    if rank == 0:  # (the same seed: the same initial parameters)
        torch.manual_seed(0)
        reference = build(args.model, args.tiny)[0].to(device)
    model = model.to(device)
    if args.engine == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.index is not None
                                                            else None)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    trained = torch.compile(wrapped, backend="comfuse" if args.backend == "comfuse" else "inductor")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, seconds = train(trained, make_batch, args.steps, device, share=(rank, world))
    later = [s * 1e3 for s in seconds[1:]] or [float("nan")]
    result = {"rank": rank, "world": world, "engine": args.engine, "model": args.model, "backend": args.backend,
              "tiny": args.tiny, "device": str(device), "torch": torch.__version__,
              "first_call_s": seconds[0], "step_ms": statistics.median(later),
              "step_ms_range": [min(later), max(later)], "losses": losses,
              "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
              "regions_fused": sum(len(r.fused) for r in comfuse.backend.REPORTS)}
    params = flat(model.parameters())  # (every rank joins FSDP2's gathers)
    if rank == 0:
        ref_losses, _ = train(reference, make_batch, args.steps, device)
        want = flat(reference.parameters())
        result.update(reference_losses=ref_losses,
                      parameter_difference=((params - want).norm() / want.norm()).item())
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.engine}-{args.model}-{args.backend}-rank{rank}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
