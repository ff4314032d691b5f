"""The gating half of the padded-capacity proof (``padded_capacity.py`` has the dispatch, experts and combine): a
(T, E, C) combine is proven to be a sum over choices j of ``gate_j * mask_j ⊗ one_hot(slot_j, C)``, each mask a
one-hot over experts with GShard's capacity drop, choice j queued behind the choices before it.

The user code this reads (top-2, fairseq's and GShard's order):

    mask1 = F.one_hot(idx1, E); mask2 = F.one_hot(idx2, E)
    loc1 = torch.cumsum(mask1, 0) - 1
    loc2 = torch.cumsum(mask2, 0) - 1 + torch.sum(mask1, 0, keepdim=True)
    mask1 = mask1 * torch.lt(loc1, C); mask2 = mask2 * torch.lt(loc2, C)
    slot1 = F.one_hot((loc1 * mask1).sum(1), C); slot2 = F.one_hot((loc2 * mask2).sum(1), C)
    combine = g1[:, None, None] * mask1[:, :, None] * slot1[:, None, :] + g2[:, None, None] * (...)

Spellings read here:

- one-hots: ``F.one_hot(i, N)``, or a zeros (T, N) buffer with one ``scatter_(1, i[:, None], 1)`` (fairseq's
  ``one_hot``), read through the buffer or through the scatter's result;
- queue positions: ``cumsum(m, 0) - 1`` plus ``sum(m_i, 0, keepdim=True)`` of each earlier choice, ``+`` or ``+=``;
- drops: ``m * lt(loc, C)`` or ``m *= lt(loc, C)``; none for a first choice into C >= T slots (its positions are
  below T), its mask a one-hot or one times a tensor of ones (Hunyuan-Large's ``topk(m, k=T, dim=0)`` + ``scatter_``
  keep, ``covers``);
- terms: products of (T, 1, 1), (T, E, 1) and (T, 1, C) tensors, ``bmm((T, E, 1), (T, 1, C))`` (fairseq) and
  ``einsum("se,sc->sec", g, s)`` (DeepSpeed); the gate a (T,) or (T, 1) factor of the mask, or a (T, E) one
  (DeepSpeed's ``gates * mask``: with one kept expert per row it is ``gates[t, i_t] * mask``).

In-place arithmetic is read as its functional value (``versions_sound`` proves that every read sees the value the
proof gives it), so ``+=``, ``*=`` and ``/=`` spellings are the same proofs as ``+``, ``*`` and ``/``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch
from torch.fx import Node

from ..shape_tensors import shape_value
from .aliases import alias_mutations
from .fx_utils import ONE_HOT, einsum_parts, reach, same_traced, val

_MUL = (operator.mul, torch.mul, operator.imul, "mul_")
_ADD = (operator.add, torch.add, operator.iadd, "add_")
_SUB = (operator.sub, torch.sub, operator.isub, "sub_")
_CASTS = ("float", "double", "half", "bfloat16", "long", "int", "bool")
_ZEROS = (torch.zeros, torch.zeros_like)


def call(node: Any, *targets) -> bool:
    """``node`` is a call of one of ``targets`` (functions or method names)."""
    return isinstance(node, Node) and node.op in ("call_function", "call_method") and node.target in targets


def shape(node: Any) -> Optional[tuple]:
    v = val(node) if isinstance(node, Node) else None
    return tuple(v.shape) if v is not None else None


def shaped(node: Any, want: tuple) -> bool:
    """``node``'s traced shape is ``want`` (sizes compared as ints or as one symbolic expression, never guarded)."""
    s = shape(node)
    return s is not None and len(s) == len(want) and all(same_traced(a, b) for a, b in zip(s, want))


def dims(node: Node) -> tuple:
    """The dims of ``x.permute(1, 0)`` / ``x.permute((1, 0))`` / ``x.transpose(0, 1)``, packed or not, as a tuple."""
    args = node.args[1:]
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else tuple(args)


