"""The sort + torch._grouped_mm form (torchtitan style and a hand-written HF style), in bf16 (what _grouped_mm
traces for); equal to eager within bf16 rounding, look-alikes left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_gpu_bf16_rewrite, compile_moe

E, H, I = 4, 32, 16
pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")


class SortedMoE(nn.Module):
    def __init__(self, style="titan", k=2):
        super().__init__()
        self.style, self.k = style, k
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        k = self.k
        top, ids = torch.topk(torch.sigmoid(self.router(x).float()), k, dim=1)
        if self.style.startswith("titan"):  # score on the expert input, gather + scatter_add_
            counts = torch.histc(ids.view(-1).float(), bins=E, min=0, max=E)
            order = torch.argsort(ids.view(-1), stable=True)
            scores = top.view(-1)[order]
            tok = order // k
            xs = torch.gather(x, 0, tok.reshape(-1, 1).expand(-1, H))
            xs = (xs.float() * scores.reshape(-1, 1)).to(x.dtype)
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(xs, self.w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(
                xs, self.w3.transpose(-2, -1), offs=offs)
            ys = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
            out = torch.zeros_like(x)
            width = H // 2 if self.style == "titan_narrow_scatter" else H  # adds the first half of each row only
            out.scatter_add_(0, tok.reshape(-1, 1).expand(-1, width), ys)
            return out
        if self.style in ("hf_fallback_fp32", "functional_fp32"):  # transformers' own fp32 path / F.grouped_mm
            gmm = _hf_fallback() if self.style == "hf_fallback_fp32" else F.grouped_mm
            flat = ids.view(-1)
            order = torch.sort(flat)[1]
            tok = order // k
            offs = torch.cumsum(torch.histc(flat.float(), bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
            xs = x[tok]
            h = F.silu(gmm(xs, self.w1.transpose(-2, -1), offs=offs)) * gmm(xs, self.w3.transpose(-2, -1), offs=offs)
            ys = gmm(h, self.w2.transpose(-2, -1), offs=offs) * top.view(-1)[order][:, None].to(x.dtype)
            out = torch.zeros_like(x)
            out.index_add_(0, tok, ys)
            return out
        if self.style in ("unsorted_scores", "scatter_other_rows"):  # look-alikes: scores or rows out of step
            flat = ids.view(-1)
            order = torch.sort(flat)[1]
            tok = order // k
            offs = torch.cumsum(torch.histc(flat.float(), bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
            xs = x[tok]
            h = F.gelu(torch._grouped_mm(xs, self.w1.transpose(-2, -1), offs=offs))
            scores = top.view(-1) if self.style == "unsorted_scores" else top.view(-1)[order]  # not in sorted order
            ys = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs) * scores[:, None].to(x.dtype)
            out = torch.zeros_like(x)
            out.index_add_(0, torch.flip(tok, [0]) if self.style == "scatter_other_rows" else tok, ys)
            return out
        if self.style in ("hf", "wrong_offsets"):  # score on the output, sort()[1], x[tok], index_add_
            flat = ids.view(-1)
            order = torch.sort(flat)[1]
            tok = order // k
            ids_for_counts = flat if self.style == "hf" else (flat + 1) % E  # counts of other ids: wrong groups
            counts = torch.histc(ids_for_counts.float(), bins=E, min=0, max=E - 1)
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
            xs = x[tok]
            h = F.gelu(torch._grouped_mm(xs, self.w1.transpose(-2, -1), offs=offs))
            ys = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs) * top.view(-1)[order][:, None].to(x.dtype)
            out = torch.zeros_like(x)
            out.index_add_(0, tok, ys)
            return out
        if self.style.startswith("bincount"):  # counts by bincount(minlength=E), offsets cast after the cumsum
            flat = ids.view(-1)
            order = torch.argsort(flat, stable=True)
            tok = order // k
            if self.style == "bincount_weighted":  # look-alike: weighted counts are not the experts' row counts
                counts = torch.bincount(flat, weights=torch.ones_like(flat, dtype=torch.float32) * 2, minlength=E)
            elif self.style == "bincount_other_ids":  # look-alike: the counts of other ids
                counts = ((flat + 1) % E).bincount(minlength=E)
            else:
                counts = torch.bincount(flat, minlength=E)
            offs = torch.cumsum(counts, dim=0).to(torch.int32) if self.style != "bincount_int" else (
                counts.cumsum(0).int())
            xs = x[tok]
            h = F.silu(torch._grouped_mm(xs, self.w1.transpose(1, 2), offs=offs)) * torch._grouped_mm(
                xs, self.w3.transpose(1, 2), offs=offs)
            # the column of sorted weights in one index, or gathered, then given its unit dimension
            sorted_w = top.view(-1)[order]
            if self.style == "bincount_int":
                scores = top.view(-1)[order, None]
            elif self.style == "bincount_fn":  # the functional spelling of the unit dimension
                scores = torch.unsqueeze(sorted_w, 1)
            elif self.style == "bincount_sized":  # a reshape to its own size and a 1
                scores = sorted_w.reshape(sorted_w.shape[0], 1)
            elif self.style == "bincount_transposed":  # look-alike: k-major order read back as a column
                scores = sorted_w.view(k, -1).t().reshape(-1, 1)
            else:
                scores = sorted_w[:, None]
            ys = torch._grouped_mm(h, self.w2.transpose(1, 2), offs=offs) * scores.to(x.dtype)
            return torch.zeros_like(x).index_add_(0, tok, ys)
        if self.style.startswith("v5"):  # transformers v5's grouped_mm forward; three look-alikes of its unsort
            flat, weights = ids.reshape(-1), top.reshape(-1)
            if self.style in ("v5_argsort", "v5_other_counts"):  # the sorted values read as flat[perm]
                perm = torch.argsort(flat, stable=True)
                ids_sorted = ((flat + 1) % E if self.style == "v5_other_counts" else flat)[perm]
            else:
                ids_sorted, perm = torch.sort(flat)
            xs = x[perm // k]
            offs = torch.cumsum(torch.histc(ids_sorted.float(), bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(xs, self.w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(
                xs, self.w3.transpose(-2, -1), offs=offs)
            ys = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs) * weights[perm].unsqueeze(-1).to(x.dtype)
            if self.style == "v5_permuted_again":  # perm applied a second time: not the inverse
                back = ys[perm]
            else:
                inv = torch.empty_like(perm)
                n = torch.arange(perm.size(0))
                inv[torch.flip(perm, [0]) if self.style == "v5_other_order" else perm] = (
                    n.flip(0) if self.style == "v5_reversed" else n)
                back = ys[inv]
            return back.view(x.shape[0], k, H).sum(dim=1)
        if self.style.startswith("split_loop"):  # torchtitan's for-loop experts; two look-alikes
            flat = ids.view(-1)
            order = torch.argsort(flat, stable=True)
            tok = order // k
            counted = (flat + 1) % E if self.style == "split_loop_other_counts" else flat
            sizes = torch.histc(counted.float(), bins=E, min=0, max=E).long().tolist()
            xs = x[tok]
            ys = []
            for e, xe in enumerate(torch.split(xs[: sum(sizes)], sizes, dim=0)):
                w = (e + 1) % E if self.style == "split_loop_next_expert" else e
                h = F.silu(xe @ self.w1[w].transpose(-2, -1)) * (xe @ self.w3[w].transpose(-2, -1))
                ys.append(h @ self.w2[w].transpose(-2, -1))
            ys = torch.cat(ys, dim=0) * top.view(-1)[order][:, None].to(x.dtype)
            out = torch.zeros_like(x)
            out.index_add_(0, tok, ys)
            return out
        raise ValueError(self.style)


def _hf_fallback():
    """transformers' ``transformers::grouped_mm_fallback`` op (its grouped_mm path when _grouped_mm cannot run)."""
    return torch.ops.transformers.grouped_mm_fallback


