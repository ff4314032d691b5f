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
#: Step-3.7's clamped silu-glu (``parts.CLAMPED``) and the look-alikes of its clamps, drawn only when asked for
#: (``draw_recipe(..., clamped=True)``, ``--clamped``), so each seed's general draws stay as they were: a genuine
#: clamped recipe is any general form with this activation; a look-alike, any general form, genuine in its own
#: code, with the activation of its flaw (the flaw's name + "_glu"): the clamp before the silu, one side only on
#: up, a bound below on the silu too, up's bounds not the silu's
CLAMPED_ACT = "clamped_silu_glu"
#: the last writes the silu in place before the clamp reads it (the proof would read the silu's node as made)
CLAMP_FLAWS = ("clamp_before_silu", "clamp_up_max_only", "clamp_gate_min", "clamp_limits_differ",
               "silu_doubled_in_place")
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_bias", "group_limited", "argmax")
FUSED = ("fused_chunk", "fused_split", "fused_slice", "fused_interleaved")
#: how a loop's expert body is skipped when its mask is empty (``if mask.any():``, ``if torch.any(mask):``,
#: ``if not mask.any(): continue``), or not skipped at all
GUARDS = ("none", "mask_any", "torch_any", "continue")
#: the loop selections a guard's mask ``ids == e`` can stand before (v5's hit loop and DeepSeek's flat masks have
#: their own skip or none)
GUARDED = ("where", "nonzero", "onehot", "any", "top1_mask", "arange_mask", "onehot_etk")
#: top-1 boolean-mask writes ``out[idx == e] = expert_e(x[idx == e])``: how the (T, 1) ids become (T,) ones
#: ("modulo": ``% E``, the same values but not provably in range(E)), what the buffer starts as, and where the
#: routing weight goes ("after" the loop on the whole buffer, "none", or inside each write at the loop's
#: positions), spelt as a column of the (T,) weight by ``w[m, None]``, ``.unsqueeze(-1)`` or the (T, 1) tensor
TOP1 = {
    "ids": ("squeeze", "column0", "view", "flatten", "modulo"),
    "buffer": ("zeros_like", "new_zeros", "empty_like"),
    "position": ("after", "none", "output", "input", "between"),
    "column": ("index_none", "unsqueeze", "t1"),
    "combine": ("assign", "accumulate"),
}

