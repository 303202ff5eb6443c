"""GPU-only checks at real shapes (skipped without CUDA). The rest of the suite also runs on
the GPU when CUDA is present (helpers.DEVICE), so these add only what needs a big GPU."""
import json
import warnings

import pytest
import torch

import comfuse
from comfuse.bench.workloads import SUITE
from comfuse.runtime.check import tolerance

from helpers import as_tuple, assert_matches_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", list(SUITE))
@pytest.mark.parametrize("shape", [(8192, 1024, 1024), (8191, 1024, 768), (1000, 512, 1000),
                                   (4095, 1024, 3072), (2048, 1024, 5120), (1031, 512, 12288)],
                         ids=["paper", "odd_M_N768", "N1000", "N3072", "N5120", "odd_M_N12288"])
def test_suite_at_real_shapes(name, shape):
    wl = SUITE[name]
    args = wl.inputs(*shape, dtype=torch.bfloat16, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = comfuse.compile(wl.fn, args)
        out = compiled(*args)
    assert all(r.fused for r in compiled.report.regions), str(compiled.report)
    assert_matches_reference(wl.fn, args, out)


@pytest.mark.parametrize("M", [65536, 1000])
def test_every_chain_plan_of_the_dlrm_mlp_matches_the_reference(M):
    """Each plan autotuning may pick for the DLRM bottom MLP (512 -> 512 -> 256 -> 128, bf16),
    the resident-A forms (224 KB of shared memory at 128 rows) and the one-loop forms included, at the real rows and
    at rows that leave a partial program."""
    from comfuse.planner.chain import chain_candidates
    from comfuse.runtime.chain import build_chain

    def dlrm(x, w1, w2, w3):
        return torch.relu(torch.relu(torch.relu(x @ w1) @ w2) @ w3)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(M, 512, generator=g),) + tuple(
        torch.randn(a, b, generator=g) / a ** 0.5 for a, b in ((512, 512), (512, 256), (256, 128)))
    args = tuple(t.to("cuda", torch.bfloat16) for t in args)
    with warnings.catch_warnings(), comfuse.settings.override(autotune="0", validate="0"):
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = comfuse.compile(dlrm, args)
        compiled(*args)
    chain = next(m for m in compiled.fused_regions() if m.__class__.__name__ == "FusedChain")
    seen, forward = [], chain.forward
    chain.forward = lambda *ext: seen.append(ext) or forward(*ext)
    compiled(*args)
    ext = seen[-1]
    plans = chain_candidates(chain.plan)
    assert any(p.resident_a for p in plans) and any(p.flat for p in plans)
    for plan in plans:
        chain.kernel = build_chain(plan)
        (out,) = chain.run(ext, ext[chain.a_ext].device, check=False)
        assert_matches_reference(dlrm, args, out)


@pytest.mark.parametrize("name", ["ln_postnorm", "rmsnorm", "softmax", "multi_stage"])
@pytest.mark.parametrize("mainloop", ["pointer", "tma"])
def test_prefetched_cooperative_strip_at_the_paper_shape(name, mainloop):
    """Side inputs loaded before the mainloop (where the region has an [M, N] one) in the
    cooperative strip, correct at 8192x1024x1024 with both mainloops."""
    wl = SUITE[name]
    args = wl.inputs(8192, 1024, 1024, dtype=torch.bfloat16, device="cuda")
    prefetch = name == "ln_postnorm"
    form = f"mainloop={mainloop}" + (",prefetch=1" if prefetch else "")
    with comfuse.settings.override(autotune="0", schedule="cooperative", plan=form), warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = comfuse.compile(wl.fn, args)
        out = compiled(*args)
    (r,) = compiled.report.regions
    assert r.fused, str(compiled.report)
    assert ("before the mainloop" in r.plan) == prefetch and f"{mainloop} mainloop" in r.plan, r.plan
    assert_matches_reference(wl.fn, args, out)


@pytest.mark.parametrize("name", ["ln_postnorm", "rmsnorm", "mblr", "softmax"])
@pytest.mark.parametrize("shape", [(8192, 1024, 1024), (2048, 1024, 3072), (1024, 512, 12288)],
                         ids=["paper", "N3072", "N12288"])
@pytest.mark.parametrize("residual_tma", [False, True], ids=["residual_ldg", "residual_tma"])
def test_warp_specialised_template_matches_the_reference(name, shape, residual_tma):
    """The Gluon template (ws_strip) forced: strips of 4, 12 (not a power of two) and 48 tiles,
    the residual loaded by the epilogue or by TMA into the hand-off buffer; 50 more calls give
    the same output (the strip counters only grow)."""
    if residual_tma and name != "ln_postnorm":
        pytest.skip("no residual to load by TMA")
    forced_schedule_matches(name, shape, "ws_strip", 50, plan="residual_tma=1" if residual_tma else "")


def forced_schedule_matches(name, shape, schedule, repeats, **settings):
    """A suite workload with ``schedule`` forced (autotuning off): fused as forced, equal to the
    float64 reference, ``repeats`` more calls bit-identical, and new tensors of the same layout
    (the direct launch) equal to the reference too."""
    wl = SUITE[name]
    fresh = wl.inputs(*shape, dtype=torch.bfloat16, device="cuda", seed=1)
    forced_fn_matches(wl.fn, wl.inputs(*shape, dtype=torch.bfloat16, device="cuda"), schedule, repeats, fresh,
                      **settings)


def forced_fn_matches(fn, args, schedule, repeats, fresh=None, tol=None, **settings):
    """``fn`` with ``schedule`` forced (autotuning off): one region, fused as forced, equal to
    the float64 reference (within ``tol``, else each output's dtype's tolerance), ``repeats``
    more calls bit-identical in every output, and ``fresh`` (new tensors of the same layout:
    the direct launch) equal to the reference too."""
    with comfuse.settings.override(autotune="0", schedule=schedule, **settings), warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = comfuse.compile(fn, args)
        out = compiled(*args)
        (r,) = compiled.report.regions
        assert r.fused and r.schedule == schedule, str(compiled.report)
        assert_matches_reference(fn, args, out, tol)
        first = [o.clone() for o in as_tuple(out)]
        for _ in range(repeats):
            out = compiled(*args)
        torch.cuda.synchronize()
        assert all(torch.equal(o, f) for o, f in zip(as_tuple(out), first))
        if fresh is not None:
            assert_matches_reference(fn, fresh, compiled(*fresh), tol)


