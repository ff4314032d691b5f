"""The experts op's GEMMs through ``torch._grouped_mm`` (CUTLASS on Hopper), for the compute-bound regime.

Why: with few large experts and many rows each (Mixtral at T >= 4096: 8 experts, ~1000 rows each, 4096 x 14336
weights) the GEMMs are compute-bound, and there our Triton grouped GEMM reaches about 480 TFLOP/s against CUTLASS's
~650 (benchmarks/RESULTS.md). Fusing the gather into the GEMM saves little there, since the GEMM dwarfs a copy of x.
So in that regime the op keeps its routing, activation, combine and backward middle (our kernels) and hands the
four GEMMs to ``torch._grouped_mm``. Everywhere else (small experts, short batches, capacity, other weight
positions) the fused Triton kernels stay: they win there.

Layers with biases (GPT-OSS's: interleaved gate/up, clamped glu) take the engine from
``config.grouped_mm_biased_min_rows_per_expert`` rows per expert in the forward (``..._backward_...`` in the
backward): inside the model at T = 4096 their fused GEMMs, with the interleaved pairs and the biases in the
epilogue, took 1.5x CUTLASS's time, and their fused backward's GEMMs 1.8x (RESULTS.md, fifteenth session).
The biases then go into the activation pass (up) and the combine (down), the interleaved pairs are read as they
lie, and a kept ``pre`` is written in the one [gate | up] layout that either backward reads. In the backward the
bias gradients are per-expert row sums (``sum_rows_by_expert``), and dx reads the interleaved weight whole from
the gate and up gradients paired up again.

``config.gemm_engine`` picks: "auto" (the rule in ``grouped_mm_weights``), "triton" (never this), "grouped_mm"
(whenever the layout allows; also on the CPU with ``config.triton_on_cpu``, where the tests drive it).

Gate and up weights held as two tensors (torchtitan's w1 and w3, any code with separate gate and up stacks) run as
two GEMMs into separate (M, I) results that the activation pass reads side by side (``UpWeights`` is then the pair);
dx is then two GEMMs summed. Copying the pair into one weight at every call would move 2 E H I values each time.

Nothing here reads a tensor's values on the host: the choice depends on shapes, dtypes and strides only, and the
group boundaries are the device offsets of the routing metadata.
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch
from torch import Tensor

from .. import config
from ..kernels.launch import launch_activation, tracing_launches
from ..kernels.weight_views import interleaved_pairs, same_storage
from .activations import Activation
from .call import ExpertsCall
from .grouped import (ROWS_TOKEN, Routed, backward_middle, combine, down_bias_scale_grad, is_dense_transpose,
                      gate_up_bias_grads, kernel_activation, sum_rows_by_expert, use_triton)


#: the up-projection operand(s) ``torch._grouped_mm`` reads: one (E, H, n_pre) weight ([gate | up], interleaved pairs
#: or ungated), or the (gate, up) pair of (E, H, I) weights where they are two tensors
UpWeights = Union[Tensor, tuple[Tensor, Tensor]]


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _dense_enough(w: Tensor) -> bool:
    """``torch._grouped_mm``'s layout rule for a (E, K, N) operand: one of the two inner strides is 1, the other a
    multiple of 16 bytes that covers the row, and experts do not overlap."""
    E, K, N = w.shape
    s0, s1, s2 = w.stride()
    inner_ok = (s2 == 1 and s1 >= N and s1 % 8 == 0) or (s1 == 1 and s2 >= K and s2 % 8 == 0)
    return inner_ok and s0 >= K * N and s0 % 8 == 0 and _aligned(w)


def _aligned(w: Tensor) -> bool:
    """Whether ``w`` starts on a 16-byte boundary. A traced call's tensors (fake while AOT autograd traces) have no
    address: there its offset into its storage decides, storages being allocated 16-byte aligned."""
    if tracing_launches():
        return w.storage_offset() * w.element_size() % 16 == 0
    return w.data_ptr() % 16 == 0


def combined_up_weights(w1: Tensor, w1_up: Optional[Tensor]) -> Optional[Tensor]:
    """The (E, H, 2I) [gate | up] view when ``w1`` and ``w1_up`` are the two halves of one tensor (HF's
    ``gate_up_proj``, either layout), ``w1`` itself when not gated, else None. No copy is made."""
    if w1_up is None:
        return w1
    E, H, I = w1.shape
    if w1_up.stride() != w1.stride() or w1_up.dtype != w1.dtype:
        return None
    if not same_storage(w1, w1_up):
        return None
    s0, s1, s2 = w1.stride()
    if w1_up.storage_offset() - w1.storage_offset() != I * s2:  # up's columns start right after gate's
        return None
    return w1.as_strided((E, H, 2 * I), (s0, s1, s2))


def _large_experts(H: int, I: int) -> bool:
    """"auto"'s size rule: experts of at least ``config.grouped_mm_min_expert_weights`` weights per projection."""
    return H * I >= config.grouped_mm_min_expert_weights


