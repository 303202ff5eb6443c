"""Triton code generation: readable source, the disk cache, and compiling for the H200."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import comfuse
from comfuse.frontend.capture import capture
from comfuse.frontend.regions import find_regions
from comfuse.planner import plan
from comfuse.runtime import build as kernel_mod

ROOT = Path(__file__).resolve().parents[1]


def run_compiler_script(script: str) -> dict:
    """Run ``script`` in a process with Triton out of interpreter mode (this one has it on)
    and return the JSON it prints last."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plan_of(fn, *args, target="interpreter"):
    (cand,) = find_regions(capture(fn, args))
    return plan(cand.region, target=target)


def test_source_is_readable_and_names_every_stage():
    p = plan_of(lambda x, w, b: torch.nn.functional.layer_norm(x @ w + b, (24,)),
                torch.randn(8, 16), torch.randn(16, 24), torch.randn(24))
    k = kernel_mod.build(p)
    text = k.source.text
    assert "# ---- stage 0: elementwise over the resident tile; ends with sum over N ----" in text
    assert "# ---- stage 2: elementwise resumes on the resident tile ----" in text
    assert "# ---- mainloop: acc = A[rows, :] @ B[:, cols] with fp32 accumulation ----" in text
    assert "%0 = acc = x_1 @ w_1" in text  # the region's IR heads the file
    assert text.count("tl.store(") == 1  # the output is written once
    assert Path(k.path).read_text() == text
    assert Path(k.path).parent == comfuse.settings.get().cache_dir / "kernels"


def test_split_cross_entropy_picks_the_target_in_a_branch_per_tile():
    """Cross-entropy's pick of the target column is a sum of where(column == target, x, 0):
    the split tile adds it only when some row's target is one of its columns (others skip
    a compare and a select per element), with the target narrowed to 32 bits once per row;
    the max and log-sum-exp passes stay unconditional."""
    import torch.nn.functional as F
    with comfuse.settings.override(schedule="split"):
        p = plan_of(lambda x, w, t: F.cross_entropy(x @ w, t, reduction="none"),
                    torch.randn(8, 16), torch.randn(16, 200), torch.randint(0, 200, (8,)))
    text = kernel_mod.build(p).source.text
    assert "picks one column per row" in text
    assert "if tl.max(((pick" in text and "offs_n[None, :] == pick" in text
    assert "2147483647" in text and "tl.exp2(" in text
    branch = text.index("if tl.max(((pick")
    assert text.index("tile_max", branch) > branch  # the reductions follow, outside the branch


def test_cache_key_changes_with_what_changes_the_source():
    x, w = torch.randn(8, 16), torch.randn(16, 24)
    a = kernel_mod.kernel_name(plan_of(lambda x, w: torch.softmax(x @ w, -1), x, w))
    b = kernel_mod.kernel_name(plan_of(lambda x, w: torch.softmax(x @ w, -1), torch.randn(9, 16), w))
    c = kernel_mod.kernel_name(plan_of(lambda x, w: torch.log_softmax(x @ w, -1), x, w))
    d = kernel_mod.kernel_name(plan_of(lambda x, w: torch.softmax(x @ w, -1), x, w, target="cuda"))
    p = plan_of(lambda x, w: torch.softmax(x @ w, -1), x, w, target="cuda")
    e = kernel_mod.kernel_name(dataclasses.replace(p, mainloop="tma"))
    f = kernel_mod.kernel_name(dataclasses.replace(p, num_stages=p.num_stages + 1))
    assert a == b  # sizes are runtime arguments (tile sizes equal here)
    assert len({a, c, d, e, f}) == 5


