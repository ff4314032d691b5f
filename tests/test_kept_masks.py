"""Switch Transformers' (transformers v4.4x) experts loop: a one-hot of the router's choice with the capacity drops in
it, one column per expert, and the loop over a Python list of the experts that kept rows::

    router_mask = (F.one_hot(idx, E) * (torch.cumsum(F.one_hot(idx, E), dim=-2) <= C)).bool()
    hit = torch.nonzero(router_mask.reshape(B * T, E).sum(dim=0), as_tuple=True)[0].tolist()
    out = torch.zeros(x.shape)
    for e in hit:
        out[router_mask[:, :, e]] = experts[f"expert_{e}"](x[router_mask[:, :, e]])
    y = probs * out

The list is traced as every expert (``moe_inductor/hit_lists.py``) and the masks read as a top-1 router's with the
dropped rows given the out-of-range id E (``passes/kept_masks.py``): rewritten, forward and backward equal to eager
(an idle expert's weights get no gradient, as in eager). Look-alikes are left alone or fall back, equal to eager: a
float keep factor, a mask that is no one-hot, counts of another mask than the body reads, the list or the loop
variable read again, the mask changed in place after it was counted or inside the loop, the list's loop run again
to count the experts in a tensor, the one-hot's ids changed in place after it was made, the one-hot or its product with keep changed in
place before the cast (a second True in a row), the buffer written elsewhere."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, C = 16, 24, 4, 3  # a capacity of 3 per sequence: longer inputs drop tokens


class SwitchLike(nn.Module):
    def __init__(self, style: str = "hit_list", batched: bool = True):
        super().__init__()
        self.style, self.batched = style, batched
        self.classifier = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleDict({f"expert_{e}": nn.Sequential(nn.Linear(H, I, bias=False), nn.ReLU(),
                                                                   nn.Linear(I, H, bias=False)) for e in range(E)})

    def forward(self, x):
        s = self.style
        probs = torch.softmax(self.classifier(x), dim=-1)
        idx = torch.argmax(probs, dim=-1)
        hot = F.one_hot(idx, num_classes=E)
        if s == "one_hot_changed":  # a second 1 in each row, put there before anything reads the one-hot
            hot.view(-1, E)[:, 1] = 1
        keep = torch.cumsum(hot, dim=-2) <= C
        if s == "float_keep":  # NaN-capable: a NaN times one_hot's 0 would be True off idx
            keep = keep.float()
        product = hot * keep
        if s == "product_changed":  # the product changed in place before its cast: True off idx
            product[..., 0] = 1
        router_mask = product.bool()
        if s == "ids_changed":  # the one-hot's ids changed after it was made: the mask keeps the old ones
            idx.fill_(0)
        if s == "not_one_hot":  # several experts per row
            router_mask = x[..., :E] > 0
        weight = torch.max(probs, dim=-1).values.unsqueeze(-1)
        out = torch.zeros(x.shape, dtype=x.dtype)
        if s == "written_elsewhere":
            out[..., 0] = 1.0
        if s == "other_counts":  # counts of another router's kept one-hot
            other = F.one_hot(torch.argmin(probs, dim=-1), num_classes=E)
            return weight * self._counted_by(x, router_mask, (other * (torch.cumsum(other, dim=-2) <= C)).bool(), out)
        loop = {"every_expert": self._every_expert, "guarded": self._guarded, "list_read_again": self._read_again,
                "loop_variable_read_after": self._variable_read_after,
                "changed_after_count": self._changed_after_count,
                "changed_mid_loop": self._changed_mid_loop, "rerun_counter": self._rerun_counter}.get(s, self._hit_list)
        return weight * loop(x, router_mask, out)

    # each spelling has a loop of its own: the trace reads the bytecode of the whole function around the loop

    def _hit_list(self, x, router_mask, out):
        hit = torch.nonzero(router_mask.reshape(-1, E).sum(dim=0), as_tuple=True)[0].tolist()
        for e in hit:
            out[router_mask[..., e]] = getattr(self.experts, f"expert_{e}")(x[router_mask[..., e]])
        return out

    def _every_expert(self, x, router_mask, out):
        for e in range(E):
            out[router_mask[..., e]] = self.experts[f"expert_{e}"](x[router_mask[..., e]])
        return out

    def _changed_mid_loop(self, x, router_mask, out):
        for e in range(E):
            if e == 2:  # the later experts' masks are not what the op would read at the end of the loop
                router_mask[..., 3] = router_mask[..., 0]
            out[router_mask[..., e]] = self.experts[f"expert_{e}"](x[router_mask[..., e]])
        return out

    def _rerun_counter(self, x, router_mask, out):
        hit = torch.nonzero(router_mask.reshape(-1, E).sum(dim=0), as_tuple=True)[0].tolist()
        ran = torch.zeros(1)
        for rep in range(2):  # the one read of the list runs twice; the second run counts the experts in a tensor
            for e in hit:
                if rep == 0:
                    out[router_mask[..., e]] = getattr(self.experts, f"expert_{e}")(x[router_mask[..., e]])
                else:
                    ran.add_(1.0)
        return out + ran

    def _guarded(self, x, router_mask, out):
        for e in range(E):
            if router_mask[..., e].any():
                out[router_mask[..., e]] = self.experts[f"expert_{e}"](x[router_mask[..., e]])
        return out

    def _counted_by(self, x, router_mask, counted, out):
        hit = torch.nonzero(counted.reshape(-1, E).sum(dim=0), as_tuple=True)[0].tolist()
        for e in hit:
            out[router_mask[..., e]] = getattr(self.experts, f"expert_{e}")(x[router_mask[..., e]])
        return out

    def _read_again(self, x, router_mask, out):
        hit = torch.nonzero(router_mask.reshape(-1, E).sum(dim=0), as_tuple=True)[0].tolist()
        for e in hit:
            out[router_mask[..., e]] = getattr(self.experts, f"expert_{e}")(x[router_mask[..., e]])
        return out * len(hit)

    def _variable_read_after(self, x, router_mask, out):
        hit = torch.nonzero(router_mask.reshape(-1, E).sum(dim=0), as_tuple=True)[0].tolist()
        for e in hit:
            out[router_mask[..., e]] = getattr(self.experts, f"expert_{e}")(x[router_mask[..., e]])
        return out + e

    def _changed_after_count(self, x, router_mask, out):
        hit = torch.nonzero(router_mask.reshape(-1, E).sum(dim=0), as_tuple=True)[0].tolist()
        router_mask[..., 0] = False
        for e in hit:
            out[router_mask[..., e]] = getattr(self.experts, f"expert_{e}")(x[router_mask[..., e]])
        return out


def _tokens(batched: bool, T: int) -> torch.Tensor:
    return torch.randn(2, T, H) if batched else torch.randn(T, H)


@pytest.mark.parametrize("style,batched", [
    ("hit_list", True),  # transformers v4.4x's loop over the list of kept experts
    ("hit_list", False),  # (T, E) masks of (T, H) tokens
    ("every_expert", True),  # for e in range(E) over the same masks
    ("guarded", True),  # behind router_mask[..., e].any()
], ids=["hit-list-BT", "hit-list-T", "every-expert", "guarded"])
def test_kept_one_hot_loops_are_rewritten(style, batched):
    torch.manual_seed(0)
    model = SwitchLike(style, batched)
    for T in (1, 11):  # 1 token a sequence: idle experts (no gradient); 11: past the capacity of 3, rows dropped
        assert_rewritten_like_eager(model, _tokens(batched, T), "unrolled_loop", f"{style} T={T}")


@pytest.mark.parametrize("style", ["float_keep", "not_one_hot", "other_counts", "list_read_again",
                                   "loop_variable_read_after", "changed_after_count", "changed_mid_loop",
                                   "rerun_counter", "ids_changed", "written_elsewhere"])
def test_kept_one_hot_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = SwitchLike(style)
    x = _tokens(True, 9)
    out = compile_moe(model, x.clone())
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x.clone()), torch.float32, style)


@pytest.mark.parametrize("style", ["one_hot_changed", "product_changed"])
@pytest.mark.parametrize("loop", ["hit_list", "every_expert"])
def test_kept_one_hot_changed_in_place_is_left_alone(style, loop):
    """The one-hot (or the product with keep) changed in place before the cast to bool: the mask may be True off
    idx, several experts writing one row (the last one wins in eager), so it is no top-1 router's mask."""
    torch.manual_seed(0)
    model = SwitchLike(style)
    model._hit_list = model._every_expert if loop == "every_expert" else model._hit_list
    x = _tokens(True, 9)
    out = compile_moe(model, x.clone())
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x.clone()), torch.float32, f"{style} {loop}")


