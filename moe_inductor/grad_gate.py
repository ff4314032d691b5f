"""The gradient a skipped expert's own parameters get: none, as in eager.

A loop that skips an expert with no tokens (speculation.py) never runs that expert's body in eager, so its own
parameters (an ``nn.Linear`` per expert) get no gradient from the step: ``p.grad`` stays None, or keeps what an
earlier step left. The rewrite runs every expert as one op, whose backward gives those parameters zeros. The values
agree, but optimisers do not: a zero gradient still moves a parameter through momentum and weight decay, where
None skips it. So the rewritten graph also returns, per skipped-if-empty body, whether its expert got rows, and
each such parameter enters the compiled graph through ``_KeepIfHit``, whose backward hands on the gradient only
where the expert got rows and otherwise hands on none (autograd then leaves ``p.grad`` as it was, as eager does).

The flags are read once per backward (one host sync; eager's loop synced once per expert in its forward). The gate
is built only where gradients are on and a speculated body owns inputs that require them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.fx import GraphModule


@dataclass(frozen=True)
class Gated:
    """Graph input ``position`` gets a gradient only where hit flag ``slot`` (an extra, last graph output) is set."""

    position: int
    slot: int


class _Flags:
    """One call's hit flags: set after the forward, read (once) by the first backward that needs them."""

    def __init__(self) -> None:
        self.flags: Optional[torch.Tensor] = None
        self._read: Optional[list] = None

    def hit(self, slot: int) -> bool:
        if self._read is None:
            self._read = self.flags.tolist()
        return bool(self._read[slot])


class _KeepIfHit(torch.autograd.Function):
    """The identity on a parameter; its backward passes the gradient on only where the expert got rows."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, flags: _Flags, slot: int) -> torch.Tensor:
        ctx.flags, ctx.slot = flags, slot
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (grad if ctx.flags.hit(ctx.slot) else None), None, None


def add_hit_flags(gm: GraphModule, speculations: list) -> list[Gated]:
    """Append to ``gm``'s outputs one bool vector: for each speculation whose body owns inputs that need gradients
    (``Speculation.own``), whether its expert got rows (``(ids == e).any()``, or ``M[..., e].any()``). Returns the
    gated inputs; [] (and ``gm`` unchanged) where there are none. Raises LookupError where a named node is gone
    (the caller falls back)."""
    from .passes.kept_masks import kept_choices

    owning = [s for s in speculations if getattr(s, "own", None)]
    if not owning:
        return []
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    outs = output.args[0]
    if not isinstance(outs, (tuple, list)):
        raise LookupError("the graph's output is not a tuple")
    gated = []
    with graph.inserting_before(output):
        flags = []
        for slot, s in enumerate(owning):
            ids_name, e, same = s.counted
            # a rewrite may keep another node that computes the same ids (the loop recomputed them in every body)
            ids = next((nodes[name] for name in (ids_name, *same) if name in nodes), None)
            if ids is None:
                raise LookupError(f"the ids {ids_name} the count counts are gone from the rewritten graph")
            # expert e's rows: ``ids == e``, or the column e of a one-hot with the router's drops in it (whose count
            # is of the rows kept, passes/kept_masks.py)
            rows = (graph.call_method("select", (ids, -1, e)) if kept_choices(ids) is not None
                    else graph.call_function(operator.eq, (ids, e)))
            flags.append(graph.call_function(torch.any, (rows,)))
            for name in s.own:
                p = nodes.get(name)
                if p is None or p.op != "placeholder":
                    raise LookupError(f"the input {name} is gone from the rewritten graph")
                gated.append(Gated(placeholders.index(p), slot))
        stacked = graph.call_function(torch.stack, (flags,))
    output.args = (type(outs)((*outs, stacked)),)
    gm.recompile()
    return gated


def wrap(compiled: Callable, gated: list[Gated]) -> Callable:
    """``compiled`` (whose last output is the hit flags) as the graph Dynamo traced: the gated inputs go in through
    ``_KeepIfHit``, and the flags are taken off the outputs."""

    def run(*args: Any) -> Any:
        flags = _Flags()
        if torch.is_grad_enabled():
            args = list(args)
            for g in gated:
                if isinstance(args[g.position], torch.Tensor) and args[g.position].requires_grad:
                    args[g.position] = _KeepIfHit.apply(args[g.position], flags, g.slot)
        out = compiled(*args)
        flags.flags = out[-1]
        return type(out)(out[:-1]) if isinstance(out, tuple) else out[:-1]

    return run
