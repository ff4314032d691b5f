"""How two weight views relate, read from their strides and storage only (no copy, no sync): whether they are views of
one storage (``same_storage``), and whether a gate and an up weight are the even and odd columns of one interleaved
tensor (``interleaved_pairs``, GPT-OSS's ``gate_up_proj``), which the kernels then load whole."""
from __future__ import annotations

import torch


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage: real tensors, and also the fake and functional tensors that
    Inductor traces the visible op with (their views keep no ``_base``, and a fake storage's data pointer is 0 for
    every tensor, so neither can prove it there). False whenever it cannot be proven: the caller then takes the
    path that reads each tensor on its own, which is right for any two tensors."""
    if (type(a) is torch.Tensor and type(b) is torch.Tensor and not torch._is_functional_tensor(a)
            and not torch._is_functional_tensor(b)):
        # the eager launch (every gated GEMM call asks): real tensors, whose data pointers say it, in about a
        # microsecond. Fake tensors, functional ones (Python subclasses, or torch.func's C++ wrappers) go below.
        try:
            return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            return False
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor

    def inner(t: torch.Tensor) -> torch.Tensor:
        # a functional tensor's storage is functionalization's; the tensor it wraps is a view of its base's
        return torch._from_functional_tensor(t.elem) if isinstance(t, FunctionalTensor) else t

    try:
        a, b = inner(a), inner(b)
        if is_fake(a) or is_fake(b):
            # one StorageImpl is one allocation: views of one fake tensor share it, two fake tensors never do
            return is_fake(a) and is_fake(b) and a.untyped_storage()._cdata == b.untyped_storage()._cdata
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, AttributeError, TypeError, NotImplementedError):  # a tensor type that exposes no storage
        return False


def interleaved_pairs(b: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor | None:
    """The whole (E, K, 2N) weight when ``b`` and ``b2`` are its even and odd columns (GPT-OSS's interleaved
    gate_up_proj, as two stride-2 views), else None. The kernel then loads it contiguously (``INTERLEAVED``)."""
    if b2 is None or b.stride(2) != 2 or b2.stride() != b.stride() or b2.dtype != b.dtype:
        return None
    if not same_storage(b, b2):
        return None
    if b2.storage_offset() - b.storage_offset() != 1 or b.stride(1) < 2 * b.shape[2]:
        return None
    E, K, N = b.shape
    return b.as_strided((E, K, 2 * N), (b.stride(0), b.stride(1), 1))