#: idiom axes of each form (an axis whose options depend on earlier draws is narrowed in ``draw_recipe``)
AXES: dict[str, dict[str, tuple]] = {
    "loop": {
        # "arange_mask": litgpt's ``(ids[..., None] == arange(E)).permute(2, 0, 1)``; "onehot_etk": the one-hot
        # permuted to (E, T, k) the same way; each read per expert by ``torch.where(hits[e])``
        "selection": ("where", "nonzero", "onehot", "boolmask", "any", "hit_v5", "top1_mask", "arange_mask",
                      "onehot_etk"),
        "experts": ("modulelist", "moduledict", "stacked_nk", "stacked_kn", "slices") + FUSED,
        "position": ("output", "input", "between"),
        # "index_add_oop": ``out = out.index_add(0, tok, y)``, each expert adding to the value before it;
        # "scatter_reduce": DeepSeek-MoE's ``out.scatter_reduce_(0, index, y, "sum")``, drawn for inference only
        # (``Recipe.inference``: eager's backward raises on a buffer reduced into twice)
        "combine": ("index_add", "index_put", "setitem", "scatter_add", "index_add_oop", "scatter_reduce"),
        "matmul": ("linear", "matmul"),
        "rows": ("index", "index_select"),
        "guard": GUARDS,
        # each row's routing weight: ``weights[tok, pos, None]``, or a column of ``weights[tok, pos]``
        "weight_read": ("index_none", "unsqueeze", "view"),
    },
    "sorted": {
        "sort": ("argsort", "sort"),
        "gather": ("index", "gather"),
        # "histc_sorted": histc of the sorted ids, transformers v5's grouped_mm; "marks": DeepSeek-V2's ``scatter_``
        # of ones into ``new_zeros((T, E))``, summed over tokens
        "counts": ("histc", "onehot_sum", "histc_sorted", "marks"),
        # "modulelist": one module per expert, which only the host walk below can use
        "experts": ("stacked_nk", "stacked_kn", "fused_chunk", "modulelist"),
        "position": ("output", "input"),
        # "unsort_inverse": v5's gather by the inverse permutation, ``inv[order] = arange(n); ys[inv]``;
        # "unsort_weighted": DeepSeek-V2's ``buf = empty_like(ys); buf[order] = ys``, the weights applied after it
        "combine": ("scatter_add", "index_add", "unsort_sum", "unsort_bmm", "unsort_inverse", "unsort_weighted"),
        # the experts step: ``torch._grouped_mm`` per projection, or DeepSeek-V2's ``moe_infer`` walk of the counts
        # on the host (``.cpu().numpy()`` or ``.tolist()``), a running slice per expert, empty experts skipped
        "step": ("grouped_mm", "walk_numpy", "walk_tolist"),
    },
    "gathered": {
        "experts": ("stacked_nk", "stacked_kn", "fused_chunk", "fused_slice"),
        # "flat_bmm": transformers v5's batched_mm, flat ``repeat_interleave`` rows, each by its own gathered weight
        # through ``torch.bmm``, the flat routing weights, ``view(T, k, H).sum(1)``
        "combine": ("einsum", "mul_sum", "flat_bmm"),
        # a fused gate/up weight: split the projection's output, or the gathered weight copy (SGLang's native path)
        "split": ("product", "gathered"),
    },
    "dense": {
        "experts": ("stacked_nk", "stacked_kn", "fused_chunk", "loop_modulelist"),
        "routing": ("scatter", "scatter_", "onehot_sum"),
        "combine": ("einsum", "mul_sum", "bmm"),
    },
    "capacity": {
        "style": ("gshard", "switch", "fairseq", "deepspeed", "nanomoe"),
        "capacity": ("constant", "from_tokens"),
        "experts": ("einsum", "bmm"),
        "dispatch": ("ne_zero", "bool", "permute_matmul"),
        "combine": ("einsum", "mm"),
        "bias": ("none", "e_n", "e1n_inplace"),
        "dropout": ("none", "module_p0", "functional_p0", "eval"),
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
#: the loop's guard flaws: a guard of the next expert's mask, a test of more than one row (``mask.sum() > 1``), and a
#: ``mask.any()`` guard over a body that also counts into a buffer or appends to a list made before the loop;
#: "empty_unproven" writes top-1 masks into ``torch.empty_like`` with ids not provably in range(E); the capacity
#: flaws: (E, C, N) biases (one per slot), a dropout of p > 0 in training, nanoMoE's queues numbered token-major;
#: "mask_shift" compares the ids with ``arange(1, E + 1)`` in litgpt's mask (expert e gets the rows of id e + 1);
#: "tiled_rows" repeats v5's batched_mm rows ``x.repeat(k, 1)`` (choice-major) against token-major ids;
#: "include_self_false" combines by ``scatter_reduce_(..., "sum", include_self=False)``: each expert's write replaces
#: what the experts before it wrote at a token, where k > 1 (inference only, as the genuine reduction)
GUARD_FLAWS = ("guard_other", "guard_count", "guard_more", "guard_list")
FLAWS: dict[str, tuple] = {
    "loop": ("soft", "other_slot", "twice", "differs", "skipped", "other_rows", "empty_unproven", "mask_shift")
    + GUARD_FLAWS + ("include_self_false",),
    "sorted": ("twice", "other_rows"),
    "gathered": ("twice", "differs", "tiled_rows"),
    "dense": ("soft", "twice", "differs", "skipped"),
    "capacity": ("capacity_mismatch", "differs", "slot_bias", "dropout_train", "token_major"),
    "split": ("other_slot", "differs", "other_rows"),
    "expert_choice": ("expert_choice",),
    "memory_slots": ("memory_slots",),
}

#: forms drawn only by a family of their own (``draw_recipe(..., forms=WALKS_LISTS)``, ``--walks-lists``): the
#: general draw offers FORM_COUNTER's and FLAWS' forms alone, so every seed keeps drawing the recipes it drew before
#: these came. Each: the counter a genuine variant bumps, and its look-alikes' flaws. "cumsum_walk" is MiniMind's
#: ``moe_infer`` (cumulative host counts walked, one scatter per expert): its walk flaws count the skipped experts
#: into the output, read each start two boundaries back, stop half way, walk the counts of other ids (each id + 1,
#: mod E: every slice sized by the expert before's count), or count every iteration after a guarded body.
#: "list_rows" is transformers v4.36 Mixtral's loop indexing rows by ``.tolist()`` lists: "list_len" reads the row
#: list as a number too, "list_reversed" reverses both lists in place before use
OWN_FAMILY: dict[str, tuple[str, tuple]] = {
    "cumsum_walk": ("split_loop", ("other_rows", "other_slot", "differs", "twice", "walk_counts", "walk_neighbour",
                                   "walk_stops", "walk_other_counts", "walk_tail")),
    "list_rows": ("unrolled_loop", ("other_rows", "other_slot", "differs", "twice", "list_len", "list_reversed")),
}
#: the family of MiniMind's cumulative walk and v4.36 Mixtral's row lists
WALKS_LISTS = ("cumsum_walk", "list_rows")
AXES.update({
    "cumsum_walk": {
        "sort": ("argsort", "argsort_stable", "sort"),
        # NumPy's cumsum of the host copy, torch's cumsum then the copy, either with minlength=E, or its .tolist()
        "cumsum": ("numpy", "torch", "numpy_minlength", "tolist_minlength"),
        # ``start = 0 if i == 0 else cum[i - 1]``, or carried from the last end
        "start": ("previous", "carried"),
        # ``if start == end: continue`` (MiniMind), ``if end <= start: continue``, or the body under ``if start !=
        # end:``
        "skip": ("continue", "le_continue", "guarded"),
        # no "slices": the per-expert scatters read each expert's MLP as the split loop does, which takes no row
        # blocks of flat weights (passes/flat_slices.py serves the unrolled loop and the masked writes)
        "experts": ("modulelist", "moduledict", "stacked_nk", "stacked_kn") + FUSED,
        # ``x[tok[s:e]]``, ``x[tok][s:e]``, ``x.index_select(0, tok[s:e])``
        "rows": ("tok_slice", "sorted_rows", "index_select"),
        # ``y.mul_(column[idxs[s:e]])``, ``y * column[...]``, ``y.mul_(weights.view(-1)[idxs[s:e]].unsqueeze(-1))``
        "weight": ("mul_", "out_of_place", "flat"),
        # ``scatter_add_`` of ``tok[s:e].view(-1, 1).repeat(1, H)`` or ``.unsqueeze(1).expand(-1, H)``, ``index_add_``,
        # or DeepSeek-MoE's ``scatter_reduce_(0, index, y, reduce="sum")`` of the repeated index (inference only)
        "combine": ("scatter_repeat", "scatter_expand", "index_add", "scatter_reduce"),
    },
    "list_rows": {
        # ``torch.where`` of the (E, k, T) one-hot (transformers v4), of ``ids == e``, or of the (E, T, k) one-hot
        "selection": ("onehot", "where", "onehot_etk"),
        # ``if tok.shape[0] == 0: continue``, or no skip (an empty list selects the same nothing)
        "skip": ("shape0", "none"),
        # the lists in locals, or ``x[tok.tolist()]`` made inside each subscript
        "lists": ("stored", "inline"),
        # ``x[None, rows].reshape(-1, H)`` or ``x[rows]``
        "rows": ("none_reshape", "plain"),
        "weight_read": ("index_none", "unsqueeze", "view"),
        "experts": ("modulelist", "moduledict", "stacked_nk", "stacked_kn", "slices") + FUSED,
        "position": ("output", "input", "between"),
        "combine": ("index_add", "index_put", "scatter_add"),
    },
})


def counter_of(form: str) -> str:
    """The counter a genuine variant of ``form`` bumps (``counters["moe_inductor"][...]``)."""
    return FORM_COUNTER[form] if form in FORM_COUNTER else OWN_FAMILY[form][0]


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

    @property
    def inference(self) -> bool:
        """Whether the module is checked in inference only (eval mode, no gradient): its combine is a
        ``scatter_reduce_``, whose backward eager raises on where a buffer is reduced into more than once, and
        which moe_inductor reads as the ``scatter_add_`` it equals only where no gradient runs through it."""
        return self.idioms.get("combine") == "scatter_reduce" or self.flaw == "include_self_false"

    def __str__(self) -> str:
        parts = [self.form, self.flaw or "genuine", f"E{self.E}k{self.k}T{self.T}s{self.seed}", self.act, self.router,
                 "renorm" if self.renorm else "raw"] + [f"{a}={v}" for a, v in self.idioms.items()]
        return " ".join(parts)


def draw_recipe(draw: Draw, lookalike: Optional[bool] = None, forms: Optional[Sequence[str]] = None,
                clamped: bool = False) -> Recipe:
    """One recipe. ``lookalike`` None draws genuine variants and look-alikes alike (3 in 4 genuine). ``forms``: the
    forms of a family of their own to draw from (OWN_FAMILY's), instead of the general ones. ``clamped``: a general
    form with Step-3.7's clamped silu-glu, or (a look-alike) one of its clamps' look-alikes (``CLAMP_FLAWS``)."""
    if lookalike is None:
        lookalike = draw("lookalike", (False, False, False, True))
    flaws = FLAWS if forms is None else {f: OWN_FAMILY[f][1] for f in forms}
    if clamped:  # a look-alike's flaw is its activation's alone
        form = draw("form", tuple(FORM_COUNTER))
        flaw = draw("flaw", CLAMP_FLAWS) if lookalike else None
    elif lookalike:
        form = draw("form", tuple(flaws))
        flaw = draw("flaw", flaws[form])
    else:
        form, flaw = draw("form", tuple(FORM_COUNTER) if forms is None else tuple(forms)), None
    idioms = {}
    for axis, options in AXES.get(form, {}).items():
        idioms[axis] = draw(axis, options)
    if flaw == "tiled_rows":
        idioms["combine"] = "flat_bmm"
    if form == "sorted" and idioms["step"] == "grouped_mm" and idioms["experts"] == "modulelist":
        idioms["experts"] = "stacked_nk"  # torch._grouped_mm takes one stacked weight
    if form == "sorted" and idioms["step"] != "grouped_mm":
        if idioms["counts"].startswith("histc"):
            idioms["counts"] = "marks"  # histc counts are floats: a walk slices by integers
        if idioms["combine"] in ("unsort_sum", "unsort_bmm", "unsort_inverse"):
            # a (T*k, H) buffer written with the walk's cat: Dynamo cannot prove the slices add up to T*k rows
            # (their sizes are fresh symbols) and the frame falls back (README's known limits)
            idioms["combine"] = "unsort_weighted"
    if idioms.get("combine") == "flat_bmm" and form == "gathered":
        idioms["split"] = "product"  # v5's batched_mm splits the projection's output
    act = (f"{flaw}_glu" if flaw else CLAMPED_ACT) if clamped else draw("act", ACTIVATIONS)
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
        _capacity_idioms(draw, idioms, flaw)
        router = "softmax"
        if idioms["style"] in ("switch", "deepspeed"):
            k = 1
        elif idioms["style"] in ("gshard", "fairseq"):
            k = min(2, E)
        elif flaw == "token_major" and k == 1:  # one choice per token has one queue order
            k = 2
    if flaw in ("other_slot", "include_self_false") and k == 1:  # another slot, or a write replaced, needs two
        k, router = 2, "softmax_topk" if router == "argmax" else router
    if flaw == "soft":  # the full probabilities differ from the top-k weights only where some are off the top-k:
        if router == "topk_softmax":  # its probabilities are zero off the top-k (a genuine MoE, not a look-alike)
            router = "softmax_topk"
        k = min(k, E - 1)  # all E chosen: the full softmax is the top-k weights
    if form == "loop":
        k = _loop_idioms(draw, idioms, flaw, k)
    _own_family_idioms(form, idioms, flaw)
    T = draw("T", (1, 2, 3, 5, 8, 11, 16))
    if flaw == "other_rows" and T == 1:
        T = 3
    if flaw == "guard_count" and T * k <= E:  # some expert gets two rows, or no body runs and nothing has a gradient
        T = E + 1
    return Recipe(form=form, flaw=flaw, E=E, k=k, T=T, act=act, router=router, renorm=draw("renorm", (False, True)),
                  seed=draw("seed", tuple(range(64))), idioms=idioms)


def _loop_idioms(draw: Draw, idioms: dict, flaw: Optional[str], k: int) -> int:
    """Narrow the loop's idioms to those its selection and flaw can be written with, and draw the top-1 mask
    writes' own; the k the selection needs."""
    selection = idioms["selection"]
    if selection in ("boolmask", "any", "top1_mask") and flaw in ("soft", "other_slot"):
        selection = "where"  # these flaws are written in the zeros-accumulator loop
    if selection in ("boolmask", "any") and flaw in ("skipped", "other_rows"):
        selection = "where"
    if flaw == "empty_unproven":
        selection = "top1_mask"
    if flaw == "mask_shift":
        selection = "arange_mask"
    if flaw in GUARD_FLAWS and selection not in ("where", "top1_mask"):  # the guards' top-k and top-1 spellings
        selection = "where"
    if flaw == "include_self_false":  # a flaw of the (token, slot) bodies' reduction
        selection = "where" if selection in ("boolmask", "top1_mask") else selection
        idioms["combine"] = "scatter_reduce"
    idioms["selection"] = selection
    if selection == "hit_v5" and idioms["experts"] in ("moduledict", "slices"):
        idioms["experts"] = "stacked_nk"  # v5's 0-d index keys no dict and slices no flat weight, in eager either
    if selection == "boolmask":
        idioms["combine"] = draw("masked_combine", ("view_sum", "bmm"))
    if selection not in GUARDED:
        idioms["guard"] = "none"
    if idioms["combine"] == "index_add_oop" and (selection in ("top1_mask", "hit_v5")
                                                 or flaw in ("guard_more", "guard_list")):
        idioms["combine"] = "index_add"  # the out-of-place chain is written for (token, slot) bodies
    if flaw in ("guard_more", "guard_list") and idioms["guard"] == "none":
        idioms["guard"] = "mask_any"  # what these flaws add is the guard's body doing more
    elif flaw in ("guard_other", "guard_count"):
        idioms["guard"] = flaw  # the flaw is the guard's test
    if selection != "top1_mask":
        return k
    for axis, options in TOP1.items():
        idioms[axis] = draw(f"top1_{axis}", options)
    if flaw == "empty_unproven":
        idioms["ids"], idioms["buffer"] = "modulo", "empty_like"
    elif flaw is not None and idioms["buffer"] == "empty_like":
        idioms["buffer"] = "zeros_like"  # a skipped or unwritten row of an empty buffer is garbage in eager too
    if flaw == "twice" and idioms["position"] in ("after", "none"):
        idioms["position"] = "output"  # twice means on the input and on the output, inside the write
    if idioms["ids"] == "modulo" and flaw is None:
        # ids not provably in range(E): a row no expert writes is the buffer's, so it starts as zeros, and no weight
        # scales the whole buffer (eager's 0 * w there is NaN at a non-finite w, where the op gives 0)
        idioms["buffer"] = "zeros_like" if idioms["buffer"] == "empty_like" else idioms["buffer"]
        idioms["position"] = "output" if idioms["position"] == "after" else idioms["position"]
    if idioms["combine"] == "accumulate" and idioms["buffer"] == "empty_like":
        idioms["combine"] = "assign"  # out[m] += ... needs zeros to add onto
    if idioms["position"] == "none":
        del idioms["column"]
    return 1


def _own_family_idioms(form: str, idioms: dict, flaw: Optional[str]) -> None:
    """Narrow the walk's and the row lists' idioms to those their flaw is written with (each flawed walk or list read
    is its own function, in the plain spelling)."""
    if form == "cumsum_walk" and flaw in ("walk_counts", "walk_neighbour", "walk_stops", "walk_other_counts"):
        idioms.update(start="previous", skip="continue")
    elif form == "cumsum_walk" and flaw == "walk_tail":
        idioms.update(start="previous", skip="guarded")
    if form == "list_rows" and flaw in ("list_len", "list_reversed"):
        idioms.update(lists="stored", rows="plain", weight_read="index_none")


def _capacity_idioms(draw: Draw, idioms: dict, flaw: Optional[str]) -> None:
    """Narrow the padded-capacity idioms to the recipe's flaw, and draw nanoMoE's and the dropout's own."""
    if flaw == "token_major":
        idioms["style"] = "nanomoe"
    if idioms["style"] == "nanomoe":  # the (k, T, E) stack summed over k by a product's sum or an einsum
        idioms["stack"] = draw("stack", ("sum", "einsum"))
    if flaw == "slot_bias":
        idioms["bias"] = "slot"
    if flaw == "dropout_train":
        idioms["dropout"] = "train_p"
    if idioms["dropout"] != "none":  # between the projections, or on the experts' output
        idioms["dropout_at"] = draw("dropout_at", ("between", "after"))


#: the choices that narrow a draw to DeepSeek-V2's ``moe_infer``: marked counts walked on the host, the weighted unsort
HOST_WALKS = {
    "lookalike": (False, True),
    "form": ("sorted",),
    "counts": ("marks", "onehot_sum"),
    "combine": ("unsort_weighted", "scatter_add", "index_add"),
    "step": ("walk_numpy", "walk_tolist"),
}


#: the choices that narrow a draw to the spellings of the guarded loops, the top-1 mask writes and the padded
#: capacity's biases, dropouts and stacked choices, with their look-alikes (``narrowed``)
GUARDS_MASKS_SLOTS = {
    "lookalike": (False, True),
    "form": ("loop", "capacity"),
    "flaw": GUARD_FLAWS + ("empty_unproven", "slot_bias", "dropout_train", "token_major"),
    "selection": ("top1_mask", "where"),
    "guard": GUARDS[1:],
    "style": ("nanomoe", "switch", "fairseq"),
    "bias": ("e_n", "e1n_inplace"),
    "dropout": ("module_p0", "functional_p0", "eval"),
}


#: the choices that narrow a draw to litgpt's broadcast mask and the one-hot read the same way, and transformers v5's
#: experts forwards written as user code (grouped_mm: histc of the sorted ids, the inverse-permutation unsort;
#: batched_mm: flat repeated rows through bmm), with their look-alikes
MASKS_AND_V5 = {
    "lookalike": (False, True),
    "form": ("loop", "sorted", "gathered"),
    "flaw": ("mask_shift", "tiled_rows", "other_rows", "differs", "twice"),
    "selection": ("arange_mask", "onehot_etk"),
    "counts": ("histc_sorted",),
    "combine": ("unsort_inverse", "flat_bmm"),
}


#: the choices that narrow a draw to the combines by ``scatter_reduce_(..., "sum")`` (inference only): DeepSeek-MoE's
#: spelling in the unrolled loop, and the look-alike that leaves ``include_self`` off
SUM_REDUCTIONS = {
    "lookalike": (False, True),
    "form": ("loop",),
    "flaw": ("include_self_false",),
    "combine": ("scatter_reduce",),
    # the selections whose bodies combine by it (boolean masks and top-1 writes have combines of their own)
    "selection": ("where", "nonzero", "onehot", "any", "hit_v5", "arange_mask", "onehot_etk"),
}


def narrowed(draw: Draw, only: dict[str, tuple]) -> Draw:
    """``draw`` with the options of each name in ``only`` cut down to those it lists, in its order (hypothesis
    shrinks towards the first), where any of them is offered: the same recipes, fewer of them."""
    def pick(name: str, options: Sequence[Any]) -> Any:
        kept = tuple(o for o in only.get(name, ()) if o in options)
        return draw(name, kept or options)

    return pick


def random_draw(rng: random.Random) -> Draw:
    """A ``Draw`` from a seeded generator (the measuring script)."""
    return lambda name, options: rng.choice(list(options))


def hypothesis_draw(data) -> Draw:
    """A ``Draw`` from hypothesis's ``st.data()`` (the test; failures shrink towards the first option)."""
    from hypothesis import strategies as st

    return lambda name, options: data.draw(st.sampled_from(list(options)), label=name)
