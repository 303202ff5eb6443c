"""The warp-specialised Gluon kernel generated from a region's stages (ws_stages): which
regions the generator takes, how the planner offers it, and that its kernels compile for
sm_90. Gluon does not run in Triton's CPU interpreter, so results are checked on the H200
(tests/test_gpu.py)."""
import dataclasses
import textwrap

import pytest
import torch
import torch.nn.functional as F

from comfuse import settings
from comfuse.bench.workloads import SUITE
from comfuse.frontend.capture import capture
from comfuse.frontend.regions import find_regions
from comfuse.ir import Op
from comfuse.planner import plan
from comfuse.planner.plan import NotFused, candidates
from comfuse.runtime.kernel import interpreting

from test_codegen import run_compiler_script

bf = torch.bfloat16


def forced(fn, *args, target="cuda", merge=False):
    (cand,) = find_regions(capture(fn, args))
    with settings.override(schedule="ws_stages", ws_merge=merge):
        return plan(cand.region, target=target)


def suite_plan(name, M=256, K=64, N=1024, target="cuda", merge=False):
    wl = SUITE[name]
    return forced(wl.fn, *wl.inputs(M, K, N, dtype=bf, device="cpu"), target=target, merge=merge)


@pytest.mark.parametrize("name, exchanges", [("rmsnorm", 1), ("softmax", 2), ("ln_postnorm", 2), ("mblr", 2),
                                             ("multi_stage", 4)])
def test_the_generator_takes_the_suites_row_reductions(name, exchanges):
    """One exchange per stage that ends in reductions: plain sums and maxima (LayerNorm's mean,
    then its squared deviations; softmax's max, then its sum)."""
    p = suite_plan(name)
    assert not isinstance(p, NotFused), p.reason
    assert p.schedule == "ws_stages" and p.exchanges == exchanges and p.tiles_n == 4
    assert f"exchange per-row partials {exchanges} time(s)" in p.describe()
    with settings.override(ws_merge=False):  # (by default autotuning offers the merged plan)
        assert p in candidates(p.region, target="cuda")


def test_the_generator_refuses_with_the_reason():
    refused = suite_plan("ln_postnorm", target="interpreter")
    assert isinstance(refused, NotFused) and "interpreter" in refused.reason
    assert "whole 128x256x64 tiles" in suite_plan("ln_postnorm", M=200).reason
    x, w = torch.randn(256, 64, dtype=bf), torch.randn(64, 512, dtype=bf)
    p = forced(lambda x, w: torch.softmax(torch.log1p((x @ w).abs()), -1), x, w)
    assert not isinstance(p, NotFused)  # (every op of the IR a user's graph can hold has a Gluon form)
    p = forced(lambda x, w: (x @ w).relu(), x, w)
    assert isinstance(p, NotFused)
    t = torch.randint(0, 512, (256, ))
    p = forced(lambda x, w, t: F.cross_entropy(x @ w, t, reduction="none"), x, w, t)
    assert isinstance(p, NotFused) and "side input" in p.reason
    p = forced(lambda x, w: torch.logsumexp(x @ w, -1), x, w)
    assert isinstance(p, NotFused) and "per-row outputs" in p.reason


def test_the_generated_kernel_reads_as_its_stages():
    """The file starts with the region's IR, has one commented pass per exchange with the IR's
    node numbers, and stores each output once."""
    from comfuse.runtime.stages_kernel import source_text
    p = suite_plan("multi_stage")
    text = source_text(p, "k")
    assert "Generated from this IR" in text and "%0 = acc" in text
    assert [f"# ---- exchange {e}:" in text for e in range(4)] == [True] * 4
    assert "# ---- the outputs, each written once ----" in text
    assert text.count("gl.store(out") == len(p.region.outputs)
    # (TRACE: the program's start and end, around the partitions' fork and join)
    assert text.index("_mark(trace_ptr, 63, 0, TRACE)") < text.index("gl.warp_specialize([") \
        < text.index("_mark(trace_ptr, 63, 1, TRACE)")
    assert "tanh_fast(" in text and "%8 tanh" in text
    # the special-function unit's exp and tanh; softmax's division by the row's sum as one
    # reciprocal a row and a multiply per element
    assert "gl.exp(" not in text and "= exp_fast(v3)" in text and "v4 * (1.0 / v5)" in text


def test_every_constexpr_of_the_generated_kernel_is_given_at_launch():
    """The direct launcher (runtime.kernel.launch_direct) takes the kernel's constexprs from
    the options; one left to its default would send every call through the JIT's binding."""
    from comfuse.runtime import stages_kernel
    for lanes in (32, 8):
        p = dataclasses.replace(suite_plan("multi_stage", N=4096, merge=True), lanes=lanes)
        k = stages_kernel.build(p, f"k_constexprs_{lanes}")
        given = 2 + len(p.region.inputs) + len(p.region.outputs) + 6  # a, b, tensors, ws, counters, M, N, K, trace
        options = k.options(4096)
        assert set(k.fn.arg_names[given:]) <= set(options) and options["LANES_N"] == lanes


