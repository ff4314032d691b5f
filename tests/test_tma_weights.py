"""The forward grouped GEMM reading its weights (and the down projection's sorted token rows) through TMA descriptors
(``config.gemm_tma_weights``, ``config.gemm_tma_descriptors``; ``B_DESC`` and ``A_DESC`` in kernels/grouped_gemm.py).
The GPU path is Hopper and later only; on the CPU the interpreter runs the descriptor code against the pointer code."""
import pytest
import torch
from torch._dynamo.utils import counters

import moe_inductor
from moe_inductor import config
from moe_inductor.kernels import launch
from tests.helpers import assert_close, assert_matches_reference, make_problem, record_launch_meta

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.fixture(params=["device", "host"])
def tma_on(request, monkeypatch):
    """The TMA path asked for, with descriptors made in the kernel or on the host, our kernels for every GEMM;
    returns the B_DESC constexpr of every forward GEMM."""
    monkeypatch.setattr(config, "gemm_tma_weights", "on")
    monkeypatch.setattr(config, "gemm_tma_descriptors", request.param)
    monkeypatch.setattr(config, "gemm_engine", "triton")
    monkeypatch.setattr(launch, "_GEMM_DECISIONS", {})
    return record_launch_meta(monkeypatch, "B_DESC")[0]


def test_tma_stays_off_without_a_hopper_gpu(tma_on, triton_kernels):
    """On the CPU (the interpreter) and fp32 the descriptors are never made."""
    if HOPPER:
        p = make_problem(9, 32, 16, 3, 2, dtype=torch.float32, device="cuda", requires_grad=False)
    else:
        p = make_problem(9, 32, 16, 3, 2, dtype=torch.bfloat16, requires_grad=False)
    moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2)
    assert tma_on and not any(tma_on)


CASES = [
    # T, H, I, E, k, dtype, layout, routing, capacity
    (37, 64, 32, 5, 2, torch.bfloat16, "nk", "random", None),      # gate/up views of one (E, 2I, H) weight
    (29, 64, 48, 3, 2, torch.float16, "kn", "random", None),       # (E, H, 2I): N contiguous; I not a tile multiple
    (40, 72, 32, 6, 2, torch.bfloat16, "nk", "skip_odd", 9),       # K = 72: a partial K step; empty experts; drops
    (1, 64, 32, 5, 2, torch.bfloat16, "nk", "random", None),
    (300, 128, 64, 3, 1, torch.bfloat16, "nk", "one_expert", None),  # every row on one expert: many whole tiles
]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA descriptors need an sm_90+ GPU")
@pytest.mark.parametrize("T,H,I,E,k,dtype,layout,routing,capacity", CASES,
                         ids=["bf16-nk", "fp16-kn", "partial-K-empty-experts", "T1", "one-hot-expert"])
def test_gpu_tma_weights_equal_the_reference(T, H, I, E, k, dtype, layout, routing, capacity, tma_on):
    p = make_problem(T, H, I, E, k, dtype=dtype, device="cuda", layout=layout, routing=routing)
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, layout=layout, capacity=capacity)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y)
    grads = torch.autograd.grad(y, p.leaves(), dy)
    assert any(tma_on), "the forward GEMMs read their weights through descriptors"
    assert_matches_reference(p, y, grads, dy, dtype, layout=layout, capacity=capacity)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA descriptors need an sm_90+ GPU")