def test_generated_kernels_compile_for_sm90_with_tensor_cores():
    """Runs in a subprocess with Triton out of interpreter mode (the test process has it on)."""
    script = textwrap.dedent("""
        import json, torch, torch.nn.functional as F
        import comfuse
        from comfuse.frontend.capture import capture
        from comfuse.frontend.regions import find_regions
        from comfuse.planner import plan
        from comfuse.runtime.aot import compile_for_gpu
        bf, h = torch.bfloat16, torch.float16
        cases = {
            "ln_bf16": (lambda x, w, b, r: F.layer_norm(x @ w + b + r, (512,)),
                        (torch.randn(256, 512, dtype=bf), torch.randn(512, 512, dtype=bf),
                         torch.randn(512, dtype=bf), torch.randn(256, 512, dtype=bf))),
            # rows of 1024: a cooperative strip of 8 tiles of 128 that exchange partials
            "wide_row_bf16": (lambda x, w: torch.softmax(x @ w, -1), (torch.randn(256, 256, dtype=bf), torch.randn(256, 1024, dtype=bf))),
            "gelu_tile_fp16": (lambda x, w: F.gelu(x @ w), (torch.randn(512, 256, dtype=h), torch.randn(256, 512, dtype=h))),
            "col_softmax_bf16": (lambda x, w: torch.softmax(x @ w, 0), (torch.randn(256, 128, dtype=bf), torch.randn(128, 512, dtype=bf))),
            "bmm_softmax_bf16": (lambda q, k: torch.softmax(q @ k.transpose(1, 2), -1),
                                 (torch.randn(4, 64, 64, dtype=bf), torch.randn(4, 256, 64, dtype=bf))),
            "ce_bf16": (lambda x, w, t: F.cross_entropy((x @ w).float(), t),
                        (torch.randn(256, 256, dtype=bf), torch.randn(256, 512, dtype=bf), torch.randint(0, 512, (256,)))),
        }
        out = {}
        for name, (fn, args) in cases.items():
            (cand,) = find_regions(capture(fn, args))
            info = compile_for_gpu(plan(cand.region, target="cuda"))
            out[name] = {k: info[k] for k in ("wgmma", "atomics", "schedule", "tma")}
            out[name]["shared"] = info["shared_bytes"]
        with comfuse.settings.override(schedule="split"):
            fn, args = cases["ce_bf16"]
            (cand,) = find_regions(capture(fn, args))
            info = compile_for_gpu(plan(cand.region, target="cuda"))
            out["ce_split"] = {k: info[k] for k in ("wgmma", "atomics", "schedule", "tma")}
            out["ce_split"]["shared"] = info["shared_bytes"]
        with comfuse.settings.override(plan="mainloop=tma"):
            for name in ("ln_bf16", "wide_row_bf16", "gelu_tile_fp16", "col_softmax_bf16"):
                fn, args = cases[name]
                (cand,) = find_regions(capture(fn, args))
                info = compile_for_gpu(plan(cand.region, target="cuda"))
                out[name + "_tma"] = {k: info[k] for k in ("wgmma", "atomics", "schedule", "tma")}
                out[name + "_tma"]["shared"] = info["shared_bytes"]
        print(json.dumps(out))
    """)
    result = run_compiler_script(script)
    for name, info in result.items():
        assert info["wgmma"] > 0, f"{name}: no wgmma in the sm_90 PTX"
        if info["schedule"] == "cooperative":
            assert info["atomics"] > 0, f"{name}: a cooperative strip without its arrival atomics"
        assert info["shared"] <= 227 * 1024, f"{name}: needs {info['shared']} bytes of shared memory"
    assert result["wide_row_bf16"]["schedule"] == "cooperative"
    assert result["ce_split"]["schedule"] == "split"
    for name in ("ln_bf16_tma", "wide_row_bf16_tma", "gelu_tile_fp16_tma", "col_softmax_bf16_tma"):
        assert result[name]["tma"] > 0, f"{name}: no cp.async.bulk.tensor in the sm_90 PTX"