def test_generated_kernels_compile_for_sm90():
    """The suite's row reductions and a LayerNorm through nn.Linear's weight ([N, K]), merged or
    not, with the output by TMA store or not, the last tile shared with the mainloop's warps
    or not, and the other forms' settings: 12 warps at <= 168 registers, the epilogue
    partition at 152 (160 at 8 warps beside the 4 of a 128-wide tile), at most a few spills;
    with 16-bit adds in 16 bits, LayerNorm's epilogue partition under 0.85x the instructions."""
    script = textwrap.dedent("""
        import json, re, torch
        import torch.nn.functional as F
        from comfuse import settings
        from comfuse.bench.workloads import SUITE
        from comfuse.frontend.capture import capture
        from comfuse.frontend.regions import find_regions
        from comfuse.planner import plan
        from comfuse.runtime.aot import partitions, resources
        from comfuse.runtime.stages_kernel import EPI_REGS, compile_sm90
        bf = torch.bfloat16
        cases = {name: (SUITE[name].fn, SUITE[name].inputs(256, 64, 1024, dtype=bf, device="cpu"))
                 for name in ("multi_stage", "ln_postnorm", "softmax")}
        cases["ln_linear"] = (lambda x, w, b: F.layer_norm(F.linear(x, w, b), (768,)),
                              (torch.randn(256, 64, dtype=bf), torch.randn(768, 64, dtype=bf),
                               torch.randn(768, dtype=bf)))
        cases["log1p_softmax"] = (lambda x, w: torch.softmax(torch.log1p((x @ w).abs()), -1),
                                  (torch.randn(256, 64, dtype=bf), torch.randn(64, 1024, dtype=bf)))
        out = {}
        for name, (fn, args) in [*cases.items(), ("multi_stage_merged", cases["multi_stage"]),
                                 ("ln_postnorm_merged", cases["ln_postnorm"]),
                                 ("multi_stage_merged_tma", cases["multi_stage"]),
                                 ("ln_linear_tma", cases["ln_linear"]),
                                 ("multi_stage_merged_tail", cases["multi_stage"]),
                                 ("ln_postnorm_merged_res", cases["ln_postnorm"]),
                                 ("ln_postnorm_merged_ahead", cases["ln_postnorm"]),
                                 ("ln_postnorm_merged_res_nokeep", cases["ln_postnorm"]),
                                 ("ln_postnorm_merged_res_nokeep_tail_vec8", cases["ln_postnorm"]),
                                 ("softmax_merged_vec8", cases["softmax"]),
                                 ("ln_postnorm_merged_narrow", cases["ln_postnorm"]),
                                 ("softmax_merged", cases["softmax"]),
                                 ("softmax_merged_expfma", cases["softmax"]),
                                 ("ln_postnorm_merged_tile128", cases["ln_postnorm"]),
                                 ("multi_stage_merged_tail_tile128", cases["multi_stage"]),
                                 ("ln_postnorm_merged_res_nokeep_tail_tile128", cases["ln_postnorm"]),
                                 ("softmax_merged_vec8_roll", cases["softmax"]),
                                 ("multi_stage_merged_tail_vec8_roll", cases["multi_stage"]),
                                 ("ln_postnorm_merged_res_nokeep_tail_vec8_roll", cases["ln_postnorm"]),
                                 ("multi_stage_merged_tail_vec8_roll_ring", cases["multi_stage"]),
                                 ("softmax_merged_tail_vec8_ring", cases["softmax"]),
                                 ("multi_stage_merged_tail128_vec8_roll_ring", cases["multi_stage"]),
                                 ("ln_postnorm_merged_vec8_roll_chunk32", cases["ln_postnorm"]),
                                 ("multi_stage_merged_tail128_vec8_roll_chunk32_ring", cases["multi_stage"]),
                                 ("ln_postnorm_merged_vec8_roll_ahead", cases["ln_postnorm"])]:
            (cand,) = find_regions(capture(fn, args))
            with settings.override(schedule="ws_stages", ws_merge="_merged" in name, ws_tma_store=name.endswith("_tma"),
                                   ws_tail=128 if "_tail128" in name else 96 if "_tail" in name else 0, ws_vec=8 if "_vec8" in name else 0,
                                   ws_lanes=8 if "_merged" in name else 32,  # (plain LayerNorm at 8 lanes: 400 bytes)
                                   ws_res_tma="_res" in name, ws_lookahead=name.endswith("_ahead"),
                                   ws_keep="_nokeep" not in name,
                                   ws_narrow=name.endswith("_narrow"), ws_exp_fma=name.endswith("_expfma"),
                                   ws_tile_n=128 if name.endswith("_tile128") else 256, ws_roll="_roll" in name,
                                   ws_last_in_ring=name.endswith("_ring"), ws_chunk=32 if "_chunk32" in name else 0):
                p = plan(cand.region, target="cuda")
            k = compile_sm90(p)
            regs = sorted(set(int(v) for v in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+);",
                                                          k.asm["ptx"])))
            epilogue = [n for r, n in partitions(k.asm["cubin"]) if r == EPI_REGS[p.epi_warps]]
            out[name] = dict(resources(k.asm["cubin"]), smem=k.metadata.shared, setmaxnreg=regs,
                             kmajor=p.region.gemm.b.major, epilogue=epilogue, epi_regs=EPI_REGS[p.epi_warps],
                             warps=[p.num_warps, p.epi_warps, p.block_n],
                             scalar_bf16=k.asm["ptx"].count("cvt.rn.bf16.f32"), roll=p.roll, ring=p.last_in_ring)
        print(json.dumps(out))
    """)
    result = run_compiler_script(script)
    assert result["ln_linear"]["kmajor"] == "K"
    # 16-bit adds in 16 bits: LayerNorm's epilogue partition a fifth shorter (4 884 -> 3 751
    # instructions, sm_90, 2026-12-01), where nvdisasm is there to count them
    plain, narrow = result["ln_postnorm_merged"]["epilogue"], result["ln_postnorm_merged_narrow"]["epilogue"]
    if plain and narrow:
        assert narrow[0] < 0.85 * plain[0], (plain, narrow)
    # exp(x - max) by one FFMA: softmax's a tenth shorter (3 827 -> 3 331)
    plain, fma = result["softmax_merged"]["epilogue"], result["softmax_merged_expfma"]["epilogue"]
    if plain and fma:
        assert fma[0] < 0.9 * plain[0], (plain, fma)
    # 128-wide tiles (COMFUSE_WS_TILE_N=128): 4 mainloop warps beside 8 epilogue warps at 160
    # registers, at most a few spills (LayerNorm with the residual by TMA and the shared tile:
    # 32 bytes, sm_90, 2026-12-01; none for the others), and over 114 KB of shared memory (one
    # CTA an SM: co-residency)
    for name in ("ln_postnorm_merged_tile128", "multi_stage_merged_tail_tile128",
                 "ln_postnorm_merged_res_nokeep_tail_tile128"):
        info = result[name]
        assert info["warps"] == [4, 8, 128] and info["smem"] > 114 * 1024, (name, info)
        if "stack" in info:
            assert info["stack"] <= (64 if "_res" in name else 0), (name, info)
    # a kept value rounds to bf16 two elements at a time (strip.bf16_pairs): no scalar
    # conversion is left in the passes that keep one (256 a tile each in multi-stage's and
    # LayerNorm's before, 2026-12-01)
    for name in ("multi_stage_merged", "ln_postnorm_merged", "ln_postnorm_merged_narrow"):
        assert result[name]["scalar_bf16"] == 0, (name, result[name]["scalar_bf16"])
    # passes not unrolled (COMFUSE_WS_ROLL): softmax's epilogue partition a fifth of the
    # instructions (3 817 -> 747, sm_90, 2026-12-02)
    assert all(result[name]["roll"] == ("_roll" in name) for name in result)
    # the last tile handed off in the B ring (COMFUSE_WS_LAST_IN_RING): its own statistics, and
    # still one CTA's shared memory (checked below with the rest)
    assert all(result[name]["ring"] == name.endswith("_ring") for name in result)
    plain, rolled = result["softmax_merged_vec8"]["epilogue"], result["softmax_merged_vec8_roll"]["epilogue"]
    if plain and rolled:
        assert rolled[0] < 0.3 * plain[0], (plain, rolled)
    for name, info in result.items():
        assert info["smem"] <= 227 * 1024, (name, info)
        assert info["epi_regs"] in info["setmaxnreg"], (name, info)
        if "reg" in info:  # (LayerNorm with a residual read per pass: 184 bytes, sm_90, 2026-12-01; the
            # residual added by the mainloop: 64, as in the template's RES 2)
            assert info["reg"] <= 168 and info["stack"] <= 256, (name, info)


