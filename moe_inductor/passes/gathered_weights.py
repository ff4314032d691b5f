"""Form "gathered_weights": expert weights gathered per token, then einsum (gpt-fast's ConditionalFeedForward).

The user code this matches (subscript letters, spacing and operand order may differ):

    w1_sel, w3_sel, w2_sel = w1[ids], w3[ids], w2[ids]              # (T, k, I, H): T*k copies of expert weights
    h = F.silu(torch.einsum("ti,taoi->tao", x, w1_sel)) * torch.einsum("ti,taoi->tao", x, w3_sel)
    out = torch.einsum("tao,taio->tai", h, w2_sel)
    y = torch.einsum("tai,ta->ti", out, weights)                     # or (out * weights[..., None]).sum(1)

It becomes one ``moe_inductor::experts_forward`` on the un-gathered weights. The gate factor may be absent (a plain
activation) and the weights may be stored (E, out, in) or (E, in, out). Anything that does not line up exactly
(another user of an intermediate, a different contraction, mismatched ids) is left alone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from ..capture import Rewrite

FORM = "gathered_weights"


def _val(node) -> Optional[torch.Tensor]:
    """The fake tensor Dynamo traced for ``node`` (``example_value`` in Dynamo graphs, ``val`` after aot)."""
    if not isinstance(node, Node):
        return None
    v = node.meta.get("val", node.meta.get("example_value"))
    return v if isinstance(v, torch.Tensor) else None


def _einsum(node: Node) -> Optional[tuple[list[str], str, list[Node]]]:
    """(input subscripts, output subscripts, operands) of an einsum node with an explicit output."""
    if node.op != "call_function" or node.target is not torch.functional.einsum and node.target is not torch.einsum:
        return None
    if not node.args or not isinstance(node.args[0], str) or node.kwargs:
        return None
    eq = node.args[0].replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->")
    subs = lhs.split(",")
    operands = list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if len(subs) != len(operands) or not all(isinstance(o, Node) for o in operands):
        return None
    return subs, out, operands


def _gathered(node: Node) -> Optional[tuple[Node, Node]]:
    """(weight, ids) if ``node`` is ``weight[ids]`` with a 3D float weight and integer ids."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return None
    w, ids = node.args
    wv, iv = _val(w), _val(ids)
    if wv is None or iv is None or wv.dim() != 3 or not wv.is_floating_point() or iv.dtype.is_floating_point:
        return None
    if iv.dtype == torch.bool or iv.dim() != 2:
        return None
    return w, ids


@dataclass
class _Projection:
    weight: Node
    ids: Node
    x: Node
    layout: str  # "nk": (E, out, in); "kn": (E, in, out)


def _projection(node: Node, x_subs_len: int = 2) -> Optional[_Projection]:
    """``einsum("ti,taoi->tao", x, w[ids])`` (either layout, either operand order) -> its parts."""
    parsed = _einsum(node)
    if parsed is None:
        return None
    subs, out, ops = parsed
    if len(ops) != 2:
        return None
    for xi, wi in ((0, 1), (1, 0)):
        g = _gathered(ops[wi])
        if g is None or len(subs[xi]) != x_subs_len or len(subs[wi]) != 4:
            continue
        t, a, p, q = subs[wi]
        xs = subs[xi]
        if len(set(subs[wi])) != 4 or xs[0] != t:
            continue
        contracted = xs[-1]
        if x_subs_len == 2 and contracted in (p, q) and out == t + a + (q if contracted == p else p):
            return _Projection(g[0], g[1], ops[xi], "kn" if contracted == p else "nk")
        if x_subs_len == 3 and xs[1] == a and contracted in (p, q) and out == t + a + (q if contracted == p else p):
            return _Projection(g[0], g[1], ops[xi], "kn" if contracted == p else "nk")
    return None


_UNARY = {F.silu: "silu", F.relu: "relu", torch.relu: "relu"}


def _activation(node: Node) -> Optional[tuple[str, Node]]:
    if node.op != "call_function":
        return None
    if node.target is F.gelu:
        approx = node.kwargs.get("approximate", "none")
        if set(node.kwargs) - {"approximate"} or approx not in ("none", "tanh"):
            return None
        return ("gelu" if approx == "none" else "gelu_tanh"), node.args[0]
    name = _UNARY.get(node.target)
    if name is None or len(node.args) != 1 or set(node.kwargs) - {"inplace"} or node.kwargs.get("inplace"):
        return None
    return name, node.args[0]


def _single_use(*nodes: Node) -> bool:
    return all(len(n.users) == 1 for n in nodes)


@dataclass
class GatheredMoE:
    y: Node
    x: Node
    ids: Node
    weights: Node
    gate: Node
    up: Optional[Node]
    down: Node
    layout: str
    activation: str
    chain: tuple