def may_take_experts_of(w2: Tensor, biased: bool = False, num_rows: Optional[int] = None) -> bool:
    """Whether experts of this size can take the engine at some token count (its size and row rules, shapes only).
    ``w2`` is the (E, I, H) down weight: unlike w1, which may hold the gate and up weights whole, it has the
    experts' own width. ``biased``: the layer has biases; ``num_rows``: the call's row count (T * k) where it is
    static, None where it is not known."""
    E, I, H = w2.shape
    if config.gemm_engine == "grouped_mm":
        return True
    if config.gemm_engine != "auto":
        return False
    if biased:
        return H * I >= config.grouped_mm_biased_min_expert_weights and (
            num_rows is None or num_rows >= config.grouped_mm_biased_min_rows_per_expert * E)
    return _large_experts(H, I)


def may_take_backward_of(x: Tensor, w2: Tensor, biased: bool, num_rows: int) -> bool:
    """Whether the engine may take the backward of a call with ``num_rows`` rows (its mode, dtype and row rules:
    shapes and settings only, so it answers for fake tensors too). False only where ``grouped_mm_weights(...,
    backward=True)`` is sure to return None."""
    mode = engine_mode(backward=True)
    if mode == "grouped_mm":
        return True
    if mode == "triton" or x.dtype != torch.bfloat16:
        return False
    E, I, H = w2.shape
    return _auto_rules_pass(E, H, I, biased, num_rows, backward=True)


def _auto_rules_pass(E: int, H: int, I: int, biased: bool, num_rows: int, backward: bool) -> bool:
    """"auto"'s row and size rules, where it was measured to win: with biases, enough rows per expert (the
    backward's own count) and large enough experts; the backward's weight gradients, enough rows per expert at any
    expert size measured; else enough rows per expert and large experts (``_large_experts``)."""
    if biased:
        per_expert = (config.grouped_mm_biased_backward_min_rows_per_expert if backward
                      else config.grouped_mm_biased_min_rows_per_expert)
        return num_rows >= per_expert * E and H * I >= config.grouped_mm_biased_min_expert_weights
    if backward:
        return num_rows >= config.grouped_mm_backward_min_rows_per_expert * E
    return num_rows >= config.grouped_mm_min_rows_per_expert * E and _large_experts(H, I)


def engine_mode(backward: bool = False) -> str:
    """The engine setting in force for the forward or the backward: ``config.gemm_engine``, which
    ``config.gemm_engine_backward`` overrides for the backward when set."""
    mode = config.gemm_engine_backward if backward and config.gemm_engine_backward is not None else config.gemm_engine
    if mode not in ("auto", "triton", "grouped_mm"):
        raise ValueError(f"moe_inductor: gemm engine must be 'auto', 'triton' or 'grouped_mm', got {mode!r}")
    return mode


