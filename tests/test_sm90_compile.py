"""Every Triton kernel compiles for the H200 (sm_90) with the configs the launchers pick, found without a GPU:
Triton's front end and the ptxas it ships run on the CPU. A kernel that does not compile, or a config whose shared
memory does not fit, would otherwise first show on the device machine, where minutes are budgeted."""
import json

import pytest

from tests.helpers import run_without_interpreter

pytestmark = pytest.mark.slow  # compiling every kernel for sm_90 takes half a minute; the full suite runs it

H200_SHARED_MEMORY = 232448  # bytes a block may use (227 KiB)


@pytest.fixture(scope="module")
def compiled():
    """One line per kernel from tests/sm90_report.py's sm90_kernel_report, compiled in a process without the
    interpreter."""
    out = run_without_interpreter("from tests.sm90_report import sm90_kernel_report; sm90_kernel_report()",
                                  timeout=900)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_and_fits(compiled):
    names = [k["name"] for k in compiled]
    for expected in ("gemm default bf16 m4096 gated=True", "wgrad default bf16", "backward middle act=5 gated=True",
                     "backward middle act=5 pairs", "expert row sums rows=1", "route place single=False", "route count",
                     "combine", "combine indexed scaled", "activation act=5", "gather rows",
                     "backward middle act=6 gated=True", "backward middle act=6 pairs", "activation act=6",
                     "gemm default bf16 m1024 clamped silu glu"):
        assert expected in names
    assert sum(name.startswith("gemm tuned") for name in names) >= 10  # the shipped H200 table, every entry
    too_big = [k for k in compiled if k["shared"] > H200_SHARED_MEMORY]
    assert not too_big, too_big


def test_16_bit_tiles_of_64_rows_or_more_use_wgmma(compiled):
    """Hopper's warpgroup MMA is the fast path; a 16-bit GEMM with a 64+ row tile that compiles without it lost it."""
    for k in compiled:
        sixteen_bit = "bf16" in k["name"] or "bfloat16" in k["name"]
        if sixteen_bit and any(f"m{b}" in k["name"] for b in (256, 1024, 4096)) or k["name"] == "wgrad default bf16":
            assert k["wgmma"], k


def test_16_bit_kernels_do_not_spill_much(compiled):
    """Register spills (stack bytes) slow a GEMM down badly. Today the worst 16-bit kernels spill 8 bytes (two
    accumulators of 128x128); the bound is set well above that and well below a real spill."""
    usage = [k for k in compiled if "stack" in k and any(t in k["name"] for t in ("bf16", "bfloat16"))]
    assert usage, "cuobjdump gave no resource usage"
    heavy = [k for k in usage if k["stack"] > 64]
    assert not heavy, heavy


def test_the_paired_backward_middle_spills_no_more_than_the_two_stores(compiled):
    """Storing (gate, up) pairs joins two (16, 128) tiles into one (16, 256) before its store (the launcher halves BLOCK_I for it); that must not cost
    registers the two separate stores did not."""
    by_name = {k["name"]: k for k in compiled}
    for act in (4, 5, 6):
        pairs, halves = by_name[f"backward middle act={act} pairs"], by_name[f"backward middle act={act} gated=True"]
        if "stack" in pairs and "stack" in halves:
            assert pairs["stack"] <= max(halves["stack"], 8), (pairs, halves)


def test_weights_read_through_a_table_load_as_the_stacked_ones_do(compiled):
    """The list op's weights, found through their table (B_TABLE), must keep the stacked weights' 16-byte
    asynchronous loads: a table entry the compiler cannot prove aligned makes it load one element at a time (4x
    slower on an H100)."""
    by_name = {k["name"]: k for k in compiled}
    pairs = [(by_name[n], by_name[n + " table"]) for n in by_name if n + " table" in by_name]
    assert len(pairs) == 24
    for stacked, tabled in pairs:
        assert stacked["copies16"] > 0 and tabled["copies16"] == stacked["copies16"], (stacked, tabled)
