"""Generated modules of the forms that use all experts' weights at once: sort + ``torch._grouped_mm``
(``sorted``), gathered weights + einsum (``gathered``), every expert on every token (``dense``), padded capacity
(``capacity``), and the memory-slots look-alike (top-k over a table of value rows, no experts).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.generator.parts import H, I, ExpertBank, Router, hidden
from tests.generator.recipe import Recipe


class SortedMoE(nn.Module):
    """torchtitan / hand-written HF grouped_mm: sort the flat ids, gather, counts -> int32 offsets, one
    ``torch._grouped_mm`` per projection, back by scatter_add / index_add / an unsort."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.r = r
        self.router = Router(r.router, r.E, r.k, r.renorm)
        self.bank = ExpertBank(r.idioms["experts"], r.E, r.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, d = self.r, self.r.idioms
        T, E, k = x.shape[0], r.E, r.k
        probs, weights, ids = self.router(x)
        flat = ids.view(-1)
        if d["sort"] == "argsort":
            order = torch.argsort(flat, stable=True)
            sorted_ids = flat[order]
        else:
            sorted_ids, order = torch.sort(flat)
        tok = order // k
        scores = weights.reshape(-1)[order]
        xs = x[tok] if d["gather"] == "index" else torch.gather(x, 0, tok.reshape(-1, 1).expand(-1, H))
        if d["counts"] == "histc":
            counts = torch.histc(flat.float(), bins=E, min=0, max=E - 1)
        elif d["counts"] == "histc_sorted":
            counts = torch.histc(sorted_ids.float(), bins=E, min=0, max=E - 1)
        elif d["counts"] == "marks":
            marks = ids.new_zeros((T, E))
            marks.scatter_(1, ids, 1)
            counts = marks.sum(dim=0)
        else:
            counts = F.one_hot(flat, num_classes=E).sum(dim=0)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        in_bmm = d["combine"] in ("unsort_bmm", "unsort_weighted")
        on_input = (d["position"] == "input" and not in_bmm) or r.flaw == "twice"
        if on_input:
            xs = (xs.float() * scores.reshape(-1, 1)).to(x.dtype)
        if d["step"] != "grouped_mm":
            ys = self._walk(xs, counts)
        else:
            ys = self._grouped(xs, offs)
        if (d["position"] == "output" and not in_bmm) or r.flaw == "twice":
            ys = ys * scores.reshape(-1, 1).to(ys.dtype)
        rows = tok.flip(0) if r.flaw == "other_rows" else tok
        if d["combine"] == "scatter_add":
            out = torch.zeros_like(x)
            return out.scatter_add_(0, rows.reshape(-1, 1).expand(-1, H), ys)
        if d["combine"] == "index_add":
            out = torch.zeros_like(x)
            out.index_add_(0, rows, ys)
            return out
        if d["combine"] == "unsort_inverse":  # transformers v5: the inverse permutation gathers the rows back
            inv = torch.empty_like(order)
            inv[order.flip(0) if r.flaw == "other_rows" else order] = torch.arange(order.size(0), device=x.device)
            return ys[inv].view(T, k, H).sum(dim=1)
        if d["combine"] == "unsort_weighted":  # DeepSeek-V2's moe_infer: the weights in fp32 after the unsort
            buf = torch.empty_like(ys)
            buf[order.flip(0) if r.flaw == "other_rows" else order] = ys
            return (buf.view(*ids.shape, -1).type(weights.dtype).mul_(weights.unsqueeze(dim=-1)).sum(dim=1)
                    .type(buf.dtype))
        buf = torch.zeros(T * k, H, dtype=ys.dtype, device=x.device)
        buf[order.flip(0) if r.flaw == "other_rows" else order] = ys
        if in_bmm:
            return torch.bmm(weights.reshape(-1, 1, k).to(buf.dtype), buf.reshape(-1, k, H)).squeeze(1)
        return buf.reshape(-1, k, H).sum(dim=1)


    def _grouped(self, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """One ``torch._grouped_mm`` per projection over the sorted rows."""
        w_up, w_gate, w_down, kn = self.bank.stacked()

        def gmm(a, w):
            return torch._grouped_mm(a, w if kn else w.transpose(-2, -1), offs=offs)

        if w_gate is None and self.r.gated:
            g, u = self.bank.split_gate_up(gmm(xs, w_up))
            return gmm(hidden(self.r.act, g, u), w_down)
        return gmm(hidden(self.r.act, gmm(xs, w_up), gmm(xs, w_gate) if self.r.gated else None), w_down)

    def _walk(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V2's ``moe_infer`` loop: the counts walked on the host, each expert's running slice of the sorted
        rows through its MLP (stacked weights, or one module per expert), experts with no rows skipped, the outputs
        ``cat``ed."""
        walked = counts.cpu().numpy() if self.r.idioms["step"] == "walk_numpy" else counts.tolist()
        outputs, start = [], 0
        for e, n in enumerate(walked):
            end = start + n
            if n == 0:
                continue
            outputs.append(self.bank.mlp(e, xs[start:end]))
            start = end
        return torch.cat(outputs, dim=0) if len(outputs) else xs.new_empty(0, H)


class GatheredMoE(nn.Module):
    """gpt-fast's ConditionalFeedForward: ``w[ids]`` copies of the experts' weights, einsum per projection."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.r = r
        self.router = Router(r.router, r.E, r.k, r.renorm)
        self.bank = ExpertBank(r.idioms["experts"], r.E, r.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.r
        probs, weights, ids = self.router(x)
        w_up, w_gate, w_down, kn = self.bank.stacked()
        if r.idioms["combine"] == "flat_bmm":
            return self._flat_rows(x, weights, ids, (w_up, w_gate, w_down, kn))
        up, down = ("th,tkhi->tki", "tki,tkih->tkh") if kn else ("th,tkih->tki", "tki,tkhi->tkh")
        xk = x
        if r.flaw == "twice":  # the weight on each slot's input as well as on its output
            xk, up = x[:, None, :] * weights[..., None], up.replace("th,", "tkh,")
        if w_gate is None and r.gated and r.idioms["split"] == "gathered":
            g_w, u_w = self.bank.split_gathered(w_up[ids])
            h = hidden(r.act, torch.einsum(up, xk, g_w), torch.einsum(up, xk, u_w))
        elif w_gate is None and r.gated:
            g, u = self.bank.split_gate_up(torch.einsum(up, xk, w_up[ids]))
            h = hidden(r.act, g, u)
        else:
            h = hidden(r.act, torch.einsum(up, xk, w_up[ids]), torch.einsum(up, xk, w_gate[ids]) if r.gated else None)
        down_ids = (ids + 1) % r.E if r.flaw == "differs" else ids
        out = torch.einsum(down, h, w_down[down_ids])
        if r.idioms["combine"] == "einsum":
            return torch.einsum("tkh,tk->th", out, weights)
        return (out * weights[..., None]).sum(dim=1)


    def _flat_rows(self, x, weights, ids, stacked) -> torch.Tensor:
        """transformers v5's batched_mm: every token repeated k times, each row through ``torch.bmm`` with its own
        gathered expert weight, scaled by the flat routing weights, summed over each token's k rows."""
        r = self.r
        w_up, w_gate, w_down, kn = stacked
        T, k = x.shape[0], r.k
        rows = x.repeat(k, 1) if r.flaw == "tiled_rows" else x.repeat_interleave(k, dim=0)
        flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1)

        def proj(w, t, which):
            if kn:
                return torch.bmm(t.unsqueeze(1), w[which]).squeeze(1)
            return torch.bmm(w[which], t.unsqueeze(-1)).squeeze(-1)

        if r.flaw == "twice":
            rows = rows * flat_w.unsqueeze(-1)
        if w_gate is None and r.gated:
            g, u = self.bank.split_gate_up(proj(w_up, rows, flat_ids))
            h = hidden(r.act, g, u)
        else:
            h = hidden(r.act, proj(w_up, rows, flat_ids), proj(w_gate, rows, flat_ids) if r.gated else None)
        down_ids = (flat_ids + 1) % r.E if r.flaw == "differs" else flat_ids
        out = proj(w_down, h, down_ids) * flat_w.unsqueeze(-1)
        return out.view(T, k, H).sum(dim=1)


class DenseMoE(nn.Module):
    """Every expert on every token (einsum over stacked weights, or a loop over a ModuleList), mixed by a (T, E)
    routing matrix that is zero off the top-k."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.r = r
        self.router = Router(r.router, r.E, r.k, r.renorm)
        storage = r.idioms["experts"]
        self.bank = ExpertBank(storage, r.E, r.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, d = self.r, self.r.idioms
        E = r.E
        probs, weights, ids = self.router(x)
        if r.flaw == "soft":
            routing = probs.to(x.dtype)
        elif d["routing"] == "scatter":
            routing = torch.zeros_like(probs).scatter(1, ids, weights.to(probs.dtype))
        elif d["routing"] == "scatter_":
            routing = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device)
            routing.scatter_(1, ids, weights)
        else:
            routing = (F.one_hot(ids, num_classes=E).to(weights.dtype) * weights[..., None]).sum(dim=1)
        xe = x[:, None, :] * routing[..., None] if r.flaw == "twice" else x  # (T, E, H) or (T, H)
        if d["experts"] == "loop_modulelist":
            out = torch.stack([self.bank.mlp(e, xe[:, e] if xe.dim() == 3 else xe) for e in range(E)], dim=1)
        else:
            out = self._einsum_experts(xe)
        if r.flaw == "differs":
            out = torch.cat([2.0 * out[:, :1], out[:, 1:]], dim=1)
        elif r.flaw == "skipped":
            out = torch.cat([out[:, :1], torch.zeros_like(out[:, 1:2]), out[:, 2:]], dim=1)
        if d["combine"] == "einsum":
            return torch.einsum("teh,te->th", out, routing)
        if d["combine"] == "mul_sum":
            return (out * routing[..., None]).sum(dim=1)
        return torch.bmm(routing.unsqueeze(1), out).squeeze(1)

    def _einsum_experts(self, xe: torch.Tensor) -> torch.Tensor:
        w_up, w_gate, w_down, kn = self.bank.stacked()
        up, down = ("th,ehi->tei", "tei,eih->teh") if kn else ("th,eih->tei", "tei,ehi->teh")
        if xe.dim() == 3:
            up = up.replace("th,", "teh,")
        if w_gate is None and self.r.gated:
            g, u = self.bank.split_gate_up(torch.einsum(up, xe, w_up))
            h = hidden(self.r.act, g, u)
        else:
            h = hidden(self.r.act, torch.einsum(up, xe, w_up), torch.einsum(up, xe, w_gate) if self.r.gated else None)
        return torch.einsum(down, h, w_down)


class CapacityMoE(nn.Module):
    """Padded capacity: (T, E, C) combine and dispatch tensors in GShard, Switch, fairseq, DeepSpeed or nanoMoE style
    (nanoMoE: the k choices one-hot in one (k, T, E) stack), the experts on the (E, C, H) buffer by einsum or bmm,
    with per-expert biases and dropouts where the recipe has them."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.r = r
        self.gate = nn.Linear(H, r.E, bias=False)
        self.bank = ExpertBank("stacked_nk", r.E, r.act)
        self.C = 1 + r.seed % 4
        bias = r.idioms["bias"]
        self.b1 = self.b3 = self.b2 = None
        if bias != "none":  # a bias on each projection: gate (and up, in a gated expert) and down
            shape = {"e_n": (r.E,), "e1n_inplace": (r.E, 1), "slot": (r.E, self.capacity(r.T))}[bias]
            self.b1 = nn.Parameter(torch.randn(*shape, I) * 0.5)
            self.b3 = nn.Parameter(torch.randn(*shape, I) * 0.5) if r.gated else None
            self.b2 = nn.Parameter(torch.randn(*shape, H) * 0.5)
        dropout = r.idioms["dropout"]
        self.drop = nn.Dropout(0.0 if dropout == "module_p0" else 0.1)
        if dropout == "eval":  # a dropout of p > 0 is the identity in eval mode (and the backward still runs)
            self.eval()

    def capacity(self, T: int) -> int:
        if self.r.idioms["capacity"] == "constant":  # two slots at least where the flaw moves the slot, or where
            # biases differ per slot (at one slot, an (E, C, N) bias is a per-expert one)
            return max(self.C, 2) if self.r.flaw in ("capacity_mismatch", "slot_bias") else self.C
        factor = 2 if self.r.k == 2 else 1
        return max(2, factor * math.ceil(T / self.r.E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, style = self.r, self.r.idioms["style"]
        T, E, C = x.shape[0], r.E, self.capacity(x.shape[0])
        logits = self.gate(x)
        gates = F.softmax(logits, dim=-1)
        if style == "gshard":
            combine = self._gshard(gates, E, C)
        elif style == "fairseq":
            combine = self._fairseq(logits, gates, E, C)
        elif style == "nanomoe":
            combine = self._nanomoe(logits, E, C)
        else:  # Switch and DeepSpeed: top-1
            idx = torch.argmax(gates, dim=-1)
            mask = F.one_hot(idx, num_classes=E)
            loc = torch.cumsum(mask, dim=0) - 1
            mask = mask * torch.lt(loc, C)
            loc_s = torch.sum(loc * mask, dim=1)
            if style == "switch":
                gate = (gates * mask).sum(dim=1)
                combine = gate[:, None, None] * mask[:, :, None] * F.one_hot(loc_s, num_classes=C)[:, None, :]
            else:
                combine = torch.einsum("se,sc->sec", gates * mask, F.one_hot(loc_s, num_classes=C).to(gates.dtype))
        dispatch = (combine != 0) if r.idioms["dispatch"] == "ne_zero" else combine.bool()
        dispatch = dispatch.to(x.dtype)
        if r.flaw == "capacity_mismatch":  # dispatch into the next slot from the one the combine reads
            dispatch = dispatch.roll(1, dims=2)
        if r.idioms["dispatch"] == "permute_matmul":  # nanoMoE: (E, C, T) @ (T, H)
            xin = dispatch.permute(1, 2, 0) @ x
        else:
            xin = torch.einsum("tec,th->ech", dispatch, x)
        out = self._experts(xin)
        if r.flaw == "differs":
            out = torch.cat([2.0 * out[:1], out[1:]], dim=0)
        if r.idioms["combine"] == "mm":  # fairseq's and nanoMoE's (T, E*C) @ (E*C, H)
            return combine.to(x.dtype).view(T, -1) @ out.view(-1, H)
        return torch.einsum("tec,ech->th", combine.to(x.dtype), out)

    def _experts(self, xin: torch.Tensor) -> torch.Tensor:
        """The experts on their (E, C, H) slots: each projection by einsum or bmm, its bias added, and the dropout
        between the projections or after them."""
        r = self.r
        w_up, w_gate, w_down, _ = self.bank.stacked()
        if r.idioms["experts"] == "einsum":
            def up(t, w):
                return torch.einsum("ech,eih->eci", t, w)

            def down(t, w):
                return torch.einsum("eci,ehi->ech", t, w)
        else:
            def up(t, w):
                return torch.bmm(t, w.transpose(1, 2))
            down = up
        h = hidden(r.act, self._biased(up(xin, w_up), self.b1, "b[:, None, :]"),
                   self._biased(up(xin, w_gate), self.b3, "b[:, None, :]") if r.gated else None)
        h = self._dropout(h, "between")
        out = self._biased(down(h, w_down), self.b2, "b.unsqueeze(1)")
        return self._dropout(out, "after")

    def _biased(self, h: torch.Tensor, b, spelling: str) -> torch.Tensor:
        """h plus a per-expert bias, broadcast over the slots in the recipe's spelling (an (E, 1, N) parameter by
        ``+=``, an (E, N) one by ``spelling``), or the per-slot (E, C, N) one of the slot_bias look-alike."""
        if b is None:
            return h
        if self.r.idioms["bias"] == "e1n_inplace":
            h += b
            return h
        if self.r.idioms["bias"] == "slot":
            return h + b
        return h + (b[:, None, :] if spelling == "b[:, None, :]" else b.unsqueeze(1))

    def _dropout(self, h: torch.Tensor, where: str) -> torch.Tensor:
        dropout = self.r.idioms["dropout"]
        if dropout == "none" or self.r.idioms["dropout_at"] != where:
            return h
        if dropout == "functional_p0":
            return F.dropout(h, p=0.0, training=self.training)
        return self.drop(h)  # p = 0; or p = 0.1 in eval mode; or p = 0.1 in training (the look-alike)

    def _nanomoe(self, logits, E, C):
        """nanoMoE's Router: the top-k logits softmaxed over a -inf row, the (T, k, E) one-hot permuted to (k, T, E)
        and numbered by one cumsum over its (k*T, E) rows (choice-major); the look-alike numbers the (T*k, E) rows
        (token-major)."""
        T, k = logits.shape[0], self.r.k
        top, ids = logits.topk(k, dim=-1)
        probs = torch.full_like(logits, float("-inf"))
        probs.scatter_(-1, ids, top)
        probs = F.softmax(probs, dim=-1)
        mask = F.one_hot(ids, num_classes=E)
        if self.r.flaw == "token_major":
            rank = (torch.cumsum(mask.reshape(T * k, E), dim=0) - 1).reshape(T, k, E).permute(1, 0, 2)
            mask = mask.permute(1, 0, 2)
        else:
            mask = mask.permute(1, 0, 2)
            rank = (torch.cumsum(mask.reshape(k * T, E), dim=0) - 1).reshape(k, T, E)
        mask *= torch.lt(rank, C)
        slots = F.one_hot(torch.sum(mask * rank, dim=-1), num_classes=C)  # (k, T, C)
        weights = mask * probs[None, :]
        if self.r.idioms["stack"] == "einsum":
            return torch.einsum("kte,ktc->tec", weights, slots.to(weights.dtype))
        return torch.sum(weights.unsqueeze(3) * slots.unsqueeze(2), dim=0)

    def _gshard(self, gates, E, C):
        remaining, masks, combine = gates, [], 0
        for _ in range(self.r.k):
            mask = F.one_hot(torch.argmax(remaining, dim=-1), num_classes=E)
            loc = torch.cumsum(mask, dim=0) - 1
            for earlier in masks:
                loc = loc + torch.sum(earlier, dim=0, keepdim=True)
            remaining = remaining.masked_fill(mask.bool(), 0.0)
            masks.append(mask)
            kept = mask * torch.lt(loc, C)
            gate = (gates * kept).sum(dim=1)
            slot = F.one_hot(torch.sum(loc * kept, dim=1), num_classes=C)
            combine = combine + gate[:, None, None] * kept[:, :, None] * slot[:, None, :]
        return combine

    def _fairseq(self, logits, gates, E, C):
        idx1 = torch.argmax(gates, dim=1, keepdim=True)
        mask1 = torch.zeros_like(gates, dtype=torch.long).scatter_(1, idx1, 1)
        idx2 = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1, keepdim=True)
        mask2 = torch.zeros_like(gates, dtype=torch.long).scatter_(1, idx2, 1)
        loc1 = torch.cumsum(mask1, dim=0) - 1
        loc2 = torch.cumsum(mask2, dim=0) - 1
        loc2 = loc2 + torch.sum(mask1, dim=0, keepdim=True)
        mask1, mask2 = mask1 * torch.lt(loc1, C), mask2 * torch.lt(loc2, C)
        g1, g2 = (gates * mask1).sum(dim=1), (gates * mask2).sum(dim=1)
        denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
        g1, g2 = g1 / denom, g2 / denom
        sc1 = F.one_hot(torch.sum(loc1 * mask1, dim=1), num_classes=C).to(gates.dtype)
        sc2 = F.one_hot(torch.sum(loc2 * mask2, dim=1), num_classes=C).to(gates.dtype)
        c1 = torch.bmm((g1[:, None] * mask1.to(g1.dtype)).unsqueeze(-1), sc1.unsqueeze(1))
        c2 = torch.bmm((g2[:, None] * mask2.to(g2.dtype)).unsqueeze(-1), sc2.unsqueeze(1))
        return c1 + c2


class MemorySlotsMoE(nn.Module):
    """Look-alike: top-k over a table of memory slots (product-key memory style), the chosen value rows mixed by
    their softmaxed scores; no expert MLP anywhere."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.r = r
        M = 4 * r.E
        self.query = nn.Linear(H, H, bias=False)
        self.keys = nn.Parameter(torch.randn(M, H) * H ** -0.5)
        self.values = nn.Parameter(torch.randn(M, H, H) * H ** -0.5 if r.gated else torch.randn(M, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores, ids = torch.topk(self.query(x) @ self.keys.T, self.r.k, dim=-1)
        w = F.softmax(scores, dim=-1)
        if self.values.dim() == 3:  # a (H, H) map per slot, applied to the token, as gathered experts are
            return torch.einsum("tk,tkh->th", w, torch.einsum("th,tkoh->tko", x, self.values[ids]))
        return (self.values[ids] * w[..., None]).sum(dim=1)