def test_cooperative_strip_compiles_pipelined_without_spills_at_sm90():
    """The ahead-of-time compile specialises as Triton's JIT does at a launch (unit strides
    constant, 16-divisible pointers and sizes). Without that, every pointer load compiled to
    scalar 2-byte loads with no cp.async pipelining and ptxas reported 255 registers and
    spills that the GPU never runs (a wrong lead followed on 2026-11-30). RMSNorm over rows
    of 1024 (8 tiles of 128, 8 warps, 4 stages): the plain strip with pointer loads must show
    pipelined cp.async loads, and it and its TMA form their atomics and no spills (cuobjdump:
    STACK 0)."""
    script = textwrap.dedent("""
        import dataclasses, json, torch
        from comfuse.frontend.capture import capture
        from comfuse.frontend.regions import find_regions
        from comfuse.planner import plan
        from comfuse.runtime.aot import compile_for_gpu, resources
        bf = torch.bfloat16
        def rms(x, w, g):
            y = x @ w
            return y * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(y.dtype) * g
        args = (torch.randn(1024, 1024, dtype=bf), torch.randn(1024, 1024, dtype=bf), torch.randn(1024, dtype=bf))
        (cand,) = find_regions(capture(rms, args))
        out = {}
        for name, mainloop in (("plain", "pointer"), ("tma", "tma")):
            p = dataclasses.replace(plan(cand.region, target="cuda"), mainloop=mainloop, block_m=128,
                                    block_n=128, block_k=64, num_warps=8, num_stages=4, tiles_n=8)
            info = compile_for_gpu(p)
            out[name] = dict(resources(info["asm"]["cubin"]), schedule=info["schedule"], wgmma=info["wgmma"],
                             atomics=info["atomics"], cp_async=info["cp_async"])
        print(json.dumps(out))
    """)
    result = run_compiler_script(script)
    assert result["plain"]["cp_async"] > 0, "the pointer mainloop is not pipelined (no cp.async)"
    for name, info in result.items():
        assert info["schedule"] == "cooperative" and info["wgmma"] > 0 and info["atomics"] > 0, (name, info)
    if any("stack" not in info for info in result.values()):
        pytest.skip("Triton's cuobjdump is not available to read the cubin's resources")
    for name, info in result.items():
        assert info["stack"] == 0, f"{name}: the cooperative strip spills {info['stack']} bytes per thread"


def test_cross_entropy_split_tile_reads_targets_per_row_and_does_not_spill_at_sm90():
    """The split kernel of linear + cross-entropy at the H200 tile (128x256x64, 8 warps, TMA,
    tile work inlined). Loaded as [BLOCK_M, 1], the int64 targets took the accumulator's
    layout: one 8-byte load per tile element (128 per thread), a 64-bit compare per
    element, and 304 bytes of spills (sm_90 PTX, 2026-11-30). Now a row vector loads as
    [BLOCK_M], the target is compared with the column index in 32 bits, and the pick of
    the target column is reduced before the exp pass (kept live across it, it spilled)."""
    script = textwrap.dedent("""
        import dataclasses, json, re, torch, torch.nn.functional as F
        import comfuse
        from comfuse.frontend.capture import capture
        from comfuse.frontend.regions import find_regions
        from comfuse.planner import plan
        from comfuse.runtime.aot import compile_for_gpu, resources
        bf = torch.bfloat16
        args = (torch.randn(256, 256, dtype=bf), torch.randn(256, 4096, dtype=bf), torch.randint(0, 4096, (256,)))
        (cand,) = find_regions(capture(lambda x, w, t: F.cross_entropy((x @ w).float(), t, reduction="none"), args))
        with comfuse.settings.override(schedule="split"):
            p = plan(cand.region, target="cuda")
        p = dataclasses.replace(p, block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, mainloop="tma",
                                tiles_n=16, form=dataclasses.replace(p.form, chunks=4, tiles_per_chunk=4))
        info = compile_for_gpu(p)
        ptx = info["asm"]["ptx"]
        print(json.dumps(dict(resources(info["asm"]["cubin"]), wgmma=info["wgmma"],
                              loads64=len(re.findall(r"ld\\.global\\.b64", ptx)),
                              compares64=len(re.findall(r"setp\\.\\w+\\.[bsu]64", ptx)))))
    """)
    result = run_compiler_script(script)
    assert result["wgmma"] > 0
    assert result["loads64"] <= 8, f"{result['loads64']} 8-byte loads: the targets are read per element"
    assert result["compares64"] <= 8, f"{result['compares64']} 64-bit compares: the column test is 64-bit"
    if "stack" in result:  # (16 bytes: two 64-bit values saved once, reloaded once per tile)
        assert result["stack"] <= 32, f"the split tile spills {result['stack']} bytes per thread"


