"""Experts held as separate per-expert weight tensors (a ModuleList of nn.Linear, HF v4's loop): the same fused op,
on a stack of the weights made at each call.

Shapes: with ``layout`` "nk" each ``w1[e]``/``w1_up[e]`` is (I, H) and each ``w2[e]`` (H, I), nn.Linear's (out, in);
with "kn" they are (in, out): (H, I) and (I, H), for experts written as ``x @ w``.

The stack is never cached: a cache keyed on the weights' versions misses ``p.data.copy_(new)`` (writes through
``.data`` bump no version counter), and nothing cheaper than reading the weights tells that they changed.

At decode sizes (T*k at most ``GATHER_MAX_ROWS`` and below E, no gradient wanted) the stack of every expert is most of
the call's time, so, with ``config.list_weight_copies`` on (off until measured on a GPU), the weights the assignments
chose are copied instead, each read in place through a table of the
experts' addresses (kernels/gather_weights.py), and each assignment runs as its own one-row "expert". The table is
cached by those addresses only: it names where the weights are, never what they hold, so it cannot go stale.
"""
from __future__ import annotations

import torch
from torch import Tensor

from collections import OrderedDict
from typing import Optional

from .. import config
from .activations import GPTOSS_ALPHA, GPTOSS_LIMIT, Activation
from .call import ExpertsCall, ExpertWeights, Routing, check_weight_position
from .experts import Needs, _forward_gemms, experts_backward, experts_forward_call, to_kn
from .grouped import use_triton
from .routing import prepare_routing

#: the most assignments (T*k) served by per-assignment weight copies. Each count compiles its own GEMM variant (the
#: copies are its experts), so only decode-sized calls take them
GATHER_MAX_ROWS = 32
_TABLES: "OrderedDict[tuple, Tensor]" = OrderedDict()
_MAX_TABLES = 64


def stacked(ws: list[Tensor]) -> Tensor:
    """``torch.stack(ws)`` of the weights as they are now: (E, N, K)."""
    with torch.no_grad():
        return torch.stack([w.detach() for w in ws])


def _views(w1: list[Tensor], w1_up: list[Tensor], w2: list[Tensor], layout: str):
    """The (E, K, N) views the op takes, of the stacked per-expert weights."""
    return (to_kn(stacked(w1), layout), to_kn(stacked(w1_up), layout) if w1_up else None,
            to_kn(stacked(w2), layout))