def binary(node: Any, targets: tuple) -> Optional[tuple]:
    """(a, b) for ``a op b`` with op one of ``targets``, in-place spellings (``a op= b``, ``a.op_(b)``) included."""
    if call(node, *targets) and len(node.args) == 2 and not node.kwargs:
        return node.args
    return None


def strip_casts(node: Any, zero_one: bool = False) -> Any:
    """The tensor under dtype casts. ``zero_one`` is for tensors of 0s and 1s (masks, one-hots), where every cast is
    exact; otherwise only float-to-float casts go (the emitter casts the routing weights to x's dtype the same way)."""
    while isinstance(node, Node) and node.args and isinstance(node.args[0], Node) and not node.kwargs:
        is_cast = (node.op == "call_method" and (
            (node.target == "to" and len(node.args) == 2 and isinstance(node.args[1], torch.dtype))
            or (node.target == "type_as" and len(node.args) == 2)
            or (node.target in _CASTS and len(node.args) == 1)))
        if not is_cast:
            break
        if not zero_one:
            src, dst = val(node.args[0]), val(node)
            if src is None or dst is None or not (src.is_floating_point() and dst.is_floating_point()):
                break
        node = node.args[0]
    return node


def new_axis(node: Any) -> Optional[tuple[Node, int]]:
    """(base, d) when ``node`` is ``base`` with one new axis at position d of a 3D result."""
    if not isinstance(node, Node) or not node.args or not isinstance(node.args[0], Node):
        return None
    base = node.args[0]
    if call(node, "unsqueeze", torch.unsqueeze) and len(node.args) == 2 and not node.kwargs:
        return base, node.args[1] % 3
    if call(node, operator.getitem) and isinstance(node.args[1], tuple):
        index = node.args[1]
        if len(index) == 3 and index.count(None) == 1 and all(i is None or i == slice(None) for i in index):
            return base, index.index(None)
    return None


def column_base(node: Any) -> Any:
    """``i`` for the (T, 1) column ``i.unsqueeze(-1)`` / ``i[:, None]`` / ``i.view(-1, 1)`` of a (T,) ``i``."""
    if not isinstance(node, Node) or not node.args or not isinstance(node.args[0], Node):
        return node
    base, args = node.args[0], node.args[1:]
    if shape(base) is None or len(shape(base)) != 1 or node.kwargs:
        return node
    if call(node, "unsqueeze", torch.unsqueeze) and args in ((1,), (-1,)):
        return base
    if call(node, operator.getitem) and args in (((slice(None), None),), ((Ellipsis, None),)):
        return base
    if call(node, "view", "reshape") and args in ((-1, 1),):
        return base
    return node


def same_size(handle: Any, size: Any) -> bool:
    """``handle`` (an int in the graph, or the node of a symbolic size) is the size ``size`` of a traced tensor."""
    if isinstance(handle, int) and not isinstance(handle, bool):
        return isinstance(size, int) and handle == size
    traced = handle.meta.get("example_value", handle.meta.get("val")) if isinstance(handle, Node) else None
    if isinstance(traced, torch.Tensor):  # a 0-d shape tensor (DeepSpeed's capacity): its exact value, which is
        # one expression for every size the guards admit, so it matches an equal int or an equal expression only
        exact = shape_value(handle)
        if isinstance(exact, torch.SymInt) and isinstance(size, torch.SymInt):
            return str(exact.node.expr) == str(size.node.expr)
        return type(exact) is int and type(size) is int and exact == size
    return isinstance(traced, torch.SymInt) and same_traced(traced, size)


