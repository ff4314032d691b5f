"""Recipes: what one generated MoE module is, drawn form first, then the idioms valid for that form.

A recipe is drawn through a ``Draw`` (a name and the options to choose from), so the same drawing code serves
hypothesis (``st.data()``, which shrinks a failure to its simplest recipe) and the measuring script (a seeded
``random.Random``, which runs hundreds of recipes and keeps going past a miss).

A genuine variant has ``flaw=None``; a look-alike names the flaw that makes it a different function (each flaw is
drawn only in the forms where it can be written).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

#: the counter each genuine form must bump (``counters["moe_inductor"][...]``)
FORM_COUNTER = {
    "loop": "unrolled_loop", "sorted": "sorted_grouped_mm", "gathered": "gathered_weights",
    "dense": "dense_experts", "capacity": "padded_capacity", "split": "split_loop",
}

ACTIVATIONS = ("silu_glu", "gelu_glu", "relu", "gelu")
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_bias", "group_limited", "argmax")
FUSED = ("fused_chunk", "fused_split", "fused_slice", "fused_interleaved")

#: idiom axes of each form (an axis whose options depend on earlier draws is narrowed in ``draw_recipe``)
AXES: dict[str, dict[str, tuple]] = {
    "loop": {
        "selection": ("where", "nonzero", "onehot", "boolmask", "any", "hit_v5"),
        "experts": ("modulelist", "moduledict", "stacked_nk", "stacked_kn", "slices") + FUSED,
        "position": ("output", "input", "between"),
        "combine": ("index_add", "index_put", "setitem", "scatter_add"),
        "matmul": ("linear", "matmul"),
    },
    "sorted": {
        "sort": ("argsort", "sort"),
        "gather": ("index", "gather"),
        "counts": ("histc", "onehot_sum"),
        "experts": ("stacked_nk", "stacked_kn", "fused_chunk"),
        "position": ("output", "input"),
        "combine": ("scatter_add", "index_add", "unsort_sum", "unsort_bmm"),
    },
    "gathered": {
        "experts": ("stacked_nk", "stacked_kn", "fused_chunk", "fused_slice"),
        "combine": ("einsum", "mul_sum"),
    },
    "dense": {
        "experts": ("stacked_nk", "stacked_kn", "fused_chunk", "loop_modulelist"),
        "routing": ("scatter", "scatter_", "onehot_sum"),
        "combine": ("einsum", "mul_sum", "bmm"),
    },
    "capacity": {
        "style": ("gshard", "switch", "fairseq", "deepspeed"),
        "capacity": ("constant", "from_tokens"),
        "experts": ("einsum", "bmm"),
        "dispatch": ("ne_zero", "bool"),
    },
    "split": {
        "dispatch": ("megatron", "jetmoe"),
        "experts": ("modulelist", "per_projection"),
        "combine": ("scatter_add", "index_add"),
    },
}

#: the look-alikes each form can carry; "expert_choice" and "memory_slots" are forms of their own
#: "other_slot" is a look-alike only where the slot of the weight and the slot of the selection disagree in one
#: index (the loop's ``weights[tok, pos + 1]``, the split loop's weights out of the sorted order): a (T, k) weight
#: tensor permuted before a combine that reads it whole is still a top-k MoE (with those weights), and is rewritten
FLAWS: dict[str, tuple] = {
    "loop": ("soft", "other_slot", "twice", "differs", "skipped", "other_rows"),
    "sorted": ("twice", "other_rows"),
    "gathered": ("twice", "differs"),
    "dense": ("soft", "twice", "differs", "skipped"),
    "capacity": ("capacity_mismatch", "differs"),
    "split": ("other_slot", "differs", "other_rows"),
    "expert_choice": ("expert_choice",),
    "memory_slots": ("memory_slots",),
}

Draw = Callable[[str, Sequence[Any]], Any]


@dataclass
class Recipe:
    form: str
    flaw: Optional[str]
    E: int
    k: int
    T: int
    act: str
    router: str
    renorm: bool
    seed: int
    idioms: dict = field(default_factory=dict)

    @property
    def gated(self) -> bool:
        return self.act.endswith("_glu")

    @property
    def genuine(self) -> bool:
        return self.flaw is None

    def __str__(self) -> str:
        parts = [self.form, self.flaw or "genuine", f"E{self.E}k{self.k}T{self.T}s{self.seed}", self.act, self.router,
                 "renorm" if self.renorm else "raw"] + [f"{a}={v}" for a, v in self.idioms.items()]
        return " ".join(parts)


def draw_recipe(draw: Draw, lookalike: Optional[bool] = None) -> Recipe:
    """One recipe. ``lookalike`` None draws genuine variants and look-alikes alike (3 in 4 genuine)."""
    if lookalike is None:
        lookalike = draw("lookalike", (False, False, False, True))
    if lookalike:
        form = draw("form", tuple(FLAWS))
        flaw = draw("flaw", FLAWS[form])
    else:
        form, flaw = draw("form", tuple(FORM_COUNTER)), None
    idioms = {}
    for axis, options in AXES.get(form, {}).items():
        idioms[axis] = draw(axis, options)
    act = draw("act", ACTIVATIONS)
    if not act.endswith("_glu"):  # a fused gate/up weight exists only for gated experts
        for axis in ("experts",):
            if idioms.get(axis, "").startswith("fused"):
                idioms[axis] = "stacked_nk"
    router = draw("router", ROUTERS if form not in ("capacity", "memory_slots", "expert_choice") else ("softmax",))
    E = draw("E", (2, 3, 4, 5, 6, 8))
    if flaw == "skipped" and E < 3:  # skipping the last of two experts is a router wider than E: eager's program too
        E = 3
    if router == "group_limited" and E % 2:
        E += 1
    k = 1 if router == "argmax" else draw("k", tuple(range(1, min(E, 3) + 1)))
    if form == "capacity":
        k = 1 if idioms["style"] in ("switch", "deepspeed") else min(2, E)
        router = "softmax"
    if flaw == "other_slot" and k == 1:  # another slot needs two
        k, router = 2, "softmax_topk" if router == "argmax" else router
    if form == "loop" and idioms["selection"] in ("boolmask", "any") and flaw in ("soft", "skipped", "other_rows", "other_slot"):
        idioms["selection"] = "where"  # these flaws are written in the zeros-accumulator loop
    if form == "loop" and idioms["selection"] == "hit_v5" and idioms["experts"] in ("moduledict", "slices"):
        idioms["experts"] = "stacked_nk"  # v5's 0-d index keys no dict and slices no flat weight, in eager either
    if form == "loop" and idioms["selection"] == "boolmask":
        idioms["combine"] = draw("masked_combine", ("view_sum", "bmm"))
    T = draw("T", (1, 2, 3, 5, 8, 11, 16))
    if flaw == "other_rows" and T == 1:
        T = 3
    return Recipe(form=form, flaw=flaw, E=E, k=k, T=T, act=act, router=router, renorm=draw("renorm", (False, True)),
                  seed=draw("seed", tuple(range(64))), idioms=idioms)


def random_draw(rng: random.Random) -> Draw:
    """A ``Draw`` from a seeded generator (the measuring script)."""
    return lambda name, options: rng.choice(list(options))


def hypothesis_draw(data) -> Draw:
    """A ``Draw`` from hypothesis's ``st.data()`` (the test; failures shrink towards the first option)."""
    from hypothesis import strategies as st

    return lambda name, options: data.draw(st.sampled_from(list(options)), label=name)
