"""Form "dense_experts", expert-major: every token repeated once per expert, a bmm over the experts, the outputs
scaled by the transposed routing matrix and summed over the experts (transformers v4.55-4.57's GPT-OSS and
Qwen3-VL-MoE experts at inference). The user code this matches::

    xs = x.repeat(E, 1).view(E, -1, H)                                    # (E, T, H): every token for every expert
    gate, up = torch.bmm(xs, gate_up_proj).chunk(2, dim=-1)               # gate_up_proj (E, H, 2I)
    out = torch.bmm(up * act(gate), down_proj)                            # (E, T, H): E times the needed work
    out = out.view(E, B, -1, H) * routing.transpose(0, 1).view(E, B, -1)[..., None]
    y = out.sum(dim=0)                                                    # (B, S, H)

``routing`` is zeros scattered with topk ids (``dense_experts._topk_scatter``), so the mix is exact over the top-k
alone, as in the token-major spelling: expert e's output reaches token t only through routing[t, e]. The two views
split the token dim alike (the same (E, *rows) shape from (E, T)), so row t of the outputs meets row t of the
routing. The op's (T, H) result is reshaped to y's shape. GPT-OSS adds (E, N) biases to both bmm outputs
(``+ b[..., None, :]``), reads its fused gate/up columns interleaved and applies its clamped glu: the op takes those
as they are (``b2`` is added before the routing weight, as here).
"""
from __future__ import annotations

import operator
from typing import Optional, Union

import torch
from torch.fx import Node

from ..spec import MoESpec
from .driver import Match
from .fx_utils import column_of, is_call, known_equal, single_use, val


def _summed_dim0(y: Node) -> Optional[Node]:
    """What ``y = t.sum(dim=0)`` (or ``.sum(0)``, no keepdim) sums; else None."""
    if not (is_call(y, "call_method", "sum") and isinstance(y.args[0], Node)):
        return None
    dim = y.args[1] if len(y.args) > 1 else y.kwargs.get("dim")
    if len(y.args) > 2 or set(y.kwargs) - {"dim", "keepdim"} or y.kwargs.get("keepdim", False) or dim not in (0, (0,)):
        return None
    return y.args[0]


def _summed_over_experts(y: Node) -> Optional[Node]:
    """The product summed by ``y = prod.sum(dim=0)`` (or ``.sum(0)``), used once; else None."""
    prod = _summed_dim0(y)
    if prod is None:
        return None
    if not (is_call(prod, "call_function", operator.mul) and len(prod.args) == 2 and not prod.kwargs
            and single_use(prod)):
        return None
    return prod


def _rows_view(node: Node, source: Node) -> bool:
    """``node`` is ``source`` itself or a view / reshape of it that splits its dim 1 and keeps dims 0 and -1."""
    if node is source:
        return True
    if not (is_call(node, "call_method", "view", "reshape") and node.args[0] is source):
        return False
    nv, sv = val(node), val(source)
    if nv is None or sv is None or nv.dim() < 3 or sv.dim() != 3:
        return False
    return known_equal(nv.shape[0], sv.shape[0]) and known_equal(nv.shape[-1], sv.shape[-1])


def _biased_bmm(node: Node) -> Optional[tuple[Node, Node, str, Optional[Node]]]:
    """(input (E, T, K), weight, layout, bias or None) for ``torch.bmm(a, w)`` (``dense_experts._bmm_projection``)
    plus, maybe, an (E, N) bias read as (E, 1, N) (``b[..., None, :]``, ``b[:, None]``, ``b.unsqueeze(1)``)."""
    from .dense_experts import _bmm_projection

    plain = _bmm_projection(node)
    if plain is not None:
        return (*plain, None)
    if not (is_call(node, "call_function", operator.add) and len(node.args) == 2 and not node.kwargs):
        return None
    for mm, bias_view in (node.args, node.args[::-1]):
        proj = _bmm_projection(mm) if isinstance(mm, Node) else None
        bias = _expert_bias(bias_view) if proj is not None and isinstance(bias_view, Node) else None
        if bias is None or not single_use(mm):
            continue
        bv, mv = val(bias), val(mm)
        if known_equal(bv.shape[0], mv.shape[0]) and known_equal(bv.shape[1], mv.shape[2]):
            return (*proj, bias)
    return None


def _expert_bias(view: Node) -> Optional[Node]:
    """b (E, N), a parameter, for its (E, 1, N) view: an index of Nones and full slices, ``unsqueeze(1)``, or a
    ``view`` / ``reshape`` whose result is (E, 1, N)."""
    b = view.args[0] if view.args and isinstance(view.args[0], Node) else None
    bv, vv = (val(b), val(view)) if b is not None else (None, None)
    if bv is None or vv is None or bv.dim() != 2 or vv.dim() != 3 or b.op not in ("placeholder", "get_attr"):
        return None
    if not all(known_equal(a, c) for a, c in zip(vv.shape, (bv.shape[0], 1, bv.shape[1]))):
        return None
    index = view.args[1] if len(view.args) == 2 else None
    ok = (is_call(view, "call_function", operator.getitem) and index in ((Ellipsis, None, slice(None)),
                                                                          (slice(None), None, slice(None)),
                                                                          (slice(None), None)))
    ok = ok or (is_call(view, "call_method", "unsqueeze") and view.args[1:] in ((1,), (-2,)))
    ok = ok or is_call(view, "call_method", "view", "reshape")
    return b if ok else None


