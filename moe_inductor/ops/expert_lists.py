"""Experts held as separate per-expert weight tensors (a ModuleList of nn.Linear, HF v4's loop): the same fused op.

Shapes: with ``layout`` "nk" each ``w1[e]``/``w1_up[e]`` is (I, H) and each ``w2[e]`` (H, I), nn.Linear's (out, in);
with "kn" they are (in, out): (H, I) and (I, H), for experts written as ``x @ w``.

Where the Triton kernels run, ``config.list_weight_tables`` is on, the call has enough rows per expert for it, and
each projection's weights share one shape, strides and x's dtype, the forward reads them where they lie, through a
table of their places (kernels/weight_table.py): no stack is made, and a call reads only the experts its tokens
chose. On the CPU, whose path computes expert by expert, the forward and the backward read each expert's own tensors
(``PerExpert``), and each weight's gradient is laid out as its weight. Otherwise (mixed layouts, weights off 16-byte
boundaries, a table that would have to be uploaded during CUDA-graph capture, and the GPU's backward) the weights
are stacked at each call. Per-expert biases (nn.Linear's,
one list per projection, empty where it has none) are stacked at each call: a few numbers per expert.

``capacity`` is the stacked op's: each expert keeps its first ``capacity`` assignments in choice-major order
(ops/routing.py) and the others contribute nothing, so a padded-capacity layer over a ModuleList (GShard, Switch,
fairseq, DeepSpeed) reads its experts' weights where they lie, as an uncapped one does.

The stack is never cached: a cache keyed on the weights' versions misses ``p.data.copy_(new)`` (writes through
``.data`` bump no version counter), and nothing cheaper than reading the weights tells that they changed. The table
is cached by the weights' addresses alone, so it cannot go stale that way.
"""
from __future__ import annotations

import torch
from torch import Tensor

from types import SimpleNamespace
from typing import Optional

from .. import config
from .activations import GPTOSS_ALPHA, GPTOSS_LIMIT, Activation
from .call import ExpertsCall, ExpertWeights, Routing, check_weight_position
from .backward import _call_and_routing, _empty_or, middle_grads, up_grads
from .experts import Needs, experts_backward, experts_forward_call, to_kn
from .grouped import use_triton
from .grouped_mm_engine import may_take_experts_of


def stacked(ws: list[Tensor]) -> Tensor:
    """``torch.stack(ws)`` of the weights as they are now: (E, N, K)."""
    with torch.no_grad():
        return torch.stack([w.detach() for w in ws])


class PerExpert:
    """E same-shaped per-expert weights as the CPU path reads them: logically (E, K, N), ``unbind(0)`` giving each
    expert's (K, N) view of its own tensor. Nothing is stacked: a call computes with the experts' weights where they
    lie, as eager's loop does, where a stack would copy every expert's weights at every call (at DeepSeek-V2-Lite's
    widths, 64 experts of 2.9M weights a projection)."""

    def __init__(self, ws: list[Tensor], layout: str) -> None:
        self._views = tuple(to_kn(w, layout) for w in ws)
        self.shape = torch.Size((len(ws), *self._views[0].shape))

    @classmethod
    def _of(cls, views: tuple) -> "PerExpert":
        new = cls.__new__(cls)
        new._views, new.shape = views, torch.Size((len(views), *views[0].shape))
        return new

    def unbind(self, dim: int = 0) -> tuple[Tensor, ...]:
        assert dim == 0, "per-expert weights unbind into their experts only"
        return self._views

    def transpose(self, dim0: int, dim1: int) -> "PerExpert":
        """(E, N, K): each expert's (K, N) view transposed, as the backward reads the weights."""
        assert sorted((dim0, dim1)) == [1, 2], "per-expert weights transpose within an expert only"
        return PerExpert._of(tuple(v.t() for v in self._views))

    def grad_buffer(self) -> "PerExpert":
        """Empty (E, K, N) gradients, one tensor per expert, each laid out as that expert's weight (nn.Linear's (N, K)
        storage gives a transposed view): autograd takes each as it is. One (E, N, K) buffer would be a fresh
        mapping of every expert's size at each step, whose first writes fault in every page (measured 3.5x slower
        than per-expert tensors, which the allocator reuses, on this project's CPU)."""
        E, K, N = self.shape
        return PerExpert._of(tuple(v.new_empty(N, K).t() if v.stride(0) == 1 and v.stride(1) == K
                                   else v.new_empty(K, N) for v in self._views))