def test_warp_specialised_template_takes_nn_linear_weights():
    """B given K-major (nn.Linear's weight through F.linear)."""
    def f(x, w, b, r, g, be):
        return torch.nn.functional.layer_norm(torch.nn.functional.linear(x, w, b) + r, (1024,), g, be, 1e-5)
    dev, bf = "cuda", torch.bfloat16
    args = (torch.randn(4096, 1024, device=dev, dtype=bf), torch.randn(1024, 1024, device=dev, dtype=bf) / 32,
            *(torch.randn(1024, device=dev, dtype=bf), torch.randn(4096, 1024, device=dev, dtype=bf),
              torch.randn(1024, device=dev, dtype=bf), torch.randn(1024, device=dev, dtype=bf)))
    with comfuse.settings.override(autotune="0", schedule="ws_strip"), warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = comfuse.compile(f, args)
        out = compiled(*args)
    (r,) = compiled.report.regions
    assert r.fused and r.schedule == "ws_strip", str(compiled.report)
    assert_matches_reference(f, args, out)


def test_fp32_is_exact_without_tf32():
    assert not torch.backends.cuda.matmul.allow_tf32
    wl = SUITE["ln_postnorm"]
    args = wl.inputs(2048, 512, 1024, dtype=torch.float32, device="cuda")
    compiled = comfuse.compile(wl.fn, args)
    assert_matches_reference(wl.fn, args, compiled(*args), tol=1e-4)


def test_repeated_launches_are_deterministic():
    wl = SUITE["multi_stage"]
    args = wl.inputs(4096, 1024, 1024, dtype=torch.bfloat16, device="cuda")
    with comfuse.settings.override(autotune="0"):  # the fused kernel, whether or not it wins
        compiled = comfuse.compile(wl.fn, args)
        first = as_tuple(compiled(*args))
        for _ in range(5):
            for a, b in zip(first, as_tuple(compiled(*args))):
                assert torch.equal(a, b)
    assert all(r.fused for r in compiled.report.regions), str(compiled.report)  # (no fallback)


@pytest.mark.parametrize("mainloop", ["pointer", "tma"])
@pytest.mark.parametrize("schedule", ["cooperative", "row_in_cta"])
def test_later_launches_take_new_tensors_of_the_same_layout(mainloop, schedule):
    """After the first launch of a layout, comfuse calls the compiled kernel directly
    (runtime/kernel.py, ``bind``): fresh tensors of the same layout must reach it (TMA
    descriptors rebuilt), and a view that loses 16-byte alignment is a new layout."""
    wl = SUITE["rmsnorm"]
    with comfuse.settings.override(autotune="0", plan=f"mainloop={mainloop}", schedule=schedule), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        args = wl.inputs(2048, 512, 1024, dtype=torch.bfloat16, device="cuda")
        compiled = comfuse.compile(wl.fn, args)
        assert compiled.report.regions[0].fused, str(compiled.report)
        for seed in range(3):
            torch.manual_seed(seed)
            fresh = wl.inputs(2048, 512, 1024, dtype=torch.bfloat16, device="cuda")
            assert_matches_reference(wl.fn, fresh, compiled(*fresh))
        assert compiled.report.regions[0].fused, str(compiled.report)  # (not a fallback)
        wide = torch.randn(2048 * 512 + 1, dtype=torch.bfloat16, device="cuda")
        x = wide[1:].view(2048, 512)  # 2-byte offset: pointer plans take it, TMA falls back
        shifted = (x, *args[1:])
        assert_matches_reference(wl.fn, shifted, compiled(*shifted))
        assert compiled.report.regions[0].fused, str(compiled.report)  # (that call only ran unfused)


@pytest.mark.timeout(300)
def test_cooperative_strip_stress_many_launches_near_the_resident_limit():
    """Strips of 64 tiles (N = 16384 in tiles of 256): as many slots as fit the GPU, 50
    launches in a row; no hang, and every launch gives the same, correct result."""
    wl = SUITE["ln_postnorm"]
    args = wl.inputs(8192, 512, 16384, dtype=torch.bfloat16, device="cuda")
    with comfuse.settings.override(schedule="cooperative"):
        compiled = comfuse.compile(wl.fn, args)
    assert "cooperative" in compiled.report.regions[0].plan
    first = compiled(*args)
    assert_matches_reference(wl.fn, args, first)
    with comfuse.settings.override(check=False):
        for _ in range(50):
            again = compiled(*args)
        torch.cuda.synchronize()
    assert torch.equal(first, again)


def test_autotune_on_the_gpu_keeps_a_correct_and_timed_choice(tmp_path):
    wl = SUITE["softmax"]
    args = wl.inputs(8192, 1024, 1024, dtype=torch.bfloat16, device="cuda")
    with comfuse.settings.override(autotune="1", cache_dir=tmp_path):
        compiled = comfuse.compile(wl.fn, args)
        out = compiled(*args)
    assert_matches_reference(wl.fn, args, out)
    (r,) = compiled.report.regions
    assert ("autotuned" in r.plan) if r.fused else r.reason.startswith("autotune:")


def test_timing_by_graph_replays_leaves_no_cublas_workspace_behind():
    """Each capture warms up on a side stream of its own, and cuBLAS keeps a workspace per
    stream for good unless it is dropped: ten timings of a GEMM by graph replays leave the
    memory in use as one plain GEMM left it."""
    import gc
    from comfuse.runtime.timing import graphed
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    expected = a @ a
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(10):
        replay = graphed(lambda: a @ a, warmup_calls=1)
        torch.testing.assert_close(replay(), expected)
        del replay
    torch.mm(a, a)
    torch.cuda.synchronize()
    gc.collect()
    assert torch.cuda.memory_allocated() - before < 4 * 2**20


