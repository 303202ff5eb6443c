"""DistributedDataParallel + torch.compile(backend="comfuse") on two GPUs of one host.

Run: torchrun --nproc_per_node=2 scripts/ddp_check.py OUT_DIR
Every rank trains the same small model on the same batches for a few steps (so the
averaged gradients equal one GPU's); rank 0 then trains an eager single-GPU copy and
compares the final weights. Each rank writes ddp-rank<r>.json; all share one kernel cache
(COMFUSE_CACHE_DIR), which is written atomically.
"""
import json
import os
import sys

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
        return self.norm(x + self.down(F.gelu(self.up(x))))


def train(model, steps, device, seed=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(64, 256, generator=g).to(device)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def main(out_dir):
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    base = Block().to(device)
    reference = Block().to(device)
    reference.load_state_dict(base.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(base, device_ids=[rank])
    compiled = torch.compile(ddp, backend="comfuse", dynamic=False)
    loss = train(compiled, 5, device)
    result = {"rank": rank, "loss": loss}
    if rank == 0:
        ref_loss = train(reference, 5, device)
        diff = max((a - b).abs().max().item() for a, b in zip(base.parameters(), reference.parameters()))
        result.update(reference_loss=ref_loss, max_weight_diff=diff)
    with open(os.path.join(out_dir, f"ddp-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