def test_explain_lists_what_the_warp_specialised_kernels_would_take():
    """On any machine, the report says which Gluon schedules an sm_90 GPU would offer for each
    region, and why the others do not apply."""
    import comfuse
    wl = SUITE["linear_ce"]
    text = str(comfuse.explain(wl.fn, wl.inputs(256, 64, 1024, dtype=bf, device="cpu")))
    line = [ln for ln in text.splitlines() if "warp-specialised kernels (sm_90)" in ln]
    assert line and "ws_split: offered" in line[0] and "ws_strip: the template writes one bf16" in line[0]
    wl = SUITE["multi_stage"]
    text = str(comfuse.explain(wl.fn, wl.inputs(256, 64, 1024, dtype=bf, device="cpu")))
    assert "ws_stages: offered" in text and "ws_strip: the epilogue is not LayerNorm" in text


@pytest.mark.parametrize("name, exchanges, kinds", [("multi_stage", 2, ["moments", "lse"]), ("ln_postnorm", 1, ["moments"]),
                                                    ("softmax", 1, ["lse"]), ("mblr", 1, ["moments"]),
                                                    ("rmsnorm", 1, [])])
def test_merged_exchanges_halve_the_strip_waits(name, exchanges, kinds):
    """A sum and its sum of squared deviations share one exchange (tile moments, Chan), and so
    do a max and its sum of exp(x - max) (online); autotuning offers the merged plan unless
    COMFUSE_WS_MERGE=0, which keeps one exchange per stage."""
    p = suite_plan(name, merge=True)
    assert p.exchanges == exchanges and sorted(k for k, _, _ in p.moments) == sorted(kinds)
    if kinds:
        assert "pairs merged" in p.describe()
        from comfuse.runtime.stages_kernel import source_text
        text = source_text(p, "k")
        assert "(merged with %" in text
        if name != "softmax":  # the exchange's value is kept in the buffer for the later passes
            assert "kept in the hand-off buffer" in text
        if name == "multi_stage":  # tanh(v) * softmax(v) computed once, in the pass that keeps it
            assert text.count("= tanh_fast(") == 1
        if name == "ln_postnorm":  # the residual read once
            assert text.count("gl.load(in1_ptr + row[:, None] * N") == 1
        plain = suite_plan(name)
        assert plain.exchanges > exchanges and not plain.moments
        assert [q for q in candidates(plain.region, target="cuda") if q.schedule == "ws_stages" and q.moments]
        with settings.override(ws_merge=False):
            offered = [q for q in candidates(plain.region, target="cuda") if q.schedule == "ws_stages"]
            assert offered and not [q for q in offered if q.moments]


def test_the_output_tile_by_one_tma_store():
    """COMFUSE_WS_TMA_STORE=1 (experimental): the output pass writes its values over the
    buffer's rows it has read, then one bulk copy writes the tile, waited for before the buffer
    is freed; only for a region whose one output is a bf16 [M, N] tile; autotuning offers it
    only with the setting."""
    from comfuse.runtime.stages_kernel import source_text
    plain = suite_plan("ln_postnorm")
    assert not plain.tma_store
    assert not [q for q in candidates(plain.region, target="cuda") if q.tma_store]
    with settings.override(ws_tma_store=True):
        p = suite_plan("ln_postnorm")
        assert [q for q in candidates(plain.region, target="cuda") if q.schedule == "ws_stages" and q.tma_store]
    assert p.tma_store and "(by one TMA store)" in p.describe()
    text = source_text(p, "k")
    assert "gl.store(out0_ptr" not in text and text.count("tma.async_copy_shared_to_global(o_desc") == 1
    out = text.index("# ---- the outputs")
    assert text.index("fence_async_shared()", out) < text.index("tma.async_copy_shared_to_global", out) \
        < text.index("tma.store_wait(0)", out) < text.index("mbarrier.arrive(tile_free)", out)
    x, w = torch.randn(256, 64, dtype=bf), torch.randn(64, 1024, dtype=bf)
    with settings.override(ws_tma_store=True):  # two outputs: each thread stores them
        two = forced(lambda x, w: (torch.softmax(x @ w, -1), torch.tanh(x @ w)), x, w)
    assert not isinstance(two, NotFused) and not two.tma_store


