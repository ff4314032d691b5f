"""A post-grad pass that gives each traced kernel write its own empty buffer again.

Why: AOT autograd's CSE (``torch._functorch.compile_utils.fx_graph_cse``) merges identical calls, and it spares
``aten.empty`` but not ``aten.empty_strided``. The visible backward (``lowerings/visible_backward.py``) allocates
each weight gradient with ``empty_strided`` in the weight's own transposed layout, so two layers of one shape (or a
gate and an up weight held apart) end up writing into ONE buffer node. Each traced launch is a
``triton_kernel_wrapper_functional`` that clones the buffers it writes unless nothing reads them afterwards, so
every write but the last gets a copy of an uninitialised (E, H, 2I) buffer: in a 2-layer Qwen3-30B-A3B training
step of 1024 tokens on the H100, two pointwise copies of 0.53 and 0.27 ms, more than the step's whole gap to
Inductor's own path (benchmarks/RESULTS.md, fortieth session).

What: before Inductor's own post-grad passes (so before it decides which clones it can drop), an empty allocation
that several such kernel writes take as an output gets one fresh twin per write. An empty buffer's contents are
undefined, so the twins compute the same thing; each write then has a buffer no one else reads, and the clone goes.
Nothing else in the graph is touched.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten

#: allocations whose contents are undefined: a twin of one is the same computation
_EMPTY = (aten.empty_strided.default, aten.empty.memory_format)


def _written_by(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    """Whether ``user`` is a functional Triton launch that writes ``node`` (an argument it clones before writing)."""
    if user.target is not torch.ops.higher_order.triton_kernel_wrapper_functional:
        return False
    kwargs = user.kwargs.get("kwargs", {})
    return any(kwargs.get(name) is node for name in user.kwargs.get("tensors_to_clone", ()))


def unshare_written_buffers(graph: torch.fx.Graph) -> int:
    """Give every empty allocation that several functional Triton launches write, and nothing else reads, one twin
    per launch after the first; returns how many twins were made."""
    made = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _EMPTY or len(node.users) < 2:
            continue
        users = list(node.users)
        if not all(_written_by(node, user) for user in users):
            continue
        val = node.meta.get("val")
        for user in users[1:]:
            with graph.inserting_before(user):
                twin = graph.call_function(node.target, node.args, dict(node.kwargs))
            twin.meta = dict(node.meta)
            if isinstance(val, torch.Tensor):  # a storage of its own, as the twin has: alias analysis reads it
                twin.meta["val"] = val.new_empty_strided(val.shape, val.stride())
            user.replace_input_with(node, twin)
            made += 1
    return made


class UnsharedBuffers(CustomGraphPass):
    """``unshare_written_buffers`` as Inductor's ``post_grad_custom_pre_pass``; its uuid is this file's source, so
    the compile caches key on it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        made = unshare_written_buffers(graph)
        if made:
            from torch._dynamo.utils import counters

            counters["moe_inductor_visible"]["unshared_buffers"] += made

    def uuid(self) -> bytes:
        return hashlib.sha256(Path(__file__).read_bytes()).digest()


#: the one instance our compiles set (Inductor's compilers compare by their settings, this object among them)
UNSHARED_BUFFERS = UnsharedBuffers()