def _per_expert(w1: list[Tensor], w1_up: list[Tensor], w2: list[Tensor], layout: str) -> Optional[tuple]:
    """The (w1, w1_up or None, w2) ``PerExpert`` weights of the CPU path, or None where a projection's weights
    differ in shape or dtype (the path then reads a stack, which refuses them as torch.stack does)."""
    groups = []
    for ws in (w1, w1_up, w2):
        if not ws:
            groups.append(None)
            continue
        if len({(w.shape, w.dtype) for w in ws}) != 1:
            return None
        groups.append(PerExpert(ws, layout))
    return tuple(groups)


def _views(w1: list[Tensor], w1_up: list[Tensor], w2: list[Tensor], layout: str):
    """The (E, K, N) views the op takes, of the stacked per-expert weights."""
    return (to_kn(stacked(w1), layout), to_kn(stacked(w1_up), layout) if w1_up else None,
            to_kn(stacked(w2), layout))


def _biases(b1: list[Tensor], b1_up: list[Tensor], b2: list[Tensor]) -> tuple:
    """The (E, N) stacks of the per-expert biases (None where a projection has none): a few numbers per expert,
    stacked at each call as the op reads stacked biases."""
    return tuple(stacked(bs) if bs else None for bs in (b1, b1_up, b2))