def test_a_division_by_a_broadcast_value_is_a_reciprocal_and_a_multiply():
    """A tile over a per-row value or a constant: one reciprocal, a multiply per element; a
    division by the constant 0 stays a division (the reciprocal would fold to 1 / 0)."""
    from comfuse.runtime.stages_kernel import source_text
    x, w = torch.randn(256, 64, dtype=bf), torch.randn(64, 1024, dtype=bf)
    text = source_text(forced(lambda x, w: torch.softmax((x @ w) / 3.0, -1), x, w), "k")
    assert "v0 * (1.0 / 3.0)" in text
    text = source_text(forced(lambda x, w: torch.softmax((x @ w) / 0.0, -1), x, w), "k")
    assert "v0 / 0.0" in text


def test_the_last_tile_shared_with_the_mainloop_warps():
    """COMFUSE_WS_TAIL=ROWS: the mainloop partition runs the last ROWS rows of its program's
    last tile through the per-tile function, in chunks of 32 rows (each thread as many values
    as an epilogue warp's thread), the epilogue partition the first ones in chunks of 16; each
    exchange counts 2 TILES_N arrivals (2 a whole tile, 1 a part); both groups combine the
    strip's partials in a layout without cross-warp sums (the same bits). 96 rows at 8 lanes
    are an autotuning candidate; all 128 leave the epilogue partition out of the last tile;
    rows that are not a multiple of 32 are refused; a shared tile is written by each thread,
    not by one TMA store."""
    from comfuse.codegen.gluon import stages
    from comfuse.runtime.stages_kernel import source_text
    plain = suite_plan("rmsnorm", merge=True)
    assert plain.tail == 0 and "_main(" not in source_text(plain, "k")
    offered = [q for q in candidates(plain.region, target="cuda") if q.schedule == "ws_stages"]
    # (8 lanes: the planner's choice; 8 lanes with a shared last tile a third candidate; those
    # two with each pass a loop over its chunks, COMFUSE_WS_ROLL; then, with loops, the whole
    # last tile the mainloop warps', in the B ring)
    assert [(q.lanes, q.tail, q.roll, q.last_in_ring) for q in offered] == [
        (8, 0, False, False), (32, 0, False, False), (8, 96, False, False), (8, 0, True, False), (8, 96, True, False),
        (8, 128, True, True)]
    assert "each pass a loop over its chunks, not unrolled" in offered[-2].describe()
    assert "the B ring" in offered[-1].describe()
    with settings.override(ws_roll=True):  # (then the planner's choice, and no unrolled twin)
        assert [(q.lanes, q.tail, q.roll) for q in candidates(plain.region, target="cuda")
                if q.schedule == "ws_stages"] == [(8, 0, True), (32, 0, False), (8, 96, True), (8, 128, True)]
    with settings.override(ws_tail=96):
        p = suite_plan("rmsnorm", merge=True)
        assert [q.tail for q in candidates(plain.region, target="cuda") if q.schedule == "ws_stages"] == [96, 96]
        with settings.override(ws_tma_store=True):
            assert not suite_plan("rmsnorm").tma_store
    assert p.tail == 96 and "the last 96 rows of the last tile" in p.describe()
    text = source_text(p, "k")
    assert "def k_main(" in text and "(k_main, (" in text and "(_mma_partition, (" not in text
    assert "BM // CHUNK - last * (96 // CHUNK), 2 - last" in text  # the epilogue partition's part
    assert "(BM - 96) // MC, BM // MC," in text and "MC: gl.constexpr = CHUNK * num_warps // EPI_WARPS" in text
    assert text.count("target = (old // (2 * TILES_N) + 1) * (2 * TILES_N)") == p.exchanges
    assert text.count("gl.BlockedLayout([TILES_P2, 1], [1, 32], [1, WARPS], [0, 1])") == 1
    # all 128 rows the mainloop warps': the epilogue partition's loop stops a tile early, and
    # their part counts a whole tile's 2 arrivals at each exchange
    with settings.override(ws_tail=128):
        whole = source_text(suite_plan("rmsnorm", merge=True), "k")
    assert "for t in range(gl.program_id(0), num_tiles - gl.num_programs(0), gl.num_programs(0)):" in whole
    assert "(BM - 128) // MC, BM // MC," in whole and "2, False, M, N, TILES_N" in whole and "2 - last" not in whole
    with settings.override(ws_tail=100):
        refused = suite_plan("rmsnorm")
    assert isinstance(refused, NotFused) and "COMFUSE_WS_TAIL=100" in refused.reason
    with pytest.raises(ValueError, match="TMA store"):
        stages.emit(p.region, p.stages, "k", "", tma_store=True, tail=96)


