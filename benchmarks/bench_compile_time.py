"""First-call compile time of the HF families under backend="moe_inductor": what the per-frame machinery costs.

    python benchmarks/bench_compile_time.py                                  # this checkout, every family
    python benchmarks/bench_compile_time.py --trees . /tmp/old_checkout      # two checkouts, runs interleaved
    python benchmarks/bench_compile_time.py --families longcat_flash --plain # against plain capture (backend=inner)

Each measurement is one fresh process that builds a tiny random model of the family (tests/hf_models.py), compiles it
with ``backend="moe_inductor"`` and takes the CPU time of the first call (trace, passes, inner compile and one run):
the process's own CPU seconds, which another busy process on the machine disturbs far less than wall time. With several
``--trees`` the processes alternate between the checkouts (``PYTHONPATH`` points at each), so that a busy machine
slows both alike; the table gives the median of ``--repeats`` per (tree, family) and the ratio to the first tree.
``--plain`` adds a column for ``torch.compile(backend=<inner>)`` itself: what the first call costs without moe_inductor.

``longcat_flash`` (not in the default list) is transformers' LongCat-Flash at tests/test_hf_families.py's sizes: its
loop over the experts that got tokens is unrolled over every choice, its zero-computation experts included
(``moe_inductor/passes/zero_experts.py``); a loop no rewrite took would fall back, the case
``moe_inductor/unproven_loops.py`` is for.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe", "qwen2_moe", "deepseek_v3")
EXTRA = ("longcat_flash",)
PLAIN = "plain"  # the column of torch.compile(backend=<inner>), without moe_inductor

_ONE = """
import sys, time, torch
sys.path.insert(0, {tests!r})
if {family!r} == "longcat_flash":
    from test_hf_families import _build
    model = _build("LongcatFlashForCausalLM").eval()
else:
    from hf_models import tiny
    model = tiny({family!r}).eval()
ids = torch.randint(0, 64, (1, 9))
if {plain!r}:
    compiled = torch.compile(model, backend={inner!r})
else:
    compiled = torch.compile(model, backend="moe_inductor", options={{"inner": {inner!r}}})
start = time.process_time()
with torch.no_grad():
    compiled(ids)
print("SECONDS", time.process_time() - start)
"""


_WHICH = """
import moe_inductor
print("MOE_INDUCTOR_AT", moe_inductor.__file__)
"""


def one(tree: str, family: str, inner: str, tests: str, plain: bool = False) -> float:
    """The first call's CPU seconds in a fresh process: ``tree``'s moe_inductor, or ``torch.compile(backend=inner)``
    where ``plain``."""
    root = os.path.abspath(tree)
    env = dict(os.environ, PYTHONPATH=root)
    code = _ONE.format(tests=tests, family=family, inner=inner, plain=plain)
    # run in the tree: ``python -c`` puts its working directory first on sys.path, ahead of PYTHONPATH, so from
    # another checkout's root every tree would import that checkout's moe_inductor
    done = subprocess.run([sys.executable, "-c", code + _WHICH], cwd=root,
                          capture_output=True, text=True, env=env, timeout=900)
    which = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("MOE_INDUCTOR_AT ")]
    if which and not plain and not which[0].startswith(root + os.sep):
        raise RuntimeError(f"{tree}: the process imported moe_inductor from {which[0]}, not from the tree")
    for line in done.stdout.splitlines():
        if line.startswith("SECONDS"):
            return float(line.split()[1])
    raise RuntimeError(f"{tree} {family}: no time\n{done.stderr[-2000:]}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="*", default=["."], help="checkouts to compare (the first is the baseline)")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES + EXTRA)
    ap.add_argument("--inner", default="aot_eager", choices=["aot_eager", "inductor"],
                    help="the inner compiler (aot_eager: Dynamo, the passes and AOTAutograd, where our code runs)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plain", action="store_true", help="also time torch.compile(backend=<inner>) itself")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tests = os.path.join(os.path.abspath(os.path.dirname(__file__)), "..", "tests")
    columns = list(args.trees) + ([PLAIN] if args.plain else [])
    times: dict = {t: {f: [] for f in args.families} for t in columns}
    for r in range(args.repeats):
        for family in args.families:
            for tree in columns:
                plain = tree == PLAIN
                times[tree][family].append(one(args.trees[0] if plain else tree, family, args.inner, tests, plain))
                print(f"[{r + 1}/{args.repeats}] {family:<12} {tree}: {times[tree][family][-1]:.2f} CPU s", flush=True)
    base = columns[0]
    print("\n| family | " + " | ".join(f"{t} (CPU s)" for t in columns) + " | " +
          " | ".join(f"{t} / {base}" for t in columns[1:]) + " |")
    print("|---" * (1 + 2 * len(columns) - 1) + "|")
    for family in args.families:
        med = [statistics.median(times[t][family]) for t in columns]
        print(f"| {family} | " + " | ".join(f"{m:.2f}" for m in med) + " | " +
              " | ".join(f"{m / med[0]:.3f}" for m in med[1:]) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"inner": args.inner, "times": times}, f, indent=1)


if __name__ == "__main__":
    main()