def size_node(anchor: Node, size: Any, held: Any = None) -> Any:
    """The op's capacity argument for a slots' C of ``size``: the int, or a node defined before ``anchor`` whose
    traced value is that symbolic size (``held``, the capacity as the drop wrote it, when it is such a node; else
    the first such node of the graph: the SymInt placeholder or size expression Dynamo passed to the slots'
    one_hot). None when no node holds it: a 0-d capacity tensor (DeepSpeed's) is a tensor, not an int; read as one
    by a compiled graph it turns into garbage, and its ``.item()`` would be a host sync."""
    if type(size) is int:
        return size
    for n in ([held] if isinstance(held, Node) else []) + list(anchor.graph.nodes):
        if n is anchor:
            break
        traced = n.meta.get("example_value", n.meta.get("val"))
        if isinstance(traced, torch.SymInt) and same_traced(traced, size):
            return n
    return None


@dataclass(frozen=True)
class OneHot:
    """A one-hot over ``classes`` of the (T,) or (T, 1) integer ``idx``; ``key`` is the tensor every spelling of it
    reads (the scatter's zeros buffer), ``fill`` the scatter that fills that buffer (None for ``F.one_hot``)."""

    idx: Node
    classes: Any  # a handle as the graph holds it (``F.one_hot``), or a traced size (the buffer's)
    key: Node
    fill: Optional[Node] = None

    def has_classes(self, size: Any) -> bool:
        return same_size(self.classes, size) if self.fill is None else same_traced(self.classes, size)


def _zeros(node: Any) -> bool:
    if not (call(node, *_ZEROS, "new_zeros") and node.args):
        return False
    return set(node.kwargs) <= {"dtype", "device", "layout", "requires_grad", "pin_memory", "memory_format"}


def one_hot(node: Any) -> Optional[OneHot]:
    """The one-hot ``node`` is (0/1 casts stripped), or None."""
    node = strip_casts(node, zero_one=True)
    if call(node, *ONE_HOT) and isinstance(node.args[0], Node):
        classes = node.kwargs.get("num_classes", node.args[1] if len(node.args) > 1 else None)
        return OneHot(node.args[0], classes, node)
    if _zeros(node):  # the buffer, read after its one write
        fills = [u for u in node.users if u.op == "call_method" and u.target == "scatter_" and u.args[0] is node]
        fill = fills[0] if len(fills) == 1 else None
    else:
        fill = node if call(node, "scatter_", "scatter") and node.args and _zeros(node.args[0]) else None
    if fill is None or len(fill.args) != 4 or fill.kwargs or fill.args[1] not in (1, -1) or fill.args[3] != 1:
        return None
    buf, index = fill.args[0], fill.args[2]
    bv, iv = val(buf), val(index) if isinstance(index, Node) else None
    if bv is None or iv is None or bv.dim() != 2 or iv.dim() != 2 or iv.shape[1] != 1 or iv.dtype != torch.int64:
        return None
    if not same_traced(iv.shape[0], bv.shape[0]):
        return None
    # the functional scatter's result is the one-hot; an in-place one fills the buffer that its readers read
    return OneHot(index, bv.shape[1], fill if fill.target == "scatter" else buf, fill)


@dataclass
class Choice:
    """One choice of every token: expert ``idx`` with weight ``gate`` ((T, 1, 1), (T, 1) or (T,)) or, when
    ``full`` is set, the weight ``full[t, idx[t]]`` of a (T, E) gate; dropped past ``capacity`` (as the graph holds
    it) at the queue positions ``loc``."""

    gate: Optional[Node]
    full: Optional[Node]
    idx: Node
    hot: OneHot
    mask: Node
    earlier: list  # the keys of the masks (dropped or not) of the earlier choices this one queues behind
    capacity: Any
    loc: Node
    slot: OneHot

    def fills(self) -> list[Node]:
        """The scatters that fill this choice's one-hot buffers."""
        return [h.fill for h in (self.hot, self.slot) if h.fill is not None]


def _cumsum_over_tokens(node: Any) -> Optional[Node]:
    if call(node, torch.cumsum, "cumsum") and _dim_arg(node, 1) == 0 and set(node.kwargs) <= {"dim"}:
        return node.args[0]
    return None


def _dim_arg(node: Node, position: int, default=None):
    return node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)


