"""Hunyuan-Large's capacity gatings (tests/corpus/hunyuan_large.py) and their look-alikes under the padded-capacity
proof: ``top1gating``'s ``topk(mask, k=capacity, dim=0)`` + ``scatter_`` keep, read as a tensor of ones only where the
capacity is the whole token count (``capacity_gating.covers``), and ``topkgating``'s T5X token priority, dispatched by
the mask its combine multiplies (``passes/priority_choices.py``). Rewritten ones equal eager forward and backward,
fp32 and bf16; look-alikes that compute something else (or something the op cannot reproduce) are left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.corpus.hunyuan_large import H, HunYuanMoE
from tests.helpers import assert_close, assert_rewritten_like_eager, compile_beside_eager


def top1_gating(logits, style):
    """Hunyuan-Large's top1gating (its statistics left out): the capacity is T, or T // 2 for ``half``; ``plain``
    keeps every token with no topk at all."""
    gates = F.softmax(logits.float(), dim=1)
    T, E = gates.shape
    capacity = T // 2 if style == "half" else T
    mask = F.one_hot(torch.argmax(gates, dim=1), num_classes=E)
    if style != "plain":
        keep = torch.topk(mask.float(), k=capacity, dim=0)[1]
        mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    loc = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    combine = torch.einsum("se,sc->sec", gates * mask.float(), F.one_hot(loc, num_classes=capacity).float())
    return combine, combine.bool()


def _priority_mask(priority, capacity, below=None):
    """The (T, E, C) one-hot of the priorities in [0, below) (below = C unless given), zero elsewhere."""
    valid = torch.logical_and(priority >= 0, priority < (capacity if below is None else below))
    slots = F.one_hot(torch.masked_fill(priority, ~valid, 0), capacity).to(torch.bool)
    return torch.masked_fill(slots, ~valid.unsqueeze(-1).expand(-1, -1, capacity), 0)


def topk_gating(logits, k, style):
    """Hunyuan-Large's topkgating (T5X's token priority, its statistics left out) and its variants: ``drop`` a
    capacity of T // 2 (the choice-major queue drops), ``raw`` combine weights by the unrenormalised softmax,
    ``zero`` a second choice of weight 0 (its slot still dispatched), ``bool`` the dispatch taken as combine's
    support, ``mul`` the combine by broadcast product (and the ids flattened by ``.t().contiguous().view(-1)``);
    look-alikes: ``threshold`` dispatches by a mask of half the capacity, ``token_major`` queues every choice of a
    token before the next token, ``repeated`` takes the argmax k times (a token's choices are not distinct
    experts)."""
    gates = F.softmax(logits.float(), dim=1)
    T, E = gates.shape
    capacity = T // 2 if style in ("drop", "threshold", "token_major", "repeated") else k * T
    top, ids = torch.topk(gates, k)
    if style == "repeated":
        ids = torch.argmax(gates, dim=1, keepdim=True).repeat(1, k)
    probs = gates / torch.clamp(top.sum(dim=1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    if style == "raw":
        probs = gates
    elif style == "zero":
        probs = probs * F.one_hot(ids[:, 0], E)
    if style == "token_major":
        flat = ids.reshape(-1)
    elif style == "mul":
        flat = ids.t().contiguous().view(-1)
    else:
        flat = ids.transpose(0, 1).reshape(-1)
    mask = F.one_hot(flat, E).to(torch.int32)
    priority = torch.cumsum(mask, dim=0) * mask - 1
    if style == "token_major":
        priority = priority.reshape(T, k, E).max(dim=1)[0]
    else:
        priority = torch.max(torch.transpose(priority.reshape(k, -1, E), 0, 1), dim=1)[0]
    dispatch = _priority_mask(priority, capacity)
    if style == "mul":
        combine = probs.unsqueeze(-1) * dispatch
    else:
        combine = torch.einsum("te,tec->tec", probs, dispatch)
    if style == "threshold":
        dispatch = _priority_mask(priority, capacity, below=capacity // 2)
    elif style == "bool":
        dispatch = combine.bool()
    return combine, dispatch


class Gate(nn.Module):
    def __init__(self, k, style):
        super().__init__()
        self.k, self.style = k, style
        self.wg = nn.Linear(H, 6, bias=False)

    def forward(self, x):
        logits = self.wg(x.reshape(-1, x.shape[-1]).to(self.wg.weight.dtype))
        if self.k == 1:
            combine, dispatch = top1_gating(logits, self.style)
        else:
            combine, dispatch = topk_gating(logits, self.k, self.style)
        return None, combine, dispatch, None


class VariantMoE(HunYuanMoE):
    """HunYuanMoE (shared MLP, one HunYuanMLP per chunk of the slots) with a gating variant."""

    def __init__(self, k, style):
        super().__init__(k)
        self.gate = Gate(k, style)


def _clustered(S, dtype=torch.float32):
    """Tokens near one direction: most of them pick the same experts, so a capacity of T // 2 drops."""
    g = torch.Generator().manual_seed(S)
    base = torch.randn(1, 1, H, generator=g) * 2
    return (base + 0.3 * torch.randn(2, S, H, generator=g)).to(dtype)


