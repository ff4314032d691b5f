"""Measure the generator: ``python -m tests.generator [--examples N] [--seed S] [--lookalikes] [--guards-masks-slots]
[--masks-v5] [--host-walks] [--sum-reductions] [--walks-lists] [--clamped] [--inner aot_eager] [--autocast]``.

Runs N recipes from a seeded generator, prints every miss, wrong rewrite and crash as it happens, then the rewrite
rate per form, per idiom and per router, and the look-alikes kept per flaw."""
from __future__ import annotations

import argparse
import os
import random
from collections import Counter, defaultdict

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MOE_INDUCTOR_STRICT_PASSES", "1")


def main() -> None:
    from tests.generator.check import run
    from tests.generator.recipe import (GUARDS_MASKS_SLOTS, HOST_WALKS, MASKS_AND_V5, SUM_REDUCTIONS, WALKS_LISTS,
                                        draw_recipe, narrowed, random_draw)

    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=int(os.environ.get("MOE_GENERATOR_EXAMPLES", 200)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--form", default=None, help="only this form (repeat draws until it comes)")
    ap.add_argument("--lookalikes", action="store_true", help="draw look-alikes only (each must be kept)")
    ap.add_argument("--guards-masks-slots", action="store_true",
                    help="draw only the guarded loops, top-1 mask writes and capacity biases/dropouts/stacked choices")
    ap.add_argument("--masks-v5", action="store_true",
                    help="draw only litgpt's broadcast masks and transformers v5's experts code written out")
    ap.add_argument("--host-walks", action="store_true",
                    help="draw only DeepSeek-V2's moe_infer: counts walked on the host, the weighted unsort")
    ap.add_argument("--sum-reductions", action="store_true",
                    help="draw only the loops combined by scatter_reduce_(..., 'sum'), checked in inference only")
    ap.add_argument("--walks-lists", action="store_true",
                    help="draw only the forms of their own family: MiniMind's walk of cumulative host counts with "
                         "a scatter per expert, and transformers v4.36 Mixtral's rows indexed by .tolist() lists")
    ap.add_argument("--clamped", action="store_true",
                    help="draw only Step-3.7's clamped silu-glu in the general forms, and its clamps' look-alikes")
    ap.add_argument("--inner", default="eager", choices=("eager", "aot_eager", "inductor"),
                    help="the compiler the rewritten graph goes to (aot_eager traces it again, as Inductor does; "
                         "inductor compiles it, as users do: slow, a few seconds per draw)")
    ap.add_argument("--autocast", action="store_true",
                    help="run every draw, compiled and eager, under CPU bf16 autocast (mixed precision), held to the "
                         "bf16 bound")
    args = ap.parse_args()
    only = (GUARDS_MASKS_SLOTS if args.guards_masks_slots else MASKS_AND_V5 if args.masks_v5
            else HOST_WALKS if args.host_walks else SUM_REDUCTIONS if args.sum_reductions else None)
    rng = random.Random(args.seed)
    tally: dict[str, Counter] = defaultdict(Counter)
    done = 0
    while done < args.examples:
        draw = random_draw(rng)
        r = draw_recipe(narrowed(draw, only) if only else draw, lookalike=True if args.lookalikes else None,
                        forms=WALKS_LISTS if args.walks_lists else None, clamped=args.clamped)
        if args.form and r.form != args.form:
            continue
        done += 1
        o = run(r, args.inner, args.autocast)
        v = o.verdict
        if v not in ("rewritten", "kept"):
            print(o.describe(), flush=True)
        if r.genuine:
            keys = [f"form {r.form}", f"router {r.router}", f"act {r.act}"]
            keys += [f"{r.form}.{axis} {value}" for axis, value in r.idioms.items()]
        else:
            keys = [f"look-alike {r.form}.{r.flaw}", "look-alike all"]
        for key in keys + (["genuine all"] if r.genuine else []):
            tally[key][v] += 1
    print(f"\n{'':44s} {'n':>4s} {'rewritten':>9s} {'missed':>6s} {'wrong':>5s} {'crash':>5s} {'kept':>5s}  rate")
    for key in sorted(tally):
        c = tally[key]
        n = sum(c.values())
        good = c["rewritten"] + c["kept"]
        print(f"{key:44s} {n:4d} {c['rewritten']:9d} {c['missed']:6d} {c['wrong']:5d} {c['crash']:5d} {c['kept']:5d}"
              f"  {good / n:.0%}")


if __name__ == "__main__":
    main()
