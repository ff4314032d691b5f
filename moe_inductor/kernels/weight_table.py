"""Experts held as separate tensors, read by the grouped GEMM where they lie, through a table of their places.

A ModuleList of E experts holds E weight tensors of one shape. The stacked kernels want one (E, K, N) tensor, and a
stack of every expert at each call reads and writes all of them, where a decode step needs the few its tokens
chose. With the table, each tile finds its expert's weights from expert 0's address and the expert's distance from
it (``grouped_gemm_kernel``'s ``B_TABLE``), and reads them in place.

The table is cached by the addresses alone: it says where the weights are, never what they hold, so a weight
changed in place (``p.data.copy_(new)``, an optimizer step) is read as it is now.
"""
from __future__ import annotations

from collections import OrderedDict
from functools import reduce
from operator import attrgetter, or_
from typing import NamedTuple, Optional, Sequence

import torch


#: bytes every expert's address is a multiple of, so that the kernel may load 16-byte vectors (the hint it gives
#: the compiler, ``grouped_gemm_kernel``'s B_TABLE, must hold)
ALIGNMENT = 16


class WeightTable(NamedTuple):
    """E same-shaped weights as the grouped GEMM reads them: logically (E, K, N), expert e's (K, N) weight starting
    ``table[e]`` elements past expert 0's, in the strides of ``like`` (expert 0's (K, N) view; every expert has
    them). Every address is a multiple of ``ALIGNMENT`` bytes."""

    table: torch.Tensor  # (E,) int64 element offsets from expert 0's weight, on the weights' device
    like: torch.Tensor

    @property
    def aligned_elements(self) -> int:
        """The elements every offset is a multiple of (the kernel's B_TABLE)."""
        return ALIGNMENT // self.like.element_size()

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.table.shape[0], *self.like.shape))

    @property
    def dtype(self) -> torch.dtype:
        return self.like.dtype

    @property
    def device(self) -> torch.device:
        return self.like.device

    def stride(self, dim: Optional[int] = None):
        """As ``Tensor.stride``; the expert stride is 0 (the table gives each expert's address)."""
        strides = (0, *self.like.stride())
        return strides if dim is None else strides[dim]


_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")
_PLAIN = {torch.Tensor, torch.nn.Parameter}
_TABLES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
#: tables kept (each a few hundred bytes): a model's layers times its projections, with room to spare
_MAX_TABLES = 256


def address_table(ws: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """An (E,) int64 tensor, on the weights' device, of how many elements past ``ws[0]``'s address each weight
    starts, cached by the addresses; None where an address is not a multiple of ``ALIGNMENT`` bytes, or where the
    table is not cached and would have to be uploaded during CUDA-graph capture (not allowed there). The caller
    stacks then. The upload goes through pinned memory, asynchronously: it never waits for the GPU."""
    addresses = tuple(map(torch.Tensor.data_ptr, ws))
    if reduce(or_, addresses) % ALIGNMENT:  # (any address's low bits show in the OR of all)
        return None
    size = ws[0].element_size()
    key = (ws[0].device, size, addresses)
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        return table
    if ws[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    host = torch.tensor([(a - addresses[0]) // size for a in addresses], dtype=torch.int64)
    if ws[0].is_cuda:
        table = host.pin_memory().to(ws[0].device, non_blocking=True)
    else:
        table = host.to(ws[0].device)
    _TABLES[key] = table
    if len(_TABLES) > _MAX_TABLES:
        _TABLES.popitem(last=False)
    return table


def weight_table(ws: Sequence[torch.Tensor], layout: str, dtype: torch.dtype, device: torch.device
                 ) -> Optional[WeightTable]:
    """The (E, K, N) table of per-expert weights held in ``layout`` ("nk": nn.Linear's (N, K); "kn": (K, N)), or
    None where the kernel cannot read them through one: not all of one shape, strides, ``dtype`` and ``device``
    (each tensor's elements are read at the first one's strides from its own address), or no table can be made."""
    first = ws[0]
    if first.dim() != 2 or first.dtype != dtype or first.device != device:
        return None
    # plain tensors only: a subclass (DTensor shards, wrappers) may not hold its elements at its data_ptr
    if not set(map(type, ws)) <= _PLAIN:
        return None
    # one shape, strides, dtype and device across the experts (C-level maps: this runs at every call; the device
    # index with the first tensor's device says the device)
    for attr in (_SHAPE, torch.Tensor.stride, _DTYPE, torch.Tensor.get_device):
        if len(set(map(attr, ws))) != 1:
            return None
    table = address_table(ws)
    if table is None:
        return None
    return WeightTable(table, first.t() if layout == "nk" else first)
