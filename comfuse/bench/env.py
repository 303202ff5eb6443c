"""What a benchmark ran on: GPU, clocks, driver, CUDA, torch and triton versions, date."""
from __future__ import annotations

import datetime
import platform
import shutil
import subprocess

import torch

from ..runtime.timing import measure


def _nvidia_smi(query: str) -> str:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return ""
    try:
        out = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else ""
    except Exception:
        return ""


def environment(device: str) -> dict:
    import triton
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "device": device,
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta.update(gpu=props.name, sm_count=props.multi_processor_count,
                    memory_gb=round(props.total_memory / 2**30, 1),
                    l2_mb=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
        smi = _nvidia_smi("driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit")
        if smi:
            keys = ["driver", "sm_clock", "sm_clock_max", "mem_clock", "power_limit"]
            meta.update(dict(zip(keys, [s.strip() for s in smi.split(",")])))
    else:
        meta.update(gpu="none (CPU, Triton interpreter)", cpu=platform.processor() or platform.machine())
    return meta


def ceilings(device: str) -> dict:
    """Measured ceilings: device-to-device copy bandwidth and a large bf16 GEMM."""
    if device != "cuda":
        return {}
    n = 1 << 30  # 1 GiB copied: 2 GiB moved
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy = measure(lambda: dst.copy_(src), device)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = measure(lambda: a @ b, device)
    return {"copy_tb_s": 2 * n / copy.median_ms / 1e9,
            "bf16_gemm_tflops": 2 * 8192**3 / gemm.median_ms / 1e9}