def test_persistent_tile_compiles_for_sm90_with_tma_and_without_spills():
    """The persistent tile plan (bias + ReLU, 128x256x64, 8 warps, TMA): Triton fuses its tile
    and K loops for sm_90, and the kernel keeps tensor cores, TMA loads and no spills."""
    script = textwrap.dedent("""
        import dataclasses, json, torch
        from comfuse.frontend.capture import capture
        from comfuse.frontend.regions import find_regions
        from comfuse.planner import plan
        from comfuse.runtime.aot import compile_for_gpu, resources
        bf = torch.bfloat16
        args = (torch.randn(1024, 512, dtype=bf), torch.randn(512, 1024, dtype=bf), torch.randn(1024, dtype=bf))
        (cand,) = find_regions(capture(lambda x, w, b: torch.relu(x @ w + b), args))
        p = plan(cand.region, target="cuda")
        p = dataclasses.replace(p, block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, mainloop="tma",
                                form=dataclasses.replace(p.form, persistent=True))
        info = compile_for_gpu(p)
        print(json.dumps(dict(resources(info["asm"]["cubin"]), wgmma=info["wgmma"], tma=info["tma"],
                              k_loop=f"step %c{64}_i32" in info["asm"]["ttgir"])))
    """)
    result = run_compiler_script(script)
    assert result["wgmma"] > 0 and result["tma"] > 0, result
    # fused, the K loop no longer steps by BLOCK_K: one loop counts (tile, K step) pairs by 1
    assert not result["k_loop"], "the tile and K loops were not fused (a loop steps by BLOCK_K)"
    if "stack" in result:
        assert result["stack"] == 0, f"the persistent tile spills {result['stack']} bytes per thread"


def test_b2b_chains_compile_for_sm90():
    script = textwrap.dedent("""
        import json, torch
        import comfuse
        from comfuse.frontend.capture import capture
        from comfuse.frontend.regions import find_chains, find_regions
        from comfuse.planner.chain import plan_chain
        from comfuse.runtime.aot import compile_chain_for_gpu
        bf = torch.bfloat16
        cases = {
            "dlrm": (lambda x, w1, w2, w3: torch.relu(torch.relu(torch.relu(x @ w1) @ w2) @ w3),
                     (torch.randn(1024, 512, dtype=bf), torch.randn(512, 512, dtype=bf),
                      torch.randn(512, 256, dtype=bf), torch.randn(256, 128, dtype=bf))),
            "target_attention": (lambda q, k, v: torch.softmax(q @ k.transpose(1, 2), -1) @ v,
                                 (torch.randn(64, 16, 64, dtype=bf), torch.randn(64, 256, 64, dtype=bf),
                                  torch.randn(64, 256, 64, dtype=bf))),
        }
        out = {}
        for name, (fn, args) in cases.items():
            cands = find_regions(capture(fn, args))
            ((chain, links),) = find_chains(cands)
            regions = [cands[i].region for i in chain]
            writes = [[] for _ in regions]
            writes[-1] = [0]
            info = compile_chain_for_gpu(plan_chain(regions, links, writes, "cuda"))
            out[name] = {"wgmma": info["wgmma"], "mma": info["mma"], "shared": info["shared_bytes"]}
        print(json.dumps(out))
    """)
    result = run_compiler_script(script)
    for name, info in result.items():
        assert info["wgmma"] + info["mma"] > 0, f"{name}: no tensor-core instructions"
        assert info["shared"] <= 227 * 1024, f"{name}: {info['shared']} bytes of shared memory"
