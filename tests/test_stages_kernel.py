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
from comfuse.planner import NotFused, candidates, plan
from comfuse.runtime.stages_kernel import source_text

from test_codegen import run_compiler_script

bf = torch.bfloat16


def forced(fn, *args, target="cuda", form=""):
    """The ws_stages plan of ``fn``'s region, in ``form`` (COMFUSE_PLAN's text)."""
    (cand,) = find_regions(capture(fn, args))
    with settings.override(schedule="ws_stages", plan=form):
        return plan(cand.region, target=target)


def suite_plan(name, M=256, K=64, N=1024, target="cuda", form=""):
    wl = SUITE[name]
    return forced(wl.fn, *wl.inputs(M, K, N, dtype=bf, device="cpu"), target=target, form=form)


def offered(region):
    return [q for q in candidates(region, target="cuda") if q.schedule == "ws_stages"]


@pytest.mark.parametrize("name, exchanges", [("rmsnorm", 1), ("softmax", 1), ("ln_postnorm", 1), ("mblr", 1),
                                             ("multi_stage", 2)])
def test_the_generator_takes_the_suites_row_reductions(name, exchanges):
    """One exchange per stage that ends in reductions, a merged pair's second joining its
    first's; the planner's plan is the first of autotuning's forms."""
    p = suite_plan(name)
    assert not isinstance(p, NotFused), p.reason
    assert p.schedule == "ws_stages" and p.form.exchanges == exchanges and p.tiles_n == 4
    assert f"exchange per-row partials {exchanges} time(s)" in p.describe()
    assert offered(p.region)[0] == p


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
    p = forced(lambda x, w: torch.logsumexp(x @ w, -1), x, w)  # per-row outputs only: by each strip's first tile
    assert not isinstance(p, NotFused) and p.region.outputs[0].axes == frozenset("M")


def test_the_generated_kernel_reads_as_its_stages():
    """The file starts with the region's IR, has one commented pass per exchange with the IR's
    node numbers, and stores each output once."""
    p = suite_plan("multi_stage")
    text = source_text(p, "k")
    assert "Generated from this IR" in text and "%0 = acc" in text
    assert [f"# ---- exchange {e}:" in text for e in range(2)] == [True] * 2
    assert "# ---- the outputs, each written once ----" in text
    assert text.count("gl.store(out") == len(p.region.outputs)
    # only public helpers, and no arithmetic left for the compiler to fold
    helpers = text.split("from comfuse.codegen.gluon.parts import ")[1].split("\n")[0]
    assert not any(name.startswith("_") for name in helpers.split(", "))
    assert " * 1 " not in text and " + 0)" not in text and "* 1)" not in text
    assert "tanh_fast(" in text and "%8 tanh" in text
    # the special-function unit's exp and tanh; softmax's division by the row's sum as one
    # reciprocal a row and a multiply per element
    assert "gl.exp(" not in text and "= exp_fast(v3)" in text and "v4 * (1.0 / v5)" in text


def test_every_constexpr_of_the_generated_kernel_is_given_at_launch():
    """The direct launcher (runtime.kernel.launch_direct) takes the kernel's constexprs from
    the options; one left to its default would send every call through the JIT's binding."""
    from comfuse.runtime import stages_kernel
    for lanes in (32, 8):
        p = suite_plan("multi_stage", N=4096, form=f"lanes={lanes}")
        k = stages_kernel.build(p, f"k_constexprs_{lanes}")
        given = 2 + len(p.region.inputs) + len(p.region.outputs) + 5  # a, b, tensors, ws, counters, M, N, K
        options = stages_kernel.options(p, 4096)
        assert set(k.fn.arg_names[given:]) <= set(options) and options["LANES_N"] == lanes