def test_gpu_tma_weights_under_torch_compile(tma_on, monkeypatch):
    """A compiled bf16 model with the TMA loads "on" computes what it computes with them "off" (the same products in
    the same order), outputs and gradients, at three token counts. Descriptors made in the kernel go into the launches
    Inductor traces (the op stays visible); host-made ones only into the launches the opaque op makes at run time."""
    from moe_inductor.kernels import launch as launch_module
    from tests.test_pass_gathered_weights import GatheredMoE

    monkeypatch.setattr(config, "visible_kernels", True)
    untraced, traced = record_launch_meta(monkeypatch, "B_DESC")
    torch.manual_seed(0)
    model = GatheredMoE("gptfast").cuda().to(torch.bfloat16)
    inputs = [torch.randn(T, 16, device="cuda", dtype=torch.bfloat16) for T in (5, 40, 97)]
    results = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(config, "gemm_tma_weights", mode)
        monkeypatch.setattr(launch_module, "_GEMM_DECISIONS", {})
        torch._dynamo.reset()
        counters.clear()
        # static graphs: a symbolic row count never takes TMA (a dynamic graph serves small counts too)
        compiled = torch.compile(model, backend="moe_inductor", dynamic=False)
        traced.clear(), untraced.clear()
        results[mode] = []
        for x in inputs:
            x = x.clone().requires_grad_()
            out = compiled(x)
            results[mode].append((out, torch.autograd.grad(out.float().sum(), x)[0]))
        assert counters["moe_inductor"], "the layer was rewritten"
        if mode == "off":
            assert not any(traced) and not any(untraced)
        elif config.gemm_tma_descriptors == "device":
            assert traced and all(traced), "the visible op's launches make their descriptors"
        else:
            assert not any(traced), "no traced launch takes host-made descriptors"
            assert untraced and all(untraced)
    for (out_on, dx_on), (out_off, dx_off) in zip(results["on"], results["off"]):
        torch.testing.assert_close(out_on, out_off, rtol=0, atol=0)
        torch.testing.assert_close(dx_on, dx_off, rtol=0, atol=0)


def test_tma_rule_reads_the_rows_per_expert():
    """"auto" asks for min_rows_per_expert rows per expert on average; "off" never; a bad value raises."""
    from moe_inductor.kernels.tma import tma_weights_apply

    a = torch.empty(4, 8, dtype=torch.bfloat16)
    b = torch.empty(3, 8, 16, dtype=torch.bfloat16)
    for mode in ("auto", "on", "off"):  # on the CPU every mode says no: a CPU tensor never reads through TMA
        assert not tma_weights_apply(a, b, None, 10_000, 3, mode)
    with pytest.raises(ValueError, match="gemm_tma_weights"):
        tma_weights_apply(a, b, None, 10_000, 3, "yes")
    if HOPPER:
        a, b = a.cuda(), b.cuda()
        assert tma_weights_apply(a, b, None, 128 * 3, 3, "auto", 128)
        assert not tma_weights_apply(a, b, None, 128 * 3 - 1, 3, "auto", 128)
        assert tma_weights_apply(a, b, None, 1, 3, "on")
        assert not tma_weights_apply(a, b, None, 10_000, 3, "off")
        assert not tma_weights_apply(a, b[:, :, 1:9], None, 128 * 3, 3, "auto"), "a start 2 bytes past alignment"


@pytest.mark.parametrize("descriptors", ["device", "host"])
@pytest.mark.parametrize("T,H,I,E,layout,routing", [
    (9, 32, 16, 3, "nk", "random"), (7, 32, 24, 5, "kn", "random"), (8, 40, 16, 4, "nk", "skip_odd"),
], ids=["nk", "kn-partial-n-tile", "partial-K-empty-experts"])
def test_descriptor_loads_equal_pointer_loads(T, H, I, E, layout, routing, descriptors, triton_kernels, monkeypatch):
    """The kernel's descriptor paths (``B_DESC`` 1 and 2, and ``A_DESC`` for the down projection's sorted rows)
    against its pointer path, on the same launches: equal outputs. On the CPU the interpreter runs both (the rule is
    forced, since it turns TMA on for Hopper GPUs only), so the descriptor code is checked without a GPU: both
    weight layouts, K and N past a tile's edge, empty experts, and token-row tiles that run past their expert's
    rows into the next expert's (computed, never stored)."""
    from moe_inductor.kernels import launch as launch_module

    if not HOPPER and torch.cuda.is_available():
        pytest.skip("a GPU without TMA")
    device = "cuda" if HOPPER else "cpu"
    p = make_problem(T, H, I, E, 2, dtype=torch.bfloat16, device=device, layout=layout, routing=routing,
                     requires_grad=False)
    monkeypatch.setattr(config, "gemm_tma_descriptors", descriptors)
    monkeypatch.setattr(config, "gemm_tma_weights", "on")  # (the rule forced below; "tuned" would ask the table)
    outs = {}
    b_desc, _ = record_launch_meta(monkeypatch, "B_DESC")
    a_desc, _ = record_launch_meta(monkeypatch, "A_DESC")
    for tma in (False, True):
        monkeypatch.setattr(launch_module, "tma_weights_apply", lambda *args, on=tma, **kwargs: on)
        monkeypatch.setattr(launch_module, "_GEMM_DECISIONS", {})
        outs[tma] = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, layout=layout)
    kind = 2 if descriptors == "device" else 1
    assert b_desc == [0, 0, kind, kind], "two forward GEMMs each way"
    # the down projection reads the sorted rows; only a descriptor made in the kernel can (it knows their count)
    assert a_desc == [False, False, False, descriptors == "device"]
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=0)


