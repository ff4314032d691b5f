"""TMA for the forward grouped GEMM (``B_DESC``, ``A_DESC`` in grouped_gemm.py): whether a launch reads through
descriptors, the host-made weight descriptors, and Triton's scratch allocator for the descriptors a kernel makes.

Like the rest of kernels/, this reads no config: the ops pass the settings in.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import configs


def tma_weights_apply(a: torch.Tensor, b: torch.Tensor, b2: Optional[torch.Tensor], num_rows: int,
                      num_experts: int, mode: str = "off", min_rows_per_expert: int = 128,
                      descriptors: str = "device", *, traced: bool = False) -> bool:
    """Whether the forward GEMM reads its weights through TMA descriptors (``B_DESC``) under ``mode``
    (``config.gemm_tma_weights``; under "tuned", whether it may, the tuned table then deciding per key): not "off",
    a Hopper-or-later GPU, 16-bit weights, each weight view one a descriptor can take (stride 1 in K or N, 16-byte
    aligned start and strides), and under "auto" at least ``min_rows_per_expert`` rows per expert on average.
    ``descriptors`` (``config.gemm_tma_descriptors``): "device" makes them in the kernel, which a launch Inductor
    traces (``traced``) can take; "host" passes ``TensorDescriptor`` objects, which torch 2.11's trace cannot, so a
    traced launch never takes them."""
    if mode not in ("tuned", "auto", "on", "off"):
        raise ValueError(f"moe_inductor: gemm_tma_weights must be 'tuned', 'auto', 'on' or 'off', got {mode!r}")
    if descriptors not in ("device", "host"):
        raise ValueError(f"moe_inductor: gemm_tma_descriptors must be 'device' or 'host', got {descriptors!r}")
    if mode == "off" or (traced and descriptors == "host") or not a.is_cuda or configs.interpreting():
        return False
    if b.dtype.itemsize != 2:
        return False
    if mode == "auto" and num_rows < min_rows_per_expert * num_experts:
        return False
    if _major_capability(a.device.index) < 9:
        return False
    for w in (b, b2) if b2 is not None else (b,):
        strides = list(w.stride())
        if w.dtype != b.dtype or strides[0] == 0 or min(strides[1:]) != 1 or strides[1:] != list(b.stride()[1:]):
            return False
        if any(x * 2 % 16 for x in strides if x != 1) or w.storage_offset() * 2 % 16:
            return False
    return True


def rows_descriptor_ok(a: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the (M, K) token rows ``a`` can be read through a 2D TMA descriptor made in the kernel: ``dtype``,
    K contiguous, 16-byte aligned row stride and start."""
    if a.dtype != dtype or a.dim() != 2 or a.stride(1) != 1:
        return False
    size = a.dtype.itemsize
    return a.stride(0) * size % 16 == 0 and a.storage_offset() * size % 16 == 0


def _scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Triton's scratch allocator for descriptors made in a kernel: device memory from torch's caching allocator,
    which a CUDA graph capture then records like any other allocation."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Give Triton a scratch allocator where none is set (``tl.make_tensor_descriptor`` needs one at launch; Inductor
    sets the same kind for its own launches). One the user set is left as it is."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


@functools.lru_cache(maxsize=None)
def _major_capability(index: Optional[int]) -> int:
    """The compute capability's major number of CUDA device ``index`` (the current one for None); asked per launch."""
    return torch.cuda.get_device_capability(index)[0]


def weight_descriptor(w: torch.Tensor, block_k: int, block_n: int):
    """A 3D TMA descriptor of the (E, K, N) weight view ``w`` with a (1, block_k, block_n) box, over the (E, N, K)
    tensor it transposes when K is its contiguous dimension (the kernel's ``B_NK``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if w.stride(1) == 1:
        w = w.transpose(1, 2)
        return TensorDescriptor(w, list(w.shape), list(w.stride()), [1, block_n, block_k])
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [1, block_k, block_n])