def _token_count(node: Any) -> Optional[Node]:
    """``m`` for ``sum(m, dim=0, keepdim=True)``."""
    if call(node, torch.sum, "sum") and _dim_arg(node, 1) == 0 and node.kwargs.get("keepdim") is True \
            and set(node.kwargs) <= {"dim", "keepdim"} and len(node.args) <= 2:
        return node.args[0]
    return None


def _topk_rows(node: Any) -> Optional[Node]:
    """The (R, N) source of ``node = topk(src, k=R, dim=0)[1]``: k is the whole of dim 0, so every column of the
    indices holds each row index 0..R-1 exactly once (in an order that is the implementation's: its tie-break on
    equal values is not specified, and here it does not matter)."""
    if not (call(node, operator.getitem) and node.args[1] == 1 and call(node.args[0], torch.topk, "topk")):
        return None
    top = node.args[0]
    kw = dict(top.kwargs)
    if set(kw) - {"k", "dim", "largest", "sorted"} or not 1 <= len(top.args) <= 3 or not isinstance(top.args[0], Node):
        return None
    names = ("k", "dim")
    for name, arg in zip(names, top.args[1:]):
        if name in kw:
            return None
        kw[name] = arg
    src, sv, iv = top.args[0], val(top.args[0]), val(node)
    if sv is None or iv is None or sv.dim() != 2 or kw.get("dim", -1) not in (0, -2) or "k" not in kw:
        return None
    if not same_size(kw["k"], sv.shape[0]) or iv.dim() != 2 or not all(
            same_traced(a, b) for a, b in zip(iv.shape, sv.shape)):
        return None
    return src


def covers(node: Any, like: Any) -> bool:
    """``node`` is a tensor of ones of ``like``'s (R, N) shape: ``zeros_like(like).scatter_(0, idx, 1)`` (or
    ``torch.zeros(R, N)``, the functional ``scatter``) with ``idx = topk(src, k=R, dim=0)[1]`` of an (R, N) src.
    Each column of idx holds every row once, so the scatter writes a 1 at every (row, column). This is
    Hunyuan-Large's "keep the first capacity tokens per expert" at a capacity of R, the whole token count; below R the
    tokens topk keeps among equal values are the implementation's choice, and nothing here reads that."""
    if not (call(node, "scatter_", "scatter", torch.scatter) and len(node.args) == 4 and not node.kwargs):
        return False
    buf, dim, idx, value = node.args
    if not (_zeros(buf) and dim in (0, -2) and type(value) in (int, float) and value == 1):
        return False
    bv, lv = val(buf), val(like) if isinstance(like, Node) else None
    if bv is None or lv is None or bv.dim() != 2 or lv.dim() != 2:
        return False
    if not all(same_traced(a, b) for a, b in zip(bv.shape, lv.shape)):
        return False
    src = _topk_rows(idx)
    sv = val(src) if src is not None else None
    return sv is not None and all(same_traced(a, b) for a, b in zip(sv.shape, bv.shape))


def uncovered(node: Any) -> Any:
    """``m`` for ``m * ones`` with ``ones`` a tensor of ones over m's shape (``covers``): the same values as m."""
    ab = binary(node, _MUL)
    for m, ones in (ab, ab[::-1]) if ab is not None else ():
        if isinstance(m, Node) and covers(ones, m):
            return m
    return node


def mask_key(node: Any) -> Any:
    """What a mask read is a read of: a one-hot's key (its buffer), else the node under 0/1 casts; a mask times a
    tensor of ones (``covers``) is a read of the mask."""
    node = uncovered(strip_casts(node, zero_one=True))
    hot = one_hot(node)
    return hot.key if hot is not None else strip_casts(node, zero_one=True)


