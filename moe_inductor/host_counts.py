"""Per-expert counts brought to the host as a NumPy array and walked there, traced as the ``.tolist()`` they equal.

DeepSeek-V2's remote code (``moe_infer``, copied by DeepSeek-V3's, SGLang's native path and many fine-tuning repos):

    tokens_per_expert = cnts.sum(dim=0).cpu().numpy()
    for i, num_tokens in enumerate(tokens_per_expert):
        end_idx = start_idx + num_tokens
        if num_tokens == 0:
            continue
        ...

Dynamo traces the array as a tensor and each element as a 0-d array, so ``if num_tokens == 0`` branches on a tensor
and the frame breaks. During a moe_inductor compile only, iterating a 1-D integer array that is a proven per-expert
count vector of static length E (``passes/counts.py``'s marked counts, or a ``histc``/``bincount`` speculation.py
knows) yields the counts as the integers ``.tolist()`` gives: the values eager's elements hold, read by the same
host sync. A skip on them is then an ordinary speculation, proven and discharged as the others.

The same counts kept as a torch tensor on the host and read one element at a time (Yuan2-M32's ``GroupedMLP``,
after Megatron's dropless dispatcher):

    tokens_per_expert = counts.cpu().to(torch.long)
    for i in range(E):
        if tokens_per_expert[i] == 0:
            continue
        end_idx = start_idx + tokens_per_expert[i]
        ...

``tokens_per_expert[i]`` is a 0-d tensor in eager, and ``if`` on it is a data-dependent branch. During a moe_inductor
compile only, ``t[i]`` with a constant i of such a host copy (``.cpu()``, casts after it), or of the count vector
itself on the device (Unsloth's ``if m_size > 0:`` on ``m_sizes[g]``: eager reads the element on the host at the
``if`` and at each slice bound), reads element i of its ``.tolist()``, listed once at the first read
(``subscript``); a vector that is changed in place anywhere in the graph falls back (``check``, as for the NumPy
walk), since a later read would be stale.

Python ints and NumPy's int64 scalars (or 0-d tensors) differ in type only: where the frame uses the numbers for more
than the loop the rewrite takes (``num_tokens / 2`` as a float64, ``y * tokens_per_expert[0]``), ``unconsumed`` finds
their reads left in the final graph, and the frame falls back.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node

from . import host_cumsum

#: on the traced host copy (the array's node) whose elements were walked as counts
WALKED = "moe_inductor_host_counts"


def traced_node(var) -> tuple[Any, Optional[Node]]:
    """(the running trace, the graph node behind Dynamo variable ``var``) while a moe_inductor compile traces, else
    (None, None); the node is None for a variable without a proxy (not a value of the graph)."""
    from . import speculation

    trace = speculation._trace()
    if trace is None:
        return None, None
    try:
        return trace, var.as_proxy().node
    except Exception:  # noqa: BLE001  (no proxy: not an array of the graph)
        return trace, None


def _count_items(var, tx) -> Optional[list]:
    """The count vector's elements as the ``.tolist()`` integers, or None where this is no such array."""
    from . import count_totals
    from .passes.counts import host_copy_of, per_expert_counts

    trace, node = traced_node(var)
    if node is None:
        return None
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype.is_floating_point or (
            value.dtype == torch.bool) or not isinstance(value.shape[0], int):
        return None
    if per_expert_counts(node) is None and count_totals.histogram_total(host_copy_of(node)) is None:
        return None
    from torch._dynamo.variables.tensor import TensorVariable

    listed = TensorVariable.method_tolist(var, tx)
    node.meta[WALKED] = True
    trace.host_counts = True
    items = listed.unpack_var_sequence(tx)
    for item in items:  # ``num_tokens.item()`` of an element (inclusionAI's Ling/LLaDA2 copies) is the number itself
        if type(item).__name__ == "SymNodeVariable":
            item.__class__ = _count_class(type(item))
    return items


