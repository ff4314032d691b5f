"""Generated modules of the two forms drawn by their own family (``--walks-lists``): MiniMind's walk of cumulative
host counts with one scatter per expert (``cumsum_walk``), and transformers v4.36-v4.39 Mixtral's expert loop that
indexes the rows with Python lists from ``.tolist()`` (``list_rows``).

Both read their lists or arrays in the function that makes them, and each look-alike that reads them otherwise has
a function of its own: the backend's proofs read a whole function's bytecode (every read of the list's local, every
instruction before a walk's skip), so a flawed read in one branch would refuse the genuine code beside it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.generator.parts import H, ExpertBank, Router
from tests.generator.recipe import Recipe


class CumsumWalkMoE(nn.Module):
    """MiniMind's ``moe_infer``: the flat ids sorted, ``cum = bincount().cpu().numpy().cumsum(0)`` (or torch's cumsum,
    or with ``minlength=E``), ``for i, end in enumerate(cum)`` with ``start = 0 if i == 0 else cum[i - 1]`` (or the
    start carried from the last end), ``if start == end: continue``, expert i on the rows of ``idxs[start:end] // k``,
    its output weighted by its rows' routing weights (``mul_`` in place, or out of place) and added into a zeros
    buffer at those tokens (``scatter_add_`` of a repeated or expanded index, ``index_add_``, or DeepSeek-MoE's
    ``scatter_reduce_(..., reduce="sum")``)."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.r = r
        self.router = Router(r.router, r.E, r.k, r.renorm)
        self.bank = ExpertBank(r.idioms["experts"], r.E, r.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.r.idioms
        probs, weights, ids = self.router(x)
        flat = ids.view(-1)
        if d["sort"] == "argsort":
            idxs = flat.argsort()
        elif d["sort"] == "argsort_stable":
            idxs = torch.argsort(flat, stable=True)
        else:
            idxs = flat.sort()[1]
        cum = self._boundaries(flat)
        tok = idxs // self.r.k
        column = weights.view(-1, 1)
        out = torch.zeros_like(x)
        walk = {"walk_counts": self._walk_counting, "walk_neighbour": self._walk_neighbour,
                "walk_stops": self._walk_stopping, "walk_tail": self._walk_tail}.get(self.r.flaw)
        if walk is None:
            walk = {"continue": self._walk, "le_continue": self._walk_le, "guarded": self._walk_guarded}[d["skip"]]
        return walk(x, cum, idxs, tok, column, weights, out)

    # Each skip spelling has its own loops: the proof of a walk shorter in eager reads the loop's code up to the skip,
    # which must be plain reads and stores (one test written two ways, ``a if c else b``, jumps there).

    def _walk(self, x, cum, idxs, tok, column, weights, out):
        """MiniMind's ``if start == end: continue``; the start read from the boundary before, or carried from the
        last end."""
        if self.r.idioms["start"] == "carried":
            start = 0
            for i, end in enumerate(cum):
                if start == end:
                    continue
                self._scatter(i, x, idxs, tok, column, weights, out, start, end)
                start = end
            return out
        for i, end in enumerate(cum):
            start = 0 if i == 0 else cum[i - 1]
            if start == end:
                continue
            self._scatter(i, x, idxs, tok, column, weights, out, start, end)
        return out

    def _walk_le(self, x, cum, idxs, tok, column, weights, out):
        """The skip as ``if end <= start: continue``."""
        if self.r.idioms["start"] == "carried":
            start = 0
            for i, end in enumerate(cum):
                if end <= start:
                    continue
                self._scatter(i, x, idxs, tok, column, weights, out, start, end)
                start = end
            return out
        for i, end in enumerate(cum):
            start = 0 if i == 0 else cum[i - 1]
            if end <= start:
                continue
            self._scatter(i, x, idxs, tok, column, weights, out, start, end)
        return out

    def _walk_guarded(self, x, cum, idxs, tok, column, weights, out):
        """The body under ``if start != end:``, nothing after it in the iteration (a carried start moves inside)."""
        if self.r.idioms["start"] == "carried":
            start = 0
            for i, end in enumerate(cum):
                if start != end:
                    self._scatter(i, x, idxs, tok, column, weights, out, start, end)
                    start = end
            return out
        for i, end in enumerate(cum):
            start = 0 if i == 0 else cum[i - 1]
            if start != end:
                self._scatter(i, x, idxs, tok, column, weights, out, start, end)
        return out

    def _boundaries(self, flat: torch.Tensor):
        """The cumulative counts in the recipe's spelling: NumPy's cumsum of the host copy, torch's cumsum copied to
        the host, either with ``minlength=E``, or ``.tolist()`` of torch's cumsum with it."""
        spelling = self.r.idioms["cumsum"]
        if self.r.flaw == "walk_other_counts":  # the counts of each id + 1: slice e holds expert e - 1's count
            flat = (flat + 1) % self.r.E
        if spelling == "numpy":
            return flat.bincount().cpu().numpy().cumsum(0)
        if spelling == "torch":
            return flat.bincount().cumsum(0).cpu().numpy()
        if spelling == "numpy_minlength":
            return flat.bincount(minlength=self.r.E).cpu().numpy().cumsum(0)
        return flat.bincount(minlength=self.r.E).cumsum(0).tolist()

    def _scatter(self, e, x, idxs, tok, column, weights, out, start, end) -> None:
        """Expert e on its slice ``[start, end)`` of the sorted order, weighted and added at its tokens."""
        r, d = self.r, self.r.idioms
        rows = tok[start:end]
        if d["rows"] == "sorted_rows":
            xe = x[tok][start:end]
        elif d["rows"] == "index_select":
            xe = x.index_select(0, rows)
        else:
            xe = x[rows]
        picked = idxs[start:end].flip(0) if r.flaw == "other_slot" else idxs[start:end]
        w = weights.view(-1)[picked].unsqueeze(-1) if d["weight"] == "flat" else column[picked]
        if r.flaw == "twice":
            xe = xe * w
        y = self.bank.mlp(e, xe).to(out.dtype)
        if r.flaw == "differs" and e == r.E - 1:
            y = 2.0 * y
        if d["weight"] == "out_of_place":
            y = y * w
        else:
            y.mul_(w)
        at = rows.flip(0) if r.flaw == "other_rows" else rows
        if d["combine"] == "index_add":
            out.index_add_(0, at, y)
        elif d["combine"] == "scatter_expand":
            out.scatter_add_(0, at.unsqueeze(1).expand(-1, H), y)
        elif d["combine"] == "scatter_reduce":  # DeepSeek-MoE's moe_infer
            out.scatter_reduce_(0, at.view(-1, 1).repeat(1, x.shape[-1]), y, reduce="sum")
        else:
            out.scatter_add_(0, at.view(-1, 1).repeat(1, x.shape[-1]), y)

    def _walk_counting(self, x, cum, idxs, tok, column, weights, out):
        """Look-alike: the skipped branch counts the idle experts, and the output is scaled by that count (eager
        counts those below the largest id only, and any idle one changes the result)."""
        skipped = 0
        for i, end in enumerate(cum):
            start = 0 if i == 0 else cum[i - 1]
            if start == end:
                skipped += 1
                continue
            self._scatter(i, x, idxs, tok, column, weights, out, start, end)
        return out * (1 + skipped)

    def _walk_neighbour(self, x, cum, idxs, tok, column, weights, out):
        """Look-alike: each start read two boundaries back, ``cum[i - 2]``: an expert also runs on the rows of the
        expert before it."""
        for i, end in enumerate(cum):
            start = 0 if i < 2 else cum[i - 2]
            if start == end:
                continue
            self._scatter(i, x, idxs, tok, column, weights, out, start, end)
        return out

    def _walk_stopping(self, x, cum, idxs, tok, column, weights, out):
        """Look-alike: the walk stops after the first half of the experts; the tokens of the rest keep zeros (``+ 0 *
        x`` keeps a gradient where no expert ran: the check runs a backward)."""
        for i, end in enumerate(cum):
            if i == self.r.E // 2:
                break
            start = 0 if i == 0 else cum[i - 1]
            if start == end:
                continue
            self._scatter(i, x, idxs, tok, column, weights, out, start, end)
        return out + 0 * x

    def _walk_tail(self, x, cum, idxs, tok, column, weights, out):
        """Look-alike: every iteration, run or skipped, ends by counting itself into a tensor after the guarded body,
        and the output is scaled by the count (eager's walk has the largest id + 1 iterations)."""
        steps = torch.zeros((), dtype=x.dtype)
        for i, end in enumerate(cum):
            start = 0 if i == 0 else cum[i - 1]
            if start != end:
                self._scatter(i, x, idxs, tok, column, weights, out, start, end)
            steps.add_(1.0)
        return out * steps


class ListRowsMoE(nn.Module):
    """transformers v4.36 Mixtral: ``pos, tok = torch.where(expert_mask[e])`` (or of ``ids == e``, or of the (E, T,
    k) one-hot), ``if tok.shape[0] == 0: continue`` (or no skip), ``rows = tok.tolist(); slots = pos.tolist()``,
    the expert on ``x[None, rows].reshape(-1, H)`` (or ``x[rows]``, or ``x[tok.tolist()]`` made in place), weighted
    by ``weights[rows, slots, None]`` (or a column of ``weights[rows, slots]``) where the recipe puts it, added back
    at ``tok`` (the tensor)."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.r = r
        self.router = Router(r.router, r.E, r.k, r.renorm)
        self.bank = ExpertBank(r.idioms["experts"], r.E, r.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, d = self.r, self.r.idioms
        probs, weights, ids = self.router(x)
        if d["selection"] == "onehot":
            hits = F.one_hot(ids, num_classes=r.E).permute(2, 1, 0)  # (E, k, T), transformers v4's expert_mask
        elif d["selection"] == "onehot_etk":
            hits = F.one_hot(ids, num_classes=r.E).permute(2, 0, 1)  # (E, T, k)
        else:
            hits = None
        body = {"list_len": self._body_len, "list_reversed": self._body_reversed}.get(
            r.flaw, self._body_inline if d["lists"] == "inline" else self._body)
        out = torch.zeros_like(x)
        for e in range(r.E):
            if hits is None:
                tok, pos = torch.where(ids == e)
            elif d["selection"] == "onehot":
                pos, tok = torch.where(hits[e])
            else:
                tok, pos = torch.where(hits[e])
            if d["skip"] == "shape0":
                if tok.shape[0] == 0:
                    continue
                body(e, x, weights, tok, pos, out)
            else:
                body(e, x, weights, tok, pos, out)
        return out

    def _lists_of(self, tok: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors whose lists index the rows and weights: the expert's own, or a look-alike's other ones."""
        if self.r.flaw == "other_rows":  # the rows reversed, against the order the output is added at
            return tok.flip(0), pos.flip(0)
        if self.r.flaw == "other_slot":  # each row's next choice's weight
            return tok, (pos + 1) % self.r.k
        return tok, pos

    def _finish(self, e, xe, w, tok, out) -> None:
        """Expert e on rows xe, the (rows, 1) weight w where the recipe puts it, added into ``out`` at ``tok``."""
        r, position = self.r, self.r.idioms["position"]
        if position == "input" or r.flaw == "twice":
            xe = xe * w
        y = self.bank.mlp(e, xe, w if position == "between" else None)
        if position == "output" or r.flaw == "twice":
            y = y * w
        if r.flaw == "differs" and e == r.E - 1:
            y = 2.0 * y
        combine = r.idioms["combine"]
        if combine == "index_add":
            out.index_add_(0, tok, y.to(out.dtype))
        elif combine == "index_put":
            out.index_put_((tok,), y, accumulate=True)
        else:
            out.scatter_add_(0, tok[:, None].expand(-1, H), y)

    def _body(self, e, x, weights, tok, pos, out) -> None:
        """The lists stored in locals, each read only as an index."""
        d = self.r.idioms
        row_t, slot_t = self._lists_of(tok, pos)
        rows = row_t.tolist()
        slots = slot_t.tolist()
        xe = x[None, rows].reshape(-1, H) if d["rows"] == "none_reshape" else x[rows]
        if d["weight_read"] == "index_none":
            w = weights[rows, slots, None]
        elif d["weight_read"] == "unsqueeze":
            w = weights[rows, slots].unsqueeze(-1)
        else:
            w = weights[rows, slots].view(-1, 1)
        self._finish(e, xe, w, tok, out)

    def _body_inline(self, e, x, weights, tok, pos, out) -> None:
        """The lists made inside the subscripts, ``x[tok.tolist()]``."""
        d = self.r.idioms
        row_t, slot_t = self._lists_of(tok, pos)
        xe = x[None, row_t.tolist()].reshape(-1, H) if d["rows"] == "none_reshape" else x[row_t.tolist()]
        if d["weight_read"] == "index_none":
            w = weights[row_t.tolist(), slot_t.tolist(), None]
        elif d["weight_read"] == "unsqueeze":
            w = weights[row_t.tolist(), slot_t.tolist()].unsqueeze(-1)
        else:
            w = weights[row_t.tolist(), slot_t.tolist()].view(-1, 1)
        self._finish(e, xe, w, tok, out)

    def _body_len(self, e, x, weights, tok, pos, out) -> None:
        """Look-alike: the row list also read as a number, the expert's input scaled by ``len(rows)``."""
        rows = tok.tolist()
        slots = pos.tolist()
        self._finish(e, x[rows] * len(rows), weights[rows, slots, None], tok, out)

    def _body_reversed(self, e, x, weights, tok, pos, out) -> None:
        """Look-alike: both lists reversed in place before use: the rows and weights of the expert's last row go to
        its first token."""
        rows = tok.tolist()
        slots = pos.tolist()
        rows.reverse()
        slots.reverse()
        self._finish(e, x[rows], weights[rows, slots, None], tok, out)