@torch.library.custom_op("moe_inductor::experts_forward_list", mutates_args=())
def experts_forward_list(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: list[Tensor], w1_up: list[Tensor],
                         w2: list[Tensor], b1: list[Tensor], b1_up: list[Tensor], b2: list[Tensor], activation: str,
                         save_pre: bool, weight_position: str, layout: str, capacity: Optional[int]
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``experts_forward`` on per-expert nn.Linear weights and biases (``w1_up`` empty for a plain activation, a
    bias list empty where its projection has none, else one (N,) bias per expert); the routing weight scales the
    expert's output, input or hidden state (``weight_position``), as in ``experts_forward``. ``capacity`` (None:
    none) drops each expert's assignments past it in choice-major order, as ``experts_forward``'s does: a dropped
    assignment adds nothing to its token's output.

    Returns:
        y (T, H), pre, order, sorted_expert, offsets, as ``experts_forward``.
    """
    check_weight_position(weight_position)
    biases = _biases(b1, b1_up, b2)
    if use_triton(x):
        tables = _weight_tables(x, topk_ids, (w1, w1_up, w2), layout, biased=bool(b1 or b2),
                                dropped=capacity is not None)
    else:  # the CPU path computes expert by expert: it reads each expert's own weights (PerExpert)
        tables = _per_expert(w1, w1_up, w2, layout)
    weights = ExpertWeights(*(tables if tables is not None else _views(w1, w1_up, w2, layout)), *biases)
    call = ExpertsCall(x, Routing(topk_ids, topk_weights, capacity), weights, Activation(activation), weight_position,
                       save_pre)
    return experts_forward_call(call)


def _weight_tables(x: Tensor, topk_ids: Tensor, groups: tuple, layout: str, biased: bool = False,
                   dropped: bool = False) -> Optional[tuple]:
    """The (w1, w1_up or None, w2) address tables the forward reads the weights through (kernels/weight_table.py),
    or None where it stacks them: the tables are off, the call has fewer rows than
    ``config.list_weight_tables_min_rows_per_expert`` per expert, "auto" would give the stacked
    weights' GEMMs to ``torch._grouped_mm`` (a layout only a stack has; never for a call with a capacity,
    ``dropped``, which the engine does not run), or a projection's weights differ in shape, strides, dtype (x's)
    or device (x's)."""
    w1, w1_up, w2 = groups
    E = len(w1)
    if not config.list_weight_tables:
        return None
    if topk_ids.numel() < config.list_weight_tables_min_rows_per_expert * E:  # where the stack was measured faster
        return None
    # An ungated stack the engine takes beats the tables. Gated layers keep the tables: their two stacks would take
    # the engine too (as two GEMMs), but a stack copies every expert's gate, up and down weights at each call, and
    # that against the fused GEMMs on the tables was never measured
    if not w1_up and not dropped:
        out_dim, in_dim = w2[0].shape if layout == "nk" else w2[0].shape[::-1]
        if may_take_experts_of(SimpleNamespace(shape=(E, in_dim, out_dim)), biased, topk_ids.numel()):
            return None
    from ..kernels.weight_table import weight_table

    tables = []
    for ws in groups:
        table = weight_table(ws, layout, x.dtype, x.device) if ws else None
        if ws and table is None:
            return None
        tables.append(table)
    return tuple(tables)


@experts_forward_list.register_fake
def _(x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, activation, save_pre, weight_position, layout,
      capacity):
    M = topk_ids.shape[0] * topk_ids.shape[1]
    n_pre = w1[0].shape[0 if layout == "nk" else 1] * (2 if w1_up else 1)
    ids = topk_ids.new_empty(M, dtype=torch.int32)
    return (x.new_empty(x.shape), x.new_empty(M, n_pre) if save_pre else x.new_empty(0), ids, torch.empty_like(ids),
            topk_ids.new_empty(len(w1) + 1, dtype=torch.int32))


@torch.library.custom_op("moe_inductor::experts_backward_list", mutates_args=())
def experts_backward_list(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: list[Tensor],
                          w1_up: list[Tensor], w2: list[Tensor], b1: list[Tensor], b1_up: list[Tensor],
                          b2: list[Tensor], pre: Tensor, order: Tensor, sorted_expert: Tensor, offsets: Tensor,
                          activation: str, weight_position: str, layout: str, dropped: bool
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``experts_forward_list``: dx, d_topk_weights, the stacked (E, N, K) dw1, dw1_up, dw2 and the
    stacked (E, N) db1, db1_up, db2 (empty where the forward had no such weight or bias). ``dropped``: whether the
    forward had a capacity. The routing metadata already says which assignments it dropped (sorted past
    ``offsets[E]``); the flag tells the backward that rows it never computes must start at zero, as
    ``experts_backward``'s does. The weights are stacked (the GPU's backward reads stacks); the CPU path has
    ``experts_backward_per_expert``."""
    g, u, d = _views(w1, w1_up, w2, layout)
    sb1, sb1_up, sb2 = _biases(b1, b1_up, b2)
    needs = Needs(True, True, True, u is not None, True, sb1 is not None, sb1_up is not None, sb2 is not None)
    dx, dtw, dg, du, dd, db1, db1_up, db2 = experts_backward(
        dy, x, topk_ids, topk_weights, g, u, d, sb1, sb1_up, sb2, pre, order, sorted_expert, offsets, activation,
        weight_position, GPTOSS_ALPHA, GPTOSS_LIMIT, dropped, list(needs))
    # the grads of the (E, K, N) views, laid out like the stacked weights (to_kn is its own inverse); a plain
    # activation has no up weights, and du is the empty placeholder
    return (dx, dtw, to_kn(dg, layout).contiguous(), to_kn(du, layout).contiguous() if u is not None else du,
            to_kn(dd, layout).contiguous(), db1, db1_up, db2)


@experts_backward_list.register_fake
def _(dy, x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets, activation,
      weight_position, layout, dropped):
    return (torch.empty_like(x), torch.empty_like(topk_weights),
            *(_stack_like(x, ws) for ws in (w1, w1_up, w2, b1, b1_up, b2)))


@torch.library.custom_op("moe_inductor::experts_backward_per_expert", mutates_args=())
def experts_backward_per_expert(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: list[Tensor],
                                w1_up: list[Tensor], w2: list[Tensor], b1: list[Tensor], b1_up: list[Tensor],
                                b2: list[Tensor], pre: Tensor, order: Tensor, sorted_expert: Tensor,
                                offsets: Tensor, activation: str, weight_position: str, layout: str, dropped: bool
                                ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor], list[Tensor], Tensor, Tensor,
                                           Tensor]:
    """``experts_backward_list`` on the CPU path, which reads each expert's own weights (``PerExpert``) and makes
    each expert's weight gradient as a tensor of its own, laid out as its weight: dx, d_topk_weights, the dw1,
    dw1_up and dw2 lists (empty where the forward had no such weights) and the stacked db1, db1_up, db2. ``pre``
    must be the forward's saved raw up projection."""
    sb1, sb1_up, sb2 = _biases(b1, b1_up, b2)
    needs = Needs(True, True, True, bool(w1_up), True, sb1 is not None, sb1_up is not None, sb2 is not None)
    weights = _per_expert(w1, w1_up, w2, layout)
    if weights is None:  # the forward refuses such weights (a stack of mixed shapes, a GEMM of mixed dtypes)
        raise RuntimeError("experts_backward_per_expert: each projection's expert weights must share one shape and "
                           "dtype, as the forward's require")
    call, routed = _call_and_routing(x, topk_ids, topk_weights, (*weights, sb1, sb1_up, sb2), activation,
                                     GPTOSS_ALPHA, GPTOSS_LIMIT, weight_position, order, sorted_expert, offsets,
                                     dropped)
    d_pre, d_scale, dd, db2, db1, db1_up = middle_grads(dy, call, routed, pre, needs)
    dx, dtw, dg, du = up_grads(call, routed, d_pre, d_scale, needs)

    def own_layout(grads) -> list[Tensor]:  # each expert's (K, N) gradient as its weight holds it
        return [to_kn(t, layout) for t in grads.unbind(0)] if grads is not None else []

    return (_empty_or(dx, x), _empty_or(dtw, x), own_layout(dg), own_layout(du), own_layout(dd),
            _empty_or(db1, x), _empty_or(db1_up, x), _empty_or(db2, x))


@experts_backward_per_expert.register_fake
def _(dy, x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets, activation,
      weight_position, layout, dropped):
    return (torch.empty_like(x), torch.empty_like(topk_weights), *([x.new_empty(w.shape) for w in ws]
                                                                   for ws in (w1, w1_up, w2)),
            *(_stack_like(x, bs) for bs in (b1, b1_up, b2)))


def _stack_like(x: Tensor, ts: list[Tensor]) -> Tensor:
    """A fake (E, ...) stack of the per-expert ``ts`` in x's dtype, or an empty tensor where there are none."""
    return x.new_empty(len(ts), *ts[0].shape) if ts else x.new_empty(0)


def _per_expert_backward(x: Tensor, pre: Tensor, order: Tensor) -> bool:
    """Whether the backward takes ``experts_backward_per_expert``: the CPU path, with the forward's raw up projection
    saved (the per-expert path does not recompute it)."""
    return not use_triton(x) and pre.shape[0] == order.shape[0]


def _setup(ctx, inputs, output):
    # (no argument has a default: the dispatcher drops arguments equal to their defaults before autograd, which
    # would make the number of gradients to return depend on the values passed)
    (x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, activation, save_pre, weight_position, layout,
     capacity) = inputs
    _, pre, order, sorted_expert, offsets = output
    groups = (w1, w1_up, w2, b1, b1_up, b2)
    ctx.save_for_backward(x, topk_ids, topk_weights, pre, order, sorted_expert, offsets,
                          *(t for g in groups for t in g))
    ctx.sizes = tuple(len(g) for g in groups)
    ctx.activation = activation
    ctx.weight_position = weight_position
    ctx.layout = layout
    ctx.dropped = capacity is not None  # (a flag, not the capacity: the metadata saved above holds the drops)


def _backward(ctx, dy, _dpre, _dorder, _dsorted, _doffsets):
    x, topk_ids, topk_weights, pre, order, sorted_expert, offsets, *flat = ctx.saved_tensors
    groups, at = [], 0
    for n in ctx.sizes:
        groups.append(flat[at:at + n])
        at += n
    op = experts_backward_per_expert if _per_expert_backward(x, pre, order) else experts_backward_list
    dx, dtw, *grads = op(dy.contiguous(), x, topk_ids, topk_weights, *groups, pre, order, sorted_expert, offsets,
                         ctx.activation, ctx.weight_position, ctx.layout, ctx.dropped)
    per_expert = [list(g) if isinstance(g, (list, tuple)) else list(g.unbind(0)) if n else []
                  for g, n in zip(grads, ctx.sizes)]
    return (dx, None, dtw, *per_expert, None, None, None, None, None)


experts_forward_list.register_autograd(_backward, setup_context=_setup)