@pytest.mark.parametrize("style,k", [("titan", 1), ("titan", 2), ("hf", 1), ("hf", 2), ("hf_fallback_fp32", 2),
                                     ("functional_fp32", 2), ("v5", 2), ("v5", 1), ("v5_argsort", 2),
                                     ("bincount", 2), ("bincount_int", 1), ("bincount_fn", 2), ("bincount_sized", 2)],
                         ids=["titan-k1", "titan-k2", "hf-k1", "hf-k2", "hf-fallback-op-fp32", "functional-fp32",
                              "v5-inverse-unsort-k2", "v5-inverse-unsort-k1", "v5-argsort-counts-of-flat-perm",
                              "bincount-minlength-cast-offsets-k2", "bincount-int-offsets-column-index-k1",
                              "bincount-torch-unsqueeze-column", "bincount-reshape-to-own-size-column"])
def test_styles_are_rewritten_and_equal(style, k):
    """Every spelling of the grouped GEMM: torch._grouped_mm (bf16 only), transformers' fp32 fallback op, and
    F.grouped_mm (bf16 on CPU, like _grouped_mm)."""
    if style == "hf_fallback_fp32":
        pytest.importorskip("transformers.integrations.moe")  # registers the op
    if style == "functional_fp32" and not hasattr(F, "grouped_mm"):
        pytest.skip("torch.nn.functional.grouped_mm is newer than this torch")
    torch.manual_seed(0)
    model = SortedMoE(style, k)
    if style != "hf_fallback_fp32":
        model = model.bfloat16()
    dtype = model.w1.dtype
    for T in (5, 19):
        x = torch.randn(T, H, dtype=dtype)
        out, ref = compile_moe(model, x).float(), model(x).float()
        assert ((out - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 2e-2)
        assert counters["moe_inductor"]["sorted_grouped_mm"] == 1
        assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("style", ["wrong_offsets", "unsorted_scores", "scatter_other_rows", "v5_other_counts",
                                   "bincount_weighted", "bincount_other_ids", "bincount_transposed"])
def test_look_alikes_are_left_alone(style):
    """Offsets of other ids (counted flat, or in sorted order as v5 counts them, or by bincount), weighted bincounts,
    scores not in the sorted order (or read back in another order as a column), results added to other rows: none is
    this MoE."""
    torch.manual_seed(0)
    model = SortedMoE(style).bfloat16()
    x = torch.randn(9, H, dtype=torch.bfloat16)
    assert torch.equal(compile_moe(model, x), model(x))
    assert not counters["moe_inductor"]
    assert counters["moe_inductor_left_alone"]["sorted_grouped_mm"] == 1  # explain() and the log say so


def test_a_scatter_index_narrower_than_the_rows_is_not_rewritten():
    torch.manual_seed(0)
    model = SortedMoE("titan_narrow_scatter").bfloat16()
    x = torch.randn(9, H, dtype=torch.bfloat16)
    assert torch.equal(compile_moe(model, x), model(x))
    assert not counters["moe_inductor"]


def test_a_loop_over_split_chunks_is_the_grouped_gemm():
    """torchtitan's for-loop experts (``counts.tolist()``, ``torch.split``, one MLP per chunk, ``torch.cat``): the
    same function as the grouped GEMM, rewritten in fp32 with its gradients equal to eager's."""
    torch.manual_seed(0)
    model = SortedMoE("split_loop", 2)
    x = torch.randn(11, H, requires_grad=True)
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(model, backend="moe_inductor", options={"inner": "aot_eager"})(x)
    assert counters["moe_inductor"]["sorted_grouped_mm"] == 1
    ref = model(x)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    params = [x, model.w1, model.w2, model.w3, model.router.weight]
    dy = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, params, dy), torch.autograd.grad(ref, params, dy)):
        assert torch.allclose(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("style", ["split_loop_next_expert", "split_loop_other_counts"])
def test_split_loop_look_alikes_are_left_alone(style):
    """Chunk e run by expert e + 1's weights, or chunks sized by the counts of other ids: not this MoE."""
    torch.manual_seed(0)
    model = SortedMoE(style)
    x = torch.randn(9, H)
    assert torch.allclose(compile_moe(model, x), model(x), atol=1e-6)
    assert not counters["moe_inductor"]


@pytest.mark.parametrize("style", ["v5_permuted_again", "v5_other_order", "v5_reversed"])
def test_unsort_look_alikes_are_left_alone(style):
    """transformers v5's unsort by an inverse permutation, ``inv[perm] = arange(n); ys[inv]``, with perm applied
    again instead, the inverse built from another order, or from a reversed arange: the rows go back to the wrong
    places, so nothing is rewritten (the region is reported)."""
    torch.manual_seed(0)
    model = SortedMoE(style).bfloat16()
    x = torch.randn(9, H, dtype=torch.bfloat16)
    assert torch.equal(compile_moe(model, x), model(x))
    assert not counters["moe_inductor"]
    assert sum(counters["moe_inductor_left_alone"].values()) == 1


@pytest.mark.parametrize("style", ["titan", "hf", "v5"])
def test_gradients_match_eager(style):
    torch.manual_seed(0)
    model = SortedMoE(style, 2).bfloat16()
    x = torch.randn(13, H, dtype=torch.bfloat16, requires_grad=True)
    params = [x, model.w1, model.w2] + ([model.w3] if style != "hf" else [])  # "hf" has no up-gate weight
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(model, backend="moe_inductor", options={"inner": "aot_eager"})(x)
    assert counters["moe_inductor"]["sorted_grouped_mm"] == 1
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, params, dy)
    ref_grads = torch.autograd.grad(model(x), params, dy)
    for g, r in zip(grads, ref_grads):
        assert ((g.float() - r.float()).norm() / r.float().norm()).item() < 2e-2


def test_compiles_are_bounded():
    model = SortedMoE("hf", 2).bfloat16()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for T in (2, 3, 5, 8, 13, 21):
        compiled(torch.randn(T, H, dtype=torch.bfloat16))
    assert counters["stats"]["unique_graphs"] <= 2
    assert counters["moe_inductor"]["sorted_grouped_mm"] == counters["stats"]["unique_graphs"]


@pytest.mark.gpu
def test_gpu_kernels_run_the_rewritten_sort_bf16():
    torch.manual_seed(0)
    model = SortedMoE("titan", 2)
    assert_gpu_bf16_rewrite(model, "sorted_grouped_mm", width=model.w1.shape[-1])