def test_a_residual_adds_a_candidate_with_it_by_tma_and_nothing_kept():
    """Where the region's residual can be TMA-loaded into the hand-off buffer (LayerNorm
    post-norm), autotuning also times 8 lanes with the residual by TMA, nothing kept and the
    last tile shared (on the H200 the fastest form at 8192x1024x1024 and 16384x2048x8192); not
    where the region has no residual, nor where a setting names the residual's form."""
    offered = [q for q in candidates(suite_plan("ln_postnorm", merge=True).region, target="cuda")
               if q.schedule == "ws_stages"]
    assert [(q.lanes, q.tail, q.res_tma, q.keep) for q in offered][:4] == \
        [(8, 0, False, True), (32, 0, False, True), (8, 96, False, True), (8, 96, True, False)]
    assert "the residual by TMA" in offered[3].describe() and "nothing kept" in offered[3].describe()
    # (with loops, see the test above: the planner's form, the shared tile, this one, and the
    # whole last tile in the B ring)
    assert [(q.tail, q.roll, q.res_tma, q.keep) for q in offered[4:]] == \
        [(0, True, False, True), (96, True, False, True), (96, True, True, False), (128, True, False, True)]
    assert not any(q.res_tma for q in candidates(suite_plan("rmsnorm", merge=True).region, target="cuda"))
    with settings.override(ws_res_tma=True):
        assert len([q for q in candidates(suite_plan("ln_postnorm", merge=True).region, target="cuda")
                    if q.schedule == "ws_stages"]) == 5


def test_the_residual_by_tma_into_the_hand_off_buffer():
    """COMFUSE_WS_RES_TMA=1 (experimental): a bf16 [M, N] input added to the tile (through adds
    of broadcast values) and read nowhere else is TMA-loaded into the hand-off buffer as soon
    as the epilogue frees it, and the mainloop adds it before the hand-off; the passes read it
    as 0. Without the setting, offered only with nothing kept and the last tile shared (the
    candidate of the test above); not where the tile or the input has another use."""
    from comfuse.codegen.gluon.stages import tma_residual
    from comfuse.runtime.stages_kernel import source_text
    ln = suite_plan("ln_postnorm", merge=True)
    j = [i.name for i in ln.region.inputs].index("r_1")
    assert tma_residual(ln.region) == j and not ln.res_tma
    assert [(q.keep, q.tail, q.roll) for q in candidates(ln.region, target="cuda") if q.res_tma] == \
        [(False, 96, False), (False, 96, True)]  # (unrolled, and a loop over the chunks)
    for name in ("rmsnorm", "softmax", "mblr", "multi_stage"):
        assert tma_residual(suite_plan(name).region) is None
    x, w, r = torch.randn(256, 64, dtype=bf), torch.randn(64, 1024, dtype=bf), torch.randn(256, 1024, dtype=bf)

    def norm(v):
        return F.layer_norm(v, (1024, ))
    for fn in (lambda x, w, r: norm(x @ w + r) + r,  # the residual read twice
               lambda x, w, r: (norm(x @ w + r), x @ w),  # the tile needed without it
               lambda x, w, r: norm((x @ w) * r)):  # not an add
        assert tma_residual(forced(fn, x, w, r).region) is None
    assert tma_residual(forced(lambda x, w, r: norm(x @ w + r), x, w, r.float()).region) is None  # fp32: not bf16
    assert tma_residual(forced(lambda x, w, r: norm(x @ w + 0.5 + r), x, w, r).region) is not None  # a scalar between
    with settings.override(ws_res_tma=True):
        p = suite_plan("ln_postnorm", merge=True)
        assert not suite_plan("rmsnorm").res_tma
    assert p.res_tma and "the residual by TMA into the hand-off buffer" in p.describe()
    text = source_text(p, "k")
    first = text.index("_load_residual(r_desc, tile_smem, tile_free, gl.program_id(0), num_tiles")
    loop = text.index("for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):", first)
    later = text.index("_load_residual(r_desc, tile_smem, tile_free, t + gl.num_programs(0)", loop)
    assert first < loop < text.index("fence_async_shared()", loop) < later
    assert "mbarrier.arrive(tile_free)" not in text and "TRACE, 2, B_KMAJOR" in text
    assert f"gl.load(in{j}_ptr" not in text and f"= 0.0  # %" in text


def test_loads_a_chunk_ahead_only_with_its_setting():
    """COMFUSE_WS_LOOKAHEAD=1 (experimental): each chunk of a pass issues the next chunk's
    loads (the tile's rows, the residual) before its own work, the chunk range constexpr (so
    the shared tile's epilogue calls the per-tile function once a range). Without it, the
    runtime range, and the planner offers it in one candidate only: with loops and the whole
    last tile in the B ring (timed in the twenty-third session)."""
    from comfuse.runtime.stages_kernel import source_text
    plain = suite_plan("ln_postnorm", merge=True)
    assert not plain.lookahead and "nxt" not in source_text(plain, "k")
    assert [(q.roll, q.tail, q.last_in_ring) for q in candidates(plain.region, target="cuda")
            if q.schedule == "ws_stages" and q.lookahead] == [(True, 128, True)]
    with settings.override(ws_lookahead=True, ws_tail=96):
        p = suite_plan("ln_postnorm", merge=True)
    assert p.lookahead and "each chunk loads the next ahead" in p.describe()
    text = source_text(p, "k")
    assert "c_lo: gl.constexpr," in text and "c_hi: gl.constexpr, share: gl.constexpr" in text
    # both passes: the first chunk's loads, then the next chunk's ahead of each chunk's work
    assert text.count("if c == c_lo:") == 2 and text.count("if c + 1 < c_hi:") == 2
    assert "nxt1 = gl.load(in1_ptr + (row + CHUNK)[:, None] * N + col[None, :])" in text  # the residual
    assert "v3 = cur1.to(gl.float32)" in text
    assert "if t + gl.num_programs(0) >= num_tiles:" in text and "2 - last" not in text
    # with loops (COMFUSE_WS_ROLL): the range at run time, the residual carried by the loop a
    # chunk ahead (the last chunk loads itself again), and the B ring allowed
    with settings.override(ws_lookahead=True, ws_roll=True, ws_tail=128, ws_last_in_ring=True):
        q = suite_plan("ln_postnorm", merge=True)
    assert q.lookahead and q.roll and q.last_in_ring
    text = source_text(q, "k")
    assert "c_lo: gl.constexpr" not in text and "if c == c_lo:" not in text
    assert text.count("nxt1 = gl.load(in1_ptr + row[:, None] * N + col[None, :])  # r_1") == 1
    assert text.count("ahead = strip * BM + gl.minimum(c + 1, c_hi - 1) * CHUNK + rows") == 1
    assert "cur1 = nxt1" in text and "v3 = cur1.to(gl.float32)" in text