@torch.library.custom_op("moe_inductor::experts_forward_list", mutates_args=())
def experts_forward_list(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: list[Tensor], w1_up: list[Tensor],
                         w2: list[Tensor], activation: str, save_pre: bool, weight_position: str, layout: str
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``experts_forward`` on per-expert nn.Linear weights (``w1_up`` empty for a plain activation); the routing
    weight scales the expert's output, input or hidden state (``weight_position``), as in ``experts_forward``.

    Returns:
        y (T, H), pre, order, sorted_expert, offsets, as ``experts_forward``.
    """
    check_weight_position(weight_position)
    tables = None if save_pre else _decode_tables(x, topk_ids, (w1, w1_up, w2))
    if tables is not None:
        return _forward_copies(x, topk_ids, topk_weights, (w1, w1_up, w2), tables, activation, weight_position, layout)
    call = ExpertsCall(x, Routing(topk_ids, topk_weights), ExpertWeights(*_views(w1, w1_up, w2, layout)),
                       Activation(activation), weight_position, save_pre)
    return experts_forward_call(call)


def _address_table(ws: list[Tensor]) -> Optional[Tensor]:
    """An int64 tensor of the weights' addresses on their device, cached by those addresses; None where it would
    have to be uploaded during CUDA-graph capture (not allowed: the stack serves that call)."""
    key = (ws[0].device, tuple(w.data_ptr() for w in ws))
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        return table
    if ws[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    table = _TABLES[key] = torch.tensor(key[1], dtype=torch.int64, device=ws[0].device)
    if len(_TABLES) > _MAX_TABLES:
        _TABLES.popitem(last=False)
    return table


def _decode_tables(x: Tensor, topk_ids: Tensor, groups: tuple) -> Optional[list[Optional[Tensor]]]:
    """The address tables of (w1, w1_up, w2) where a call takes the per-assignment copies: the Triton kernels run,
    T*k is at least 1, at most ``GATHER_MAX_ROWS`` and below E, and each projection's weights are contiguous, of one
    shape and dtype, on x's device. Else None."""
    E, M = len(groups[0]), topk_ids.numel()
    if not (config.list_weight_copies and use_triton(x) and 0 < M <= GATHER_MAX_ROWS and M < E):
        return None
    tables = []
    for ws in groups:
        if not ws:
            tables.append(None)
            continue
        first = ws[0]
        if any(w.shape != first.shape or w.dtype != first.dtype or w.device != x.device or not w.is_contiguous()
               for w in ws):
            return None
        table = _address_table(ws)
        if table is None:
            return None
        tables.append(table)
    return tables


def _forward_copies(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, groups: tuple, tables: list,
                    activation: str, weight_position: str, layout: str) -> tuple[Tensor, ...]:
    """The forward on per-assignment copies of the chosen experts' weights: sorted assignment j runs as "expert"
    j of one row, on its own copy. Returns what ``experts_forward_call`` returns (pre empty: no backward)."""
    from ..kernels.gather_weights import gather_weights

    E = len(groups[0])
    routing = Routing(topk_ids, topk_weights)
    routed = prepare_routing(routing, E)
    M = routed.order.shape[0]
    copies = [to_kn(gather_weights(t, routed.sorted_expert, ws[0], E), layout) if ws else None
              for t, ws in zip(tables, groups)]
    slots = torch.arange(M + 1, dtype=routed.offsets.dtype, device=x.device)
    one_each = routed._replace(sorted_expert=slots[:M], offsets=slots, num_experts=M)
    call = ExpertsCall(x, routing, ExpertWeights(*copies), Activation(activation), weight_position, False)
    y = _forward_gemms(call, one_each, None, num_experts=E)
    return y, x.new_empty(0), routed.order, routed.sorted_expert, routed.offsets


@experts_forward_list.register_fake
def _(x, topk_ids, topk_weights, w1, w1_up, w2, activation, save_pre, weight_position, layout):
    M = topk_ids.shape[0] * topk_ids.shape[1]
    n_pre = w1[0].shape[0 if layout == "nk" else 1] * (2 if w1_up else 1)
    ids = topk_ids.new_empty(M, dtype=torch.int32)
    return (x.new_empty(x.shape), x.new_empty(M, n_pre) if save_pre else x.new_empty(0), ids, torch.empty_like(ids),
            topk_ids.new_empty(len(w1) + 1, dtype=torch.int32))


@torch.library.custom_op("moe_inductor::experts_backward_list", mutates_args=())
def experts_backward_list(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: list[Tensor],
                          w1_up: list[Tensor], w2: list[Tensor], pre: Tensor, order: Tensor, sorted_expert: Tensor,
                          offsets: Tensor, activation: str, weight_position: str, layout: str
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``experts_forward_list``: dx, d_topk_weights, and the stacked (E, N, K) dw1, dw1_up, dw2
    (dw1_up empty for a plain activation)."""
    g, u, d = _views(w1, w1_up, w2, layout)
    dx, dtw, dg, du, dd, *_ = experts_backward(dy, x, topk_ids, topk_weights, g, u, d, None, None, None, pre, order,
                                               sorted_expert, offsets, activation, weight_position, GPTOSS_ALPHA,
                                               GPTOSS_LIMIT, False,
                                               list(Needs(True, True, True, u is not None, True, False, False, False)))
    # the grads of the (E, K, N) views, laid out like the stacked weights (to_kn is its own inverse); a plain
    # activation has no up weights, and du is the empty placeholder
    return (dx, dtw, to_kn(dg, layout).contiguous(), to_kn(du, layout).contiguous() if u is not None else du,
            to_kn(dd, layout).contiguous())


@experts_backward_list.register_fake
def _(dy, x, topk_ids, topk_weights, w1, w1_up, w2, pre, order, sorted_expert, offsets, activation,
      weight_position, layout):
    E = len(w1)

    def stack_like(ws):
        return x.new_empty(E, *ws[0].shape) if ws else x.new_empty(0)

    return torch.empty_like(x), torch.empty_like(topk_weights), stack_like(w1), stack_like(w1_up), stack_like(w2)


def _setup(ctx, inputs, output):
    # (no argument has a default: the dispatcher drops arguments equal to their defaults before autograd, which
    # would make the number of gradients to return depend on the values passed)
    x, topk_ids, topk_weights, w1, w1_up, w2, activation, save_pre, weight_position, layout = inputs
    _, pre, order, sorted_expert, offsets = output
    ctx.save_for_backward(x, topk_ids, topk_weights, pre, order, sorted_expert, offsets, *w1, *w1_up, *w2)
    ctx.sizes = (len(w1), len(w1_up))
    ctx.activation = activation
    ctx.weight_position = weight_position
    ctx.layout = layout


def _backward(ctx, dy, _dpre, _dorder, _dsorted, _doffsets):
    x, topk_ids, topk_weights, pre, order, sorted_expert, offsets, *ws = ctx.saved_tensors
    n1, n_up = ctx.sizes
    w1, w1_up, w2 = ws[:n1], ws[n1:n1 + n_up], ws[n1 + n_up:]
    dx, dtw, dw1, dw1_up, dw2 = experts_backward_list(dy.contiguous(), x, topk_ids, topk_weights, w1, w1_up, w2, pre,
                                                      order, sorted_expert, offsets, ctx.activation,
                                                      ctx.weight_position, ctx.layout)
    return (dx, None, dtw, list(dw1.unbind(0)), list(dw1_up.unbind(0)) if n_up else [], list(dw2.unbind(0)), None,
            None, None, None)


experts_forward_list.register_autograd(_backward, setup_context=_setup)