def test_the_scratch_allocator_leaves_a_users_allocator(monkeypatch):
    """Descriptors made in a kernel need Triton's scratch allocator: ours is set only where none is."""
    pytest.importorskip("triton")
    from triton.runtime import _allocation

    from moe_inductor.kernels import tma

    def users(size, alignment, stream):
        raise AssertionError("not called here")

    token = _allocation._allocator.set(_allocation._NULL_ALLOCATOR)
    try:
        tma.ensure_scratch_allocator()
        assert _allocation._allocator.get() is tma._scratch
        _allocation._allocator.set(users)
        tma.ensure_scratch_allocator()
        assert _allocation._allocator.get() is users
    finally:
        _allocation._allocator.reset(token)


def _tma_keys_seen(monkeypatch) -> list:
    """Record each "|tma" key the launches look up in the tuned table, once, in order."""
    from moe_inductor.kernels import configs

    seen = []
    real = configs.TABLE.lookup

    def spy(key):
        if key.endswith("|tma") and key not in seen:
            seen.append(key)
        return real(key)

    monkeypatch.setattr(configs.TABLE, "lookup", spy)
    return seen


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_tuned_mode_takes_tma_where_the_table_says(layout, triton_kernels, monkeypatch):
    """Under "tuned" the table decides per key: no entry or POINTERS keeps the pointer launch; a config entry runs the
    persistent launch with descriptors made in the kernel, in that config, and computes what the pointers compute.
    (On the CPU the interpreter runs both; the hardware rule is forced, as it admits Hopper GPUs only.)"""
    from moe_inductor.kernels import configs
    from moe_inductor.kernels import launch as launch_module

    if torch.cuda.is_available():
        pytest.skip("the interpreter's check; the GPU's is test_gpu_tma_weights_equal_the_reference")
    p = make_problem(11, 32, 16, 5, 2, dtype=torch.bfloat16, layout=layout, requires_grad=False)
    monkeypatch.setattr(config, "gemm_tma_weights", "tuned")
    monkeypatch.setattr(config, "gemm_engine", "triton")
    monkeypatch.setattr(launch_module, "tma_weights_apply", lambda a, b, b2, rows, e, mode, *rest, **kw: mode != "off")
    b_desc, _ = record_launch_meta(monkeypatch, "B_DESC")
    block_n, _ = record_launch_meta(monkeypatch, "BLOCK_N")
    seen = _tma_keys_seen(monkeypatch)

    def run():
        launch_module._GEMM_DECISIONS.clear()
        b_desc.clear(), block_n.clear(), seen.clear()
        return moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, layout=layout)

    monkeypatch.setattr(launch_module, "_GEMM_DECISIONS", {})
    pointers = run()
    assert b_desc == [0, 0] and len(seen) == 2, "no entries: both GEMMs keep their pointer loads"
    up_key, down_key = seen
    configs.TABLE.lookup(up_key)  # (loads the table before entries are put in it)
    monkeypatch.setitem(configs.TABLE._table, up_key, configs.POINTERS)
    monkeypatch.setitem(configs.TABLE._table, down_key, configs.LaunchConfig(16, 16, 32, 1, 1))
    y = run()
    assert b_desc == [0, 2] and block_n[1] == 16, "the down projection in its entry's config, through descriptors"
    torch.testing.assert_close(y, pointers, rtol=0, atol=0)
    monkeypatch.setattr(config, "gemm_tma_weights", "off")
    run()
    assert b_desc == [0, 0] and seen == [], "'off' never asks the table"