@pytest.mark.timeout(300)
def test_dynamic_lengths_tune_and_run_per_shape_through_the_backend(tmp_path):
    """torch.compile(backend="comfuse") with dynamic shapes on the GPU: each new token count
    is lowered, autotuned on its real inputs and compiled on its first call; forward and
    backward match eager within bf16 tolerance."""
    import torch.nn.functional as F
    from comfuse import backend, graph_check
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 1024).to("cuda", torch.bfloat16)
    norm = torch.nn.LayerNorm(1024).to("cuda", torch.bfloat16)

    def block(x, r):
        return norm(F.gelu(lin(x)) + r)
    torch._dynamo.reset()
    with comfuse.settings.override(cache_dir=tmp_path), warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        cm = torch.compile(block, backend="comfuse", dynamic=True)
        for tokens in (4096, 6144):
            x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            r = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
            backend.REPORTS.clear()
            out = cm(x, r)
            assert backend.REPORTS and backend.REPORTS[-1].regions, "the shape was not lowered"
            torch.testing.assert_close(out.float(), block(x, r).float(), rtol=2e-2, atol=2e-2)
            g = torch.randn_like(out, dtype=torch.float32)  # (a sum of squares of a LayerNorm is nearly constant)
            (out.float() * g).sum().backward()
            gx = x.grad.float()
            x.grad = None
            (block(x, r).float() * g).sum().backward()
            err = ((gx - x.grad.float()).norm() / x.grad.float().norm()).item()
            assert err < 2e-2, f"input gradient off by {err:.3g} (relative norm) at {tokens} tokens"


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_the_backend_times_a_fused_graph_against_inductors_on_the_gpu(tmp_path, grad):
    """COMFUSE_GRAPH_CHECK on the GPU: a graph that keeps a fused region (forced: autotuning
    off) is timed at its first call against Inductor's compilation without it; both forms
    were timed (with grad on, the training step too), one was kept, and the result and the
    gradients match eager."""
    import torch.nn.functional as F
    from comfuse import backend, graph_check
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 1024).to("cuda", torch.bfloat16)
    norm = torch.nn.LayerNorm(1024).to("cuda", torch.bfloat16)

    def block(x, r):
        return norm(F.gelu(lin(x)) + r)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    r = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    before = len(backend.GRAPH_CHECKS)
    # (COMFUSE_CHECK off: the tests' float64 check of every launch would be timed too)
    with comfuse.settings.override(cache_dir=tmp_path, check=False), warnings.catch_warnings(), \
            torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        cm = torch.compile(block, backend="comfuse", dynamic=False,
                           options={"autotune": "0", "graph_check": "1"})
        out = cm(x, r)
        out = cm(x, r)
        torch.testing.assert_close(out.float(), block(x, r).float(), rtol=2e-2, atol=2e-2)
        if grad:
            g = torch.randn_like(out, dtype=torch.float32)
            (out.float() * g).sum().backward()
            gx = x.grad.float()
            x.grad = None
            (block(x, r).float() * g).sum().backward()
            assert ((gx - x.grad.float()).norm() / x.grad.float().norm()).item() < 2e-2
    checks = backend.GRAPH_CHECKS[before:]
    assert len(checks) == 1 and checks[0]["regions"] >= 1 and checks[0]["kept"] in ("fused", "inductor")
    c = checks[0]
    # (the steps are timed where the forward won and the fused backward kept a fused region:
    # otherwise the two forms' steps differ in the forward alone)
    stepped = grad and (c["fused_ms"] <= c["inductor_ms"] * graph_check.GRAPH_MARGIN and c["backward_regions"] != 0)
    timed = ("fused_ms", "inductor_ms") + (("fused_step_ms", "inductor_step_ms") if stepped else ())
    assert all(0 < c[k] < 100 for k in timed) and (stepped or "fused_step_ms" not in c), c


@pytest.mark.parametrize("forced", [True, False], ids=["ws_stages", "autotuned"])
def test_reduce_overhead_mode_replays_the_fused_region_in_a_cuda_graph(forced, tmp_path):
    """torch.compile(..., backend="comfuse") in mode "reduce-overhead": Inductor's CUDA graphs
    hold the fused region's launch (no graph skipped), the results match float64 over
    repeated replays, and (forced) the region ran the generated kernel (ws_stages). Autotuned,
    the region tunes by graph replays and the whole-graph check times both graphs, each in
    Inductor's CUDA graphs."""
    from torch._dynamo.utils import counters

    from comfuse import backend
    wl = SUITE["rmsnorm"]
    xs = wl.inputs(8192, 1024, 1024, dtype=torch.bfloat16, device="cuda")
    ref = wl.fn(*[t.double() if t.is_floating_point() else t for t in xs])
    opts = {"mode": "reduce-overhead"}  # (autotuned: the whole-graph check on too, as a user gets it)
    if forced:
        opts.update(schedule="ws_stages", autotune="0", graph_check="0")
    torch._dynamo.reset()
    skips = counters["inductor"]["cudagraph_skips"]
    with comfuse.settings.override(cache_dir=tmp_path, check=False), warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        fn = torch.compile(wl.fn, backend="comfuse", dynamic=False, options=opts)
        outs = []
        for _ in range(4):  # warm-up, recording, then replays
            torch.compiler.cudagraph_mark_step_begin()
            outs.append(fn(*xs).clone())
    assert counters["inductor"]["cudagraph_skips"] == skips, "Inductor skipped CUDA graphs"
    for out in outs:
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2
    assert torch.equal(outs[-1], outs[-2])
    if forced:
        (r,) = backend.REPORTS[-1].regions
        assert r.fused and r.schedule == "ws_stages", str(backend.REPORTS[-1])


@pytest.mark.parametrize("vocab", [32768, 128256])
def test_linear_cross_entropy_never_allocates_logits(vocab):
    """LM head + cross-entropy at 8192 tokens, hidden 4096: correct, and the memory the
    fused call allocates beyond its inputs stays under 1% of the fp32 logits."""
    M, K = 8192, 4096
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(K, vocab, device="cuda") / K ** 0.5).to(torch.bfloat16)
    t = torch.randint(0, vocab, (M,), device="cuda")
    fn = SUITE["linear_ce"].fn
    with comfuse.settings.override(check=False):
        compiled = comfuse.compile(fn, (x, w, t))
        compiled(x, w, t)  # build, and autotune where it is on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = compiled(x, w, t)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    (r,) = compiled.report.regions
    assert r.fused and r.schedule in ("split", "cooperative"), str(compiled.report)
    assert extra <= 0.01 * M * vocab * 4, f"{extra / 2**20:.1f} MiB beyond the inputs"
    ref = fn(x.double(), w.double(), t)
    assert abs(loss.item() - ref.item()) <= 1e-3 * abs(ref.item())