def test_eight_adjacent_columns_a_lane_by_default():
    """COMFUSE_WS_VEC (8 by default): each thread of the epilogue takes 8 adjacent columns of a
    row at a time (the VEC constexpr at launch, the plan's own kernel name); 0: all its 32
    adjacent; at 32 lanes the two are the same kernel (8 columns a lane there anyway), and
    autotuning's 32-lane alternative says so; other widths refused."""
    from comfuse.runtime.kernel import kernel_name
    from comfuse.runtime.stages_kernel import options
    p = suite_plan("softmax", merge=True)
    assert p.vec == 8 and options(p, 1024)["VEC"] == 8 and "8 adjacent columns a lane" in p.describe()
    wide = [c for c in candidates(p.region, target="cuda") if c.schedule == "ws_stages" and c.lanes == 32]
    assert wide and all(c.vec == 0 and options(c, 1024)["VEC"] == 8 for c in wide)
    with settings.override(ws_vec=0):
        plain = suite_plan("softmax", merge=True)
    with settings.override(ws_lanes=32):
        assert suite_plan("softmax", merge=True).vec == 0
    with settings.override(ws_vec=4):
        refused = suite_plan("softmax")
    assert plain.vec == 0 and options(plain, 1024)["VEC"] == 32 and "adjacent columns" not in plain.describe()
    assert kernel_name(p) != kernel_name(plain)
    assert isinstance(refused, NotFused) and "COMFUSE_WS_VEC=4" in refused.reason


def test_sixteen_bit_adds_in_sixteen_bits_with_their_setting():
    """COMFUSE_WS_NARROW=1 (experimental): LayerNorm's bias and residual adds, typed bf16 with
    bf16 operands (the tile as the buffer holds it, the inputs as stored), are computed in
    bf16; fp32 from there on. Not the add whose operand the mainloop already put in the tile
    (the residual by TMA), nor where nothing is 16-bit (softmax)."""
    from comfuse.codegen.gluon.stages import narrow_nodes
    from comfuse.runtime.stages_kernel import source_text
    plain = suite_plan("ln_postnorm", merge=True)
    assert not plain.narrow and "acc_h" not in source_text(plain, "k")
    with settings.override(ws_narrow=True):
        p = suite_plan("ln_postnorm", merge=True)
        assert not suite_plan("softmax", merge=True).narrow
    r = p.region
    j = [i.name for i in r.inputs].index("r_1")
    bias_add, res_add = (i for i, n in enumerate(r.nodes) if n.op is Op.ADD and n.dtype == bf)
    assert narrow_nodes(r) == {bias_add, res_add} and narrow_nodes(r, in_buffer=j) == {bias_add}
    assert p.narrow and "16-bit adds and products in 16 bits" in p.describe()
    text = source_text(p, "k")
    assert "acc_h = tile_smem.slice(c * CHUNK, CHUNK, dim=0).load(layout)" in text
    assert f"h{bias_add} = acc_h + vh0[None, :]" in text and f"h{res_add} = h{bias_add} + h{res_add - 1}" in text
    assert f"v{res_add} = h{res_add}.to(gl.float32)" in text


def test_exp_of_x_minus_the_row_max_by_one_fma_with_its_setting():
    """COMFUSE_WS_EXP_FMA=1 (experimental): exp(x - a row's max), in the output pass and in the
    merged exchange's online partial, as 2^(x log2(e) - max log2(e)); not where the region
    has no exp (RMSNorm)."""
    from comfuse.runtime.stages_kernel import source_text
    plain = suite_plan("softmax", merge=True)
    assert not plain.exp_fma and " * 1.4426950408889634 - " not in source_text(plain, "k")
    with settings.override(ws_exp_fma=True):
        p = suite_plan("softmax", merge=True)
        assert not suite_plan("rmsnorm", merge=True).exp_fma
    assert p.exp_fma and "exp(x - row max) by one FFMA" in p.describe()
    text = source_text(p, "k")
    assert text.count(" * 1.4426950408889634 - ") == 2 and "exp_fast(v" not in text


def test_nothing_kept_in_the_buffer_with_its_setting():
    """COMFUSE_WS_KEEP=0 (experimental): a merged kernel's later passes recompute the exchange's
    value (LayerNorm: the residual read again) rather than read it kept in the hand-off buffer;
    the default keeps it."""
    from comfuse.runtime.stages_kernel import source_text
    kept = suite_plan("ln_postnorm", merge=True)
    assert kept.keep and "kept for the later passes" in source_text(kept, "k")
    with settings.override(ws_keep=False):
        p = suite_plan("ln_postnorm", merge=True)
    assert not p.keep and "nothing kept in the buffer" in p.describe()
    text = source_text(p, "k")
    assert "kept for the later passes" not in text and ".store(v" not in text
    assert text.count("gl.load(in1_ptr + row[:, None] * N + col[None, :])") == 2  # the residual, in both passes


@pytest.mark.parametrize("form", [{}, dict(ws_res_tma=True), dict(ws_tma_store=True)],
                         ids=["plain", "res_tma", "tma_store"])