def test_generated_kernels_compile_for_sm90():
    """The suite's row reductions and a LayerNorm through nn.Linear's weight ([N, K]) in each
    form autotuning times: 12 warps at <= 168 registers, the epilogue partition at 152, at most
    a few spills; a kept value rounds two elements at a time; passes as loops take a fraction
    of the unrolled epilogue's instructions."""
    script = textwrap.dedent("""
        import json, re, torch
        import torch.nn.functional as F
        from comfuse import settings
        from comfuse.bench.workloads import SUITE
        from comfuse.codegen.gluon.stages import EPI_REGS
        from comfuse.frontend.capture import capture
        from comfuse.frontend.regions import find_regions
        from comfuse.planner import plan
        from comfuse.runtime.aot import partitions, resources
        from comfuse.runtime.build import kernel_name
        from comfuse.runtime.stages_kernel import compile_sm90
        bf = torch.bfloat16
        cases = {name: (SUITE[name].fn, SUITE[name].inputs(256, 64, 1024, dtype=bf, device="cpu"))
                 for name in ("multi_stage", "ln_postnorm", "softmax")}
        cases["ln_linear"] = (lambda x, w, b: F.layer_norm(F.linear(x, w, b), (768,)),
                              (torch.randn(256, 64, dtype=bf), torch.randn(768, 64, dtype=bf),
                               torch.randn(768, dtype=bf)))
        cases["log1p_softmax"] = (lambda x, w: torch.softmax(torch.log1p((x @ w).abs()), -1),
                                  (torch.randn(256, 64, dtype=bf), torch.randn(64, 1024, dtype=bf)))
        forms = [(name, "") for name in cases] + [
            ("multi_stage", "lanes=32"), ("multi_stage", "tail=96"), ("ln_postnorm", "res_tma=1,keep=0,tail=96"),
            ("softmax", "roll=1"), ("multi_stage", "roll=1,tail=96"),
            ("ln_postnorm", "roll=1,res_tma=1,keep=0,tail=96"), ("multi_stage", "last_in_ring=1,roll=1,tail=128"),
            ("softmax", "last_in_ring=1,tail=96"), ("ln_postnorm", "last_in_ring=1,roll=1,lookahead=1,tail=128"),
            ("ln_postnorm", "roll=1,lookahead=1")]
        out = {}
        for name, form in forms:
            fn, args = cases[name]
            (cand,) = find_regions(capture(fn, args))
            with settings.override(schedule="ws_stages", plan=form):
                p = plan(cand.region, target="cuda")
            k = compile_sm90(p, kernel_name(p))
            regs = sorted(set(int(v) for v in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+);",
                                                          k.asm["ptx"])))
            epilogue = [n for r, n in partitions(k.asm["cubin"]) if r == EPI_REGS]
            out[f"{name}[{form}]"] = dict(resources(k.asm["cubin"]), smem=k.metadata.shared, setmaxnreg=regs,
                                          kmajor=p.region.gemm.b.major, epilogue=epilogue,
                                          scalar_bf16=k.asm["ptx"].count("cvt.rn.bf16.f32"), roll=p.form.roll,
                                          ring=p.form.last_in_ring)
        print(json.dumps(out))
    """)
    result = run_compiler_script(script)
    assert result["ln_linear[]"]["kmajor"] == "K"
    # a kept value rounds to bf16 two elements at a time (parts.bf16_pairs): no scalar
    # conversion is left in the passes that keep one
    for name in ("multi_stage[]", "ln_postnorm[]"):
        assert result[name]["scalar_bf16"] == 0, (name, result[name]["scalar_bf16"])
    assert all(info["roll"] == ("roll=1" in name) for name, info in result.items())
    assert all(info["ring"] == ("last_in_ring=1" in name) for name, info in result.items())
    # passes not unrolled: softmax's epilogue partition a fifth of the instructions (3 817 -> 747, sm_90)
    plain, rolled = result["softmax[]"]["epilogue"], result["softmax[roll=1]"]["epilogue"]
    if plain and rolled:
        assert rolled[0] < 0.3 * plain[0], (plain, rolled)
    for name, info in result.items():
        assert info["smem"] <= 227 * 1024, (name, info)
        assert 152 in info["setmaxnreg"], (name, info)
        if "reg" in info:  # (LayerNorm with a residual read per pass: 184 bytes; added by the mainloop: 64)
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
    do a max and its sum of exp(x - max) (online); each exchange's partials are loaded once."""
    p = suite_plan(name)
    assert p.form.exchanges == exchanges and sorted(k for k, _, _ in p.form.moments) == sorted(kinds)
    text = source_text(p, "k")
    loads = [ln.strip() for ln in text.splitlines() if "= gl.load(ws_ptr" in ln]
    assert len(loads) == len(set(loads)), loads
    if kinds:
        assert "pairs merged" in p.describe()
        assert "(merged with %" in text
        if name != "softmax":  # the exchange's value is kept in the buffer for the later passes
            assert "kept in the hand-off buffer" in text
        if name == "multi_stage":  # tanh(v) * softmax(v) computed once, in the pass that keeps it
            assert text.count("= tanh_fast(") == 1
        if name == "ln_postnorm":  # the residual read once
            assert text.count("gl.load(in1_ptr + row[:, None] * N") == 1


