"""The experts forward on the CPU, in plain torch: one gather, two matmuls per expert, everything else batched.

The tokens are gathered once into expert-sorted rows. Each expert's rows are then a contiguous slice, so a projection
is one ``torch.mm`` per non-empty expert written in place into one (rows, n) buffer, and the scale, bias, activation
and the combine each run once over all rows. At the small sizes CPU users run, the per-op dispatch is most of the
time, and this keeps it at two calls per expert whatever the routing: no padding (skewed routing costs nothing
extra) and no per-expert gather, activation or scatter. Gate and up held as the two halves of one tensor (HF's
``gate_up_proj``) go through one matmul.

The arithmetic is the kernels' (``grouped.project_reference``, applied per expert): raw up-projection results (kept
in ``pre`` for the backward), the routing scale on the accumulator ("input") or after the activation ("between") or
after the down projection ("output"), biases, then the combine in fp32 for 16-bit inputs.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.weight_views import interleaved_pairs
from .activations import apply_activation
from .call import ExpertsCall
from .grouped import Routed, project, row_sizes
from .grouped_mm_engine import combined_up_weights


def project_up(rows: Tensor, sizes: list[int], w1: Tensor, w1_up: Optional[Tensor], out: Tensor) -> Tensor:
    """``out[lo:hi] = [rows[lo:hi] @ w1[e] | rows[lo:hi] @ w1_up[e]]`` for each expert e (``rows @ w1[e]`` where
    ``w1_up`` is None), ``sizes`` as in ``project``. One matmul per expert where the two are one tensor's halves (HF's
    gate_up_proj) or its interleaved columns (GPT-OSS's, whose stride-2 views ``torch.mm`` would copy), else two."""
    n = w1.shape[2]
    if not isinstance(w1, Tensor):  # per-expert weights (ops/expert_lists.PerExpert): each expert's own tensors
        project(rows, sizes, w1, out[:, :n] if w1_up is not None else out)
        return project(rows, sizes, w1_up, out[:, n:]) if w1_up is not None else out
    both = combined_up_weights(w1, w1_up)
    if both is not None:
        return project(rows, sizes, both, out)
    pairs = interleaved_pairs(w1, w1_up)
    if pairs is not None:
        joint = project(rows, sizes, pairs, rows.new_empty(rows.shape[0], 2 * n))
        kept = sum(sizes[:w1.shape[0]])  # rows past the experts' are left alone, as ``project`` leaves them
        out[:kept, :n], out[:kept, n:] = joint[:kept, 0::2], joint[:kept, 1::2]
        return out
    project(rows, sizes, w1, out[:, :n])
    project(rows, sizes, w1_up, out[:, n:])
    return out


def _to(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def forward_sorted(call: ExpertsCall, routed: Routed, pre: Optional[Tensor]) -> Tensor:
    """y (T, H) of the experts call on the CPU (see ``ops/experts.py`` for the shapes and ``weight_position``).

    ``routed`` holds the routing metadata (``ops/routing.py``): rows past ``offsets[-1]`` were dropped (capacity)
    or had ids outside [0, E), and contribute nothing. ``pre``, when given, is the (T*k, n_pre) buffer that
    receives the raw up-projection results in sorted order.
    """
    x, w, weight_position = call.x, call.weights, call.weight_position
    w1, w1_up, w2, b1, b1_up, b2 = w.w1, w.w1_up, w.w2, w.b1, w.b1_up, w.b2
    T, H = x.shape
    E, _, I = w1.shape
    acc_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    y = torch.zeros(T, H, dtype=acc_dtype, device=x.device)
    sizes, kept = row_sizes(routed.offsets)
    if kept == 0:
        return _to(y, x.dtype)
    assignment = routed.order[:kept].long()
    token = assignment // routed.topk
    rows = x.index_select(0, token)
    s = routed.scale.index_select(0, assignment)[:, None]
    gated = w1_up is not None
    n_pre = I * (2 if gated else 1)
    h = pre[:kept] if pre is not None else x.new_empty(kept, n_pre)
    project_up(rows, sizes, w1, w1_up, h)
    gate, up = (h[:, :I], h[:, I:]) if gated else (h, None)
    if weight_position == "input":
        gate, up = gate * _to(s, h.dtype), (up * _to(s, h.dtype) if gated else None)
    if b1 is not None or b2 is not None:
        expert = torch.repeat_interleave(torch.arange(E, device=x.device), torch.tensor(sizes, device=x.device))
    if b1 is not None:
        gate = gate + b1[expert]
        up = up + b1_up[expert] if gated else None
    a = apply_activation(call.activation.name, gate, up, call.activation.alpha, call.activation.limit)
    if weight_position == "between":
        a = a * _to(s, a.dtype)
    a = _to(a, x.dtype).contiguous()
    o = project(a, sizes, w2, x.new_empty(kept, H))
    if b2 is not None:
        o = o + b2[expert]
    if weight_position == "output":
        o = o * _to(s, o.dtype)
    return _to(y.index_add_(0, token, _to(o, acc_dtype)), x.dtype)
