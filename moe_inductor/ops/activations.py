"""Expert activations, in plain torch.

One table serves the CPU path, the backward (through ``torch.autograd``) and the references in the tests, so the
Triton epilogues have exactly one definition to agree with.  Gated activations take ``(gate, up)``; the others take
``gate`` alone and ignore ``up``.

Two gated activations clamp, each its own way, with a bound ``limit``:
  "gptoss_glu"        GPT-OSS: ``g = gate.clamp(max=limit)``, ``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)``
  "clamped_silu_glu"  Step-3.7: ``silu(gate).clamp(max=limit) * up.clamp(-limit, limit)`` (the clamp after the silu)
A clamp passes the gradient where its input lies within the bounds, the bounds included, and nothing where it binds:
autograd's rule for ``clamp``, which both backwards follow.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

#: GPT-OSS's glu parameters, the defaults wherever an activation's ``alpha``/``limit`` are not given
GPTOSS_ALPHA = 1.702
GPTOSS_LIMIT = 7.0

# name -> (is_gated, triton epilogue id). The ids are shared with kernels/grouped_gemm.py.
ACTIVATIONS: dict[str, tuple[bool, int]] = {
    "none": (False, 0),
    "relu": (False, 1),
    "gelu": (False, 2),
    "gelu_tanh": (False, 3),
    "silu": (False, 4),
    "silu_glu": (True, 4),
    "gelu_glu": (True, 2),
    "gelu_tanh_glu": (True, 3),
    "relu_glu": (True, 1),
    "gptoss_glu": (True, 5),
    "clamped_silu_glu": (True, 6),
}


class Activation(NamedTuple):
    """An expert activation and its parameters: ``alpha`` is read by "gptoss_glu" only, ``limit`` by "gptoss_glu"
    and "clamped_silu_glu"."""

    name: str = "silu_glu"
    alpha: float = GPTOSS_ALPHA
    limit: float = GPTOSS_LIMIT


#: the identity: a projection with no activation after it
NO_ACTIVATION = Activation("none")


def kernel_id(act: Activation) -> int:
    """The Triton epilogue id of ``act`` (kernels/grouped_gemm.py)."""
    return ACTIVATIONS[act.name][1]


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not supported; choose one of {sorted(ACTIVATIONS)}")


def is_gated(name: str) -> bool:
    check_activation(name)
    return ACTIVATIONS[name][0]


def _unary(kind: int, g: torch.Tensor) -> torch.Tensor:
    if kind == 0:
        return g
    if kind == 1:
        return F.relu(g)
    if kind == 2:
        return F.gelu(g)
    if kind == 3:
        return F.gelu(g, approximate="tanh")
    if kind == 4:
        return F.silu(g)
    raise AssertionError(kind)


def apply_activation(
    name: str, gate: torch.Tensor, up: torch.Tensor | None, alpha: float = GPTOSS_ALPHA, limit: float = GPTOSS_LIMIT
) -> torch.Tensor:
    """``act(gate, up)`` computed in the input dtype, the way the eager modules compute it."""
    gated, kind = ACTIVATIONS[name]
    return apply_activation_id(gated, kind, gate, up, alpha, limit)


def apply_activation_id(gated: bool, kind: int, gate: torch.Tensor, up: torch.Tensor | None, alpha: float,
                        limit: float) -> torch.Tensor:
    """``apply_activation`` of the activation the kernels call (``gated``, epilogue id ``kind``)."""
    if not gated:
        return _unary(kind, gate)
    assert up is not None
    if kind == 5:  # GPT-OSS: clamped gate/up, gate * sigmoid(alpha * gate) * (up + 1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if kind == 6:  # Step-3.7: the silu's output clamped from above, up clamped both ways
        return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)
    return _unary(kind, gate) * up


def _unary_backward(kind: int, g: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    aten = torch.ops.aten
    if kind == 0:
        return grad
    if kind == 1:
        return aten.threshold_backward(grad, F.relu(g), 0)
    if kind == 2:
        return aten.gelu_backward(grad, g)
    if kind == 3:
        return aten.gelu_backward(grad, g, approximate="tanh")
    if kind == 4:
        return aten.silu_backward(grad, g)
    raise AssertionError(kind)


def activation_backward(
    name: str,
    gate: torch.Tensor,
    up: torch.Tensor | None,
    grad_out: torch.Tensor,
    alpha: float,
    limit: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of ``apply_activation`` w.r.t. ``gate`` and ``up``, in fp32.

    Written out rather than taken from autograd: op implementations run below the autograd key.
    """
    gate, grad_out = gate.float(), grad_out.float()
    gated, kind = ACTIVATIONS[name]
    if not gated:
        return _unary_backward(kind, gate, grad_out), None
    up = up.float()
    if kind == 5:
        gate_c = gate.clamp(max=limit)
        up_c = up.clamp(min=-limit, max=limit)
        sig = torch.sigmoid(gate_c * alpha)
        glu = gate_c * sig
        d_glu = (sig + gate_c * alpha * sig * (1 - sig)) * (gate <= limit)
        return grad_out * (up_c + 1) * d_glu, grad_out * glu * ((up >= -limit) & (up <= limit))
    if kind == 6:  # autograd's steps, in its order: the product, each clamp (``where``), then the silu
        silu = F.silu(gate)
        zero = grad_out.new_zeros(())
        d_silu = torch.where(silu <= limit, grad_out * up.clamp(min=-limit, max=limit), zero)
        d_up = torch.where((up >= -limit) & (up <= limit), grad_out * silu.clamp(max=limit), zero)
        return _unary_backward(4, gate, d_silu), d_up
    return _unary_backward(kind, gate, grad_out * up), grad_out * _unary(kind, gate)