def _transposed_routing(scale: Node) -> Optional[tuple[Node, Node]]:
    """(routing (T, E), its (E, *rows) view) for ``routing.transpose(0, 1)`` (or ``.t()``, ``.T``), maybe viewed
    (E, *rows), read with a trailing size-1 axis (``[..., None]``, ``.unsqueeze(-1)``)."""
    sv = val(scale)
    if sv is None or sv.dim() < 3:
        return None
    viewed = column_of(scale, sv.dim() - 1)
    if viewed is None:
        return None
    transposed = viewed
    if is_call(viewed, "call_method", "view", "reshape") and isinstance(viewed.args[0], Node):
        transposed = viewed.args[0]
    if not ((is_call(transposed, "call_method", "transpose") and set(transposed.args[1:]) in ({0, 1}, {0, -1}))
            or (is_call(transposed, "call_method", "t") and len(transposed.args) == 1)
            or (is_call(transposed, "call_function", getattr) and transposed.args[1:] == ("T",))):
        return None
    routing = transposed.args[0]
    rv = val(routing)
    if not isinstance(routing, Node) or rv is None or rv.dim() != 2:
        return None
    return routing, viewed


def _repeat_of(rep, xs: Node, num_experts, hidden) -> Optional[Node]:
    """x (T, H) where ``rep`` is ``x.repeat(E, 1)`` and ``xs``, what the experts read of it, is (E, T, H)."""
    if not (isinstance(rep, Node) and is_call(rep, "call_method", "repeat") and len(rep.args) == 3
            and not rep.kwargs):
        return None
    x = rep.args[0]
    xv, sv = val(x), val(xs)
    if not isinstance(x, Node) or xv is None or xv.dim() != 2 or sv is None or sv.dim() != 3:
        return None
    if not (known_equal(rep.args[1], num_experts) and rep.args[2] == 1):
        return None
    if not all(known_equal(a, b) for a, b in zip(sv.shape, (num_experts, xv.shape[0], hidden))):
        return None
    return x


def _repeated_tokens(xs: Node, num_experts, hidden) -> Optional[Node]:
    """x (T, H) for ``x.repeat(E, 1).view(E, -1, H)`` (or ``.reshape``, or ``(E, T, H)`` said whole)."""
    if not (is_call(xs, "call_method", "view", "reshape") and isinstance(xs.args[0], Node)):
        return None
    return _repeat_of(xs.args[0], xs, num_experts, hidden)


def _result_shape(y: Node) -> Union[tuple, str]:
    """The sizes to reshape the op's (T, H) result to ``y``'s shape, with -1 for its one symbolic size (if any)."""
    yv = val(y)
    sizes = tuple(yv.shape)
    symbolic = [i for i, s in enumerate(sizes) if not isinstance(s, int)]
    if len(symbolic) > 1:
        return "the result has more than one symbolic size: its shape cannot be said to the op's reshape"
    return tuple(-1 if i in symbolic else s for i, s in enumerate(sizes))


def _summed_outputs(y: Node) -> Optional[Node]:
    """The bmm whose (E, T, H) output ``y = out.sum(dim=0)`` sums, through views that give it back its own shape
    (``bmm(...).view(-1, H).reshape(E, -1, H)``), each used once; else None."""
    out = _summed_dim0(y)
    if out is None:
        return None
    shaped = val(out)
    while is_call(out, "call_method", "view", "reshape") and isinstance(out.args[0], Node) and single_use(out):
        out = out.args[0]
    ov = val(out)
    if shaped is None or ov is None or ov.dim() != 3 or shaped.dim() != 3:
        return None
    if not all(known_equal(a, b) for a, b in zip(ov.shape, shaped.shape)):
        return None
    return out if is_call(out, "call_function", torch.bmm) and single_use(out) else None


def _scaled_repeat(xs: Node, num_experts, hidden) -> Optional[tuple[Node, Node]]:
    """(x (T, H), the scale) for ``(x.repeat(E, 1) * scale).view(E, -1, H)``, the scale in either operand."""
    if not (is_call(xs, "call_method", "view", "reshape") and isinstance(xs.args[0], Node)):
        return None
    prod = xs.args[0]
    if not (is_call(prod, "call_function", operator.mul) and len(prod.args) == 2 and not prod.kwargs
            and single_use(prod)):
        return None
    for rep, scale in (prod.args, prod.args[::-1]):
        x = _repeat_of(rep, xs, num_experts, hidden) if isinstance(scale, Node) else None
        if x is not None:
            return x, scale
    return None