def _drops(model, x) -> bool:
    """Some expert gets more (token, choice) assignments than T // 2."""
    with torch.no_grad():
        gates = F.softmax(model.gate.wg(x.reshape(-1, H).to(model.gate.wg.weight.dtype)).float(), dim=1)
        ids = torch.topk(gates, model.gate.k)[1]
    return bool(torch.bincount(ids.reshape(-1), minlength=6).max() > x.shape[0] * x.shape[1] // 2)


REWRITTEN = [(1, "keep"), (1, "plain"), (2, "keep"), (2, "drop"), (2, "raw"), (2, "zero"), (2, "bool"), (2, "mul"),
             (3, "drop")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,style", REWRITTEN, ids=[f"k{k}-{s}" for k, s in REWRITTEN])
def test_hunyuan_gating_is_rewritten_and_equal(k, style, dtype):
    torch.manual_seed(0)
    model = VariantMoE(k, style).to(dtype)
    model.gate.float()  # Hunyuan-Large keeps its gate in fp32 whatever the model's dtype
    x = _clustered(7, dtype)
    if style == "drop":  # the queue's drops are under test: the input must make some
        assert _drops(model, x)
    assert_rewritten_like_eager(model, x, "padded_capacity", f"k={k} {style} {dtype}")
    assert not counters["moe_inductor_left_alone"]


def test_hunyuan_zero_weight_slot_is_dispatched():
    """``zero``: the dispatch is not combine's support (a kept second choice of weight 0 still takes its slot), and
    the rewrite is still eager's: the slot's token gets 0 times its expert's output in both."""
    torch.manual_seed(0)
    model = VariantMoE(2, "zero")
    logits = model.gate.wg(_clustered(7).reshape(-1, H))
    combine, dispatch = topk_gating(logits, 2, "zero")
    assert dispatch.sum() > combine.bool().sum()


LEFT_ALONE = [
    # a capacity below T: topk keeps T // 2 of the tied ones per expert, in an order torch does not specify
    (1, "half", "no factor of a term is a capacity-dropped one-hot"),
    # slots filled by another mask than the one the combine weights (half the capacity): tokens get expert(0) back
    (2, "threshold", "not filled by the token-priority mask its combine weights"),
    # every choice of a token before the next token: another drop order than the op's
    (2, "token_major", "its priority is not the max over the k choices"),
    # a token's k choices one expert: eager keeps one slot at the later position, the op would run both
    (2, "repeated", "its priority is not the max over the k choices"),
]


@pytest.mark.parametrize("k,style,reason", LEFT_ALONE, ids=[f"k{k}-{s}" for k, s, _ in LEFT_ALONE])
def test_hunyuan_look_alikes_are_left_alone(k, style, reason):
    torch.manual_seed(0)
    model = VariantMoE(k, style)
    x = _clustered(7)
    if style != "repeated":
        assert _drops(model, x)  # the capacity of T // 2 bites, so the look-alike computes something else
    outputs, graphs, breaks, seen = compile_beside_eager(model, model, [x])
    for got, want in outputs:
        assert_close(got, want, torch.float32, style)
    assert counters["moe_inductor"]["padded_capacity"] == 0
    assert counters["moe_inductor_left_alone"]["padded_capacity"] == graphs
    assert any(reason in r.reason for r in seen.left_alone), [r.reason for r in seen.left_alone]