def grouped_mm_weights(x: Tensor, w1: Tensor, w1_up: Optional[Tensor], w2: Tensor, b1: Optional[Tensor],
                       b2: Optional[Tensor], weight_position: str, dropped: bool, num_rows,
                       backward: bool = False) -> Optional[UpWeights]:
    """The up weights to run through ``torch._grouped_mm`` when this call should (``UpWeights``), else None.
    ``backward``: decide for the backward's GEMMs (``config.gemm_engine_backward``, when set, overrides the mode;
    "auto" then asks ``config.grouped_mm_backward_min_rows_per_expert`` rows per expert and no size rule).

    "auto" takes this path only where it was measured to win on the H200: bf16 on Hopper, at least
    ``config.grouped_mm_min_rows_per_expert`` rows per expert on average, and experts of at least
    ``config.grouped_mm_min_expert_weights`` weights per projection (H * I).
    """
    mode = engine_mode(backward)
    if mode == "triton" or isinstance(num_rows, torch.SymInt) or num_rows == 0:
        return None
    # a traced call decides once, for the graph: only a backward whose ops were picked for it
    # (``visible_backward.engine_backward_traceable``) takes the engine there
    if tracing_launches() and not (backward and config.visible_engine_backward):
        return None
    if not isinstance(w1, Tensor):  # per-expert weights read through a table (kernels/weight_table.py): no one tensor
        return None
    E, H, I = w1.shape
    biased = b1 is not None or b2 is not None
    # the size rule first: it is the cheapest test, and most calls (decode, small experts) stop here
    if mode == "auto" and not _auto_rules_pass(E, H, I, biased, num_rows, backward):
        return None
    if weight_position != "output" or dropped:
        return None
    if x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm") or not use_triton(x) or H % 8 or I % 8:
        return None
    if x.is_cuda and not _is_hopper(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return None
    if not x.is_cuda and mode != "grouped_mm":
        return None
    if not _dense_enough(w2):
        return None
    w_up = combined_up_weights(w1, w1_up)
    if w_up is None and w1_up is not None:  # GPT-OSS's pairs: read as they lie
        w_up = interleaved_pairs(w1, w1_up)
    if w_up is None and w1_up is not None and not same_storage(w1, w1_up):  # two tensors: two GEMMs
        separate = w1_up.shape == w1.shape and w1_up.dtype == w1.dtype and _dense_enough(w1) and _dense_enough(w1_up)
        return (w1, w1_up) if separate else None
    if w_up is None or not _dense_enough(w_up):
        return None
    return w_up


def is_interleaved(w_up: UpWeights, w1: Tensor) -> bool:
    """Whether ``grouped_mm_weights``' up weights hold (gate, up) in even and odd columns (else [gate | up], two
    tensors or ungated): the whole weight's columns are twice as dense as the gate's."""
    return isinstance(w_up, Tensor) and w_up.shape[2] == 2 * w1.shape[2] and w1.stride(2) == 2 * w_up.stride(2)


def _up_projection(rows: Tensor, w_up: UpWeights, group_ends: Tensor) -> Tensor:
    """The raw up projection of expert-sorted ``rows``, (M, n_pre): [gate | up] halves when the pair is two
    tensors (else in the whole weight's own column order)."""
    if isinstance(w_up, Tensor):
        return torch._grouped_mm(rows, w_up, offs=group_ends)
    return torch.cat([torch._grouped_mm(rows, w, offs=group_ends) for w in w_up], 1)


def _sorted_rows(x: Tensor, token: Tensor) -> Tensor:
    """The rows of ``x`` (T, H) in expert-sorted order (``token``: each sorted row's token), (M, H) row-major.
    Traced, our gather kernel writes them (kernels/gather.py): Inductor's own gather, read through a transpose by a
    weight gradient's GEMM, would be laid out with the grouped dimension contiguous, which ``torch._grouped_mm``
    refuses on the device."""
    if tracing_launches():
        from ..kernels.gather import gather_rows  # (imports triton: installs without it never trace)

        return gather_rows(x, token)
    return x.index_select(0, token)


def _row_of(order: Tensor) -> Tensor:
    """The inverse permutation of ``order``: the sorted row of each assignment."""
    M = order.shape[0]
    return torch.empty_like(order).scatter_(0, order.long(), torch.arange(M, dtype=order.dtype, device=order.device))


def forward(x: Tensor, routed: Routed, w_up: UpWeights, w2: Tensor, act: Activation,
            biases: tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]] = (None, None, None),
            interleaved: bool = False, save_pre: bool = True) -> tuple[Tensor, Tensor]:
    """(y, pre): the experts forward with "output" routing weights; pre (M, n_pre) is the raw up projection as
    [gate | up] halves, without biases (empty unless ``save_pre``). ``biases`` = (b1, b1_up, b2); ``interleaved``:
    ``w_up``'s columns are (gate, up) pairs."""
    b1, b1_up, b2 = biases
    group_ends = routed.offsets[1:]
    x_sorted = x.index_select(0, routed.order.long() // routed.topk)
    kact = kernel_activation(act)
    if not isinstance(w_up, Tensor):  # gate and up as two tensors: two GEMMs, read side by side
        gate, up = (torch._grouped_mm(x_sorted, w, offs=group_ends) for w in w_up)
        del x_sorted
        pre = x.new_empty(gate.shape[0], 2 * gate.shape[1]) if save_pre else x.new_empty(0)
        h = launch_activation(gate, kact, biases=(b1, b1_up), sorted_expert=routed.sorted_expert,
                              pre_out=pre if save_pre else None, up=up)
        del gate, up
        return _down_and_combine(h, routed, w2, b2), pre
    raw = torch._grouped_mm(x_sorted, w_up, offs=group_ends)
    del x_sorted
    # the raw GEMM output is already the kept layout unless its pairs are interleaved or it is not to be kept
    reorder = save_pre and interleaved and kact.gated
    pre = x.new_empty(raw.shape) if reorder else (raw if save_pre else x.new_empty(0))
    h = launch_activation(raw, kact, interleaved=interleaved, biases=(b1, b1_up),
                          sorted_expert=routed.sorted_expert, pre_out=pre if reorder else None)
    del raw
    return _down_and_combine(h, routed, w2, b2), pre


def _down_and_combine(h: Tensor, routed: Routed, w2: Tensor, b2: Optional[Tensor]) -> Tensor:
    out_sorted = torch._grouped_mm(h, w2, offs=routed.offsets[1:])
    del h
    return combine(out_sorted, routed.topk_ids, w2.shape[0], row_of=_row_of(routed.order), scale=routed.scale, bias=b2)


def _weight_grad(a: Tensor, g: Tensor, group_ends: Tensor, like: Tensor) -> Tensor:
    """Per expert a_e^T @ g_e, (E, K, N), computed in the layout of ``like`` (a transposed weight gets a transposed
    gradient, so that autograd does not copy it): ``is_dense_transpose``'s rule, which the fake kernel follows."""
    if is_dense_transpose(like):
        return torch._grouped_mm(g.t(), a, offs=group_ends).transpose(1, 2)
    return torch._grouped_mm(a.t(), g, offs=group_ends)


def middle_grads(dy: Tensor, call: ExpertsCall, routed: Routed, w_up: UpWeights, pre: Tensor, needs) -> tuple:
    """The first half of the engine's backward (``ops/backward.py`` runs the two as ops of their own), the last that
    reads ``pre``: (d_pre, d_scale_sorted, dw2, db2, db1, db1_up).
    d_pre (M, n_pre) holds the gradients of the raw up projection, as its (gate, up) column pairs where
    ``needs.gate_up_pairs`` and the weight is interleaved, else as [gate | up] halves (see ``backward.Needs``)."""
    x, w, act = call.x, call.weights, call.activation
    order, offsets, topk = routed.rows
    sorted_expert = routed.sorted_expert
    M = order.shape[0]
    E, _, I = w.w1.shape
    interleaved = is_interleaved(w_up, w.w1)
    group_ends = offsets[1:]
    token = order.long() // topk
    if pre.shape[0] != M:  # the forward did not keep it: the raw up projection again, as [gate | up] halves
        pre = _up_projection(_sorted_rows(x, token), w_up, group_ends)
        if interleaved:
            pre = pre.view(M, I, 2).transpose(1, 2).reshape(M, 2 * I)
    dy_sorted = _sorted_rows(dy, token)
    g = torch._grouped_mm(dy_sorted, w.w2.transpose(1, 2), offs=group_ends)  # d h, before the routing weight
    # Where the interleaved weight came whole, d_pre's columns are written as its (gate, up) pairs, which the whole
    # weight's gradient and dx's GEMM read as they are. Else they are [gate | up] halves: two gradients want dense
    # operands, and one stack for dx costs less than stride-2 stores.
    # d_pre goes to the kernel whole (it writes the halves or pairs itself): a traced launch that wrote two views
    # would have Inductor clone each without the rest of its storage
    d_pre = x.new_empty(M, pre.shape[1])
    h_scaled, d_gate, d_up, d_scale_sorted = backward_middle(pre, g, routed.sorted, (w.b1, w.b1_up), act, x.dtype,
                                                             out=d_pre, scale_h=True,
                                                             paired=interleaved and needs.gate_up_pairs)
    del g, pre
    if w.b2 is not None and needs.topk_weights:  # the routing weight also scales the down bias
        expert_c = sorted_expert.long().clamp(max=E - 1)
        d_scale_sorted = d_scale_sorted + down_bias_scale_grad(dy, w.b2, token, expert_c)
    dw2 = _weight_grad(h_scaled, dy_sorted, group_ends, w.w2) if needs.w2 else None
    del h_scaled, dy_sorted
    db2 = None
    if w.b2 is not None and needs.b2:
        db2 = sum_rows_by_expert(dy, routed, ROWS_TOKEN, w.b2.dtype, scale=routed.scale)
    paired = interleaved and needs.gate_up_pairs
    db1, db1_up = gate_up_bias_grads(d_gate, d_up, d_pre if paired else None, routed,
                                     (w.b1 if needs.b1 else None, w.b1_up if needs.b1_up else None))
    return d_pre, d_scale_sorted, dw2, db2, db1, db1_up


def up_grads(call: ExpertsCall, routed: Routed, w_up: UpWeights, d_pre: Tensor, d_scale_sorted: Optional[Tensor],
             needs) -> tuple:
    """The second half of the engine's backward, from ``middle_grads``' d_pre and d_scale_sorted: (dx, d_weights,
    dw1, dw1_up), None where not wanted. x is gathered in expert order (M x H) only here, for dW1, after the first
    half's sorted dy (also M x H) is gone: one such tensor at a time."""
    x, w1, w1_up = call.x, call.weights.w1, call.weights.w1_up
    topk_weights = call.routing.topk_weights
    order, offsets, topk = routed.rows
    T, H = x.shape
    M = order.shape[0]
    E, _, I = w1.shape
    gated = w1_up is not None
    interleaved = is_interleaved(w_up, w1)
    paired = interleaved and needs.gate_up_pairs
    d_gate, d_up = gate_up_columns(d_pre, gated, paired)
    group_ends = offsets[1:]
    dw1 = dw1_up = None
    if needs.combined_gate_up or needs.w1 or needs.w1_up:
        x_sorted = _sorted_rows(x, order.long() // topk)
        if needs.combined_gate_up and isinstance(w_up, Tensor):  # one GEMM over d_pre, its columns in d_pre's order (pairs seen as (E, H, I, 2))
            dw1 = _weight_grad(x_sorted, d_pre, group_ends, w_up)
            if paired:
                dw1 = dw1.unflatten(2, (I, 2))
        else:  # two GEMMs: the gradients of an op must not be views of one tensor
            dw1 = _weight_grad(x_sorted, d_gate, group_ends, w1) if needs.w1 else None
            dw1_up = _weight_grad(x_sorted, d_up, group_ends, w1_up) if needs.w1_up else None
        del x_sorted
    del d_gate, d_up
    dx = None
    if needs.x:
        if interleaved and not paired:  # the whole weight's columns are (gate, up) pairs: so must d_pre's be
            d_pre = torch.stack((d_pre[:, :I], d_pre[:, I:]), -1).view(M, 2 * I)
        if isinstance(w_up, Tensor):
            dx_sorted = torch._grouped_mm(d_pre, w_up.transpose(1, 2), offs=group_ends)
        else:  # two tensors: d_gate @ w1^T + d_up @ w1_up^T
            dx_sorted = torch._grouped_mm(d_pre[:, :I], w_up[0].transpose(1, 2), offs=group_ends)
            dx_sorted += torch._grouped_mm(d_pre[:, I:], w_up[1].transpose(1, 2), offs=group_ends)
        del d_pre
        dx = combine(dx_sorted, routed.topk_ids, E, row_of=_row_of(order))
    d_weights = None
    if needs.topk_weights:
        # rows of out-of-range ids (masked choices) were never computed: their h, and so their sum, may be garbage
        d_scale_sorted = torch.where(routed.sorted_expert < E, d_scale_sorted, 0.0)
        d_flat = torch.zeros(M, dtype=torch.float32, device=x.device).index_put_((order.long(),), d_scale_sorted)
        d_weights = d_flat.view(T, topk).to(topk_weights.dtype)
    return dx, d_weights, dw1, dw1_up


def gate_up_columns(d_pre: Tensor, gated: bool, paired: bool) -> tuple[Tensor, Optional[Tensor]]:
    """(d_gate, d_up) as views of d_pre (M, n_pre): its even and odd columns when ``paired``, else its halves; the
    whole of it and None when the activation is not gated."""
    if not gated:
        return d_pre, None
    if paired:
        return d_pre[:, 0::2], d_pre[:, 1::2]
    half = d_pre.shape[1] // 2
    return d_pre[:, :half], d_pre[:, half:]
