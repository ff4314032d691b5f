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

from ..kernels.configs import interpreting
from ..kernels.launch import LazyKernel, cdiv, device_guard, launch_kernel, next_pow2, static_dim, tracing_launches
from .grouped import use_triton

route_count_kernel = LazyKernel("routing", "route_count_kernel")
route_place_kernel = LazyKernel("routing", "route_place_kernel")


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
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(
        0, sorted_keys, torch.ones_like(sorted_keys)
    )
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(counts[:num_experts], 0)
    return order.to(torch.int32), sorted_keys.to(torch.int32), offsets


# Up to this many routed rows one program does everything in one launch; above it, programs of CHUNK_ROWS rows.
SINGLE_LAUNCH_MAX_ROWS = 1024  # measured on the H200: one program over 4096 rows takes ~85 us, four take ~35
CHUNK_ROWS = 1024


def route_metadata(topk_ids: Tensor, num_experts: int, capacity: Optional[int] = None,
                   chunked: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Routing metadata by the Triton kernels on the GPU, by ``route_reference`` elsewhere.

    ``chunked``: take the count-then-place path (two launches), which is right for every row count; by default only
    a symbolic row count (a dynamic graph) does, and a known one picks one launch when it fits in one chunk.
    """
    if not use_triton(topk_ids):
        return route_reference(topk_ids, num_experts, capacity)
    T, k = topk_ids.shape
    if tracing_launches():
        k, num_experts = static_dim(k), static_dim(num_experts)
    M = T * k
    ids = topk_ids.contiguous()
    order = ids.new_empty(M, dtype=torch.int32)
    sorted_expert = ids.new_empty(M, dtype=torch.int32)
    offsets = ids.new_empty(num_experts + 1, dtype=torch.int32)
    bins = next_pow2(num_experts + 1)
    if chunked is None:
        chunked = tracing_launches() and not isinstance(M, int)  # deciding on a symbolic M would guard on it
    if chunked:
        chunk = 16 if interpreting() else CHUNK_ROWS
        num_chunks, single, t_rows = torch.sym_max(cdiv(M, chunk), 1), False, torch.sym_max(T, 1)
    else:
        # One chunk (and one launch) covers small batches; large ones are split so the per-program sort stays small.
        chunk = 16 if interpreting() else (SINGLE_LAUNCH_MAX_ROWS if M <= SINGLE_LAUNCH_MAX_ROWS else CHUNK_ROWS)
        num_chunks, t_rows = max(cdiv(M, chunk), 1), max(T, 1)
        single = num_chunks == 1
    # the per-chunk histograms; one chunk counts in registers, and its kernel never reads this (order stands in)
    # (flat: a symbolic (num_chunks, bins) shape would make tracing guard on num_chunks == 1, i.e. on the token count)
    counts = order if single else ids.new_empty(num_chunks * bins, dtype=torch.int32)
    meta = dict(CHOICE_MAJOR=capacity is not None, TOPK=k, CHUNK=chunk, BINS=bins, SINGLE=single,
                num_warps=8 if chunk > 1024 else 4)
    cap = M + 1 if capacity is None else capacity
    with device_guard(ids):
        if not single:
            launch_kernel(route_count_kernel, (num_chunks,), (ids, counts, M, t_rows, num_experts),
                          dict(CHOICE_MAJOR=meta["CHOICE_MAJOR"], TOPK=k, CHUNK=chunk, BINS=bins))
        launch_kernel(route_place_kernel, (num_chunks,),
                      (ids, counts, order, sorted_expert, offsets, M, t_rows, num_experts, cap, num_chunks), meta)
    return order, sorted_expert, offsets


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
    """``text`` cut to what a device-side assert takes; the cut keeps the start, which names the layer's bound."""
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