def test_tma_tuner_runs_both_kinds_and_keeps_pointers_within_the_margin(triton_kernels, monkeypatch, tmp_path):
    """The TMA key's tuning times the pointer launches (its first candidate, POINTERS) and each persistent descriptor
    launch; a candidate displaces POINTERS only when faster by more than the margin."""
    from moe_inductor.kernels import configs
    from moe_inductor.kernels import launch as launch_module

    if torch.cuda.is_available():
        pytest.skip("the interpreter's check")
    monkeypatch.setenv("MOE_INDUCTOR_CACHE_DIR", str(tmp_path))
    full = configs.LaunchConfig(16, 32, 32, 1, 1)
    cands = configs.tma_candidates(full, torch.bfloat16, gated=True)
    assert cands[0] == configs.POINTERS and cands[1] == full and len(set(cands)) == len(cands)
    assert configs.tma_candidates(full, torch.float32, gated=True) == [configs.POINTERS], "TMA takes 16-bit only"

    # the tuner's choice against the margin, with the times given
    for times, want in (((1.0, 0.99, 2.0), configs.POINTERS), ((1.0, 0.97, 2.0), cands[1])):
        clock = iter(times)
        got = configs.tune(f"gemm|test{times[1]}|tma", lambda: cands[:3], lambda c: None,
                           bench=lambda fn: (fn(), next(clock))[1], first_margin=launch_module._TMA_MARGIN)
        assert got == want

    # the launches each candidate runs: pointers (and with them the key's tail split, were there one), then one
    # persistent descriptor launch per other candidate
    p = make_problem(7, 32, 16, 3, 2, dtype=torch.bfloat16, requires_grad=False)
    monkeypatch.setattr(config, "gemm_tma_weights", "tuned")
    monkeypatch.setattr(config, "gemm_engine", "triton")
    monkeypatch.setattr(config, "autotune", True)  # (a key without an entry is tuned only so)
    monkeypatch.setattr(launch_module, "tma_weights_apply", lambda *args, **kwargs: True)
    monkeypatch.setattr(launch_module, "_GEMM_DECISIONS", {})
    persistent, _ = record_launch_meta(monkeypatch, "PERSISTENT")
    tried = []

    def pick(key, default, candidates, run, autotune, first_margin=0.0):
        if not key.endswith("|tma"):
            return configs.TABLE.lookup(key) or default
        assert first_margin == launch_module._TMA_MARGIN
        small = [configs.POINTERS, configs.LaunchConfig(16, 16, 32, 1, 1)]
        for c in small:
            persistent.clear()
            run(c)
            tried.append(list(persistent))
        return small[1]

    monkeypatch.setattr(launch_module, "_pick", pick)
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2)
    assert tried == [[False], [True]] * 2, "each GEMM: its pointer launch, then the persistent one"
    moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2)
    assert len(tried) == 8, "the stand-in tuner stored nothing, so the decision was not kept: tuned again"
    monkeypatch.setattr(config, "gemm_tma_weights", "off")
    torch.testing.assert_close(y, moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2),
                               rtol=0, atol=0)