def test_a_division_by_a_broadcast_value_is_a_reciprocal_and_a_multiply():
    """A tile over a per-row value or a constant: one reciprocal, a multiply per element; a
    division by the constant 0 stays a division (the reciprocal would fold to 1 / 0)."""
    x, w = torch.randn(256, 64, dtype=bf), torch.randn(64, 1024, dtype=bf)
    text = source_text(forced(lambda x, w: torch.softmax((x @ w) / 3.0, -1), x, w), "k")
    assert "v0 * (1.0 / 3.0)" in text
    text = source_text(forced(lambda x, w: torch.softmax((x @ w) / 0.0, -1), x, w), "k")
    assert "v0 / 0.0" in text


def test_the_last_tile_shared_with_the_mainloop_warps():
    """tail=ROWS: the mainloop partition runs the last ROWS rows of its program's last tile
    through the per-tile function, in chunks of 32 rows (each thread as many values as an
    epilogue warp's thread), the epilogue partition the first ones in chunks of 16; each
    exchange counts 2 TILES_N arrivals (2 a whole tile, 1 a part); both groups combine the
    strip's partials in a layout without cross-warp sums (the same bits). 96 rows are an
    autotuning candidate; all 128 leave the epilogue partition out of the last tile; rows that
    are not a multiple of 32 are refused."""
    plain = suite_plan("rmsnorm")
    assert plain.form.tail == 0 and "_main(" not in source_text(plain, "k")
    forms = offered(plain.region)
    # (8 lanes: the planner's choice; 8 lanes with a shared last tile a third candidate; those
    # two with each pass a loop over its chunks; then, with loops, the whole last tile the
    # mainloop warps', in the B ring)
    assert [(q.form.lanes, q.form.tail, q.form.roll, q.form.last_in_ring) for q in forms] == [
        (8, 0, False, False), (32, 0, False, False), (8, 96, False, False), (8, 0, True, False), (8, 96, True, False),
        (8, 128, True, True)]
    assert "each pass a loop over its chunks, not unrolled" in forms[-2].describe()
    assert "the B ring" in forms[-1].describe()
    with settings.override(schedule="ws_stages", plan="roll=1"):  # a forced form is the only candidate
        assert [(q.form.lanes, q.form.tail, q.form.roll) for q in offered(plain.region)] == [(8, 0, True)]
    p = suite_plan("rmsnorm", form="tail=96")
    assert p.form.tail == 96 and "the last 96 rows of the last tile" in p.describe()
    text = source_text(p, "k")
    assert "def k_main(" in text and "(k_main, (" in text and "(mma_partition, (" not in text
    assert "c_hi=BM // CHUNK - last * (96 // CHUNK), share=2 - last" in text  # the epilogue partition's part
    assert "c_lo=(BM - 96) // MC, c_hi=BM // MC, share=1," in text
    assert "MC: gl.constexpr = CHUNK * num_warps // EPI_WARPS" in text
    assert text.count("target = (old // (2 * TILES_N) + 1) * (2 * TILES_N)") == p.form.exchanges
    assert text.count("gl.BlockedLayout([TILES_P2, 1], [1, 32], [1, WARPS], [0, 1])") == 1
    # all 128 rows the mainloop warps': the epilogue partition's loop stops a tile early, and
    # their part counts a whole tile's 2 arrivals at each exchange
    whole = source_text(suite_plan("rmsnorm", form="tail=128"), "k")
    assert "for t in range(gl.program_id(0), num_tiles - gl.num_programs(0), gl.num_programs(0)):" in whole
    assert "c_lo=(BM - 128) // MC, c_hi=BM // MC, share=2," in whole and "2 - last" not in whole
    refused = suite_plan("rmsnorm", form="tail=100")
    assert isinstance(refused, NotFused) and "tail=100" in refused.reason


def test_a_residual_adds_a_candidate_with_it_by_tma_and_nothing_kept():
    """Where the region's residual can be TMA-loaded into the hand-off buffer (LayerNorm
    post-norm), autotuning also times 8 lanes with the residual by TMA, nothing kept and the
    last tile shared (on the H200 the fastest form at 8192x1024x1024 and 16384x2048x8192); not
    where the region has no residual, nor where a setting names the residual's form."""
    forms = [q.form for q in offered(suite_plan("ln_postnorm").region)]
    assert [(f.lanes, f.tail, f.res_tma, f.keep) for f in forms][:4] == \
        [(8, 0, False, True), (32, 0, False, True), (8, 96, False, True), (8, 96, True, False)]
    assert "the residual by TMA" in forms[3].describe() and "nothing kept" in forms[3].describe()
    # (with loops, see the test above: the planner's form, the shared tile, this one, and the
    # whole last tile in the B ring)
    assert [(f.tail, f.roll, f.res_tma, f.keep) for f in forms[4:]] == \
        [(0, True, False, True), (96, True, False, True), (96, True, True, False), (128, True, False, True)]
    assert not any(q.form.res_tma for q in offered(suite_plan("rmsnorm").region))