def _queue_position(loc: Node, hot: OneHot) -> Optional[list]:
    """The earlier choices' mask keys for ``loc = cumsum(one_hot, 0) - 1 + sum(m_i, 0, keepdim=True) + ...``."""
    terms: list[tuple[int, Any]] = []

    def walk(node, sign):
        if (ab := binary(node, _ADD)) is not None:
            walk(ab[0], sign)
            walk(ab[1], sign)
        elif (ab := binary(node, _SUB)) is not None:
            walk(ab[0], sign)
            walk(ab[1], -sign)
        else:
            terms.append((sign, node))

    walk(loc, 1)
    constant = sum(s * t for s, t in terms if isinstance(t, int) and not isinstance(t, bool))
    tensors = [(s, t) for s, t in terms if not isinstance(t, int)]
    cumsums = [t for s, t in tensors if s == 1 and mask_key(_cumsum_over_tokens(t)) is hot.key]
    earlier = [_token_count(t) for s, t in tensors if s == 1 and t not in cumsums]
    if constant != -1 or len(cumsums) != 1 or any(e is None for e in earlier) or any(s != 1 for s, _ in tensors):
        return None
    if len(earlier) != len(tensors) - 1:
        return None
    return [mask_key(e) for e in earlier]


#: why a drop is not the op's: the positions it compares with C are not the queue the op fills
NOT_CHOICE_MAJOR = ("its capacity drop compares positions that are not cumsum(one_hot, 0) - 1 plus the counts of "
                    "the earlier choices: a priority order (token-major, say) other than the choice-major order the "
                    "op drops in")
#: why a drop is not the op's: the capacity it drops at is not the slots' C
OTHER_CAPACITY = "its capacity drop compares with a capacity other than the slots' C"


def dropped_mask(mask: Node, capacity) -> Union[tuple[OneHot, Node, list, Any], str, None]:
    """(one-hot, loc, earlier, the capacity as written) for ``mask = one_hot(idx, E) * lt(loc, capacity)`` (or
    ``*=``) with loc a queue position; why not, when ``mask`` is a one-hot times an ``lt``; else None."""
    args = binary(mask, _MUL)
    if args is None:
        return None
    reason = None
    for a, b in (args, args[::-1]):
        hot, keep = one_hot(a), strip_casts(b, zero_one=True)
        if hot is None or not (call(keep, torch.lt, operator.lt, "lt") and len(keep.args) == 2 and not keep.kwargs):
            continue
        loc, cap = keep.args
        if not isinstance(loc, Node):
            continue
        if not same_size(cap, capacity):
            reason = OTHER_CAPACITY
            continue
        earlier = _queue_position(loc, hot)
        if earlier is None:
            reason = NOT_CHOICE_MAJOR
            continue
        return hot, loc, earlier, cap
    return reason


def _factors(node: Any, T, E, C) -> Optional[list[tuple[str, Node]]]:
    """The factors of one combine term, each tagged with the axes it spans: "te" ((T, E), under a new C axis), "tc"
    ((T, C), under a new E axis), "t" ((T, 1, 1)). Products of (T, E, C)/(T, E, 1)/(T, 1, C) tensors, batched
    outer products ``bmm(a (T, E, 1), b (T, 1, C))`` (a sum over a size-1 axis is a plain product), and
    ``einsum("se,sc->sec", a, b)``."""
    if (ab := binary(node, _MUL)) is not None and len(shape(node) or ()) == 3:
        parts = [_factors(p, T, E, C) for p in ab]
        return None if None in parts else parts[0] + parts[1]
    if (call(node, torch.bmm, torch.matmul, operator.matmul, "bmm", "matmul") and len(node.args) == 2
            and not node.kwargs and shape(node.args[0]) == (T, E, 1) and shape(node.args[1]) == (T, 1, C)):
        parts = [_factors(p, T, E, C) for p in node.args]
        return None if None in parts else parts[0] + parts[1]
    parsed = einsum_parts(node) if isinstance(node, Node) else None
    if parsed is not None:
        subs, out, ops = parsed
        if len(out) != 3 or len(set(out)) != 3:
            return None
        t, e, c = out
        tags = {t + e: "te", t + c: "tc"}
        if any(s not in tags for s in subs):
            return None
        return [(tags[s], op) for s, op in zip(subs, ops)]
    axis = new_axis(node)
    if axis is not None and axis[1] == 2 and shape(node) == (T, E, 1):
        return [("te", axis[0])]
    if axis is not None and axis[1] == 1 and shape(node) == (T, 1, C):
        return [("tc", axis[0])]
    if shape(node) == (T, 1, 1):
        return [("t", node)]
    return None