@pytest.mark.timeout(300)
def test_linear_cross_entropy_training_step_uses_no_more_memory_than_inductor():
    """Vocabulary 128256, 8192 tokens, hidden 4096: forward and backward through
    torch.compile(backend="comfuse") against Inductor alone: the same gradients, and a peak no
    higher than Inductor's (5 % allowance)."""
    import torch.nn.functional as F
    M, K, V = 8192, 4096, 128256
    w = (torch.randn(V, K, device="cuda") / K ** 0.5).to(torch.bfloat16).requires_grad_(True)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (M,), device="cuda")

    def step(fn):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with comfuse.settings.override(check=False):  # the float64 check holds [M, V] float64 tensors
            fn(x, t).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, x.grad.clone(), w.grad.clone()

    def loss(x, t):
        return F.cross_entropy(F.linear(x, w).float(), t)
    torch._dynamo.reset()
    ours = torch.compile(loss, backend="comfuse", dynamic=False)
    step(ours)  # build
    mem_ours, gx, gw = step(ours)
    torch._dynamo.reset()
    theirs = torch.compile(loss, dynamic=False)
    step(theirs)
    mem_theirs, gx_ref, gw_ref = step(theirs)
    torch.testing.assert_close(gx.float(), gx_ref.float(), rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(gw.float(), gw_ref.float(), rtol=2e-2, atol=1e-4)
    assert mem_ours <= 1.05 * mem_theirs, \
        f"{mem_ours / 2**30:.2f} GiB vs Inductor {mem_theirs / 2**30:.2f} GiB: scripts/memory_peak.py lists what is alive at the peak"


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs of one host (nvidia-h200-x2)")
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_gpus_train_as_one(tmp_path, engine):
    """scripts/distributed_check.py on two GPUs: the block trained under DDP or FSDP2 through
    the backend ends with one GPU's parameters."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "COMFUSE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": root,
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(root, "scripts", "distributed_check.py"), str(tmp_path), "--engine", engine],
                          capture_output=True, text=True, env=env, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0 = json.loads((tmp_path / f"{engine}-block-comfuse-rank0.json").read_text())
    assert r0["regions_fused"] >= 1 and r0["parameter_difference"] < 1e-3, r0


CE_GPU = {
    "ce_mean": lambda x, w, t: torch.nn.functional.cross_entropy(x @ w, t),
    "ce_sum_nn_linear": lambda x, w, t: torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w), t,
                                                                          reduction="sum"),
    "ce_none_ignore": lambda x, w, t: torch.nn.functional.cross_entropy((x @ w).float(), t, ignore_index=3,
                                                                        reduction="none"),
    "logsumexp": lambda x, w, t: torch.logsumexp((x @ w).float(), -1),
}


@pytest.mark.parametrize("name", list(CE_GPU))
@pytest.mark.parametrize("shape", [(1280, 256, 5120), (8192, 4096, 32768), (2048, 1024, 128256)],
                         ids=["groups_8_and_2", "paper", "vocab128256"])
def test_terminal_template_matches_the_reference(name, shape):
    """The Gluon template's log-sum-exp kind (ws_split) forced: 10 row blocks (a last group of
    2 in the grouped order), the paper's shape, Llama 3's vocabulary; ignored targets; B as
    nn.Linear's [N, K] weight; 20 more calls give the same result; new tensors go through the
    direct launch. The template rounds the logits to bf16 as eager's GEMM does, which the
    float64 reference does not (it moves an fp32 per-row loss by ~1e-4 of its size): checked
    against float64 at 1e-3 and against eager, which rounds alike, at 1e-4."""
    fn = CE_GPU[name]
    M, K, N = shape
    gen = torch.Generator(device="cuda").manual_seed(0)

    def inputs(seed):
        gen.manual_seed(seed)
        x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(K, N, device="cuda", generator=gen) / K ** 0.5).to(torch.bfloat16)
        if name == "ce_sum_nn_linear":
            w = w.t().contiguous()
        t = torch.randint(0, N, (M, ), device="cuda", generator=gen)
        t[::11] = 3
        t[::13] = 3 if name == "ce_none_ignore" else -100  # (its ignore_index is 3; -100 is out of range there)
        return x, w, t
    args = inputs(0)
    with comfuse.settings.override(autotune="0", schedule="ws_split"), warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = comfuse.compile(fn, args)
        out = compiled(*args)
        (r,) = compiled.report.regions
        assert r.fused and r.schedule == "ws_split", str(compiled.report)

        def check(args, out):
            assert_matches_reference(fn, args, out, tol=1e-3 if out.dtype == torch.float32 else None)
            torch.testing.assert_close(out.float(), fn(*args).float(), rtol=1e-4 if out.dtype == torch.float32
                                       else 1e-2, atol=1e-4)
        check(args, out)
        first = as_tuple(out)[0].clone()
        for _ in range(20):
            out = compiled(*args)
        torch.cuda.synchronize()
        assert torch.equal(as_tuple(out)[0], first)
        fresh = inputs(1)
        check(fresh, compiled(*fresh))


def test_the_terminal_template_writes_the_logits_beside_the_loss():
    """An LM head as a model runs it (nn.Linear's weight, a Llama head's 8192 x 2048 x 32000):
    the logits, which the model returns, and the per-row loss, with the template's
    log-sum-exp kind forced; it writes the logits as it passes them. Both match the float64
    reference and eager."""
    F = torch.nn.functional
    M, K, N = 8192, 2048, 32000
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
    t = torch.randint(0, N, (M, ), device="cuda", generator=g)
    t[::13] = -100

    def head(x, w, t):
        y = F.linear(x, w)
        return y, F.cross_entropy(y.float(), t, reduction="none")
    with comfuse.settings.override(autotune="0", schedule="ws_split"), warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = comfuse.compile(head, (x, w, t))
        out = compiled(x, w, t)
    (r,) = compiled.report.regions
    assert r.fused and r.schedule == "ws_split" and "x @ W itself" in r.plan, str(compiled.report)
    # (the template rounds the logits to bf16 before the loss, as eager does and the float64
    # reference does not: the fp32 loss is judged at 1e-3, as the other terminal tests judge it)
    assert_matches_reference(lambda *a: head(*a)[0], (x, w, t), out[0])
    assert_matches_reference(lambda *a: head(*a)[1], (x, w, t), out[1], tol=1e-3)
    for got, want in zip(out, head(x, w, t)):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_gpt2s_head_behind_inductors_padding_runs_on_the_template_with_a_partial_last_tile():
    """GPT-2's LM head (vocabulary 50257) with its loss under the backend, inference: Inductor
    pads the weight's columns to 50264 and slices the logits; the region is the product with
    the weight itself over 50257 columns (196 whole tiles and one of 81), forced onto the
    template, which writes the logits and the loss; both match eager."""
    from comfuse import inductor_pass
    F = torch.nn.functional
    torch._dynamo.reset()
    inductor_pass.REPORTS.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 768, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(50257, 768, device="cuda", generator=g) / 768 ** 0.5).to(torch.bfloat16)
    t = torch.randint(0, 50257, (8192, ), device="cuda", generator=g)

    def head(x, w, t):
        y = F.linear(x, w)
        return y, F.cross_entropy(y.float(), t)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        y, loss = torch.compile(head, backend="comfuse", options={"schedule": "ws_split", "autotune": "0"})(x, w, t)
    regions = [r for rep in inductor_pass.REPORTS for r in rep.regions if r.fused]
    assert [r.schedule for r in regions] == ["ws_split"] and "N=50257" in regions[0].ir.splitlines()[0], \
        inductor_pass.REPORTS
    y2, want = head(x, w, t)
    torch.testing.assert_close(y.float(), y2.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(loss.float(), want.float(), rtol=1e-3, atol=1e-3)


def _head_trained_through_the_backend(fn, lm, x, t, schedule: str, steps: int = 1) -> tuple:
    """``fn(x, t)`` (a loss through ``lm``) trained ``steps`` times through the backend with
    ``schedule`` forced (gradients of the last step kept), then eagerly: (comfuse's loss,
    eager's, comfuse's gradients of x and lm's weight, eager's, the forward graphs' region
    reports)."""
    from comfuse import inductor_pass
    torch._dynamo.reset()
    inductor_pass.REPORTS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        # (the whole-graph check off: the fused graph runs, whatever its time against Inductor's)
        compiled = torch.compile(fn, backend="comfuse", options={"schedule": schedule, "autotune": "0",
                                                                  "graph_check": "0"})
        for _ in range(steps):
            x.grad = None
            lm.zero_grad()
            loss = compiled(x, t)
            loss.backward()
    got = [x.grad.clone(), lm.weight.grad.clone()]
    x.grad = None
    lm.zero_grad()
    ref = fn(x, t)
    ref.backward()
    forward = [r for rep in inductor_pass.REPORTS if rep.function.startswith("forward") for r in rep.regions]
    return loss, ref, got, [x.grad, lm.weight.grad], forward


def _gpt2s_head() -> tuple:
    """(a loss through GPT-2's LM head, the head, 8192 tokens' hidden states, their targets)."""
    torch.manual_seed(0)
    lm = torch.nn.Linear(768, 50257, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8192, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 50257, (8192, ), device="cuda")

    def fn(x, t):
        return torch.nn.functional.cross_entropy(lm(x).float(), t)
    return fn, lm, x, t


@pytest.mark.parametrize("schedule", ["ws_split", "split"])
def test_gpt2s_head_trains_fused_with_the_loss_alone_behind_inductors_padding(schedule):
    """GPT-2's LM head (vocabulary 50257) in a training loop that uses the loss alone: Inductor
    pads the weight's columns to 50264 before the graph is partitioned, and the forward saves
    the padded product for its backward; the region writes it whole (its padded columns
    zeroed) with the loss, and the loss and every gradient (one vector) are eager's."""
    loss, ref, got, want, forward = _head_trained_through_the_backend(*_gpt2s_head(), schedule)
    assert [(r.fused, r.schedule) for r in forward] == [(True, schedule)], forward
    assert "mm" in forward[0].outputs, forward  # (the padded product, saved whole)
    torch.testing.assert_close(loss.float(), ref.float(), rtol=1e-3, atol=1e-3)
    got, want = (torch.cat([g.flatten() for g in gs]).double() for gs in (got, want))
    assert ((got - want).norm() / want.norm()).item() < 2e-2