def test_a_later_launch_passes_what_the_first_one_checked(form):
    """StagesKernel.launch after the first call of a layout: each TMA descriptor built from
    the first call's checked fields over this call's tensor (without TensorDescriptor's checks
    again), in the kernel's order, and the rest as bound; the bound launch keeps no tensor of a
    call alive. The run is stubbed (no GPU here): what it is given is compared."""
    from comfuse.runtime.kernel import layout_key
    from comfuse.runtime.stages_kernel import StagesKernel
    wl = SUITE["ln_postnorm"]
    fn_args = wl.inputs(256, 64, 1024, dtype=bf, device="cpu")
    (cand,) = find_regions(capture(wl.fn, fn_args))
    with settings.override(schedule="ws_stages", ws_merge=True, **form):
        p = plan(cand.region, target="cuda")
    assert p.res_tma == bool(form.get("ws_res_tma")) and p.tma_store == bool(form.get("ws_tma_store"))
    k = StagesKernel(p, None, None)
    shapes = {frozenset("MN"): (1, 256, 1024), frozenset("N"): (1, 1, 1024), frozenset("M"): (1, 256, 1)}

    def call_tensors():
        ins = [torch.randn(shapes[i.axes]).to(bf) for i in p.region.inputs]
        outs = [torch.empty(shapes[o.axes], dtype=bf) for o in p.region.outputs]
        return fn_args[0].unsqueeze(0).clone(), fn_args[1].unsqueeze(0).clone(), ins, outs
    first = k.tensors(*call_tensors())
    ws, counters = torch.empty(8), torch.zeros(2, dtype=torch.int64)
    full = k.arguments(first, ws, counters)
    fresh = k.fresh(first)
    fields = k.descriptor_fields(full, len(first))
    assert all("base" not in f for f in fields) and len(fields) == 2 + p.res_tma + p.tma_store
    seen = []
    k._bound[layout_key(first)] = (lambda *a: seen.append(a), [None] * fresh + full[fresh:], fresh, fields)
    call = call_tensors()
    k.launch(*call)
    (got,) = seen
    want = k.arguments(k.tensors(*call), ws, counters)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            assert g is w or (g.data_ptr() == w.data_ptr() and g.shape == w.shape and g.stride() == w.stride())
        elif type(w).__name__ == "TensorDescriptor":
            assert type(g) is type(w) and g.base.data_ptr() == w.base.data_ptr()
            assert {n: v for n, v in vars(g).items() if n != "base"} == {n: v for n, v in vars(w).items() if n != "base"}
        else:
            assert g == w