def test_the_residual_by_tma_into_the_hand_off_buffer():
    """res_tma: a bf16 [M, N] input added to the tile (through adds of broadcast values) and
    read nowhere else is TMA-loaded into the hand-off buffer as soon as the epilogue frees it,
    and the mainloop adds it before the hand-off; the passes read it as 0. Offered with nothing
    kept and the last tile shared (the candidates of the test above); not where the tile or the
    input has another use."""
    from comfuse.planner.gluon import tma_residual
    ln = suite_plan("ln_postnorm")
    j = [i.name for i in ln.region.inputs].index("r_1")
    assert tma_residual(ln.region) == j and not ln.form.res_tma
    assert [(q.form.keep, q.form.tail, q.form.roll) for q in offered(ln.region) if q.form.res_tma] == \
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
    p = suite_plan("ln_postnorm", form="res_tma=1")
    refused = suite_plan("rmsnorm", form="res_tma=1")
    assert isinstance(refused, NotFused) and "res_tma" in refused.reason
    assert p.form.res_tma and "the residual by TMA into the hand-off buffer" in p.describe()
    text = source_text(p, "k")
    first = text.index("load_residual(r_desc, tile_smem, tile_free, gl.program_id(0), num_tiles")
    loop = text.index("for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):", first)
    later = text.index("load_residual(r_desc, tile_smem, tile_free, t + gl.num_programs(0)", loop)
    assert first < loop < text.index("fence_async_shared()", loop) < later
    assert "mbarrier.arrive(tile_free)" not in text and "RES: gl.constexpr = 2" in text
    assert f"gl.load(in{j}_ptr" not in text and f"= 0.0  # %" in text


def test_loads_a_chunk_ahead_only_in_passes_as_loops():
    """lookahead: a pass's loop carries its [M, N] inputs (the residual) a chunk ahead (the last
    chunk loads itself again); offered in one candidate only, with loops and the whole last
    tile in the B ring; refused in unrolled passes."""
    plain = suite_plan("ln_postnorm")
    assert not plain.form.lookahead and "nxt" not in source_text(plain, "k")
    assert [(q.form.roll, q.form.tail, q.form.last_in_ring) for q in offered(plain.region) if q.form.lookahead] == \
        [(True, 128, True)]
    refused = suite_plan("ln_postnorm", form="lookahead=1,tail=96")
    assert isinstance(refused, NotFused) and "lookahead" in refused.reason
    q = suite_plan("ln_postnorm", form="lookahead=1,roll=1,tail=128,last_in_ring=1")
    assert q.form.lookahead and q.form.roll and q.form.last_in_ring
    assert "each chunk's [M, N] inputs loaded a chunk ahead" in q.describe()
    text = source_text(q, "k")
    assert "c_lo: gl.constexpr" not in text and "if c == c_lo:" not in text
    assert text.count("nxt1 = gl.load(in1_ptr + row[:, None] * N + col[None, :])  # r_1") == 1
    assert text.count("ahead = strip * BM + gl.minimum(c + 1, c_hi - 1) * CHUNK + rows") == 1
    assert "cur1 = nxt1" in text and "v3 = cur1.to(gl.float32)" in text


def test_nothing_kept_in_the_buffer():
    """keep=0: a merged kernel's later passes recompute the exchange's value (LayerNorm: the
    residual read again) rather than read it kept in the hand-off buffer; the planner's form
    keeps it."""
    kept = suite_plan("ln_postnorm")
    assert kept.form.keep and "kept for the later passes" in source_text(kept, "k")
    p = suite_plan("ln_postnorm", form="keep=0")
    assert not p.form.keep and "nothing kept in the buffer" in p.describe()
    text = source_text(p, "k")
    assert "kept for the later passes" not in text and ".store(v" not in text
    assert text.count("gl.load(in1_ptr + row[:, None] * N + col[None, :])") == 2  # the residual, in both passes