def match_input_scaled(y: Node) -> Union[Match, str, None]:
    """transformers v4.52-4.57's Llama 4 experts: every token repeated once per expert and scaled by its (E, T)
    score, zero off the top-k, BEFORE the experts; bmm over the experts; summed over E::

        xs = x.repeat(E, 1) * table.transpose(0, 1).reshape(-1, 1)        # table: sigmoid of a -inf scatter
        gate, up = torch.bmm(xs.view(E, -1, H), gate_up_proj).chunk(2, dim=-1)
        y = torch.bmm(up * act(gate), down_proj).view(-1, H).reshape(E, -1, H).sum(dim=0)

    A zero score gives a zero input, and every expert read here maps zero to zero (no bias; every activation the
    reads take has act(0) = 0), so only the top-k contribute: the op with the weight on the input."""
    from .dense_experts import _bmm_projection, _fewer_flops, read_bmm_experts
    from .score_tables import expert_major_scores

    bmm = _summed_outputs(y)
    down = _bmm_projection(bmm) if bmm is not None else None
    if down is None:
        return None
    h, w_down, layout = down
    bv = val(bmm)
    num_experts, hidden = bv.shape[0], bv.shape[2]
    gated = read_bmm_experts(h, _bmm_projection, layout)
    if isinstance(gated, str):
        return gated
    gate, up = gated.gate, gated.up
    found = _scaled_repeat(gate[0], num_experts, hidden)
    if found is None:
        return None  # not tokens repeated per expert: another spelling's, or no MoE
    x, scale = found
    routed = expert_major_scores(scale)
    if routed is None:
        return "the repeated tokens are not scaled by a flattened (E, T) table of scores"
    if isinstance(routed, str):
        return routed
    ids = routed.ids
    if not (known_equal(val(routed.expert_major).shape[0], num_experts)
            and known_equal(val(routed.expert_major).shape[1], val(x).shape[0])
            and known_equal(val(ids).shape[0], val(x).shape[0])):
        return "the score table is not (E, T) for the experts' (E, T, H) tokens"
    spec = MoESpec(x, ids, routed.values, gate[1], up[1] if up else None, w_down, layout, gated.activation,
                   weight_position="input", **gated.spec_fields())
    return Match(spec, y, note=_fewer_flops(spec) + "; routing weight on the input", derive=routed.derive())


def match_repeated(y: Node) -> Union[Match, str, None]:
    """The expert-major dense MoE ending at ``y`` (module docstring); or why not where ``y`` sums every expert's
    bmm output scaled by a transposed routing matrix (the form's mark); None otherwise. Llama 4's spelling, the
    weight on the repeated input, is ``match_input_scaled``."""
    from .dense_experts import _fewer_flops, _topk_scatter, read_bmm_experts

    prod = _summed_over_experts(y)
    if prod is None:
        return match_input_scaled(y)
    for out_view, scale in (prod.args, prod.args[::-1]):
        if not isinstance(out_view, Node) or not isinstance(scale, Node):
            continue
        routed_view = _transposed_routing(scale)
        bmm = out_view.args[0] if is_call(out_view, "call_method", "view", "reshape") else out_view
        down = _biased_bmm(bmm) if isinstance(bmm, Node) else None
        if routed_view is not None and down is not None and _rows_view(out_view, bmm):
            break
    else:
        return None
    routing, viewed = routed_view
    h, w_down, layout, b2 = down
    ov, rv, bv = val(out_view), val(viewed), val(bmm)
    num_experts, hidden = bv.shape[0], bv.shape[2]
    if not (ov.dim() == rv.dim() + 1 and all(known_equal(a, b) for a, b in zip(ov.shape[:-1], rv.shape))):
        return "the experts' outputs and the routing matrix split the tokens differently"
    if not (known_equal(val(routing).shape[1], num_experts) and known_equal(val(routing).shape[0], bv.shape[1])):
        return "the routing matrix is not (T, E) for the experts' (E, T, H) outputs"
    if not single_use(bmm) or (out_view is not bmm and not single_use(out_view)):
        return "the experts' (E, T, H) outputs are used elsewhere too"
    routed = _topk_scatter(routing)
    if routed is None:
        return ("the (T, E) mixing matrix is not zeros scattered with topk ids (a soft mixture of every expert is "
                "not sparse: nothing to skip)")
    gated = read_bmm_experts(h, _biased_bmm, layout)
    if isinstance(gated, str):
        return gated
    gate, up = gated.gate, gated.up
    x = _repeated_tokens(gate[0], num_experts, hidden)
    if x is None:
        return "the experts' input is not the tokens repeated once per expert (x.repeat(E, 1).view(E, -1, H))"
    ids, values = routed
    if not known_equal(val(ids).shape[0], val(x).shape[0]):
        return "the tokens and the routing matrix do not agree in T"
    shape = _result_shape(y)
    if isinstance(shape, str):
        return shape
    if up is not None and up[3] is not None:
        return "the up projection has a bias of its own beside the gate's"
    spec = MoESpec(x, ids, values, gate[1], up[1] if up else None, w_down, layout, gated.activation,
                   b1=gate[3], b2=b2, **gated.spec_fields())
    return Match(spec, y, note=_fewer_flops(spec), result_shape=shape)