def test_gpt2s_padded_head_is_replayed_with_its_padded_columns_zeroed(monkeypatch):
    """The same head over six steps: once settled, the region's calls are replayed, the
    zeroing of the padded columns among the replayed launches, and the last step's loss and
    gradients are still eager's. (With every launch checked against the reference, as the
    tests' COMFUSE_CHECK=1 has it, no call settles: the check is off here.)"""
    from comfuse import region_op
    from comfuse.runtime.replay import Replay
    monkeypatch.setenv("COMFUSE_CHECK", "0")
    before = set(region_op.REGISTRY)
    loss, ref, got, want, forward = _head_trained_through_the_backend(*_gpt2s_head(), "ws_split", steps=6)
    padded = [m for i, (m, _) in region_op.REGISTRY.items() if i not in before and getattr(m, "saves_padded", False)]
    assert padded and any(m.__dict__.get("_replay").__class__ is Replay for m in padded), \
        [(m.__dict__.get("_replay"), m.report.replayed) for m in padded]
    torch.testing.assert_close(loss.float(), ref.float(), rtol=1e-3, atol=1e-3)
    got, want = (torch.cat([g.flatten() for g in gs]).double() for gs in (got, want))
    assert ((got - want).norm() / want.norm()).item() < 2e-2


def test_linear_cross_entropy_trains_through_the_backend_with_the_template_forced():
    """Linear + cross-entropy under torch.compile(backend="comfuse") with the template's
    log-sum-exp kind forced: Inductor's backward needs the logits and their statistics; the
    training forward's region is the template writing the logits too, or where what the
    backward saves is more than that, runs its ops (with the reason); the gradients are
    eager's."""
    torch.manual_seed(0)
    lm = torch.nn.Linear(1024, 32768, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 32768, (2048, ), device="cuda")
    t[::7] = -100

    def fn(x, t):
        return torch.nn.functional.cross_entropy(lm(x), t)
    loss, ref, got, want, forward = _head_trained_through_the_backend(fn, lm, x, t, "ws_split")
    assert forward and all((r.fused and r.schedule == "ws_split") or (not r.fused and r.reason) for r in forward), \
        forward
    torch.testing.assert_close(loss.float(), ref.float(), rtol=2e-2, atol=1e-2)
    for g, w in zip(got, want):
        err = ((g.double() - w.double()).norm() / w.double().norm()).item()
        assert err < 2e-2, err


