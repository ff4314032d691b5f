"""Generated modules of the per-expert loop forms: the unrolled ``for e in range(E)`` loop (``loop``), the sorted
rows split by counts (``split``), and the expert-choice look-alike (each expert picks its top tokens).

Every module reads its recipe's idioms in ``forward``; a look-alike's flaw changes one line of the genuine code.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.generator.parts import H, ExpertBank, Router, hidden
from tests.generator.recipe import Recipe


class LoopMoE(nn.Module):
    """``for e in range(E)``: select expert e's (token, slot) pairs, run the expert, add back at the tokens; or,
    under a top-1 router, write its rows by a boolean mask (``out[idx == e] = expert_e(x[idx == e])``). Either body
    may stand behind a guard that skips an expert with no rows (``if mask.any():`` and its spellings)."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.r = r
        self.router = Router(r.router, r.E, r.k, r.renorm)
        self.bank = ExpertBank(r.idioms["experts"], r.E, r.act, r.idioms["matmul"])
        if r.flaw == "guard_more":
            self.register_buffer("ran", torch.zeros(r.E))

    def _expert(self, e: int, xe: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Expert e on xe, the (rows, 1) routing weight w applied where the recipe puts it."""
        position, flaw = self.r.idioms["position"], self.r.flaw
        if position == "input" or flaw == "twice":
            xe = xe * w
        y = self.bank.mlp(e, xe, w if position == "between" else None)
        if position == "output" or flaw == "twice":
            y = y * w
        return 2.0 * y if flaw == "differs" and e == self.r.E - 1 else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.r
        probs, weights, ids = self.router(x)
        selection = r.idioms["selection"]
        if selection == "boolmask":
            return self._masked(x, weights, ids)
        v5 = selection == "hit_v5"
        experts, hits = range(r.E), None
        if selection == "onehot":
            hits = F.one_hot(ids, num_classes=r.E).permute(2, 1, 0)  # (E, k, T), transformers v4's expert_mask
        elif selection == "onehot_etk":
            hits = F.one_hot(ids, num_classes=r.E).permute(2, 0, 1)  # (E, T, k)
        elif selection == "arange_mask":  # litgpt's LLaMAMoE: (T, k, E) booleans permuted to (E, T, k)
            first = 1 if r.flaw == "mask_shift" else 0
            hits = (ids[..., None] == torch.arange(first, r.E + first, device=x.device)).permute(2, 0, 1)
        elif v5:  # transformers v5's eager loop: a spare class, the loop over the experts that got tokens
            with torch.no_grad():
                hits = F.one_hot(ids, num_classes=r.E + 1).permute(2, 1, 0)
                experts = torch.greater(hits.sum(dim=(-1, -2)), 0).nonzero()
        if selection == "top1_mask":  # (T,) ids and weight, each computed once before the loop
            idx, out, body = self._top1_ids(ids), self._top1_buffer(x), self._write
            routing = (idx, weights.squeeze(-1), weights)
        else:
            idx, out, body = ids, torch.zeros_like(x), self._accumulate
            routing = (ids, probs, weights, hits)
        ran = []
        if r.idioms["combine"] == "index_add_oop":  # a loop of its own: the proofs of the guarded and hit loops
            return self._chained(x, idx, routing, out, ran)  # read the rest of their iteration, where this stores
        # The guard stands in this loop and the whole rest of the iteration is one call: the skip's proof reads the
        # bytecode from the branch to the iteration's end, which must be the body and nothing after it.
        for e in experts:
            if v5:
                e = e[0]
                if e == r.E:
                    continue
            if r.flaw == "skipped" and e == 1:
                continue
            hit = idx == e
            guard = r.idioms["guard"]
            if guard == "none":
                body(e, x, hit, routing, out, ran)
            elif guard == "mask_any":
                if hit.any():
                    body(e, x, hit, routing, out, ran)
            elif guard == "torch_any":
                if torch.any(hit):
                    body(e, x, hit, routing, out, ran)
            elif guard == "continue":
                if not hit.any():
                    continue
                body(e, x, hit, routing, out, ran)
            elif guard == "guard_other":  # the next expert's rows decide whether this one runs
                if (idx == (e + 1) % r.E).any():
                    body(e, x, hit, routing, out, ran)
            elif hit.sum() > 1:  # "guard_count": an expert with one row is skipped too
                body(e, x, hit, routing, out, ran)
        if selection == "top1_mask" and r.idioms["position"] == "after":
            out = out * self._column(weights, routing[1])
        return out * len(ran) if r.flaw == "guard_list" else out

    def _chained(self, x, idx, routing, out, ran):
        """``out = out.index_add(0, tok, y)`` per expert, behind the recipe's guard: every branch of the iteration
        sets ``out`` only, to an add into its value (what a skipped body may leave behind)."""
        r, guard = self.r, self.r.idioms["guard"]
        for e in range(r.E):
            if r.flaw == "skipped" and e == 1:
                continue
            hit = idx == e
            if guard == "none":
                out = self._accumulate(e, x, hit, routing, out, ran)
            elif guard == "mask_any":
                if hit.any():
                    out = self._accumulate(e, x, hit, routing, out, ran)
            elif guard == "torch_any":
                if torch.any(hit):
                    out = self._accumulate(e, x, hit, routing, out, ran)
            elif guard == "continue":
                if not hit.any():
                    continue
                out = self._accumulate(e, x, hit, routing, out, ran)
            elif guard == "guard_other":  # the next expert's rows decide whether this one runs
                if (idx == (e + 1) % r.E).any():
                    out = self._accumulate(e, x, hit, routing, out, ran)
            elif hit.sum() > 1:  # "guard_count": an expert with one row is skipped too
                out = self._accumulate(e, x, hit, routing, out, ran)
        return out

    def _did_run(self, e: int, ran: list) -> None:
        """What a guard_more or guard_list body does besides the expert: a count in a buffer, or a list entry."""
        if self.r.flaw == "guard_more":
            self.ran[e] += 1
        elif self.r.flaw == "guard_list":
            ran.append(e)

    def _accumulate(self, e, x, hit, routing, out, ran) -> None:
        """Expert e's (token, slot) rows, selected from ``hit = ids == e``, run and added back at the tokens."""
        r = self.r
        ids, probs, weights, hits = routing
        if r.flaw == "soft":  # every token through every expert, weighted by its full probability
            tok = torch.arange(x.shape[0], device=x.device)
            w = probs[:, e, None].to(x.dtype)
        elif r.idioms["selection"] == "any":
            tok = hit.any(dim=-1).nonzero().squeeze(-1)
            w = (weights * hit).sum(dim=-1)[tok, None]
        else:
            if r.idioms["selection"] == "where":
                tok, pos = torch.where(hit)
            elif r.idioms["selection"] == "nonzero":
                tok, pos = hit.nonzero(as_tuple=True)
            elif r.idioms["selection"] in ("onehot", "hit_v5"):  # (E, k, T)
                pos, tok = torch.where(hits[e])
            else:  # (E, T, k)
                tok, pos = torch.where(hits[e])
            if r.flaw == "other_slot":
                pos = (pos + 1) % r.k
            read = r.idioms.get("weight_read", "index_none")
            w = weights[tok, pos, None] if read == "index_none" else (
                weights[tok, pos].unsqueeze(-1) if read == "unsqueeze" else weights[tok, pos].view(-1, 1))
        y = self._expert(e, x.index_select(0, tok) if r.idioms.get("rows") == "index_select" else x[tok], w)
        rows = (tok + 1) % x.shape[0] if r.flaw == "other_rows" else tok
        combine = r.idioms["combine"]
        if combine == "index_add_oop":  # out of place: the caller keeps the new value
            return out.index_add(0, rows, y)
        if combine == "index_add":
            out.index_add_(0, rows, y)
        elif combine == "index_put":
            out.index_put_((rows,), y, accumulate=True)
        elif combine == "setitem":
            out[rows] += y
        elif combine == "scatter_reduce":  # DeepSeek-MoE's spelling; without include_self, a write replaces
            out.scatter_reduce_(0, rows[:, None].expand(-1, x.shape[1]), y, "sum",
                                include_self=r.flaw != "include_self_false")
        else:
            out.scatter_add_(0, rows[:, None].expand(-1, x.shape[1]), y)
        self._did_run(e, ran)

    def _top1_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The (T,) ids of a top-1 router's (T, 1) ones, in the recipe's spelling."""
        spelling = self.r.idioms["ids"]
        if spelling == "squeeze":
            return ids.squeeze(-1)
        if spelling == "column0":
            return ids[:, 0]
        if spelling == "view":
            return ids.view(-1)
        if spelling == "flatten":
            return ids.flatten()
        return ids.view(-1) % self.r.E  # the same ids, no longer provably below E

    def _top1_buffer(self, x: torch.Tensor) -> torch.Tensor:
        buffer = self.r.idioms["buffer"]
        if buffer == "zeros_like":
            return torch.zeros_like(x)
        return x.new_zeros(x.shape) if buffer == "new_zeros" else torch.empty_like(x)

    def _column(self, weights: torch.Tensor, w: torch.Tensor, rows=None) -> torch.Tensor:
        """The routing weight of the masked ``rows`` (None: of every row) as a column: ``w[rows, None]``,
        ``w[rows].unsqueeze(-1)`` of the (T,) weight, or ``weights[rows]`` of the router's (T, 1) one."""
        column = self.r.idioms["column"]
        if rows is None:
            return w[:, None] if column == "index_none" else w.unsqueeze(-1) if column == "unsqueeze" else weights
        if column == "index_none":
            return w[rows, None]
        return w[rows].unsqueeze(-1) if column == "unsqueeze" else weights[rows]

    def _write(self, e, x, hit, routing, out, ran) -> None:
        """A top-1 router's boolean-mask write, ``out[idx == e] = expert_e(x[idx == e])``, the weight inside it where
        the recipe puts it there; ``routing`` holds the (T,) ids and weight and the router's (T, 1) weight."""
        r = self.r
        idx, w, weights = routing
        rows = idx.flip(0) == e if r.flaw == "other_rows" else hit  # the same count per expert, other tokens
        if r.idioms["position"] in ("after", "none"):
            y = self._expert_unscaled(e, x[rows])
        else:
            y = self._expert(e, x[rows], self._column(weights, w, hit))
        if r.idioms["combine"] == "accumulate":
            out[hit] += y
        else:
            out[hit] = y
        self._did_run(e, ran)

    def _masked(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V2's training loop: every token repeated k times, rows written per expert by a boolean mask."""
        r = self.r
        T, k = x.shape[0], r.k
        flat = ids.view(-1)
        xr = x.repeat_interleave(k, dim=0)
        wf = weights.reshape(-1, 1)
        on_output = r.idioms["position"] == "output" and r.flaw != "twice"
        buf = torch.empty_like(xr)
        for e in range(r.E):
            sel = flat == e
            y = self._expert(e, xr[sel], wf[sel]) if not on_output else self._expert_unscaled(e, xr[sel])
            buf[sel] = y.to(buf.dtype)
        per_slot = buf.view(T, k, -1)
        if not on_output:
            return per_slot.sum(dim=1)
        if r.idioms["combine"] == "view_sum":
            return (per_slot * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        return torch.bmm(weights.unsqueeze(1), per_slot).squeeze(1)

    def _expert_unscaled(self, e: int, xe: torch.Tensor) -> torch.Tensor:
        y = self.bank.mlp(e, xe)
        return 2.0 * y if self.r.flaw == "differs" and e == self.r.E - 1 else y


class SplitMoE(nn.Module):
    """Rows sorted by expert, split by ``counts.tolist()``, one expert per split, ``cat``, scaled, scattered back
    (Megatron's SequentialMLP behind its routing map, or JetMoE's sort)."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.r = r
        self.router = Router(r.router, r.E, r.k, r.renorm)
        per_projection = r.idioms["experts"] == "per_projection"
        storage = ("fused_chunk" if r.gated else "stacked_nk") if per_projection else "modulelist"
        self.bank = ExpertBank(storage, r.E, r.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.r
        T, E = x.shape[0], r.E
        probs, weights, ids = self.router(x)
        if r.idioms["dispatch"] == "megatron":
            full = torch.zeros_like(probs).scatter(1, ids, weights.to(probs.dtype))
            rmap = torch.zeros_like(probs).int().scatter(1, ids, 1).bool()
            tok = torch.arange(T, device=x.device).unsqueeze(0).expand(E, -1).masked_select(rmap.T.contiguous())
            xs, counts = x.index_select(0, tok), rmap.sum(dim=0)
            ws = full.T.contiguous().masked_select(rmap.T.contiguous())
        else:
            order = ids.flatten().sort(0)[1]
            tok = order.div(r.k, rounding_mode="trunc")
            ws = weights.flatten()[order]
            xs = x[tok]
            counts = torch.zeros(T, E, device=x.device).scatter(1, ids, 1).long().sum(0)
        if r.flaw == "other_slot":
            ws = ws.flip(0)
        pieces = torch.split(xs, counts.tolist())
        if r.idioms["experts"] == "modulelist":
            outs = [self.bank.mlp(e, p) for e, p in enumerate(pieces)]
        else:
            outs = self._per_projection(pieces)
        if r.flaw == "differs":
            outs[0] = 2.0 * outs[0]
        ys = torch.cat(outs, dim=0) * ws.unsqueeze(-1)
        rows = tok.flip(0) if r.flaw == "other_rows" else tok
        if r.idioms["combine"] == "scatter_add":
            out = torch.zeros(T, H, dtype=x.dtype, device=x.device)
            return out.scatter_add_(0, rows.unsqueeze(1).expand(-1, H), ys)
        return torch.zeros(T, H, dtype=x.dtype, device=x.device).index_add(0, rows, ys)

    def _per_projection(self, pieces) -> list:
        """JetMoE's ParallelExperts: one ``F.linear`` per split and projection, ``cat``, split again."""
        bank = self.bank
        sizes = [p.shape[0] for p in pieces]
        w_up, w_gate, w_down, _ = bank.stacked()
        h = torch.cat([F.linear(p, w_up[e]) for e, p in enumerate(pieces)])
        if w_gate is None and self.r.gated:
            g, u = h.chunk(2, dim=-1)
            h = hidden(self.r.act, g, u)
        else:
            h = hidden(self.r.act, h)
        return [F.linear(p, w_down[e]) for e, p in enumerate(torch.split(h, sizes))]


class ExpertChoiceMoE(nn.Module):
    """Look-alike: each expert picks its top-c tokens (top-k over the token axis), not each token its experts."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.r = r
        self.gate = nn.Linear(H, r.E, bias=False)
        self.bank = ExpertBank("stacked_nk", r.E, r.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.r
        probs = F.softmax(self.gate(x), dim=-1)
        c = max(1, min(x.shape[0], x.shape[0] * r.k // r.E))
        w, tok = torch.topk(probs, c, dim=0)  # (c, E)
        out = torch.zeros_like(x)
        for e in range(r.E):
            out.index_add_(0, tok[:, e], self.bank.mlp(e, x[tok[:, e]]) * w[:, e, None])
        return out
