"""Routing weights of exactly zero where a capacity form dispatches combine's support (``combine.bool()``,
``combine != 0``): the op's weights and an added term that give eager's gradient there.

Eager does not dispatch a kept (token, choice) whose weight is zero (a softmax underflow in fp16/bf16, a masked
gate): its slot stays a zero row, the expert runs on that row, and the combine multiplies the output by the zero
weight. So the token's row and the experts' weights get nothing from that choice, and the weight's gradient is
``dy_t . expert_e(0)``: zero for bias-free experts (every activation here maps 0 to 0), ``dy_t`` times the expert's
output on a zero row for biased ones. The forward is the same either way (zero times a finite output), and so are
the drops: the queue positions come from the masks, not from the weights. The op, given the weight ``w``, runs the
token through the expert, and its weight gradient there would be ``dy_t . expert_e(x_t)``.

So the op gets ``w * (w != 0)``: the same values, and no gradient where w is zero. Where the experts have biases,
``zero_weight_term`` adds ``sum_j z_tj * expert_{ids_tj}(0)`` beside the op, z the weights that are zero on the
choices the op keeps (0 elsewhere): exactly zero forward, and the gradient ``dy_t . expert_e(0)`` on every kept zero weight.
A dropped choice has no slot in eager, so its weight gets nothing there either way. The term is made only where a
backward can run (grad enabled), and its experts' call is detached: only z's gradient is wanted.

The zero test is made in the dtype whose support the dispatch is (``support_dtype``): the combine's, or that of the
cast the combine einsum reads.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from ..spec import MoESpec
from .emit import emit_experts
from .fx_utils import val


def _zero(graph: Graph, w: Node, support_dtype: torch.dtype) -> Node:
    """Where ``w``, in the dispatch's dtype, is zero: the choices eager leaves out of their slots."""
    return graph.call_function(operator.eq, (graph.call_method("to", (w, support_dtype)), 0))


def dispatched_weights(graph: Graph, w: Node, support_dtype: torch.dtype) -> Node:
    """The op's (T, k) weights for the raw weights ``w``: the same values, no gradient where they are zero."""
    nonzero = graph.call_function(operator.invert, (_zero(graph, w, support_dtype),))
    return graph.call_function(operator.mul, (w, nonzero))


def has_biases(spec: MoESpec) -> bool:
    """Whether the experts' output on a zero row can be nonzero."""
    return any(b is not None for b in (spec.b1, spec.b1_up, spec.b2))


def zero_weight_term(graph: Graph, spec: MoESpec, raw: Node, support_dtype: torch.dtype, E: int, k: int,
                     before: Node, out_dtype: torch.dtype) -> Node:
    """``sum_j z_tj * expert_{ids_tj}(0)`` (T, H) in ``out_dtype``, z the weights that are zero on the kept choices
    (and 0 elsewhere): zero, with eager's gradient on the kept zero weights. ``spec`` has the op's ids and capacity;
    ``raw`` the (T, k) weights before ``dispatched_weights``. The experts' outputs on a zero row are one op call
    over E rows."""
    x = spec.x
    zeros = graph.call_method("new_zeros", (x, (E, graph.call_method("size", (x, -1)))))
    every = graph.call_method("view", (graph.call_function(torch.arange, (E,), {"device": val(x).device}), E, 1))
    ones = graph.call_method("new_ones", (x, (E, 1)))
    on_zero = emit_experts(graph, dataclasses.replace(spec, x=zeros, ids=every, weights=ones, capacity=None),
                           before, out_dtype, traced_x=x)  # (E, H): expert e on a zero row
    # only z's gradient is wanted: the experts' would be z times theirs, zero; detached, no backward runs the call
    on_zero = graph.call_method("detach", (on_zero,))
    ids = spec.ids
    kept = graph.call_method("t", (graph.call_method("reshape", (_kept_flat(graph, ids, E, spec.capacity), k, -1)),))
    # a where, not a product: a non-finite weight elsewhere must not make this term NaN
    z = graph.call_function(torch.where, (graph.call_function(operator.and_, (_zero(graph, raw, support_dtype), kept)),
                                          raw, 0.0))
    # exactly zero in the dispatch's dtype (a wider raw weight that rounds to zero there is not zero itself)
    z = graph.call_method("to", (graph.call_method("to", (z, support_dtype)), out_dtype))
    picked = graph.call_function(operator.getitem, (on_zero, ids))  # (T, k, H)
    return graph.call_method("sum", (graph.call_function(operator.mul, (picked, graph.call_method(
        "unsqueeze", (z, -1)))), 1))


def _kept_flat(graph: Graph, ids: Node, E: int, capacity) -> Node:
    """(k*T,) bools in choice-major order (row j*T + t): the choices the op keeps, the first ``capacity`` of each
    expert's queue."""
    flat = graph.call_method("reshape", (graph.call_method("t", (ids,)), -1))
    hot = graph.call_function(F.one_hot, (flat, E))
    # the 1-based position of each row in the queue of its expert
    position = graph.call_method("sum", (graph.call_function(operator.mul, (
        graph.call_function(torch.cumsum, (hot, 0)), hot)), -1))
    return graph.call_function(operator.le, (position, capacity))