def test_linear_cross_entropy_with_the_template_under_reduce_overhead_trains_and_infers():
    """The template's head under mode "reduce-overhead", as GPT-2 runs it: training steps,
    then inference calls, at two batch sizes (each a graph of its own, the template bound for
    a second layout inside Inductor's CUDA-graph warm-up). Nothing the template keeps may land
    in Inductor's graph pool untracked (its pool check refuses every later run of that pool);
    the loss and the gradients match eager's."""
    from comfuse import inductor_pass
    torch._dynamo.reset()
    inductor_pass.REPORTS.clear()
    torch.manual_seed(0)
    lm = torch.nn.Linear(768, 50257, bias=False, device="cuda", dtype=torch.bfloat16)

    def fn(x, t):
        return torch.nn.functional.cross_entropy(lm(x).float(), t)
    opts = {"mode": "reduce-overhead", "schedule": "ws_split", "autotune": "0"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = torch.compile(fn, backend="comfuse", dynamic=False, options=opts)
        for rows in (4096, 2048):
            x = torch.randn(rows, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            t = torch.randint(0, 50257, (rows, ), device="cuda")
            for _ in range(3):  # (warm-up, recording, replay)
                torch.compiler.cudagraph_mark_step_begin()
                x.grad = None
                lm.zero_grad()
                loss = compiled(x, t)
                loss.backward()
            got = torch.cat([loss.detach().float().view(1), x.grad.flatten().float(), lm.weight.grad.flatten().float()])
            with torch.no_grad():
                for _ in range(3):
                    torch.compiler.cudagraph_mark_step_begin()
                    inferred = compiled(x, t).float().clone()
            x.grad = None
            lm.zero_grad()
            ref = fn(x, t)
            ref.backward()
            want = torch.cat([ref.detach().float().view(1), x.grad.flatten().float(), lm.weight.grad.flatten().float()])
            assert ((got - want).norm() / want.norm()).item() < 2e-2
            torch.testing.assert_close(inferred, ref.detach().float(), rtol=2e-2, atol=1e-2)
    fused = [r for rep in inductor_pass.REPORTS for r in rep.regions if r.fused]
    assert any(r.schedule == "ws_split" for r in fused), inductor_pass.REPORTS


@pytest.mark.parametrize("name", ["multi_stage", "ln_postnorm", "rmsnorm", "softmax", "mblr"])
@pytest.mark.parametrize("shape", [(8192, 1024, 1024), (2048, 1024, 3072)], ids=["paper", "N3072"])
@pytest.mark.parametrize("form", ["", "lanes=32", "lanes=32,tail=64", "tail=96"],
                         ids=["8lanes", "32lanes", "32lanes-tail64", "8lanes-tail96"])
def test_generated_warp_specialised_kernel_matches_the_reference(name, shape, form):
    """The Gluon kernel generated from the region's stages (ws_stages) forced: 1 or 2 exchanges
    a tile (moment and online-softmax pairs merged), strips of 4 and 12 tiles, a chunk's rows
    over 8 or 32 lanes, the last rows of each program's last tile by the mainloop's warps (both
    shapes give some programs 2 tiles and some 1); 20 more calls give the same output (the
    counters only grow, 2 E TILES_N a strip a launch; a shared tile's two groups write the same
    statistics, to the bit); new tensors go through the direct launch."""
    forced_schedule_matches(name, shape, "ws_stages", 20, plan=form)


@pytest.mark.parametrize("shape", [(8192, 1024, 1024), (2048, 1024, 3072), (4096, 3072, 768)],
                         ids=["paper", "N3072", "bert_ffn_out"])
@pytest.mark.parametrize("form", ["res_tma=1", "res_tma=1,tail=96", "res_tma=1,keep=0,tail=96"],
                         ids=["whole_tiles", "tail96", "tail96-nothing_kept"])
def test_generated_kernel_with_the_residual_by_tma_matches_the_reference(shape, form):
    """LayerNorm post-norm with the residual TMA-loaded into the hand-off buffer as soon as the
    epilogue frees it, added by the mainloop before the hand-off (the template's RES 2), alone
    and with the last tile shared; strips of 4, 12 and 3 tiles; with nothing kept and the last
    tile shared (autotuning's candidate for a region with a residual)."""
    forced_schedule_matches("ln_postnorm", shape, "ws_stages", 20, plan=form)


@pytest.mark.parametrize("name, form", [("ln_postnorm", "keep=0"), ("ln_postnorm", "keep=0,res_tma=1"),
                                        ("multi_stage", "keep=0"), ("mblr", "keep=0")],
                         ids=["ln_postnorm", "ln_postnorm-res_tma", "multi_stage", "mblr"])
@pytest.mark.parametrize("shape", [(8192, 1024, 1024), (2048, 1024, 3072)], ids=["paper", "N3072"])
def test_generated_kernel_with_nothing_kept_matches_the_reference(name, form, shape):
    """keep=0: the merged kernel's later passes recompute the exchange's value (the residual
    read again, or already in the buffer with res_tma) rather than read it kept in the hand-off
    buffer."""
    forced_schedule_matches(name, shape, "ws_stages", 20, plan=form)


@pytest.mark.parametrize("name, form", [("multi_stage", ""), ("ln_postnorm", ""), ("rmsnorm", ""), ("softmax", ""),
                                        ("mblr", ""), ("multi_stage", ",tail=96"), ("softmax", ",tail=96"),
                                        ("ln_postnorm", ",res_tma=1,keep=0,tail=96")],
                         ids=["multi_stage", "ln_postnorm", "rmsnorm", "softmax", "mblr", "multi_stage-tail96",
                              "softmax-tail96", "ln_postnorm-res_tma-nothing_kept-tail96"])
@pytest.mark.parametrize("shape", [(8192, 1024, 1024), (2048, 1024, 3072)], ids=["paper", "N3072"])
def test_generated_kernel_with_passes_not_unrolled_matches_the_reference(name, shape, form):
    """roll: each epilogue pass a run-time loop over its chunks, a chunk of the hand-off tile
    read and written as its 64-column pieces (parts.chunk_view: the pieces' place in the NVMMA
    layout is what this checks, which the CPU's emulation takes as given)."""
    forced_schedule_matches(name, shape, "ws_stages", 20, plan="roll=1" + form)


@pytest.mark.parametrize("name, form", [("multi_stage", ",roll=1"), ("ln_postnorm", ",roll=1"),
                                        ("rmsnorm", ",roll=1"), ("softmax", ""), ("mblr", ",roll=1")],
                         ids=["multi_stage-roll", "ln_postnorm-roll", "rmsnorm-roll", "softmax", "mblr-roll"])
@pytest.mark.parametrize("shape", [(8192, 1024, 1024), (2048, 1024, 3072)], ids=["paper", "N3072"])
def test_generated_kernel_with_the_last_tile_in_the_ring_matches_the_reference(name, shape, form):
    """last_in_ring with the last 96 rows shared: each program's last tile handed off into the
    B operand's ring (its K loop done) rather than the hand-off buffer, with its own statistics,
    so the mainloop's warps start their rows while the epilogue partition may still be on the
    tile before; some programs get one tile (that one in the ring at once)."""
    forced_schedule_matches(name, shape, "ws_stages", 20, plan="tail=96,last_in_ring=1" + form)


@pytest.mark.parametrize("name, form", [("multi_stage", ",last_in_ring=1"), ("ln_postnorm", ""),
                                        ("softmax", ",last_in_ring=1")],
                         ids=["multi_stage-ring", "ln_postnorm", "softmax-ring"])
@pytest.mark.parametrize("shape", [(8192, 1024, 1024), (2048, 1024, 3072)], ids=["paper", "N3072"])
def test_generated_kernel_with_the_whole_last_tile_by_the_mainloop_warps_matches_the_reference(name, shape, form):
    """tail=128: each program's last tile all the mainloop warps' (in the B ring or the hand-off
    buffer), its exchanges counting their part as a whole tile, the epilogue partition's loop a
    tile shorter."""
    forced_schedule_matches(name, shape, "ws_stages", 20, plan="tail=128,roll=1" + form)


@pytest.mark.parametrize("form", ["", ",tail=128,last_in_ring=1", ",tail=96"],
                         ids=["ln_postnorm", "ln_postnorm-tail128-ring", "ln_postnorm-tail96"])
@pytest.mark.parametrize("shape", [(8192, 1024, 1024), (2048, 1024, 3072)], ids=["paper", "N3072"])
def test_generated_kernel_with_loops_loading_a_chunk_ahead_matches_the_reference(shape, form):
    """roll with lookahead: the residual read from global memory a chunk ahead, carried by the
    pass's loop."""
    forced_schedule_matches("ln_postnorm", shape, "ws_stages", 20, plan="roll=1,lookahead=1" + form)


@pytest.mark.parametrize("name", ["log1p", "expm1"])
def test_generated_kernel_with_log1p_and_expm1_matches_the_reference(name):
    """log1p and expm1 in the generated kernel (strip.py's Gluon forms of Kahan's
    formulas), on small values where the naive log(1 + v) / exp(v) - 1 lose every digit."""
    def fn(x, w):
        v = (x @ w) * 1e-3
        return torch.softmax((torch.log1p(v.abs()) if name == "log1p" else torch.expm1(v)) * 1e3, -1)
    args = (torch.randn(8192, 1024, device="cuda").to(torch.bfloat16),
            (torch.randn(1024, 1024, device="cuda") / 32).to(torch.bfloat16))
    forced_fn_matches(fn, args, "ws_stages", 5)


@pytest.mark.parametrize("tail", [0, 96], ids=["whole_tiles", "tail96"])
@pytest.mark.parametrize("name", ["ln_saving_statistics", "softmax_and_max"])
@pytest.mark.parametrize("shape", [(8192, 1024, 1024), (2048, 1024, 3072)], ids=["paper", "N3072"])
def test_generated_kernel_with_per_row_outputs_matches_the_reference(name, shape, tail):
    """Per-row [M] outputs (a training forward's saved LayerNorm statistics; a row max) beside
    the [M, N] one, written by each strip's first tile; checked on the CPU by the emulation
    (test_stages_emulate.py), here on the GPU."""
    from test_stages_emulate import ROW_OUTPUTS
    fn, vectors = ROW_OUTPUTS[name]
    M, K, N = shape
    args = (torch.randn(M, K, device="cuda").to(torch.bfloat16),
            (torch.randn(K, N, device="cuda") / K ** 0.5).to(torch.bfloat16),
            *[torch.randn(N, device="cuda").to(torch.bfloat16) for _ in range(vectors)])
    fresh = tuple(torch.randn_like(a, dtype=torch.float32).to(a.dtype) for a in args)
    # bf16's tolerance for the float32 statistics too: the kernel takes them from the fp32
    # accumulator, where the program rounds x @ w + b to bf16 first (the first GPU run: 1.3e-3
    # off the float64 reference, against float32's 1e-4; a kernel rounds only when it stores)
    forced_fn_matches(fn, args, "ws_stages", 20, fresh, tol=tolerance(torch.bfloat16), plan=f"tail={tail}")


def test_a_region_reads_an_operand_inductor_pads(tmp_path):
    """A fused region whose A operand (rows of 2000 bf16 elements, 4000 bytes: not a multiple
    of 128) is an Inductor buffer that a cuBLAS GEMM also reads. Inductor pads such rows for
    alignment; a kernel launched from its wrapper takes its strides as constants and would
    need a copy, so the region runs through the operator, which takes the padded buffer as
    it is: the result matches eager's."""
    from comfuse import backend
    torch.manual_seed(0)
    x = torch.randn(512, 2000, device="cuda", dtype=torch.bfloat16)
    w, w2 = (torch.randn(2000, n, device="cuda", dtype=torch.bfloat16) / 45 for n in (256, 384))
    r = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)

    def f(x, w, w2, r):
        h = x * 2 + 1
        return h @ w2, torch.relu(h @ w + r)
    torch._dynamo.reset()
    with comfuse.settings.override(cache_dir=tmp_path, check=False, autotune="0", graph_check="0",
                                   schedule="tile"), torch.no_grad():
        got = torch.compile(f, backend="comfuse", dynamic=False)(x, w, w2, r)
    launched = [r.launch for rep in backend.REPORTS[-1:] for r in rep.regions if r.fused]
    assert len(launched) == 1 and "Inductor pads the rows of" in launched[0], str(backend.REPORTS[-1])
    want = f(x.double(), w.double(), w2.double(), r.double())
    for g, e in zip(got, want):
        torch.testing.assert_close(g.double(), e, rtol=2e-2, atol=2e-2)


def test_a_split_plan_is_launched_by_inductor_as_its_two_kernels(tmp_path):
    """A loss over rows of 8192 (cross-entropy of a GEMM's logits, the logits not returned)
    with the split schedule inside the backend: Inductor's wrapper launches the slices'
    kernel and then the combine kernel, which reads the statistics the first wrote; the loss
    matches eager's in float64."""
    from comfuse import backend
    torch.manual_seed(0)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 8192, device="cuda", dtype=torch.bfloat16) / 16
    t = torch.randint(0, 8192, (1024,), device="cuda")

    def f(x, w, t):
        return torch.nn.functional.cross_entropy((x @ w).float(), t)
    torch._dynamo.reset()
    with comfuse.settings.override(cache_dir=tmp_path, check=False, autotune="0", graph_check="0",
                                   schedule="split"), torch.no_grad():
        got = torch.compile(f, backend="comfuse", dynamic=False)(x, w, t)
    regions = [r for r in backend.REPORTS[-1].regions if r.fused]
    assert [(r.schedule, r.launch) for r in regions] == [("split", "Inductor's wrapper launches the kernel")], \
        str(backend.REPORTS[-1])
    want = f(x.double(), w.double(), t).double()
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


