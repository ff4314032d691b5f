"""The two grouped primitives every MoE op is built from, each with a plain-torch reference, and the combine.

``grouped_gemm``         c[rows_c(i)] (+)= epilogue(a[rows_a(i)] @ b[e(i)])   (forward, dX, and dY @ W^T)
``grouped_weight_grad``  dw[e] = sum_i a[rows_a(i)]^T (scale_i * g[rows_g(i)])   (dW grouped over K)

Rows are addressed through the expert-sorted ``order`` (see kernels/grouped_gemm.py for the legend). CUDA tensors run
the Triton kernels through their host wrappers in kernels/launch.py; CPU tensors run the reference, or the kernels
under the interpreter when ``config.triton_on_cpu`` is set.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import config
from ..kernels.launch import (Epilogue, KernelActivation, Rows, SortedRouting, launch_backward_middle, launch_combine,
                              launch_expert_row_sums, launch_grouped_gemm, launch_grouped_weight_grad)
from ..kernels.modes import (  # noqa: F401  (re-exported constants)
    ROWS_ASSIGNMENT,
    ROWS_SORTED,
    ROWS_TOKEN,
    SCALE_ACC,
    SCALE_NONE,
    SCALE_OUT,
)
from .activations import ACTIVATIONS, NO_ACTIVATION, Activation, apply_activation_id


class Routed(NamedTuple):
    """A call's routing, prepared once (``ops.routing.prepare_routing``) for every launch of its forward or
    backward: the (T, k) ids, the routing weight of each assignment (T*k,), the metadata of ops/routing.py, E, and
    whether a capacity may have dropped assignments."""

    topk_ids: torch.Tensor
    scale: torch.Tensor
    order: torch.Tensor
    sorted_expert: torch.Tensor
    offsets: torch.Tensor
    num_experts: int
    dropped: bool

    @property
    def topk(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def rows(self) -> Rows:
        """What a grouped GEMM reads of the routing."""
        return Rows(self.order, self.offsets, self.topk_ids.shape[1])

    @property
    def sorted(self) -> SortedRouting:
        """What the elementwise kernels read of the routing."""
        return SortedRouting(self.scale, self.order, self.sorted_expert, self.num_experts)


def kernel_activation(act: Activation) -> KernelActivation:
    """``act`` as the kernels take it."""
    gated, act_id = ACTIVATIONS[act.name]
    return KernelActivation(gated, act_id, float(act.alpha), float(act.limit))


def epilogue(act: Activation = NO_ACTIVATION, **fields) -> Epilogue:
    """A GEMM epilogue applying ``act``; ``fields`` as in ``kernels.launch.Epilogue``."""
    return Epilogue(act_id=ACTIVATIONS[act.name][1], alpha=float(act.alpha), limit=float(act.limit), **fields)


#: a plain GEMM: no second dot, bias, scale or activation
PLAIN = epilogue()


def is_dense_transpose(w: torch.Tensor) -> bool:
    """Whether each expert of the (E, K, N) weight view ``w`` is the transpose of a dense (N, K) matrix (nn.Linear-style
    storage, whole or the gate or up half of a (E, 2I, H) gate_up tensor). A gradient for such a weight is allocated
    transposed too, so that autograd reads it (or copies it into the parameter) along rows; every other layout gets
    a dense (E, K, N) gradient. The real and the fake kernels both follow this rule: the layouts they return must
    agree."""
    return (w.dim() == 3 and w.stride(1) == 1 and w.stride(2) == w.shape[1]
            and w.stride(0) >= w.shape[1] * w.shape[2])


def use_triton(t: torch.Tensor) -> bool:
    return triton_device(t.device)


def triton_device(device: torch.device) -> bool:
    """Whether our Triton kernels run on tensors of ``device``: CUDA, or the CPU under ``config.triton_on_cpu``."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and config.triton_on_cpu)


def _rows(mode: int, positions: torch.Tensor, assignment: torch.Tensor, topk: int) -> torch.Tensor:
    if mode == ROWS_SORTED:
        return positions
    if mode == ROWS_TOKEN:
        return assignment // topk
    return assignment


