"""Llama 4's expert-major score tables: the (E, T) scores that weigh each expert's copy of every token before the
experts run, zero off the top-k. Read by the token-replicated (``dense_experts.match_token_replicated``) and the
repeated-input (``dense_repeated.match_input_scaled``) spellings.

Two tables are zero off the top-k:

    table = torch.sigmoid(torch.full_like(logits, -inf).scatter_(1, ids, v))   # sigmoid(-inf) is 0
    table = torch.zeros_like(logits).scatter(1, ids, v)                         # dense_experts._topk_scatter

Either is transposed to (E, T) and flattened by ``.reshape(-1, 1)``, with floating casts anywhere in the chain
(transformers' ``torch.sigmoid(scores.float()).to(dtype)``): a cast maps 0 to 0 and -inf to -inf, so the zeros stay
where the top-k is not. Every step is elementwise but the transpose, so the chain applied to the (T, k) top-k values
gives the table's nonzero entries: ``derive`` replays it for the op's routing weights.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch.fx import Graph, Node

from ..spec import MoESpec
from .aliases import alias_mutations
from .fx_utils import is_call, val

_FLOAT_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


def float_cast(node: Node) -> Optional[torch.dtype]:
    """The floating dtype ``node`` casts its one input to (``.float()``, ``.to(torch.bfloat16)``,
    ``.to(dtype=...)``), else None: a cast with a device, ``copy=`` or ``non_blocking=`` is not read."""
    if node.op != "call_method" or not node.args or not isinstance(node.args[0], Node):
        return None
    if node.target in _FLOAT_CASTS and len(node.args) == 1 and not node.kwargs:
        return _FLOAT_CASTS[node.target]
    if node.target != "to":
        return None
    if len(node.args) == 2 and not node.kwargs:
        dtype = node.args[1]
    elif len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        dtype = node.kwargs["dtype"]
    else:
        return None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _transposes(node: Node) -> bool:
    return ((is_call(node, "call_method", "transpose") and set(node.args[1:]) in ({0, 1}, {0, -1}))
            or (is_call(node, "call_method", "t") and len(node.args) == 1)
            or (is_call(node, "call_function", torch.transpose) and set(node.args[1:]) in ({0, 1}, {0, -1})))


@dataclass
class ExpertMajorScores:
    ids: Node  # (T, k) from topk over the experts
    values: Node  # (T, k): what the table holds at ids, before ``steps``
    steps: tuple  # from the table outward: a floating dtype (a cast) or "sigmoid"
    expert_major: Node  # the (E, T) transposed table

    def derive(self) -> Optional[Callable[[Graph, MoESpec], MoESpec]]:
        """The op's routing weights from the top-k values: the chain's casts and sigmoid replayed on them (None
        where the chain has none)."""
        if not self.steps:
            return None
        steps = self.steps

        def replay(graph: Graph, spec: MoESpec) -> MoESpec:
            w = spec.weights
            for step in steps:
                w = (graph.call_function(torch.sigmoid, (w,)) if step == "sigmoid"
                     else graph.call_method("to", (w, step)))
            return dataclasses.replace(spec, weights=w)

        return replay


def _topk_ids(ids: Node) -> bool:
    if not (is_call(ids, "call_function", operator.getitem) and ids.args[1] == 1):
        return False
    top = ids.args[0]
    if not (is_call(top, "call_function", torch.topk) or is_call(top, "call_method", "topk")):
        return False
    return top.kwargs.get("dim", top.args[2] if len(top.args) > 2 else -1) in (-1, 1)


def _neg_inf_scatter(routing: Node) -> Optional[tuple[Node, Node]]:
    """(ids, values) for ``full_like(s, -inf).scatter_(1, ids, v)`` with topk ids, written by nothing else."""
    if not (is_call(routing, "call_method", "scatter_") and len(routing.args) == 4 and not routing.kwargs):
        return None
    base, dim, ids, values = routing.args
    if not (is_call(base, "call_function", torch.full_like) and len(base.args) == 2
            and base.args[1] == float("-inf") and not base.kwargs):
        return None
    if dim not in (1, -1) or alias_mutations(base) != [routing] or set(base.users) != {routing}:
        return None
    if not isinstance(ids, Node) or not isinstance(values, Node) or not _topk_ids(ids):
        return None
    iv, vv = val(ids), val(values)
    if iv is None or vv is None or iv.shape != vv.shape or iv.dim() != 2:
        return None
    return ids, values


def expert_major_scores(scale: Node) -> Union[ExpertMajorScores, str, None]:
    """The table behind ``scale``, an (E*T, 1) flattening of (E, T) scores zero off the top-k (module docstring);
    a reason where ``scale`` flattens a transposed table that is not provably so; None where it is no such
    flattening."""
    if not (is_call(scale, "call_method", "reshape", "view") and scale.args[1:] == (-1, 1)
            and isinstance(scale.args[0], Node)):
        return None
    node, chain, expert_major = scale.args[0], [], None
    while True:
        if _transposes(node):
            if expert_major is not None:
                return None
            expert_major = node
        elif is_call(node, "call_function", torch.sigmoid) and len(node.args) == 1 and not node.kwargs:
            if "sigmoid" in chain:
                return None
            chain.append("sigmoid")
        elif (dtype := float_cast(node)) is not None:
            chain.append(dtype)
        else:
            break
        node = node.args[0]
        if not isinstance(node, Node):
            return None
    ev = val(expert_major) if expert_major is not None else None
    if ev is None or ev.dim() != 2:
        return None
    routing, steps = node, tuple(reversed(chain))
    if "sigmoid" in steps:
        found = _neg_inf_scatter(routing)
        if found is None:
            return "the sigmoided scores are not a -inf table scattered with topk ids (sigmoid is 0 only at -inf)"
    else:
        from .dense_experts import _topk_scatter

        found = _topk_scatter(routing)
        if found is None:
            return "the scores are not zeros scattered with topk ids (a soft mixture of every expert: nothing to skip)"
    # the chain's copies are read as the table: a write to any of them (other than the table's own scatter) would
    # change what the experts are scaled by
    cur = scale.args[0]
    while cur is not routing:
        if any(m is not routing for m in alias_mutations(cur)):
            return "the scores are changed in place between their table and the experts"
        cur = cur.args[0]
    return ExpertMajorScores(found[0], found[1], steps, expert_major)
