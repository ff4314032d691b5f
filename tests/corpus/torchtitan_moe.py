"""torchtitan's MoE, mirrored from pytorch/torchtitan (``torchtitan/models/moe/moe.py``: ``MoE``,
``TokenChoiceTopKRouter``, ``TokenReorderer``, ``GroupedExperts`` with ``_run_experts_grouped_mm`` and
``_run_experts_for_loop``).

Style: router scores (sigmoid or softmax in fp32), top-k, ``histc`` counts per expert, a stable ``argsort`` of the
flat ids, ``x[order // k]``, the score applied to the routed input (``score_before_experts``, the default) or to
the output; experts by three bf16 ``torch._grouped_mm`` on int32 ``cumsum`` offsets, or by a ``.tolist()`` +
``torch.split`` loop; the unsort writes ``unsorted[order] = routed_output`` and sums ``view(-1, k, H)`` over k (or
a ``bmm`` with the scores); a shared expert; a no-grad buffer update of the token counts.

Departures: ``histc`` gets the ids as floats (CPU's histc has no integer kernel) and its counts are cast back to
the ids' dtype, which is what torchtitan's histc of the integer ids gives on the GPU (the for-loop's
``x[: sum(counts.tolist())]`` needs integers); no EP padding wrapper (it pads for alignment under expert
parallelism only).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 16, 4, 2


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert):
    num_tokens_per_expert = num_tokens_per_expert.tolist()
    num_padding = x.shape[0] - sum(num_tokens_per_expert)
    x = torch.split(x[: sum(num_tokens_per_expert)], split_size_or_sections=num_tokens_per_expert, dim=0)
    out_experts_splits = []
    for expert_idx, x_expert in enumerate(x):
        h = F.silu(torch.matmul(x_expert, w1[expert_idx].transpose(-2, -1)))
        h = h * torch.matmul(x_expert, w3[expert_idx].transpose(-2, -1))
        h = torch.matmul(h, w2[expert_idx].transpose(-2, -1))
        out_experts_splits.append(h)
    out = torch.cat(out_experts_splits, dim=0)
    return torch.vstack((out, out.new_zeros((num_padding, out.shape[-1]))))


def _run_experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert):
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x.bfloat16(), w1.bfloat16().transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x.bfloat16(), w3.bfloat16().transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)


class GroupedExperts(nn.Module):
    def __init__(self, use_grouped_mm):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.use_grouped_mm = use_grouped_mm

    def forward(self, x, num_tokens_per_expert):
        run = _run_experts_grouped_mm if self.use_grouped_mm else _run_experts_for_loop
        return run(self.w1, self.w2, self.w3, x, num_tokens_per_expert)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, score_func, route_norm):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.num_experts, self.top_k, self.score_func, self.route_norm, self.route_scale = E, K, score_func, route_norm, 1.0

    def forward(self, x, expert_bias=None):
        scores = self.gate(x)
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(scores.to(torch.float32))
        else:
            scores = F.softmax(scores.to(torch.float32), dim=1)
        if expert_bias is not None:
            _, selected_experts_indices = torch.topk(scores + expert_bias, k=self.top_k, dim=1)
            top_scores = scores.gather(dim=1, index=selected_experts_indices)
        else:
            top_scores, selected_experts_indices = torch.topk(scores, k=self.top_k, dim=1)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        num_tokens_per_expert = torch.histc(
            selected_experts_indices.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts
        ).to(selected_experts_indices.dtype)
        return top_scores, selected_experts_indices, num_tokens_per_expert


class TokenReorderer(nn.Module):
    def forward(self, top_scores, selected_experts_indices):
        num_tokens_per_expert = torch.histc(selected_experts_indices.view(-1).float(), bins=E, min=0, max=E).to(
            selected_experts_indices.dtype)
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        return top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert


class MoE(nn.Module):
    def __init__(self, use_grouped_mm=True, score_before_experts=True, score_func="sigmoid", route_norm=False):
        super().__init__()
        self.experts = GroupedExperts(use_grouped_mm)
        self.router = TokenChoiceTopKRouter(score_func, route_norm)
        self.reorderer = TokenReorderer()
        self.shared_experts = FeedForward(H, I)
        self.score_before_experts = score_before_experts
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert = self.reorderer(
            top_scores, selected_experts_indices)
        routed_input = x[token_indices_experts_sorted // self.router.top_k]
        if self.score_before_experts:
            routed_input = (routed_input.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        out = self.shared_experts(x)
        routed_output_unsorted = torch.zeros(
            (bs * slen * self.router.top_k, dim), dtype=routed_output.dtype, device=routed_output.device)
        routed_output_unsorted[token_indices_experts_sorted] = routed_output
        routed_output_unsorted = routed_output_unsorted.reshape(-1, self.router.top_k, dim)
        if not self.score_before_experts:
            out_experts = torch.bmm(top_scores.reshape(-1, 1, self.router.top_k),
                                    routed_output_unsorted.float()).to(x.dtype).squeeze(1)
        else:
            out_experts = routed_output_unsorted.sum(dim=1)
        return (out + out_experts).reshape(bs, slen, dim)


def _input(T, g):
    return torch.randn(1, T, H, generator=g)


SOURCE = "pytorch/torchtitan torchtitan/models/moe/moe.py MoE"
CASES = [
    Case("torchtitan_grouped_mm_score_before", SOURCE + " (grouped_mm, score_before_experts)",
         lambda: MoE(True, True), _input, form="sorted_grouped_mm", dtype=torch.bfloat16),
    Case("torchtitan_grouped_mm_score_after", SOURCE + " (grouped_mm, score after, softmax, route_norm)",
         lambda: MoE(True, False, "softmax", True), _input, form="sorted_grouped_mm", dtype=torch.bfloat16),
    Case("torchtitan_for_loop", SOURCE + " (_run_experts_for_loop)", lambda: MoE(False, True), _input,
         form="sorted_grouped_mm"),
]