def _te_parts(node: Any, T, E, C) -> list:
    """The factors of a (T, E) product: products of (T, E) and (T, 1) tensors, ``einsum("s,se->se", g, m)``, and
    float casts; a dropped mask (itself a product) stays whole, with its casts (``choice`` strips them)."""
    under = strip_casts(node, zero_one=True)
    if isinstance(dropped_mask(under, C), tuple) or uncovered(under) is not under:
        return [node]
    if (ab := binary(node, _MUL)) is not None and shape(node) == (T, E):
        return _te_parts(ab[0], T, E, C) + _te_parts(ab[1], T, E, C)
    parsed = einsum_parts(node) if isinstance(node, Node) else None
    if parsed is not None and shape(node) == (T, E):
        subs, out, ops = parsed
        if len(out) == 2 and all(s in (out, out[0]) for s in subs):
            return [p for op in ops for p in _te_parts(op, T, E, C)]
    under = strip_casts(node)
    return [node] if under is node else _te_parts(under, T, E, C)


def _at_least(C, T) -> bool:
    """C >= T for every size the graph admits (ints, or symbolic sizes; no guard is added)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return same_traced(C, T) or statically_known_true(C >= T)


def _undropped(wide: list, slot: Optional[OneHot], T, E, C) -> Optional[tuple]:
    """(mask, (one-hot, loc, [], capacity), other (T, E) factors) for a first choice kept without a drop: a one-hot
    over the E experts (or one times a tensor of ones, ``covers``), queued at ``cumsum(mask, 0) - 1`` behind no
    earlier choice, into a slot one-hot of C >= T classes. Its positions are below T <= C, so ``lt(loc, C)`` would
    be all true: it is the dropped choice at capacity C, which drops none of it. Below T eager's slot one-hot
    raises where the op would drop, so it is left alone."""
    if slot is None or not _at_least(C, T):
        return None
    for i, part in enumerate(wide):
        mask = strip_casts(part, zero_one=True)
        hot = one_hot(uncovered(mask))
        if hot is None or not hot.has_classes(E):
            continue
        position = strip_casts(column_base(slot.idx), zero_one=True)
        prod = binary(position.args[0], _MUL) if call(position, torch.sum, "sum") and _dim_arg(position, 1) in (
            1, -1) and set(position.kwargs) <= {"dim"} else None
        loc = next((p for p in prod if p is not mask), None) if prod is not None and mask in prod else None
        if not isinstance(loc, Node) or _queue_position(loc, hot) != []:
            continue
        capacity = slot.classes if slot.fill is None else C
        return mask, (hot, loc, [], capacity), wide[:i] + wide[i + 1:]
    return None


def choice(term: Node, T, E, C) -> Union[Choice, str]:
    """One ``gate * mask ⊗ one_hot(slot, C)`` term of combine (see the module docstring), or why it is not."""
    factors = _factors(term, T, E, C)
    if factors is None:
        return ("a term is not a product of (T, 1, 1), (T, E, 1) and (T, 1, C) factors (bmm or einsum outer "
                "products included)")
    gates, wide, slots = [], [], []
    for tag, node in factors:
        if tag == "tc":
            slots.append(node)
        elif tag == "t":
            gates.append(node)
        else:
            for part in _te_parts(node, T, E, C):
                if shape(part) in ((T, 1), (T,)):
                    gates.append(part)
                elif shape(part) == (T, E):
                    wide.append(part)
                else:
                    return "a term has a factor that is neither a gate, an expert mask nor a slot one-hot"
    if len(slots) != 1:
        return "a term has no single (T, C) slot factor"
    # exactly one of the (T, E) factors is the dropped mask; another is a full gate, read at the kept expert
    found, reason = None, "no factor of a term is a capacity-dropped one-hot, one_hot(expert, E) * lt(position, C)"
    for i, part in enumerate(wide):
        mask = strip_casts(part, zero_one=True)
        dropped = dropped_mask(mask, C)
        if isinstance(dropped, str):
            reason = dropped
        elif dropped is not None and dropped[0].has_classes(E):
            found = (mask, dropped, wide[:i] + wide[i + 1:])
            break
    slot = one_hot(slots[0])
    if found is None:
        found = _undropped(wide, slot, T, E, C)
    if found is None:
        return reason
    mask, (hot, loc, earlier, cap), fulls = found
    if len(gates) + len(fulls) != 1 or any(not val(f).is_floating_point() for f in fulls):
        return "a term has no single gate (a (T,) or (T, 1) factor, or a (T, E) float one)"
    if slot is None or not slot.has_classes(C):
        return "a term's slot factor is not a one-hot over the C slots"
    # the slot is the queue position of the kept (token, expert): sum(loc * mask, dim=1)
    position = strip_casts(column_base(slot.idx), zero_one=True)
    prod = binary(position.args[0], _MUL) if call(position, torch.sum, "sum") and _dim_arg(position, 1) in (
        1, -1) and set(position.kwargs) <= {"dim"} else None
    if prod is None or set(prod) != {loc, mask}:
        return "a term's slot is not the queue position of its kept choice, sum(loc * mask, dim=1)"
    return Choice(gates[0] if gates else None, fulls[0] if fulls else None, hot.idx, hot, mask, earlier, cap, loc,
                  slot)


def order_choices(choices: list[Choice]) -> Optional[list[Choice]]:
    """Choice j queues behind exactly choices 0..j-1 (their masks before or after the drop)."""
    ordered = sorted(choices, key=lambda c: len(c.earlier))
    for j, c in enumerate(ordered):
        if len(c.earlier) != j:
            return None
        wanted = [{ordered[i].hot.key, mask_key(ordered[i].mask)} for i in range(j)]
        used = [[i for i, w in enumerate(wanted) if e in w] for e in c.earlier]
        if sorted(i for u in used for i in u) != list(range(j)) or any(len(u) != 1 for u in used):
            return None
    return ordered


def versions_sound(end: Node, op_inputs: Iterable[Node], fills: Iterable[Node], from_inputs: bool = False) -> bool:
    """Every read in the region sees the value the proof reads (its node's functional value): no tensor the region
    depends on is written in place between its definition and its last read, under any name (``alias_mutations``:
    through a view, an in-place function, an ``out=``, or an in-place op's result); ``op_inputs`` are read once
    more, by the op at ``end``. The one exception is a one-hot's buffer, whose one fill (in ``fills``) comes before
    every read of it. ``from_inputs``: the region starts at ``op_inputs`` (the proof reads nothing above them, as where
    a router fills its (T, E) probabilities by ``scatter_`` before the softmax that the op's weights are read from)."""
    position = {n: i for i, n in enumerate(end.graph.nodes)}
    inputs, fills = set(op_inputs), set(fills)
    for n in reach([end, *inputs], lambda n: [] if from_inputs and n in inputs else n.all_input_nodes):
        if n.op in ("output",):
            continue
        writes = [m for m in alias_mutations(n) if position[m] > position[n]]
        fill = [m for m in writes if m in fills and m.args[0] is n]
        if fill:
            if any(position[u] < position[fill[0]] for u in n.users if u is not fill[0]):
                return False  # a read of the zeros before they became the one-hot
            writes = [m for m in writes if m is not fill[0]]
        last = max([position[u] for u in n.users] + ([position[end]] if n in inputs else []), default=-1)
        if any(position[m] < last for m in writes):
            return False
    return True
