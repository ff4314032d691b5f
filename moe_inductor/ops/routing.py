"""Routing metadata on the device: expert-sorted order, per-expert offsets, and capacity drops.

Shapes: topk_ids (T, k) int; M = T*k; E experts.
  order_M          int32, flat assignment index t*k + j of each row, stable-sorted by expert (dropped rows last)
  sorted_expert_M  int32, the expert of each sorted row; E for a dropped or out-of-range assignment
  offsets_E1       int32, rows of expert e are [offsets[e], offsets[e+1]); offsets[0] = 0

Everything is a device op (sort, scatter_add, cumsum): no value is read back to the host, so the op is safe under
CUDA graphs and adds no unbacked symbols under torch.compile.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.launch import launch_route
from .call import Routing
from .grouped import Routed, use_triton


def route_reference(topk_ids: Tensor, num_experts: int, capacity: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The implementation (plain torch, any device). Out-of-range ids are treated as dropped: never read out of bounds.

    Capacity keeps, per expert, the first ``capacity`` assignments in choice-major priority (all first choices in
    token order, then all second choices, ...), the rule of GShard, fairseq and Switch.
    """
    T, k = topk_ids.shape
    M = T * k
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    keys = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    if capacity is None:
        sorted_keys, order = torch.sort(keys, stable=True)
    else:
        # priority order, then each assignment's slot among those of its expert; kept rows first, then the
        # dropped ones grouped by expert (bucket E + 1 + e), then out-of-range ids (bucket 2E + 1)
        priority = torch.arange(M, device=dev).view(T, k).t().reshape(-1)
        by_priority, perm = torch.sort(keys[priority], stable=True)
        counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, keys, torch.ones_like(keys))
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(M, device=dev) - starts[by_priority]
        valid = by_priority < num_experts
        bucket = torch.where(valid & (slot < capacity), by_priority,
                             torch.where(valid, num_experts + 1 + by_priority, 2 * num_experts + 1))
        bucket_sorted, perm2 = torch.sort(bucket, stable=True)
        order = priority[perm[perm2]]
        sorted_keys = bucket_sorted.clamp(max=num_experts)
    # the keys are sorted, so expert e's rows start where the first key >= e stands (one op, not a histogram)
    offsets = torch.searchsorted(sorted_keys, torch.arange(num_experts + 1, device=dev), out_int32=True)
    return order.to(torch.int32), sorted_keys.to(torch.int32), offsets


def route_metadata(topk_ids: Tensor, num_experts: int, capacity: Optional[int] = None,
                   chunked: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Routing metadata by the Triton kernels on the GPU (``kernels.launch.launch_route``, ``chunked`` as there), by
    ``route_reference`` elsewhere."""
    if not use_triton(topk_ids):
        return route_reference(topk_ids, num_experts, capacity)
    return launch_route(topk_ids, num_experts, capacity, chunked)


def prepare_routing(routing: Routing, num_experts: int) -> Routed:
    """The routing of one call, prepared once for all its launches: the metadata and the flat routing weights."""
    order, sorted_expert, offsets = route_metadata(routing.topk_ids, num_experts, routing.capacity)
    return Routed(routing.topk_ids, routing.topk_weights.contiguous().view(-1), order, sorted_expert, offsets,
                  num_experts, routing.capacity is not None)


@torch.library.custom_op("moe_inductor::route", mutates_args=())
def route(topk_ids: Tensor, num_experts: int, capacity: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Routing metadata for the grouped kernels.

    Args:
        topk_ids: (T, k) integer expert ids.
        num_experts: E.
        capacity: optional per-expert capacity C; assignments past it are dropped (sorted last, expert id E).
    Returns:
        order (T*k,) int32, sorted_expert (T*k,) int32, offsets (E+1,) int32.
    """
    return route_metadata(topk_ids, num_experts, capacity)


@route.register_fake
def _(topk_ids, num_experts, capacity=None):
    M = topk_ids.shape[0] * topk_ids.shape[1]
    return (
        topk_ids.new_empty(M, dtype=torch.int32),
        topk_ids.new_empty(M, dtype=torch.int32),
        topk_ids.new_empty(num_experts + 1, dtype=torch.int32),
    )


#: CUDA's ``_assert_async`` refuses a message of 255 bytes or more (at run time, as the compiled code's first call)
DEVICE_MESSAGE_BYTES = 254


def device_assert_message(text: str) -> str:
    """``text`` as a device-side assert takes it: safe inside the string literal Inductor's generated code puts it
    in (its C++ kernels write ``throw std::runtime_error("<text>")`` as it is, so a double quote or a backslash, as in
    an einsum's source line, fails the compile), and cut to the assert's length; the cut keeps the start, which names
    the layer's bound."""
    text = "".join(" " if ch.isspace() or not ch.isprintable() else "'" if ch == '"' else "/" if ch == "\\" else ch
                   for ch in text)
    data = text.encode()
    if len(data) <= DEVICE_MESSAGE_BYTES:
        return text
    return data[:DEVICE_MESSAGE_BYTES - 3].decode(errors="ignore") + "..."


def ids_error(where: object, num_experts: int) -> str:
    """The error for routing ids outside [0, E): the layer and the range its ids must lie in."""
    return (f"moe_inductor: {where or 'experts'}: routing ids must lie in [0, {num_experts}) (the layer has "
            f"{num_experts} experts); some do not, e.g. a router wider than the expert list")


def check_topk_ids(topk_ids: Tensor, num_experts: int, where: Optional[str] = None) -> None:
    """Raise on ids outside [0, E), naming the values found. Free on CPU; one host sync on the GPU, so only the eager
    entry point calls it there."""
    if topk_ids.numel() == 0:
        return
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"{ids_error(where, num_experts)}: got values in [{lo}, {hi}]")


def assert_ids_in_range(topk_ids: Tensor, num_experts: int, where: Optional[str] = None) -> None:
    """``check_topk_ids`` without a host sync: a device-side assert (``torch._assert_async``), which Inductor fuses
    into a kernel of its own and which a CUDA graph can capture. The values found are not known on the host, so
    the message gives the range they must lie in."""
    ok = torch.logical_and(topk_ids >= 0, topk_ids < num_experts).all()
    torch._assert_async(ok, device_assert_message(ids_error(where, num_experts)))
