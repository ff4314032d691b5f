"""A graph input that records a gradient and is changed in place: the graph changes a clone, then copies it back.

AOTAutograd runs a graph's changes to its inputs after the compiled forward, as ``input.copy_(new)``. Where the
backward also needs the input's value from before the change (``y.mul_(w)`` with ``w`` recording a gradient needs the
old ``y`` for ``w``'s gradient), it saves that input, and the copy that follows changes the saved tensor: the
backward then raises "one of the variables needed for gradient computation has been modified by an inplace
operation", where eager runs. Plain capture hits it too, but only where a graph break hands a graph such an input;
our capture settings and hooks break graphs elsewhere than plain capture does (the generator's NumPy walk, whose
callee breaks at ``str()`` of a symbolic expert id, handed its second graph the expert's output to weight in place).

So before an AOTAutograd-based inner compile, each such input is read through a copy made at the graph's start, and
the copy is copied into the input at the end: the same values in the same tensors after the call, the same
gradients (the copy passes them through), and the saved tensor is the copy, which nothing changes later. The copy is
an op of ours (``moe_inductor::own_copy``), opaque to Inductor's partitioner: a plain ``clone`` it would recompute in
the backward from the input, and save the input again.

Inputs left as they are: a leaf that records a gradient (eager raises on changing it in place, and so must we), an
input an output of the graph aliases (the caller would get a view of the copy), one another input views (that view
must see each change as it is made), an input nothing reads but views and
changes whose gradient needs none of its old values (a residual's ``h += x``: nothing of it is saved, and a copy would
only cost time), and every input where grad mode is off.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from .passes.aliases import tensors_written
from .passes.fx_utils import val


@torch.library.custom_op("moe_inductor::own_copy", mutates_args=())
def own_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` in a tensor of its own (``x.clone()``), which a partitioner saves rather than recomputes from
    ``x``; its gradient passes through unchanged."""
    return x.clone()


@own_copy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


own_copy.register_autograd(lambda ctx, grad: grad)


#: changes in place whose gradient reads none of the changed tensor's old values (as long as it is not also among
#: their other arguments): AOTAutograd saves nothing of the input for them
_WRITES_ONLY = frozenset({"add_", "sub_", "copy_", "zero_", "fill_", "index_add_", "index_put_", "index_copy_",
                          "index_fill_", "scatter_add_", "masked_fill_", "masked_scatter_"})
_WRITES_ONLY_OPERATORS = frozenset({operator.iadd, operator.isub, operator.setitem})


def clone_mutated_grad_inputs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> list[str]:
    """Make each input of ``gm`` that records a gradient (not a leaf) and that the graph changes in place be changed
    through a clone, copied back at the end (module docstring). Returns the names of the inputs it did this for."""
    if not torch.is_grad_enabled():
        return []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return []
    output = next(n for n in gm.graph.nodes if n.op == "output")
    done = []
    for node, example in zip(placeholders, example_inputs):
        if not isinstance(example, torch.Tensor) or not example.requires_grad or example.is_leaf:
            continue
        aliases = _aliases_of(gm, node)
        if aliases is None or not any(_changes_in_place(n, aliases) for n in gm.graph.nodes):
            continue
        if any(n.op == "placeholder" and n is not node for n in aliases):  # another input views it: it must see
            continue  # each change when it is made, not at the end
        if not _may_be_saved(gm, aliases):  # AOTAutograd runs it as it is (a residual's ``h += x``)
            continue
        if _reads(output.args, aliases):
            continue
        _read_through_clone(gm, node, output)
        done.append(node.name)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _storage(value: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(value.untyped_storage())


def _aliases_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[set]:
    """The nodes whose traced value shares ``node``'s storage (the input, its views, ``.to()`` of it that returned
    it), by the traced values' storages; None where the input's traced value is unknown."""
    value = val(node)
    if value is None:
        return None
    try:
        storage = _storage(value)
        return {n for n in gm.graph.nodes if (v := val(n)) is not None and _storage(v) == storage}
    except Exception:  # noqa: BLE001  (a value without a storage, a tensor subclass: nothing is known to alias it)
        return None


def _changes_in_place(node: torch.fx.Node, aliases: set) -> bool:
    """Whether ``node`` writes into one of ``aliases``: ``y[i] = v``, or any tensor ``aliases.tensors_written``
    names (an in-place method or function, ``y += z``, ``inplace=True`` by name or position, each tensor of a
    ``torch._foreach_mul_`` list; ``out=`` a tensor that records a gradient raises in eager, so no traced graph
    holds one)."""
    if node.op not in ("call_method", "call_function"):
        return False
    if node.op == "call_function" and node.target is operator.setitem:
        return node.args[0] in aliases
    return any(t in aliases for t in tensors_written(node))


def _may_be_saved(gm: torch.fx.GraphModule, aliases: set) -> bool:
    """Whether a node other than a view of the input, or a change in place whose gradient needs none of its old values
    (``_WRITES_ONLY``), reads the input: such a reader may have its value saved for backward."""
    for node in gm.graph.nodes:
        if node in aliases or node.op not in ("call_method", "call_function"):
            continue
        if not _reads((node.args, node.kwargs), aliases):
            continue
        target = node.args[0] if node.args else None
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        writes_only = (isinstance(target, torch.fx.Node) and target in aliases
                       and (node.target in _WRITES_ONLY_OPERATORS or name in _WRITES_ONLY)
                       and not _reads((node.args[1:], node.kwargs), aliases))
        if not writes_only:
            return True
    return False


def _reads(args: Any, aliases: set) -> bool:
    """Whether any node among ``args`` (nested in tuples, lists and dicts) is one of ``aliases``."""
    found: list = []
    torch.fx.node.map_arg(args, lambda n: found.append(n in aliases))
    return any(found)


def _read_through_clone(gm: torch.fx.GraphModule, node: torch.fx.Node, output: torch.fx.Node) -> None:
    graph = gm.graph
    with graph.inserting_after(node):
        clone = graph.call_function(torch.ops.moe_inductor.own_copy.default, (node,))
    if "stack_trace" in node.meta:
        clone.meta["stack_trace"] = node.meta["stack_trace"]
    node.replace_all_uses_with(clone, delete_user_cb=lambda user: user is not clone)
    with graph.inserting_before(output):
        graph.call_method("copy_", (node, clone))
