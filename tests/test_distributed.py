"""torch.compile(backend="comfuse") under PyTorch's distributed engines, on the CPU: two
processes (gloo), a small block with a fused region, trained two steps under
DistributedDataParallel and under FSDP2 (``fully_shard``); the trained parameters equal one
process's eager training on the whole batch. Both ranks share one kernel cache (the test's)."""
import json
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import comfuse
from comfuse import backend

WORLD = 2
STEPS = 2


class Block(torch.nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.up, self.down, self.norm = torch.nn.Linear(d, h), torch.nn.Linear(h, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.down(F.gelu(self.up(x))))


def _train(model, rank=None):
    """STEPS of SGD on fixed batches of 8 rows; a rank takes its share of each batch."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        if rank is not None:
            x = x.chunk(WORLD)[rank]
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _rank(rank, engine, rendezvous, out):
    warnings.filterwarnings("error", category=comfuse.FallbackWarning)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model = Block()
        if engine == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            trained = torch.compile(DistributedDataParallel(model), backend="comfuse")
        else:
            from torch.distributed.fsdp import fully_shard
            fully_shard(model)
            trained = torch.compile(model, backend="comfuse")
        _train(trained, rank)
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        params = torch.cat([p.detach().flatten() for p in full])
        torch.manual_seed(0)
        reference = Block()
        _train(reference)
        want = torch.cat([p.detach().flatten() for p in reference.parameters()])
        fused = sum(len(r.fused) for r in backend.REPORTS)
        (out / f"rank{rank}.json").write_text(json.dumps(
            {"error": ((params - want).norm() / want.norm()).item(), "fused": fused}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_training_under_a_distributed_engine_matches_one_process(tmp_path, engine):
    context = mp.spawn(_rank, args=(engine, tmp_path / "rendezvous", tmp_path), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 300
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"{engine}: the ranks did not finish within 300 s")
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["fused"] >= 1, f"rank {rank}: no region fused"
        assert result["error"] < 1e-5, f"rank {rank}: parameters differ from one process's by {result['error']:.2e}"


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_the_distributed_script_runs_a_llama_model_on_the_cpu(tmp_path, engine):
    """scripts/distributed_check.py --tiny --device cpu: a Llama model with its loss under
    torchrun, two gloo ranks; rank 0's parameters equal one process's eager training."""
    import os
    import subprocess
    import sys
    pytest.importorskip("transformers", reason="transformers is part of the dev extras")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(root, "scripts", "distributed_check.py"), str(tmp_path), "--engine", engine,
                           "--model", "llama", "--tiny", "--device", "cpu", "--steps", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"{engine}-llama-comfuse-rank{r}.json").read_text()) for r in range(WORLD)]
    assert all(r["regions_fused"] >= 1 for r in ranks), ranks
    assert ranks[0]["parameter_difference"] < 1e-5, ranks[0]