def test_the_rows_descriptor_follows_each_calls_alignment(triton_kernels, monkeypatch):
    """The launch decision is cached per shape; whether the sorted token rows can come through a descriptor depends
    on each call's ``a`` (its start and row stride 16-byte aligned), so an aligned call must not hand its decision
    to a misaligned one of the same shape. Both compute what the pointers compute."""
    from moe_inductor.kernels import launch as launch_module
    from moe_inductor.ops import grouped_mm, grouped_mm_reference

    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("a GPU without TMA")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(config, "gemm_tma_weights", "on")
    monkeypatch.setattr(config, "gemm_tma_descriptors", "device")
    if device == "cpu":  # (the rule admits Hopper GPUs only; the interpreter runs the descriptor code)
        monkeypatch.setattr(launch_module, "tma_weights_apply", lambda *args, **kwargs: True)
    monkeypatch.setattr(launch_module, "_GEMM_DECISIONS", {})
    a_desc, _ = record_launch_meta(monkeypatch, "A_DESC")
    gen = torch.Generator().manual_seed(5)
    storage = torch.randn(13 * 32 + 1, generator=gen).to(device, torch.bfloat16)
    aligned, shifted = storage[:13 * 32].view(13, 32), storage[1:].view(13, 32)  # the second starts 2 bytes on
    b = torch.randn(3, 32, 16, generator=gen).to(device, torch.bfloat16)
    offs = torch.tensor([4, 9, 13], dtype=torch.int32, device=device)
    for a in (aligned, shifted):
        assert_close(grouped_mm(a, b, offs), grouped_mm_reference(a.double(), b.double(), offs), torch.bfloat16, "out")
    assert a_desc == [True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA descriptors need an sm_90+ GPU")
def test_gpu_tuned_entries_run_the_shipped_tiles(monkeypatch):
    """Under "tuned", every forward key answered with each of the shipped H200 TMA tiles in turn (a gated key's
    tiles for the gate/up GEMM, a plain key's for the down one): the persistent descriptor launches run in those
    tiles and compute the reference, forward and backward; the backward's GEMMs, which read the other weight layout,
    keep their pointer launches."""
    import json

    from moe_inductor.kernels import configs
    from moe_inductor.kernels import launch as launch_module

    shipped = json.loads((configs._TUNED_DIR / "NVIDIA_H200.json").read_text())
    tiles = {gated: sorted({configs.LaunchConfig(**{f: x for f, x in v.items() if f[0] != "_"})
                            for k, v in shipped.items() if k.endswith("|tma") and ("|g1|" in k) == gated}
                           - {configs.POINTERS}, key=repr) for gated in (True, False)}
    assert tiles[True] and tiles[False]
    real = configs.TABLE.lookup
    monkeypatch.setattr(config, "gemm_tma_weights", "tuned")
    monkeypatch.setattr(config, "gemm_engine", "triton")
    p = make_problem(300, 256, 128, 6, 2, dtype=torch.bfloat16, device="cuda", routing="skip_odd")
    for i in range(max(len(t) for t in tiles.values())):
        gated_tile, plain_tile = (tiles[g][i % len(tiles[g])] for g in (True, False))

        def lookup(key, gated_tile=gated_tile, plain_tile=plain_tile):
            if key.endswith("|kn|tma"):
                return None
            if key.endswith("|tma"):
                return gated_tile if "|g1|" in key else plain_tile
            return real(key)

        monkeypatch.setattr(configs.TABLE, "lookup", lookup)
        monkeypatch.setattr(launch_module, "_GEMM_DECISIONS", {})
        persistent, _ = record_launch_meta(monkeypatch, "PERSISTENT")
        block_n, _ = record_launch_meta(monkeypatch, "BLOCK_N")
        stages, _ = record_launch_meta(monkeypatch, "num_stages")
        y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2)
        assert persistent[:2] == [True, True], (gated_tile, plain_tile)
        assert block_n[:2] == [gated_tile.BLOCK_N, plain_tile.BLOCK_N]
        assert stages[:2] == [gated_tile.num_stages, plain_tile.num_stages]
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y)
        grads = torch.autograd.grad(y, p.leaves(), dy)
        assert not any(persistent[2:]), "the backward's GEMMs read the other layout: no entry, pointers"
        assert_matches_reference(p, y, grads, dy, torch.bfloat16)