@pytest.mark.skipif(not interpreting(), reason="a compiled call on CPU tensors needs Triton's interpreter")
def test_the_host_cost_script_runs_a_call_through_the_bound_launch():
    """scripts/stages_host_cost.py: a compiled call whose region is on a stubbed ws_stages
    kernel goes through StagesKernel.launch's bound path (one layout bound, reused), and
    returns outputs of the program's shapes."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "stages_host_cost.py"
    spec = importlib.util.spec_from_file_location("stages_host_cost", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with settings.override(autotune="0", validate="0"):
        compiled, args = mod.stubbed_call("ln_postnorm")
        for _ in range(3):
            out = compiled(*args)
    (region,) = compiled.fused_regions()
    assert region.plan.schedule == "ws_stages" and len(region.kernel._bound) == 1
    assert mod.per_call_us(lambda: compiled(*args), 5) > 0
    want = SUITE["ln_postnorm"].fn(*args)
    got = out[0] if isinstance(out, tuple) else out
    assert got.shape == want.shape and got.dtype == want.dtype


def test_128_wide_tiles_with_their_setting():
    """COMFUSE_WS_TILE_N=128 (experimental): 128x128 tiles, the mainloop in 4 warps (one
    warpgroup) beside 8 epilogue warps, twice the tiles a strip; 8 lanes a row only (no 32-lane
    alternative among the candidates); other widths refused; the default stays 128x256 with
    8 + 4 warps."""
    from comfuse.runtime.kernel import kernel_name
    from comfuse.runtime.stages_kernel import EPI_REGS, options
    wide = suite_plan("ln_postnorm", merge=True)
    assert (wide.block_n, wide.num_warps, wide.epi_warps, wide.tiles_n) == (256, 8, 4, 4)
    with settings.override(ws_tile_n=128):
        p = suite_plan("ln_postnorm", merge=True)
        alternatives = [c for c in candidates(p.region, target="cuda") if c.schedule == "ws_stages"]
        with settings.override(ws_lanes=32):
            lanes32 = suite_plan("ln_postnorm", merge=True)
    with settings.override(ws_tile_n=64):
        refused = suite_plan("ln_postnorm")
    assert (p.block_n, p.num_warps, p.epi_warps, p.tiles_n, p.lanes, p.vec, p.num_stages) == (128, 4, 8, 8, 8, 8, 4)
    assert "TMA mainloop in 4 warps, the epilogue in 8 warps" in p.describe()
    o = options(p, 1024)
    # (32-row chunks: 8 warps of 4 rows each; at 16 rows two threads would hold each value)
    assert (o["BN"], o["TILES_N"], o["EPI_WARPS"], o["num_warps"], o["VEC"], o["CHUNK"]) == (128, 8, 8, 4, 8, 32)
    assert options(wide, 1024)["CHUNK"] == 16 and options(wide, 1024)["STAGES"] == 3 and o["STAGES"] == 4
    assert o["EPI_REGS"] == EPI_REGS[8] and 4 * 32 * 184 + 8 * 32 * EPI_REGS[8] <= 65536
    assert alternatives and all(c.block_n == 128 and c.lanes == 8 for c in alternatives)
    assert sorted(c.tail for c in alternatives) == [0, 64, 64]  # (the shared tile: 64 rows of 4 warps')
    assert kernel_name(p) != kernel_name(wide)
    assert isinstance(lanes32, NotFused) and "8 lanes" in lanes32.reason
    assert isinstance(refused, NotFused) and "COMFUSE_WS_TILE_N=64" in refused.reason
    from comfuse.runtime.stages_kernel import source_text
    assert "TILE_LAYOUT_N128 as TILE_LAYOUT" in source_text(p, "k")
    assert "TILE_LAYOUT_N128" not in source_text(wide, "k")


@pytest.mark.parametrize("form", [{}, dict(ws_lanes=32), dict(ws_tail=96), dict(ws_tile_n=128),
                                  dict(ws_tile_n=128, ws_tail=64)],
                         ids=["8lanes", "32lanes", "8lanes-tail96", "tile128", "tile128-tail64"])
def test_no_thread_holds_a_value_another_holds(form):
    """The epilogue's chunk layout ([1, VEC] a thread, [32 / LANES_N, LANES_N] a warp, [WARPS, 1]
    warps) covers WARPS * 32 / LANES_N rows at once: a chunk of fewer rows would have threads
    hold the same values (a Gluon layout wraps), the warps repeating one another's work. Each
    group's chunk (the epilogue warps' CHUNK; the mainloop warps' CHUNK * num_warps / EPI_WARPS
    on a shared tile) spans at least that; and a row's lanes do not cover more than the tile."""
    from comfuse.runtime.stages_kernel import options
    with settings.override(**form):
        p = suite_plan("ln_postnorm", merge=True)
    o = options(p, 1024)
    lanes, chunk = o["LANES_N"], o["CHUNK"]
    assert chunk >= o["EPI_WARPS"] * (32 // lanes), o
    if p.tail:
        assert chunk * o["num_warps"] // o["EPI_WARPS"] >= o["num_warps"] * (32 // lanes), o
        assert p.tail % chunk == 0 and (128 - p.tail) % (chunk * o["num_warps"] // o["EPI_WARPS"]) == 0, o
    assert lanes * o["VEC"] <= o["BN"], o


def test_the_mainloop_warps_share_of_a_tile_takes_the_epilogues_column_layout():
    """On a shared last tile (COMFUSE_WS_TAIL) the mainloop warps' rows are laid out as the
    epilogue warps' are: VEC adjacent columns a thread at a time (8 by default), not all of its
    columns adjacent (the layout Nsight Compute found at 4x the shared-memory wavefronts)."""
    from comfuse.runtime.stages_kernel import options, source_text
    with settings.override(ws_tail=96):
        p = suite_plan("ln_postnorm", merge=True)
    text = source_text(p, "k")
    main = text[text.index("def k_main("):text.index("def k(")]
    assert "LANES_N, VEC)" in main and "BN // LANES_N" not in main
    assert "LANES_N, VEC, num_warps))" in text[text.index("def k("):]
    assert options(p, 1024)["VEC"] == 8


def test_the_last_tile_in_the_ring_only_with_a_shared_last_tile():
    """COMFUSE_WS_LAST_IN_RING=1: only where the last tile is shared with the
    mainloop's warps (COMFUSE_WS_TAIL), not with the residual by TMA (the mainloop adds it from
    the buffer) nor lookahead; the kernel then hands the last tile off into b_bufs, with its own
    statistics and barrier, and neither partition waits on the buffer for it."""
    from comfuse.runtime.stages_kernel import source_text
    with settings.override(ws_last_in_ring=True):
        assert not suite_plan("multi_stage", merge=True).last_in_ring  # (no shared tile)
        with settings.override(ws_tail=96):
            p = suite_plan("multi_stage", merge=True)
            with settings.override(ws_res_tma=True):
                assert not suite_plan("ln_postnorm", merge=True).last_in_ring
            with settings.override(ws_lookahead=True):
                assert not suite_plan("ln_postnorm", merge=True).last_in_ring
    assert p.last_in_ring and "the last tile handed off in the B ring" in p.describe()
    text = source_text(p, "k")
    assert "spare_smem = b_bufs._reinterpret(gl.bfloat16, [BM, BN], TILE_LAYOUT)" in text
    assert "mbarrier.wait(spare_ready, 0)" in text and "spare_smem, spare_ready, True)" in text
    # (an autotuning candidate in one form only: with loops and the whole last tile the mainloop's;
    # where the region has an [M, N] input, LayerNorm's residual, its loops load it a chunk ahead)
    assert [(q.tail, q.roll, q.lookahead) for q in candidates(p.region, target="cuda")
            if q.last_in_ring] == [(128, True, False)]
    ln = suite_plan("ln_postnorm", merge=True)
    ring = [q for q in candidates(ln.region, target="cuda") if q.last_in_ring]
    assert [(q.tail, q.roll, q.lookahead) for q in ring] == [(128, True, True)]
    assert "a chunk ahead" in source_text(ring[0], "k")


def test_32_row_chunks_need_a_tail_the_mainloop_warps_chunks_divide():
    """COMFUSE_WS_CHUNK=32 (experimental): the epilogue's chunks 32 rows (the launch's CHUNK),
    the mainloop warps' 64, so a shared tail of 64 or 128 rows only; 16 is the default's."""
    from comfuse.runtime.stages_kernel import chunk_rows, options
    with settings.override(ws_chunk=32, ws_roll=True):
        p = suite_plan("multi_stage", merge=True)
        with settings.override(ws_tail=128, ws_last_in_ring=True):
            whole = suite_plan("multi_stage", merge=True)
        with settings.override(ws_tail=96):
            refused = suite_plan("multi_stage", merge=True)
    assert p.chunk == 32 and chunk_rows(p) == 32 and options(p, 1024)["CHUNK"] == 32
    assert "chunks of 32 rows" in p.describe()
    assert whole.chunk == 32 and whole.tail == 128 and whole.last_in_ring
    assert isinstance(refused, NotFused) and "COMFUSE_WS_CHUNK=32 with COMFUSE_WS_TAIL=96" in refused.reason
    with settings.override(ws_chunk=16):
        assert suite_plan("multi_stage", merge=True).chunk == 0  # (the default's plan, the same kernel)
    with settings.override(ws_chunk=24):
        assert "COMFUSE_WS_CHUNK=24" in suite_plan("multi_stage", merge=True).reason