def _combine(y: Node) -> Optional[tuple[Node, Node]]:
    """(per-choice outputs (T, k, H), routing weights (T, k)) of ``einsum("tai,ta->ti")`` or ``(o * w[..., None]).sum(1)``."""
    parsed = _einsum(y)
    if parsed is not None:
        subs, out, ops = parsed
        if len(ops) != 2:
            return None
        for oi, wi in ((0, 1), (1, 0)):
            if len(subs[oi]) == 3 and len(subs[wi]) == 2 and subs[wi] == subs[oi][:2] and out == subs[oi][0] + subs[oi][2]:
                return ops[oi], ops[wi]
        return None
    if y.op == "call_method" and y.target == "sum" and len(y.args) >= 1:
        dim = y.args[1] if len(y.args) > 1 else y.kwargs.get("dim")
        if dim != 1 or y.kwargs.get("keepdim", False) or isinstance(y.args[0], Node) is False:
            return None
        prod = y.args[0]
        if prod.op != "call_function" or prod.target is not operator.mul or not _single_use(prod):
            return None
        for o, w in (prod.args, prod.args[::-1]):
            base = _unsqueezed_last(w)
            if isinstance(o, Node) and base is not None and _single_use(w):
                return o, base
        return None
    return None


def _unsqueezed_last(node) -> Optional[Node]:
    """``w`` for ``w[..., None]`` or ``w.unsqueeze(-1)`` (w 2D)."""
    if not isinstance(node, Node) or not node.args:
        return None
    base = node.args[0]
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == (Ellipsis, None):
        return base
    if node.op == "call_method" and node.target == "unsqueeze" and (node.args[1:] or (node.kwargs.get("dim"),))[0] in (-1, 2):
        return base
    return None


def _where(node: Node) -> str:
    """``file:line: code`` of the user's source for a node, from Dynamo's stack trace, else the node name."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        head = lines[i].strip()
        if head.startswith('File "') and ", line " in head:
            path = head[len('File "'):head.index('"', len('File "'))]
            lineno = head.split(", line ")[1].split(",")[0]
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{path.rsplit('/', 1)[-1]}:{lineno}: {code}"
    return node.name


def match(y: Node) -> Optional[GatheredMoE]:
    combined = _combine(y)
    if combined is None:
        return None
    out, weights = combined
    down = _projection(out, x_subs_len=3)
    if down is None or not _single_use(out):
        return None
    h = down.x
    gate_node, up_node = None, None
    if h.op == "call_function" and h.target is operator.mul and len(h.args) == 2:
        for a, b in (h.args, h.args[::-1]):
            if isinstance(a, Node) and isinstance(b, Node) and _activation(a) is not None:
                gate_node, up_node = a, b
                break
    else:
        gate_node = h
    act = _activation(gate_node) if gate_node is not None else None
    if act is None:
        return None
    activation, gate_in = act
    gate = _projection(gate_in)
    up = _projection(up_node) if up_node is not None else None
    if gate is None or (up_node is not None and up is None):
        return None
    projections = [p for p in (gate, up, down) if p is not None]
    if any(p.ids is not gate.ids for p in projections) or any(p.layout != gate.layout for p in projections):
        return None
    if up is not None and up.x is not gate.x:
        return None
    chain = [out, h, gate_node, gate_in, down.x] + ([up_node] if up_node is not None else [])
    if not _single_use(*{id(n): n for n in chain}.values()):
        return None
    ids_val, w_val, x_val = _val(gate.ids), _val(weights), _val(gate.x)
    if ids_val is None or w_val is None or x_val is None or x_val.dim() != 2 or tuple(w_val.shape) != tuple(ids_val.shape):
        return None
    return GatheredMoE(y, gate.x, gate.ids, weights, gate.weight, up.weight if up else None, down.weight,
                       gate.layout, f"{activation}_glu" if up is not None else activation, tuple(chain))


def rewrite(gm: GraphModule) -> list[Rewrite]:
    """Replace every provable gathered-weights MoE in ``gm``; returns what was rewritten."""
    done = []
    for node in list(gm.graph.nodes):
        m = match(node)
        if m is None:
            continue
        y_val = _val(m.y)
        # Dynamo compiles under the grad mode it traced in (and guards on it), so it is the mode the op runs in
        save_pre = torch.is_grad_enabled() and any(
            v is not None and v.requires_grad for v in map(_val, (m.x, m.weights, m.gate, m.up, m.down)))
        graph = gm.graph
        with graph.inserting_before(m.y):
            # views of the un-gathered weights in the op's (E, K, N) form; nothing is copied
            views = [None if w is None else graph.call_method("transpose", (w, 1, 2)) if m.layout == "nk" else w
                     for w in (m.gate, m.up, m.down)]
            weights = graph.call_method("to", (m.weights, _val(m.x).dtype))
            op = graph.call_function(torch.ops.moe_inductor.experts_forward.default, (
                m.x, m.ids, weights, views[0], views[1], views[2], None, None, None, m.activation, "output",
                1.702, 7.0, None, save_pre))
            new = graph.call_function(operator.getitem, (op, 0))
            if y_val is not None and y_val.dtype != _val(m.x).dtype:
                new = graph.call_method("to", (new, y_val.dtype))
        m.y.replace_all_uses_with(new)
        gate_val, down_val = _val(m.gate), _val(m.down)
        per_choice = sum(v[0].numel() * v.element_size() for v in map(_val, (m.gate, m.up, m.down)) if v is not None)
        done.append(Rewrite(FORM, _where(m.y), int(gate_val.shape[0]), int(_val(m.ids).shape[-1]), m.activation,
                            (tuple(gate_val.shape), tuple(down_val.shape)),
                            note=f"avoids gathering T*k x {per_choice / 2**10:.1f} KiB of expert weights per call"))
    if done:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return done