def test_inside_the_backend_candidates_compile_in_workers_and_are_timed_by_graph_replays(tmp_path, caplog):
    """Inside the backend's pass a region whose candidates Inductor launches is timed by
    CUDA-graph replays, its candidates compiled by the compile workers (Triton's cache then
    answers every first launch); the stored decision says how it was timed, and the result
    matches eager's."""
    import logging

    from comfuse.runtime import workers

    def fn(x, w, b):  # (a pointwise epilogue: tile plans, which the cost model has tuned)
        return torch.nn.functional.gelu(x @ w + b)
    args = [torch.randn(*s, device="cuda", dtype=torch.bfloat16) / 8 for s in ((4096, 768), (768, 3072), (3072,))]
    torch._dynamo.reset()
    with comfuse.settings.override(cache_dir=tmp_path, autotune="1"), torch.no_grad(), \
            caplog.at_level(logging.INFO, logger="comfuse.tuning"):
        got = torch.compile(fn, backend="comfuse", dynamic=False)(*args)
    decisions = [json.loads(p.read_text()) for p in (tmp_path / "tuning").glob("*.json")]
    assert decisions and all(d["timing"] == "graph" for d in decisions), decisions
    assert "and compile workers" in caplog.text, caplog.text
    assert workers._pool and not workers._pool[0].broken
    want = fn(*(a.double() for a in args))
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