@pytest.mark.parametrize("form", ["", "res_tma=1"], ids=["plain", "res_tma"])
def test_a_later_launch_passes_what_the_first_one_checked(form):
    """StagesKernel.launch after the first call of a layout: each TMA descriptor built from
    the first call's checked fields over this call's tensor (without TensorDescriptor's checks
    again), in the kernel's order, and the rest as bound; the bound launch keeps no tensor of a
    call alive. The run is stubbed (no GPU here): what it is given is compared."""
    from comfuse.runtime.launch import layout_key
    from comfuse.runtime.stages_kernel import StagesKernel
    wl = SUITE["ln_postnorm"]
    fn_args = wl.inputs(256, 64, 1024, dtype=bf, device="cpu")
    (cand,) = find_regions(capture(wl.fn, fn_args))
    with settings.override(schedule="ws_stages", plan=form):
        p = plan(cand.region, target="cuda")
    assert p.form.res_tma == bool(form)
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
    assert all("base" not in f for f in fields) and len(fields) == 2 + p.form.res_tma
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


@pytest.mark.parametrize("form", ["", "lanes=32", "tail=96", "lanes=32,tail=64"],
                         ids=["8lanes", "32lanes", "8lanes-tail96", "32lanes-tail64"])
def test_no_thread_holds_a_value_another_holds(form):
    """The epilogue's chunk layout ([1, 8] a thread, [32 / LANES_N, LANES_N] a warp, [WARPS, 1]
    warps) covers WARPS * 32 / LANES_N rows at once: a chunk of fewer rows would have threads
    hold the same values (a Gluon layout wraps), the warps repeating one another's work. Each
    group's chunk (the epilogue warps' CHUNK; the mainloop warps' CHUNK * num_warps / EPI_WARPS
    on a shared tile) spans at least that; and a row's lanes do not cover more than the tile."""
    from comfuse.codegen.gluon.stages import VEC
    from comfuse.runtime.stages_kernel import options
    p = suite_plan("ln_postnorm", form=form)
    o = options(p, 1024)
    lanes, chunk = o["LANES_N"], o["CHUNK"]
    assert chunk >= o["EPI_WARPS"] * (32 // lanes), o
    tail = p.form.tail
    if tail:
        assert chunk * o["num_warps"] // o["EPI_WARPS"] >= o["num_warps"] * (32 // lanes), o
        assert tail % chunk == 0 and (128 - tail) % (chunk * o["num_warps"] // o["EPI_WARPS"]) == 0, o
    assert lanes * VEC <= o["BN"], o


def test_the_mainloop_warps_share_of_a_tile_takes_the_epilogues_column_layout():
    """On a shared last tile the mainloop warps' rows are laid out as the epilogue warps' are,
    by the same per-tile function: 8 adjacent columns a thread at a time, LANES_N lanes a row."""
    p = suite_plan("ln_postnorm", form="tail=96")
    text = source_text(p, "k")
    main = text[text.index("def k_main("):text.index("def k(")]
    assert "LANES_N=LANES_N)" in main and "BN // LANES_N" not in main and "WARPS=num_warps" in main
    assert "gl.BlockedLayout([1, 8], [32 // LANES_N, LANES_N], [WARPS, 1], [1, 0])" in text


def test_the_last_tile_in_the_ring_only_with_a_shared_last_tile():
    """last_in_ring: only where the last tile is shared with the mainloop's warps (tail), not
    with the residual by TMA (the mainloop adds it from the buffer); the kernel then hands the
    last tile off into b_bufs, with its own statistics and barrier, and neither partition waits
    on the buffer for it."""
    for form in ("last_in_ring=1", "last_in_ring=1,tail=96,res_tma=1"):
        refused = suite_plan("ln_postnorm", form=form)
        assert isinstance(refused, NotFused) and "last_in_ring" in refused.reason, form
    p = suite_plan("multi_stage", form="last_in_ring=1,tail=96")
    assert p.form.last_in_ring and "the last tile handed off in the B ring" in p.describe()
    text = source_text(p, "k")
    assert "spare_smem = b_bufs._reinterpret(gl.bfloat16, [BM, BN], TILE_LAYOUT)" in text
    assert "mbarrier.wait(spare_ready, 0)" in text and "spare_ready=spare_ready, SPARE=True)" in text
    # (an autotuning candidate in one form only: with loops and the whole last tile the mainloop's;
    # where the region has an [M, N] input, LayerNorm's residual, its loops load it a chunk ahead)
    assert [(q.form.tail, q.form.roll, q.form.lookahead) for q in offered(p.region) if q.form.last_in_ring] == \
        [(128, True, False)]
    ln = suite_plan("ln_postnorm")
    ring = [q for q in offered(ln.region) if q.form.last_in_ring]
    assert [(q.form.tail, q.form.roll, q.form.lookahead) for q in ring] == [(128, True, True)]
    assert "a chunk ahead" in source_text(ring[0], "k")
