"""One description of an experts call, and the one function that turns it into the op's arguments.

Both routes into the op build an ``ExpertsCall``: the FX passes with ``torch.fx.Node`` fields (``passes/emit.py``,
from a ``MoESpec``), the tensor route with tensors (``ops.fused_experts``, the substitutions in ``hf.py``, the list
op). ``op_call`` gives the op overload and its positional arguments in the schema's order, for either one; the op
bodies read their arguments back with ``from_op_args``, so everything below them takes the call's parts (routing,
expert weights, activation) instead of restating the schema. A new op feature is a field here, its place in
``op_call``/``from_op_args`` and the op's schema, and the kernel that reads it.

The parts are named tuples: Dynamo traces their construction and field reads in ``fused_experts``, and they cost
next to nothing on the eager path, which small batches make host-bound.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from .activations import GPTOSS_ALPHA, GPTOSS_LIMIT, Activation, check_activation, is_gated

#: a field's value: a Tensor on the tensor route, a ``torch.fx.Node`` on the FX route
Value = Any

__all__ = ["Activation", "ExpertWeights", "ExpertsCall", "Routing", "check_call", "from_op_args", "gate_up_pairs",
           "gate_up_whole", "op_call", "pairs_view"]

WEIGHT_POSITIONS = ("output", "between", "input")


class Routing(NamedTuple):
    """Which experts each token goes to, with what weight, and the per-expert capacity."""

    topk_ids: Value  # (T, k) integer expert ids
    topk_weights: Value  # (T, k) routing weights
    capacity: Optional[Any] = None  # an int (or a symbolic size): drop past it in choice-major order


class ExpertWeights(NamedTuple):
    """The expert weights and biases.

    Stacked, they are the op's logical (E, K, N) views: ``w1`` the up projection (the gate when ``w1_up`` is given),
    ``w2`` the down projection; ``b1``/``b1_up`` (E, I) and ``b2`` (E, H) biases. Per expert (the list op), ``w1``,
    ``w1_up`` and ``w2`` are tuples of E weights held in ``layout`` ("nk": nn.Linear's (out, in); "kn": (in, out)),
    and the biases tuples of E (N,) biases or None.
    """

    w1: Value
    w1_up: Optional[Value]
    w2: Value
    b1: Optional[Value] = None
    b1_up: Optional[Value] = None
    b2: Optional[Value] = None
    layout: str = "kn"


class ExpertsCall(NamedTuple):
    """One experts call: ``y = sum_k w_k * down_e(act(up_e(x)))``, the routing weight where ``weight_position``
    says (see ops/experts.py); ``save_pre`` keeps the raw up projection for the backward."""

    x: Value  # (T, H) tokens
    routing: Routing
    weights: ExpertWeights
    activation: Activation = Activation()
    weight_position: str = "output"
    save_pre: bool = False


def op_call(call: ExpertsCall, gate_up: Optional[Value] = None) -> tuple[Any, tuple]:
    """The op overload that runs ``call`` and its positional arguments: ``experts_forward`` for stacked weights,
    ``experts_forward_list`` for per-expert ones. Both return (y, pre, order, sorted_expert, offsets).

    ``gate_up``: the weight that ``call``'s w1 and w1_up are the two parts of, whole: (E, H, 2I) when they are its
    [gate | up] halves, or (E, H, I, 2) (``pairs_view``) when they are its even and odd columns (GPT-OSS's
    interleaved gate_up_proj). It is passed in w1's place, with no w1_up (``from_op_args`` takes the parts again):
    the op's backward then gives one gradient for the whole weight. Passed as two slices, their two gradients are
    stitched into the weight's gradient by a further pass over it (``slice_backward`` and an add, a read and a
    write of the whole gradient)."""
    r, w, act = call.routing, call.weights, call.activation
    if isinstance(w.w1, (tuple, list)):
        if any(b is not None and not isinstance(b, (tuple, list)) for b in (w.b1, w.b1_up, w.b2)):
            raise ValueError("the per-expert list op takes per-expert biases (one per expert), not a stacked one")
        if (act.alpha, act.limit) != (GPTOSS_ALPHA, GPTOSS_LIMIT):
            raise ValueError("the per-expert list op runs the clamped glus with the default alpha and limit only")
        return torch.ops.moe_inductor.experts_forward_list.default, (
            call.x, r.topk_ids, r.topk_weights, list(w.w1), list(w.w1_up or ()), list(w.w2), list(w.b1 or ()),
            list(w.b1_up or ()), list(w.b2 or ()), act.name, call.save_pre, call.weight_position, w.layout,
            r.capacity)
    w1, w1_up = (gate_up, None) if gate_up is not None and w.w1_up is not None else (w.w1, w.w1_up)
    return torch.ops.moe_inductor.experts_forward.default, (
        call.x, r.topk_ids, r.topk_weights, w1, w1_up, w.w2, w.b1, w.b1_up, w.b2, act.name, call.weight_position,
        float(act.alpha), float(act.limit), r.capacity, call.save_pre)


def gate_up_whole(w1: Any, w1_up: Any, activation: str) -> bool:
    """Whether ``experts_forward``'s w1 holds a gated activation's gate and up weights whole, [gate | up] along its
    last dim, with no w1_up (``op_call``'s ``gate_up``)."""
    return w1_up is None and is_gated(activation) and isinstance(w1, torch.Tensor) and w1.dim() == 3 \
        and w1.shape[2] % 2 == 0


def gate_up_pairs(w1: Any, w1_up: Any, activation: str) -> bool:
    """Whether ``experts_forward``'s w1 holds a gated activation's gate and up weights whole as (E, H, I, 2) pairs,
    the gate in [..., 0] and the up in [..., 1], with no w1_up (``op_call``'s ``gate_up``, from ``pairs_view``).
    A fourth dim of 2 says it: the op's schema has no other word for the layout, and no other w1 has four dims."""
    return w1_up is None and is_gated(activation) and isinstance(w1, torch.Tensor) and w1.dim() == 4 \
        and w1.shape[3] == 2


def pairs_view(w: torch.Tensor) -> torch.Tensor:
    """The (E, H, I, 2) view of an (E, H, 2I) weight whose even and odd columns are the gate and up weights (no
    copy, any strides): ``op_call``'s ``gate_up`` for an interleaved pair."""
    return w.unflatten(2, (w.shape[2] // 2, 2))


def from_op_args(args: tuple) -> ExpertsCall:
    """The call that ``experts_forward``'s positional arguments describe (``op_call``'s inverse for stacked
    weights; a whole gate/up w1 becomes its two parts again: halves, or the stride-2 views of its pairs)."""
    (x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, activation, weight_position, alpha, limit, capacity,
     save_pre) = args
    if gate_up_whole(w1, w1_up, activation):
        half = w1.shape[2] // 2
        w1, w1_up = w1[:, :, :half], w1[:, :, half:]
    elif gate_up_pairs(w1, w1_up, activation):
        w1, w1_up = w1[..., 0], w1[..., 1]
    return ExpertsCall(x, Routing(topk_ids, topk_weights, capacity), ExpertWeights(w1, w1_up, w2, b1, b1_up, b2),
                       Activation(activation, alpha, limit), weight_position, save_pre)


def check_weight_position(weight_position: str) -> None:
    """A clear error for a routing-weight position the op does not have."""
    if weight_position not in WEIGHT_POSITIONS:
        raise ValueError(f"weight_position={weight_position!r}; choose one of {WEIGHT_POSITIONS}")


def check_call(call: ExpertsCall) -> None:
    """Shape/dtype checks of a call with stacked weights, naming the offending argument."""
    x, (topk_ids, topk_weights, _), (w1, w1_up, w2, b1, b1_up, b2, _) = call.x, call.routing, call.weights
    activation = call.activation.name
    check_activation(activation)
    check_weight_position(call.weight_position)
    if x.dim() != 2:
        raise ValueError(f"x must be (T, H); got shape {tuple(x.shape)}")
    T, H = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be (T={T}, k); got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor; got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must match topk_ids {tuple(topk_ids.shape)}; got {tuple(topk_weights.shape)}")
    if w1.dim() != 3 or w1.shape[1] != H:
        raise ValueError(f"w1 must be (E, H={H}, I) after layout; got shape {tuple(w1.shape)}")
    E, _, I = w1.shape
    if is_gated(activation) != (w1_up is not None):
        raise ValueError(f"activation={activation!r} {'needs' if is_gated(activation) else 'takes no'} separate up weights")
    if w1_up is not None and w1_up.shape != w1.shape:
        raise ValueError(f"the up weights must match the gate weights {tuple(w1.shape)}; got {tuple(w1_up.shape)}")
    if w2.shape != (E, I, H):
        raise ValueError(f"w2 must be (E={E}, I={I}, H={H}) after layout; got shape {tuple(w2.shape)}")
    for name, t in (("w1", w1), ("w1_up", w1_up), ("w2", w2)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    for name, t, n in (("b1", b1, I), ("b1_up", b1_up, I), ("b2", b2, H)):
        if t is not None and tuple(t.shape) != (E, n):
            raise ValueError(f"{name} must be (E={E}, {n}); got shape {tuple(t.shape)}")
    if (b1 is None) != (b1_up is None) and w1_up is not None:
        raise ValueError("b1 and b1_up must both be given or both be None for a gated activation")