def test_kept_memory_stays_out_of_a_cuda_graph_pool():
    """With this thread's allocations routed to a CUDA-graph memory pool (as Inductor routes them
    while it warms up a graph under reduce-overhead), what a kernel keeps (``kept.allocate``) is
    made outside the pool: the pool then holds only the routed tensor, the one Inductor tracks.
    The counters are zero when the caller reads them."""
    from comfuse.runtime import kept
    dev = torch.cuda.current_device()
    pool = torch.cuda.graph_pool_handle()
    torch._C._cuda_beginAllocateCurrentThreadToPool(dev, pool)
    try:
        routed = torch.empty(1 << 20, device="cuda")
        ws, counters = kept.allocate("cuda", lambda: (torch.empty(1 << 20, device="cuda"),
                                                      torch.zeros(64, dtype=torch.int64, device="cuda")))
    finally:
        torch._C._cuda_endAllocateToPool(dev, pool)
    try:
        assert torch._C._cuda_checkPoolLiveAllocations(dev, pool, {routed.untyped_storage().data_ptr()})
        assert not torch._C._cuda_checkPoolLiveAllocations(dev, pool, set())  # (the check sees the routed one)
        assert counters.sum().item() == 0 and ws.numel() == 1 << 20
    finally:
        del routed
        torch._C._cuda_releasePool(dev, pool)


@pytest.mark.parametrize("M", [8192, 1031])
def test_every_plan_of_swiglus_two_products_matches_the_reference(M):
    """SwiGLU at a Llama-3-8B MLP's widths (4096 -> 14336, bf16): the region that computes the
    gate and up products in one mainloop, autotuned (its choice and times printed), then every
    candidate plan against the float64 reference."""
    import torch.nn.functional as F
    from comfuse.planner.candidates import candidates
    from comfuse.runtime.build import build

    def swiglu(x, wg, wu):
        return F.silu(x @ wg) * (x @ wu)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(M, 4096, generator=g),) + tuple(torch.randn(4096, 14336, generator=g) / 64 for _ in range(2))
    args = tuple(t.to("cuda", torch.bfloat16) for t in args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", comfuse.ComfuseWarning)
        compiled = comfuse.compile(swiglu, args)
        out = compiled(*args)
        assert compiled.report.regions[0].found.dual
        assert_matches_reference(swiglu, args, out)
        (module,) = compiled.fused_regions()
        seen, forward = [], module.forward
        module.forward = lambda *ext: seen.append(ext) or forward(*ext)
        compiled(*args)
        ext = seen[-1]
        plans = candidates(module.region, "cuda")
        assert any(p.mainloop == "tma" for p in plans)
        for plan in plans:
            (result,) = module.run(ext, ext[module.operands[0]].device, build(plan), check=True)
            assert result.shape == (M, 14336)
        with comfuse.settings.override(autotune="1"):
            tuned = comfuse.compile(swiglu, args)
            assert_matches_reference(swiglu, args, tuned(*args))
    (report,) = tuned.report.regions
    print(f"\nswiglu M={M}: {report.plan or report.reason}")


def _bert_two_layers():
    """BERT for masked LM, 2 layers at real widths (bf16, dropout off), on 16 x 512 tokens with
    labels: (model, its keyword inputs, eager's loss of one step, eager's gradients as one
    vector). Dynamo and the whole-graph checks start empty."""
    tf = pytest.importorskip("transformers")
    from comfuse import backend
    from comfuse.bench.models import grads, step
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = tf.BertConfig(num_hidden_layers=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = tf.BertForMaskedLM(cfg).to("cuda", torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (16, 512), device="cuda")
    kwargs = {"input_ids": ids, "labels": ids}
    want = step(model, model, kwargs).float()
    want_grads = grads(model)
    backend.GRAPH_CHECKS.clear()
    return model, kwargs, want, want_grads


def test_a_training_graph_under_reduce_overhead_is_checked_by_its_steps(monkeypatch):
    """BERT (2 layers, real widths) under mode "reduce-overhead": its training graph differs
    from Inductor's in its attention mask (given a dense last dimension), here not timed alone.
    The whole-graph check times that graph by its steps alone (its forward alone runs no
    CUDA-graph replay) and keeps the rewrite, whose steps run cuDNN's fused attention; the
    gradients match eager's."""
    from comfuse import backend
    from comfuse.bench.models import grads, rel, step
    monkeypatch.setattr(backend, "dense_masks_pay", lambda gm, training: None)
    model, kwargs, want, want_grads = _bert_two_layers()
    run = torch.compile(model, backend="comfuse", mode="reduce-overhead")
    with comfuse.settings.override(autotune="auto"):  # (as users run it: graphs are timed)
        for _ in range(3):
            loss = step(run, model, kwargs).detach().float()
    assert rel(loss, want) < 1e-2 and rel(grads(model), want_grads) < 3e-2
    (check, ) = [c for c in backend.GRAPH_CHECKS if c["training"]]
    assert "fused_ms" not in check and "inductor_ms" not in check, check
    assert check["kept"] == "fused" and check["fused_step_ms"] < check["inductor_step_ms"], check


def test_bert_keeps_its_dense_masks_timed_alone_without_compiling_its_graph_twice(caplog):
    """BERT (2 layers, real widths), default mode: the attention with the dense mask is timed
    alone (forward and backward) and wins, so the training graph keeps it without a whole-graph
    check of the rewrite (a check remains only for a region kept fused); loss and gradients
    match eager's."""
    import logging
    from comfuse import backend
    from comfuse.bench.models import grads, rel, step
    model, kwargs, want, want_grads = _bert_two_layers()
    run = torch.compile(model, backend="comfuse")
    with caplog.at_level(logging.INFO, logger="comfuse.backend"), comfuse.settings.override(autotune="auto"):
        loss = step(run, model, kwargs).detach().float()
    assert rel(loss, want) < 1e-2 and rel(grads(model), want_grads) < 3e-2
    said = [r.getMessage() for r in caplog.records if "timed alone" in r.getMessage()]
    print("\n" + "\n".join(said))
    assert said and "dense masks kept" in said[0] and "with their backward" in said[0], said
    assert all(c["regions"] > 0 for c in backend.GRAPH_CHECKS), backend.GRAPH_CHECKS