@functools.lru_cache(maxsize=None)
def _count_class(base: type) -> type:
    """A SymNodeVariable whose ``.item()`` is itself, as a NumPy int64 element's is its value."""

    class HostCount(base):
        def call_method(self, tx, name, args, kwargs):
            if name == "item" and not args and not kwargs:
                return self
            return super().call_method(tx, name, args, kwargs)

    return HostCount


def subscript(var, tx, key) -> Optional[Any]:
    """``counts[e]`` (a constant e in [0, E)) of a proven per-expert count vector, a torch tensor, or a host copy
    of one: element e of its ``.tolist()``, the value eager's 0-d tensor holds (Yuan2-M32's ``GroupedMLP`` branches
    on ``tokens_per_expert[i] == 0`` of a ``.cpu()`` copy and slices by running sums of the elements; Unsloth's
    reference ``torch_grouped_gemm`` reads ``m_sizes[g]`` of the device counts, branches on ``m_size > 0`` and
    slices by them, each a host sync in eager). Else None, and Dynamo indexes."""
    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.tensor import NumpyNdarrayVariable, TensorVariable

    if not isinstance(var, TensorVariable) or isinstance(var, NumpyNdarrayVariable) or not isinstance(
            key, ConstantVariable) or type(key.value) is not int:
        return None
    trace, node = traced_node(var)
    if node is None:
        return None
    items = trace.listed_counts.get(node)
    if items is None:
        items = _count_items(var, tx)
        if items is None:
            return None
        trace.listed_counts[node] = items
    return items[key.value] if 0 <= key.value < len(items) else None


def install() -> None:
    """Hook Dynamo's unpacking of NumPy arrays (idempotent; nothing changes outside a moe_inductor compile)."""
    try:
        from torch._dynamo.variables.tensor import NumpyNdarrayVariable
    except ImportError:
        return
    if getattr(NumpyNdarrayVariable.unpack_var_sequence, "_moe_inductor", False):
        return
    original = NumpyNdarrayVariable.unpack_var_sequence

    def unpack_var_sequence(self, tx, *args, **kwargs):
        items = None if args or kwargs else _count_items(self, tx)
        if items is None and not args and not kwargs:
            items = host_cumsum.walk_items(self, tx)
        return items if items is not None else original(self, tx, *args, **kwargs)

    unpack_var_sequence._moe_inductor = True
    NumpyNdarrayVariable.unpack_var_sequence = unpack_var_sequence


def check(gm: GraphModule) -> None:
    """Before the passes: the counts walked or indexed as numbers are not changed in place anywhere in the graph
    (``a[1] += 1`` on the NumPy copy, a write to the ``.cpu()`` tensor it shares memory with), since the numbers
    listed are then not the per-expert counts the proof takes them for, or go stale within the walk. Raises
    SpeculationNotDischarged. Run before the passes: their dead-code removal may drop a write nothing reads after."""
    from .passes.aliases import alias_mutations
    from .speculation import SpeculationNotDischarged

    for node in gm.graph.nodes:
        written = alias_mutations(node) if node.meta.get(WALKED) else None
        if written:
            raise SpeculationNotDischarged(f"the host counts {node.name} walked as numbers are changed in place "
                                           f"({written[0].name}): they are then not the per-expert counts; not kept")


def unconsumed(gm: GraphModule) -> Optional[str]:
    """After the rewrites: why the walked counts are still read by the graph (as numbers, beyond the size checks of
    what went with a rewrite), else None. Writes into them are refused before the passes (``check``)."""
    from .speculation_check import _SIZE_CHECK_OPS

    for node in gm.graph.nodes:
        if not node.meta.get(WALKED):
            continue
        for pick in node.users:
            for item in pick.users:
                readers = [u for u in item.users if u.target not in _SIZE_CHECK_OPS
                           and u.target is not torch.ops.aten._assert_scalar.default]
                if readers:
                    return (f"the host counts walked as numbers are still read by {readers[0].name} after the "
                            "rewrites (a use of them beyond the loop the rewrite took)")
    return None