def project(rows: torch.Tensor, sizes: list[int], w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[lo:hi] = rows[lo:hi] @ w[e]`` for each expert e, its rows [lo, hi) ``sizes[e]`` long; ``sizes`` may
    end with one more entry, rows past the experts' that are left alone. The views come from one ``split``/``unbind``
    each, not from a slice per expert."""
    for n, r, we, o in zip(sizes, rows.split_with_sizes(sizes), w.unbind(0), out.split_with_sizes(sizes)):
        if n:
            torch.mm(r, we, out=o)
    return out


def project_weight_grad(rows_a: torch.Tensor, rows_g: torch.Tensor, sizes: list[int], dw: torch.Tensor) -> torch.Tensor:
    """``dw[e] = rows_a[lo:hi]^T @ rows_g[lo:hi]`` for each expert e, ``sizes`` as in ``project`` (rows past the
    experts' are not read), zeros for an expert with no rows; ``dw`` in any strides and dtype."""
    pieces = zip(sizes, rows_a.split_with_sizes(sizes), rows_g.split_with_sizes(sizes), dw.unbind(0))
    for n, ra, rg, d in pieces:
        if n == 0:
            d.zero_()
        elif d.is_contiguous() and d.dtype == ra.dtype:
            torch.mm(ra.t(), rg, out=d)
        elif d.t().is_contiguous() and d.dtype == ra.dtype:  # nn.Linear's (out, in) storage: dw^T = g^T a, in
            torch.mm(rg.t(), ra, out=d.t())  # place (a strided copy of the product costs more than the GEMM)
        else:
            d.copy_(ra.t() @ rg)
    return dw


def _plain(epi: Epilogue) -> bool:
    """Whether ``epi`` only stores (or adds) the GEMM's result: no second dot, raw results, scale, bias or
    activation."""
    return (epi.b2 is None and epi.pre is None and epi.bias is None and epi.bias2 is None
            and epi.scale_mode == SCALE_NONE and epi.act_id == PLAIN.act_id)


def row_sizes(offsets: torch.Tensor, num_rows: Optional[int] = None) -> tuple[list[int], int]:
    """Each expert's number of sorted rows, then, where ``num_rows`` is given, the number of rows past the experts
    (for one ``split`` of all ``num_rows``); and how many rows the experts have. One read of ``offsets`` on the
    host: CPU only."""
    bounds = offsets.tolist()
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    return (sizes if num_rows is None else sizes + [num_rows - bounds[-1]]), bounds[-1]


def _gather_sorted(t: torch.Tensor, mode: int, order_kept: torch.Tensor, topk: int) -> torch.Tensor:
    """The rows of ``t`` that the kept sorted rows read (``mode`` as in the kernels), in sorted order."""
    if mode == ROWS_SORTED:
        return t[:order_kept.shape[0]]
    return t.index_select(0, order_kept // topk if mode == ROWS_TOKEN else order_kept)


def grouped_gemm_cpu(a: torch.Tensor, b: torch.Tensor, rows: Rows, out: torch.Tensor, *, a_rows: int,
                     c_rows: int, accumulate: bool) -> torch.Tensor:
    """``grouped_gemm_reference`` with a plain epilogue, batched for the CPU: one gather of every kept row, one
    ``torch.mm`` per non-empty expert into one buffer, one store (or add) of all rows. The reference's per-expert
    indexing costs more than its matmuls at the sizes CPU users train at (RESULTS.md, CPU training step)."""
    order, offsets, topk = rows
    sizes, kept = row_sizes(offsets)
    if kept == 0:
        return out
    order_kept = order[:kept].long()
    h = project(_gather_sorted(a, a_rows, order_kept, topk), sizes, b, a.new_empty(kept, b.shape[2]))
    h = h if h.dtype == out.dtype else h.to(out.dtype)
    if c_rows == ROWS_SORTED:
        if accumulate:
            out[:kept] += h
        else:
            out[:kept] = h
    else:  # within one expert a token appears once, so adding all experts' rows at once is the reference's sum
        dest = order_kept // topk if c_rows == ROWS_TOKEN else order_kept
        if accumulate:
            out.index_add_(0, dest, h)
        else:
            out.index_copy_(0, dest, h)
    return out


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, rows: Rows, out: torch.Tensor, *, a_rows: int, c_rows: int,
                 epi: Epilogue = PLAIN) -> torch.Tensor:
    """Writes into ``out`` and returns it. ``b`` is (E, K, N) in any strides; ``epi.pre`` gets the raw GEMM
    results."""
    if use_triton(a):
        launch_grouped_gemm(a, b, rows, out, a_rows=a_rows, c_rows=c_rows, epilogue=epi, autotune=config.autotune,
                            tail_split=config.gemm_tail_split, tma_weights=config.gemm_tma_weights,
                            tma_min_rows_per_expert=config.tma_min_rows_per_expert,
                            tma_descriptors=config.gemm_tma_descriptors)
        return out
    # a token's rows of different experts land on one output row: only an add is order-free there
    if _plain(epi) and (c_rows != ROWS_TOKEN or epi.accumulate):
        return grouped_gemm_cpu(a, b, rows, out, a_rows=a_rows, c_rows=c_rows, accumulate=epi.accumulate)
    return grouped_gemm_reference(a, b, rows, out, a_rows=a_rows, c_rows=c_rows, epi=epi)


def project_reference(rows: torch.Tensor, w: torch.Tensor, s: Optional[torch.Tensor], epi: Epilogue) -> torch.Tensor:
    """Rows through one projection as the kernel's epilogues define it (``epi`` holding one expert's slices):
    ``rows @ w`` (and ``@ epi.b2``, the up half of a gated activation), raw results into ``epi.pre``, then the
    routing scale ``s`` when SCALE_ACC, the bias, the activation, and ``s`` when SCALE_OUT."""
    acc = rows @ w
    acc2 = rows @ epi.b2 if epi.b2 is not None else None
    if epi.pre is not None:
        epi.pre[..., :w.shape[-1]] = acc
        if acc2 is not None:
            epi.pre[..., w.shape[-1]:] = acc2
    if epi.scale_mode != SCALE_NONE:
        s = s.to(acc.dtype)
    if epi.scale_mode == SCALE_ACC:
        acc = acc * s
        acc2 = acc2 * s if acc2 is not None else None
    if epi.bias is not None:
        acc = acc + epi.bias
        if acc2 is not None:
            acc2 = acc2 + epi.bias2
    h = apply_activation_id(acc2 is not None, epi.act_id, acc, acc2, epi.alpha, epi.limit)
    return h * s if epi.scale_mode == SCALE_OUT else h


def expert_slice(epi: Epilogue, e: int, lo: int, hi: int) -> Epilogue:
    """Expert ``e``'s part of a grouped epilogue: its weight and bias rows, and sorted rows [lo, hi) of ``pre``."""
    def at(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return t[e] if t is not None else None

    return epi._replace(b2=at(epi.b2), bias=at(epi.bias), bias2=at(epi.bias2),
                        pre=epi.pre[lo:hi] if epi.pre is not None else None)


def grouped_gemm_reference(a: torch.Tensor, b: torch.Tensor, rows: Rows, out: torch.Tensor, *, a_rows: int,
                           c_rows: int, epi: Epilogue = PLAIN) -> torch.Tensor:
    """Plain torch, one matmul per non-empty expert, in the input dtype like the eager modules."""
    order, offsets, topk = rows
    bounds = offsets.tolist()  # CPU only: the reference may read sizes back
    order_l = order.long()
    for e in range(b.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        positions = torch.arange(lo, hi, device=a.device)
        assignment = order_l[lo:hi]
        rows_a = a[_rows(a_rows, positions, assignment, topk)]
        s = epi.scale[assignment][:, None] if epi.scale_mode != SCALE_NONE else None
        h = project_reference(rows_a, b[e], s, expert_slice(epi, e, lo, hi))
        rows_c = _rows(c_rows, positions, assignment, topk)
        if epi.accumulate:
            out[rows_c] += h.to(out.dtype)
        else:
            out[rows_c] = h.to(out.dtype)
    return out


def grouped_weight_grad(a: torch.Tensor, g: torch.Tensor, rows: Rows, dw: torch.Tensor, *, a_rows: int, g_rows: int,
                        scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Writes ``dw`` (E, K, N), zeros for empty experts, and returns it."""
    if use_triton(a):
        launch_grouped_weight_grad(a, g, rows, dw, a_rows=a_rows, g_rows=g_rows, scale=scale,
                                   autotune=config.autotune)
        return dw
    return grouped_weight_grad_cpu(a, g, rows, dw, a_rows=a_rows, g_rows=g_rows, scale=scale)


def grouped_weight_grad_cpu(a: torch.Tensor, g: torch.Tensor, rows: Rows, dw: torch.Tensor, *, a_rows: int,
                            g_rows: int, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``grouped_weight_grad_reference`` batched for the CPU: one gather of each operand's kept rows (and one
    scale), then one ``torch.mm`` per expert on contiguous slices."""
    order, offsets, topk = rows
    sizes, kept = row_sizes(offsets)
    order_kept = order[:kept].long()
    rows_a = _gather_sorted(a, a_rows, order_kept, topk)
    rows_g = _gather_sorted(g, g_rows, order_kept, topk)
    if scale is not None:
        rows_g = (rows_g * scale[order_kept].to(rows_g.dtype)[:, None]).to(g.dtype)
    return project_weight_grad(rows_a, rows_g, sizes, dw)


def grouped_weight_grad_reference(a: torch.Tensor, g: torch.Tensor, rows: Rows, dw: torch.Tensor, *, a_rows: int,
                                  g_rows: int, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    order, offsets, topk = rows
    bounds = offsets.tolist()
    order_l = order.long()
    for e in range(dw.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            dw[e] = 0
            continue
        positions = torch.arange(lo, hi, device=a.device)
        assignment = order_l[lo:hi]
        rows_g = g[_rows(g_rows, positions, assignment, topk)]
        if scale is not None:
            rows_g = (rows_g * scale[assignment].to(rows_g.dtype)[:, None]).to(g.dtype)
        dw[e] = (a[_rows(a_rows, positions, assignment, topk)].t() @ rows_g).to(dw.dtype)
    return dw


#: the width of the column of ones that turns the weight-gradient GEMM into per-expert row sums (a GEMM tile's
#: smallest width; the other 15 columns of the result are the same sums, computed and dropped)
_ONES_WIDTH = 16


def sum_rows_by_expert(g: torch.Tensor, routed: Routed, g_rows: int, dtype: torch.dtype,
                       scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(E, width) sums, per expert, of the rows of ``g`` its sorted rows read (``g_rows`` as in the weight-gradient
    GEMM, each times ``scale`` of its assignment where given), accumulated in fp32 and cast to ``dtype``: a bias
    gradient. Each program of kernels/row_sums.py sums its expert's rows in order, where an ``index_add_`` into E
    rows serialises on atomics (GPT-OSS's training profile in RESULTS.md) and sums in no fixed order. Off the
    kernels it is the weight-gradient GEMM of a column of ones, ``ones^T @ g_e``."""
    E = routed.num_experts
    if use_triton(g):
        sums = g.new_empty(E, g.shape[1], dtype=dtype)
        launch_expert_row_sums(g, routed.rows, sums, g_rows=g_rows, scale=scale)
        return sums
    ones = g.new_ones(routed.order.shape[0], _ONES_WIDTH)
    sums = g.new_empty(E, _ONES_WIDTH, g.shape[1], dtype=dtype)
    grouped_weight_grad(ones, g, routed.rows, sums, a_rows=ROWS_SORTED, g_rows=g_rows, scale=scale)
    return sums[:, 0].contiguous()


def down_bias_scale_grad(dy: torch.Tensor, b2: torch.Tensor, token: torch.Tensor,
                         expert: torch.Tensor) -> torch.Tensor:
    """(M,) fp32: for each sorted row, ``dy[token] . b2[expert]``, the routing weight's gradient through the down
    bias (``expert`` clamped into range). It is one (T, E) product of dy with every expert's bias and a gather of M
    of its entries, not the two (M, H) fp32 tensors that gathering dy's and b2's rows would make first."""
    return (dy.float() @ b2.float().t())[token, expert]


def gate_up_bias_grads(d_gate: torch.Tensor, d_up: Optional[torch.Tensor], pairs: Optional[torch.Tensor],
                       routed: Routed, wanted: tuple[Optional[torch.Tensor], Optional[torch.Tensor]]) -> tuple:
    """(db1, db1_up): the per-expert row sums of d_gate and d_up, for each of ``wanted`` = (b1, b1_up) given (None:
    no gradient wanted), in its dtype. Where the two are the even and odd columns of ``pairs`` (M, 2I) and both are
    wanted, one pass over the pairs gives both, split into two tensors after (an op's gradients must not be views
    of one)."""
    b1, b1_up = wanted
    if pairs is not None and b1 is not None and b1_up is not None and b1.dtype == b1_up.dtype:
        both = sum_rows_by_expert(pairs, routed, ROWS_SORTED, b1.dtype)
        return both[:, 0::2].contiguous(), both[:, 1::2].contiguous()
    db1 = sum_rows_by_expert(d_gate, routed, ROWS_SORTED, b1.dtype) if b1 is not None else None
    db1_up = sum_rows_by_expert(d_up, routed, ROWS_SORTED, b1_up.dtype) if b1_up is not None else None
    return db1, db1_up


def combine(rows: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, row_of: Optional[torch.Tensor] = None,
            scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y (T, H) = sum over k of rows (T*k, H), skipping assignments with an id outside [0, E) (rows never written).

    ``row_of`` (T*k,): assignment t*k + j is read from row ``row_of[t*k + j]`` (rows in expert-sorted order);
    ``scale`` (T*k,): each assignment's row is multiplied by it, in fp32, before the sum;
    ``bias`` (E, H): each assignment's row gets its expert's bias added, in fp32, before the scale.
    """
    if use_triton(rows):
        return launch_combine(rows, topk_ids, num_experts, row_of, scale, bias)
    T, k = topk_ids.shape
    H = rows.shape[1]
    valid = ((topk_ids >= 0) & (topk_ids < num_experts)).reshape(-1)
    picked = rows[row_of.long()] if row_of is not None else rows  # row_of is a permutation of the rows
    picked = picked.float()
    if bias is not None:
        picked = picked + bias.float()[topk_ids.reshape(-1).long().clamp(0, num_experts - 1)]
    picked = picked * (scale.float()[:, None] if scale is not None else 1.0)
    return torch.where(valid[:, None], picked, 0.0).view(T, k, H).sum(1).to(rows.dtype)


def backward_middle(pre: torch.Tensor, g: torch.Tensor, routing: SortedRouting,
                    biases: tuple[Optional[torch.Tensor], Optional[torch.Tensor]], act: Activation,
                    dtype: torch.dtype, out: Optional[tuple | torch.Tensor] = None, scale_h: bool = False,
                    paired: bool = False) -> tuple:
    """(h, d_gate, d_up, d_scale) of the fused middle (kernels/backward_middle.py); h and the gradients in ``dtype``,
    d_up None when the activation is not gated; ``biases`` = (b1, b1_up), both None without biases.

    Args:
        out: (d_gate, d_up) buffers to write into, of one shape and strides (two column halves of one (M, 2I)
            tensor, or its even and odd columns); or that one tensor d_pre whole ((M, I) when not gated), written
            as its halves, or as (gate, up) pairs where ``paired``: d_gate and d_up are then its views.
        scale_h: store h multiplied by its routing weight.
    """
    M, I = g.shape
    kact = kernel_activation(act)
    h = g.new_empty(M, I, dtype=dtype)
    whole = None
    if isinstance(out, torch.Tensor):
        d_pre = out
        if kact.gated:
            whole = "pairs" if paired else "halves"
        d_gate, d_up = d_pre, None
    elif out is not None:
        d_gate, d_up = out
    else:
        d_gate = g.new_empty(M, I, dtype=dtype)
        d_up = g.new_empty(M, I, dtype=dtype) if kact.gated else None
    d_scale = g.new_empty(M, dtype=torch.float32)
    launch_backward_middle(pre, g, routing, biases, (h, d_gate, d_up, d_scale), kact, scale_h, whole=whole)
    if whole is not None:
        d_gate, d_up = (out[:, 0::2], out[:, 1::2]) if paired else (out[:, :I], out[:, I:])
    return h, d_gate, d_up, d_scale