def test_a_dropped_row_is_zero_before_the_weight():
    """Every token over the capacity: the op gives the dropped rows 0, and ``probs * out`` stays the user's."""
    torch.manual_seed(0)
    model = SwitchLike("hit_list")
    x = torch.randn(2, 20, H)
    out = compile_moe(model, x)
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    ref = model(x)
    assert_close(out, ref, torch.float32, "forward")
    assert (ref == 0).all(-1).sum() >= 2 * (20 - E * C), "the case must drop rows"


def test_kept_one_hot_reads():
    """``kept_one_hot`` takes ``(one_hot(idx, E) * keep).bool()`` with an int or bool keep, in either order, and
    refuses a float keep, a keep that widens the one-hot, and a product that is not cast to bool."""
    from moe_inductor.passes.kept_masks import kept_column, kept_counts, kept_one_hot

    def graph_of(keep_dtype, shape=(5, E), cast="bool", order=0):
        g = torch.fx.Graph()
        idx = g.placeholder("idx")
        idx.meta["example_value"] = torch.zeros(5, dtype=torch.long)
        keep = g.placeholder("keep")
        keep.meta["example_value"] = torch.zeros(shape, dtype=keep_dtype)
        hot = g.call_function(F.one_hot, (idx,), {"num_classes": E})
        hot.meta["example_value"] = torch.zeros(5, E, dtype=torch.long)
        product = g.call_function(torch.mul, (hot, keep) if order == 0 else (keep, hot))
        product.meta["example_value"] = torch.zeros(torch.broadcast_shapes((5, E), shape), dtype=torch.long)
        mask = g.call_method(cast, (product,))
        mask.meta["example_value"] = torch.zeros(product.meta["example_value"].shape,
                                                 dtype=torch.bool if cast == "bool" else torch.long)
        column = g.call_function(__import__("operator").getitem, (mask, (slice(None), 2)))
        counts = g.call_method("sum", (mask, 0))
        return mask, column, counts

    mask, column, counts = graph_of(torch.bool)
    assert kept_one_hot(mask) is not None and kept_column(column)[1] == 2 and kept_counts(counts) is mask
    assert kept_one_hot(graph_of(torch.int64, order=1)[0]) is not None
    assert kept_one_hot(graph_of(torch.float32)[0]) is None
    assert kept_one_hot(graph_of(torch.bool, shape=(3, 5, E))[0]) is None
    assert kept_one_hot(graph_of(torch.bool, cast="long")[0]) is None
