"""Experts held as separate tensors, read by the grouped GEMM where they lie: a table of their addresses.

A ModuleList of E experts holds E weight tensors of one shape. The stacked kernels want one (E, K, N) tensor, and a
stack of every expert at each call reads and writes all of them: on DeepSeek-V2-Lite's 64 experts that was 0.73 ms
of a 1.18 ms call at one token, and of a 2.02 ms call at 4096 (H100, RESULTS.md). With the table, each tile loads
its expert's address and reads the weights in place (``grouped_gemm_kernel``'s ``B_TABLE``), so a call reads only
the experts its tokens chose.

The table is cached by the addresses alone: it says where the weights are, never what they hold, so a weight
changed in place (``p.data.copy_(new)``, an optimizer step) is read as it is now.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional, Sequence

import torch


class WeightTable(NamedTuple):
    """E same-shaped weights as the grouped GEMM reads them: logically (E, K, N), expert e's (K, N) weight at the
    address ``table[e]``, in the strides of ``like`` (expert 0's (K, N) view; every expert has them)."""

    table: torch.Tensor  # (E,) int64 addresses, on the weights' device
    like: torch.Tensor

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


_TABLES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
#: tables kept (each a few hundred bytes): a model's layers times its projections, with room to spare
_MAX_TABLES = 256


def address_table(ws: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """An (E,) int64 tensor of the weights' addresses on their device, cached by those addresses; None where it is
    not cached and would have to be uploaded during CUDA-graph capture (not allowed there: the caller then stacks).
    The upload goes through pinned memory, asynchronously: it never waits for the GPU."""
    key = (ws[0].device, tuple(w.data_ptr() for w in ws))
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        return table
    if ws[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    host = torch.tensor(key[1], dtype=torch.int64)
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
    if any(w.shape != first.shape or w.stride() != first.stride() or w.dtype != dtype or w.device != device
           for w in ws):
        return None
    table = address_table(ws)
    if table is None:
        return None
    return WeightTable(table, first.t() if layout == "nk" else first)
