"""Triton grouped GEMMs for MoE experts.

Shapes (the legend used across kernels/ and ops/):
  T tokens, k choices per token, M = T*k assignments, E experts, K reduction width, N output width.
  ``order_M``    int32, the flat assignment index (t*k + j) of every row in expert-sorted order.
  ``offsets_E1`` int32 (E+1,), rows of expert e are ``[offsets[e], offsets[e+1])`` of the sorted order.
                 Rows past ``offsets[E]`` were dropped (capacity) and are never touched.

Row modes say which row of a tensor a sorted position ``i`` reads or writes:
  ROWS_SORTED = i itself, ROWS_TOKEN = order[i] // k, ROWS_ASSIGNMENT = order[i].

The forward kernel walks a flattened tile list: m-tile ``i_m`` belongs to the expert whose cumulative tile count
passes it. The list is derived inside the kernel from ``offsets``, so the host never reads a count back and the grid
is sized by the worst case ``cdiv(M, BLOCK_M) + min(E, M)``; tiles past the real count exit at once. That is what keeps the
op free of host syncs and safe under CUDA graphs, and it spreads a hot expert over the whole grid.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .modes import ROWS_ASSIGNMENT, ROWS_SORTED, ROWS_TOKEN, SCALE_ACC, SCALE_NONE, SCALE_OUT  # noqa: F401


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _unary_act(x, ACT: tl.constexpr):
    # ids: 0 none, 1 relu, 2 gelu (erf), 3 gelu (tanh), 4 silu; see ops/activations.py
    if ACT == 1:
        x = tl.maximum(x, 0.0)
    elif ACT == 2:
        x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 3:
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = 0.5 * x * (1.0 + (2.0 * _sigmoid(2.0 * z) - 1.0))
    elif ACT == 4:
        x = x * _sigmoid(x)
    return x


@triton.jit
def _activation(gate, up, GATED: tl.constexpr, ACT: tl.constexpr, alpha, limit):
    """act(gate, up) for a gated activation, act(gate) otherwise (``up`` unused), in fp32; ids as in
    ops/activations.py, 5 being GPT-OSS's glu: clamp, gate * sigmoid(alpha * gate) * (up + 1); 6 Step-3.7's
    clamped silu-glu: min(silu(gate), limit) * clamp(up, -limit, limit)."""
    if GATED:
        if ACT == 5:
            # in fp32: Inductor's wrapper passes Python floats as fp64 scalars, which would make the epilogue fp64
            alpha, limit = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)
            gate_c = tl.minimum(gate, limit)
            up_c = tl.minimum(tl.maximum(up, -limit), limit)
            out = (up_c + 1.0) * (gate_c * _sigmoid(gate_c * alpha))
        elif ACT == 6:
            # fp32, as above; the clamps keep a NaN a NaN, as torch.clamp does
            limit = tl.cast(limit, tl.float32)
            silu_c = tl.minimum(gate * _sigmoid(gate), limit, propagate_nan=tl.PropagateNan.ALL)
            up_c = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                              propagate_nan=tl.PropagateNan.ALL)
            out = silu_c * up_c
        else:
            out = _unary_act(gate, ACT) * up
    else:
        out = _unary_act(gate, ACT)
    return out


@triton.jit
def _rows(MODE: tl.constexpr, o_m, assignment, topk):
    """Row index, as int64, that sorted position o_m reads or writes under row mode MODE (see the module doc)."""
    if MODE == 0:
        rows = o_m
    elif MODE == 1:
        rows = assignment // topk
    else:
        rows = assignment
    return rows.to(tl.int64)


@triton.jit
def _expert_of_tile(p_offsets, i_m, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                    SPLIT: tl.constexpr = 0, FULL_M: tl.constexpr = 1):
    """(expert, first row, end row) of m-tile ``i_m``; expert == NUM_EXPERTS when the tile is past the work.

    SPLIT picks which of each expert's rows the tiles cover (see ``grouped_gemm_kernel``): 0 all of them, 1 only
    its whole BLOCK_M tiles, 2 only the rows past its whole FULL_M tiles (its tail, fewer than FULL_M rows)."""
    o_e = tl.arange(0, E_POW2)
    m_e = o_e < NUM_EXPERTS
    b_start = tl.load(p_offsets + o_e, mask=m_e, other=0)
    b_end = tl.load(p_offsets + o_e + 1, mask=m_e, other=0)
    if SPLIT == 1:
        b_tiles = (b_end - b_start) // BLOCK_M
    elif SPLIT == 2:
        b_start += (b_end - b_start) // FULL_M * FULL_M
        b_tiles = tl.cdiv(b_end - b_start, BLOCK_M)
    else:
        b_tiles = tl.cdiv(b_end - b_start, BLOCK_M)
    b_cum = tl.cumsum(b_tiles, 0)
    expert = tl.sum((b_cum <= i_m).to(tl.int32), 0)
    m_sel = o_e == expert
    tile_first = tl.sum(tl.where(m_sel, b_cum - b_tiles, 0), 0)
    row_start = tl.sum(tl.where(m_sel, b_start, 0), 0) + (i_m - tile_first) * BLOCK_M
    row_end = tl.sum(tl.where(m_sel, b_end, 0), 0)
    return expert, row_start, row_end


@triton.jit
def _weight_tile_tma(desc, expert, k0, n0, B_NK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (BLOCK_K, BLOCK_N) weight tile at (k0, n0) of ``expert`` through a 3D TMA descriptor: over (E, N, K) when
    B_NK (HF's nn.Linear layout, read transposed), else (E, K, N). Past N or K it reads zeros (TMA's bounds)."""
    if B_NK:
        tile = desc.load([expert, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
    else:
        tile = desc.load([expert, k0, n0]).reshape(BLOCK_K, BLOCK_N)
    return tile


@triton.jit
def _weight_descriptor(p_w, N, K, stride_e, stride_k, stride_n, NUM_EXPERTS: tl.constexpr, B_NK: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A 3D TMA descriptor of the weights at ``p_w``, made in the kernel, as ``_weight_tile_tma`` reads it: over
    (E, N, K) when B_NK (``stride_k`` is then 1), else over (E, K, N) (``stride_n`` is 1)."""
    if B_NK:
        desc = tl.make_tensor_descriptor(p_w, [NUM_EXPERTS, N, K], [stride_e, stride_n, 1], [1, BLOCK_N, BLOCK_K])
    else:
        desc = tl.make_tensor_descriptor(p_w, [NUM_EXPERTS, K, N], [stride_e, stride_k, 1], [1, BLOCK_K, BLOCK_N])
    return desc


@triton.jit
def _weight_tile(p_w_blk, m_k, m_n, EVEN_K: tl.constexpr):
    """The (BLOCK_K, BLOCK_N) weight tile at ``p_w_blk``, masked past N (and past K unless EVEN_K)."""
    if EVEN_K:
        tile = tl.load(p_w_blk, mask=m_n[None, :], other=0.0)
    else:
        tile = tl.load(p_w_blk, mask=m_k[:, None] & m_n[None, :], other=0.0)
    return tile


@triton.jit
def _gemm_tile(
    i_tile, num_tiles,
    p_a, p_b, p_b2, p_bias, p_bias2, p_c, p_pre, p_order, p_scale, p_offsets, p_b_table, p_b2_table, d_a, d_b, d_b2,
    N, K, topk,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_b2e, stride_b2k, stride_b2n,
    stride_bias_e, stride_bias_n, stride_bias2_e, stride_bias2_n,
    stride_cm, stride_cn, stride_pre_m, stride_pre_n,
    alpha, limit,
    NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
    A_ROWS: tl.constexpr, C_ROWS: tl.constexpr, SCALE_MODE: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_PRE: tl.constexpr,
    ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, INTERLEAVED: tl.constexpr, SPLIT: tl.constexpr, FULL_M: tl.constexpr,
    B_DESC: tl.constexpr, B_NK: tl.constexpr, A_DESC: tl.constexpr, B_TABLE: tl.constexpr,
):
    """Tile ``i_tile`` of ``num_tiles`` (see ``grouped_gemm_kernel``; ``d_a``, ``d_b``, ``d_b2`` are the descriptors
    the launch reads through, where it does). A tile past the work does nothing."""
    # Grouped ordering: GROUP_M consecutive m-tiles share each weight n-block while it is hot in L2. Without it an
    # expert's whole weight matrix is streamed from HBM once per m-tile.
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = num_tiles // num_n
    per_group = GROUP_M * num_n
    first_m = (i_tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    i_m = first_m + (i_tile % per_group) % group_rows
    i_n = (i_tile % per_group) // group_rows
    expert, row_start, row_end = _expert_of_tile(p_offsets, i_m, NUM_EXPERTS, E_POW2, BLOCK_M, SPLIT, FULL_M)
    if expert < NUM_EXPERTS:
        e64 = expert.to(tl.int64)

        o_m = row_start + tl.arange(0, BLOCK_M)
        m_m = o_m < row_end
        assignment = tl.load(p_order + o_m, mask=m_m, other=0)
        a_rows = _rows(A_ROWS, o_m, assignment, topk)

        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < N
        o_k = tl.arange(0, BLOCK_K)
        if B_TABLE:  # the expert's weights: its table entry elements past expert 0's, a multiple of B_TABLE
            # (the hint keeps the loads vectorised and asynchronous: without it the compiler cannot tell that the
            # address is 16-byte aligned, and loads one element at a time)
            p_b_e = p_b + tl.multiple_of(tl.load(p_b_table + e64), B_TABLE)
            p_b2_e = p_b2 + tl.multiple_of(tl.load(p_b2_table + e64), B_TABLE)
        elif not B_DESC:  # (descriptor launches index experts in the descriptor)
            p_b_e = p_b + e64 * stride_be
            p_b2_e = p_b2 + e64 * stride_b2e
        if not A_DESC:
            p_a_blk = p_a + a_rows[:, None] * stride_am + o_k[None, :] * stride_ak
        if not B_DESC:
            p_b_blk = p_b_e + o_k[:, None] * stride_bk + o_n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if INTERLEAVED:
            o_n2 = i_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
            m_n2 = o_n2 < 2 * N
            p_b_blk = p_b_e + o_k[:, None] * stride_bk + o_n2[None, :] * stride_bn
            acc_pairs = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        elif GATED:
            if not B_DESC:
                p_b2_blk = p_b2_e + o_k[:, None] * stride_b2k + o_n[None, :] * stride_b2n
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BLOCK_K)):
            m_k = o_k < K - i_k * BLOCK_K  # unused (and dropped by the compiler) when EVEN_K
            if A_DESC:
                b_a = d_a.load([row_start, i_k * BLOCK_K])
            elif EVEN_K:
                b_a = tl.load(p_a_blk, mask=m_m[:, None], other=0.0)
            else:
                b_a = tl.load(p_a_blk, mask=m_m[:, None] & m_k[None, :], other=0.0)
            if B_DESC:
                b_b = _weight_tile_tma(d_b, expert, i_k * BLOCK_K, i_n * BLOCK_N, B_NK, BLOCK_K, BLOCK_N)
            elif INTERLEAVED:
                b_b = _weight_tile(p_b_blk, m_k, m_n2, EVEN_K)
            else:
                b_b = _weight_tile(p_b_blk, m_k, m_n, EVEN_K)
            if UPCAST:  # the interpreter's bf16 dot is wrong
                b_a = b_a.to(tl.float32)
                b_b = b_b.to(tl.float32)
            if INTERLEAVED:
                acc_pairs = tl.dot(b_a, b_b, acc_pairs, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(b_a, b_b, acc, input_precision=DOT_PRECISION)
            if GATED and not INTERLEAVED:
                if B_DESC:
                    b_b2 = _weight_tile_tma(d_b2, expert, i_k * BLOCK_K, i_n * BLOCK_N, B_NK, BLOCK_K, BLOCK_N)
                else:
                    b_b2 = _weight_tile(p_b2_blk, m_k, m_n, EVEN_K)
                    p_b2_blk += BLOCK_K * stride_b2k
                if UPCAST:
                    b_b2 = b_b2.to(tl.float32)
                acc2 = tl.dot(b_a, b_b2, acc2, input_precision=DOT_PRECISION)
            if not A_DESC:
                p_a_blk += BLOCK_K * stride_ak
            if not B_DESC:
                p_b_blk += BLOCK_K * stride_bk
        if INTERLEAVED:  # column 2j is gate j, column 2j + 1 is up j
            acc, acc2 = tl.split(tl.reshape(acc_pairs, (BLOCK_M, BLOCK_N, 2)))

        m_out = m_m[:, None] & m_n[None, :]
        if SAVE_PRE:  # raw GEMM results, kept for the backward ([gate | up] side by side)
            p_pre_blk = p_pre + o_m.to(tl.int64)[:, None] * stride_pre_m + o_n[None, :] * stride_pre_n
            tl.store(p_pre_blk, acc.to(p_pre.dtype.element_ty), mask=m_out)
            if GATED:
                tl.store(p_pre_blk + N * stride_pre_n, acc2.to(p_pre.dtype.element_ty), mask=m_out)
        if SCALE_MODE != 0:
            b_s = tl.load(p_scale + assignment, mask=m_m, other=0.0).to(tl.float32)
        if SCALE_MODE == 1:
            acc = acc * b_s[:, None]
            if GATED:
                acc2 = acc2 * b_s[:, None]
        if HAS_BIAS:
            b_bias = tl.load(p_bias + e64 * stride_bias_e + o_n * stride_bias_n, mask=m_n, other=0.0)
            acc += b_bias.to(tl.float32)[None, :]
            if GATED:
                b_bias2 = tl.load(p_bias2 + e64 * stride_bias2_e + o_n * stride_bias2_n, mask=m_n, other=0.0)
                acc2 += b_bias2.to(tl.float32)[None, :]
        if GATED:
            acc = _activation(acc, acc2, True, ACT, alpha, limit)
        else:
            acc = _activation(acc, acc, False, ACT, alpha, limit)
        if SCALE_MODE == 2:
            acc = acc * b_s[:, None]

        c_rows = _rows(C_ROWS, o_m, assignment, topk)
        p_c_blk = p_c + c_rows[:, None] * stride_cm + o_n[None, :] * stride_cn
        if ACCUMULATE:
            acc += tl.load(p_c_blk, mask=m_out, other=0.0).to(tl.float32)
        tl.store(p_c_blk, acc.to(p_c.dtype.element_ty), mask=m_out)


# (the row and tile counts change with every token count: specialising on them would compile a kernel per
# divisibility class and per count of 1)
@triton.jit(do_not_specialize=["num_a_rows", "num_tiles"])
def grouped_gemm_kernel(
    # pointers
    p_a, p_b, p_b2, p_bias, p_bias2, p_c, p_pre, p_order, p_scale, p_offsets, p_b_table, p_b2_table,
    # sizes
    N, K, topk, num_a_rows, num_tiles,
    # strides
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_b2e, stride_b2k, stride_b2n,
    stride_bias_e, stride_bias_n, stride_bias2_e, stride_bias2_n,
    stride_cm, stride_cn, stride_pre_m, stride_pre_n,
    alpha, limit,
    # meta-parameters
    NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
    A_ROWS: tl.constexpr, C_ROWS: tl.constexpr, SCALE_MODE: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_PRE: tl.constexpr,
    ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, INTERLEAVED: tl.constexpr = False, SPLIT: tl.constexpr = 0, FULL_M: tl.constexpr = 1,
    B_DESC: tl.constexpr = 0, B_NK: tl.constexpr = False, A_DESC: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False, B_TABLE: tl.constexpr = 0,
):
    """c[rows_c(i)] (+)= epilogue(a[rows_a(i)] @ b[e(i)] [, a[rows_a(i)] @ b2[e(i)]]) for every kept row i.

    INTERLEAVED (gated only): ``b`` is the whole (E, K, 2N) gate/up weight whose even columns are the gate and odd
    columns the up projection (GPT-OSS). Each step loads one contiguous (BLOCK_K, 2 * BLOCK_N) tile of it and runs
    one dot; the accumulator's column pairs are split into gate and up after the loop. Two stride-2 views of the
    same weight would each load every other element, which defeats vectorised and asynchronous loads.

    SPLIT (1 or 2) makes the launch one of a pair that covers every row between them: 1 runs each expert's whole
    BLOCK_M tiles, 2 the rest of its rows (fewer than FULL_M, the first launch's BLOCK_M) in tiles of its own,
    smaller BLOCK_M. One tile size for all rows pads each expert's last tile to BLOCK_M rows: at 273 rows per
    expert (Qwen1.5-MoE at T = 4096) 128-row tiles compute 384 rows, 41% more than the work.

    B_DESC (not with INTERLEAVED) reads the weight tiles through TMA descriptors (``_weight_tile_tma``): the TMA
    unit copies them instead of address arithmetic and loads in every thread. 1: ``p_b`` and ``p_b2`` are host-made
    descriptors (a traced launch cannot take them on torch 2.11); 2: they are pointers and the kernel makes the
    descriptors itself (``tl.make_tensor_descriptor``, which needs Triton's scratch allocator at launch).
    A_DESC (with A_ROWS == ROWS_SORTED and B_DESC == 2) reads the token rows through a descriptor too: a tile's rows
    are then contiguous, and those past the expert's end (the next expert's rows, or zeros past ``num_a_rows``) are
    computed and never stored. Gathered token rows stay pointer loads (Hopper's TMA cannot gather rows).

    B_TABLE (pointer loads only; 0 is off): experts held as separate tensors of one shape and strides, read where
    they lie (no stack of them is made): ``p_b`` and ``p_b2`` point at expert 0's weights, and ``p_b_table`` and
    ``p_b2_table`` (E,) hold how many elements past it each expert's start, every one a multiple of B_TABLE (the
    launch checks 16-byte alignment); ``stride_be`` is unused.

    PERSISTENT: each program walks tiles ``program_id, program_id + num_programs, ...`` of ``num_tiles`` (the grid
    of a launch without it, which ignores ``num_tiles``), so the descriptors it makes are made once per program
    rather than once per tile.
    """
    if B_DESC == 2:
        d_b = _weight_descriptor(p_b, N, K, stride_be, stride_bk, stride_bn, NUM_EXPERTS, B_NK, BLOCK_K, BLOCK_N)
        d_b2 = d_b
        if GATED:
            d_b2 = _weight_descriptor(p_b2, N, K, stride_b2e, stride_b2k, stride_b2n, NUM_EXPERTS, B_NK, BLOCK_K,
                                      BLOCK_N)
    else:  # host-made descriptors (B_DESC == 1), or pointers the tile never reads as descriptors
        d_b, d_b2 = p_b, p_b2
    if A_DESC:
        d_a = tl.make_tensor_descriptor(p_a, [num_a_rows, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
    else:
        d_a = p_a
    if PERSISTENT:
        for i_tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            _gemm_tile(
                i_tile, num_tiles,
                p_a, p_b, p_b2, p_bias, p_bias2, p_c, p_pre, p_order, p_scale, p_offsets, p_b_table, p_b2_table,
                d_a, d_b, d_b2,
                N, K, topk,
                stride_am, stride_ak,
                stride_be, stride_bk, stride_bn,
                stride_b2e, stride_b2k, stride_b2n,
                stride_bias_e, stride_bias_n, stride_bias2_e, stride_bias2_n,
                stride_cm, stride_cn, stride_pre_m, stride_pre_n,
                alpha, limit,
                NUM_EXPERTS, E_POW2,
                A_ROWS, C_ROWS, SCALE_MODE,
                GATED, ACT, HAS_BIAS, SAVE_PRE,
                ACCUMULATE, UPCAST, DOT_PRECISION,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                EVEN_K, INTERLEAVED, SPLIT, FULL_M,
                B_DESC, B_NK, A_DESC, B_TABLE,
            )
    else:
        _gemm_tile(
            tl.program_id(0), tl.num_programs(0),
            p_a, p_b, p_b2, p_bias, p_bias2, p_c, p_pre, p_order, p_scale, p_offsets, p_b_table, p_b2_table,
            d_a, d_b, d_b2,
            N, K, topk,
            stride_am, stride_ak,
            stride_be, stride_bk, stride_bn,
            stride_b2e, stride_b2k, stride_b2n,
            stride_bias_e, stride_bias_n, stride_bias2_e, stride_bias2_n,
            stride_cm, stride_cn, stride_pre_m, stride_pre_n,
            alpha, limit,
            NUM_EXPERTS, E_POW2,
            A_ROWS, C_ROWS, SCALE_MODE,
            GATED, ACT, HAS_BIAS, SAVE_PRE,
            ACCUMULATE, UPCAST, DOT_PRECISION,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
            EVEN_K, INTERLEAVED, SPLIT, FULL_M,
            B_DESC, B_NK, A_DESC, B_TABLE,
        )


@triton.jit
def grouped_weight_grad_kernel(
    # pointers
    p_a, p_g, p_dw, p_order, p_scale, p_offsets,
    # sizes
    K, N, topk,
    # strides
    stride_am, stride_ak, stride_gm, stride_gn, stride_we, stride_wk, stride_wn,
    # meta-parameters
    A_ROWS: tl.constexpr, G_ROWS: tl.constexpr, HAS_SCALE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dw[e] = sum over rows i of expert e of a[rows_a(i)]^T (scale[i] * g[rows_g(i)]): grouped over K and N."""
    i_pid = tl.program_id(0)
    num_k = tl.cdiv(K, BLOCK_K)
    num_n = tl.cdiv(N, BLOCK_N)
    i_e = i_pid // (num_k * num_n)
    i_kn = i_pid % (num_k * num_n)
    i_k = i_kn // num_n
    i_n = i_kn % num_n
    row_start = tl.load(p_offsets + i_e)
    row_end = tl.load(p_offsets + i_e + 1)

    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_k = o_k < K
    m_n = o_n < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    # do_not_specialize is moot here: the row range is read from device memory, so it never recompiles.
    for m0 in range(row_start, row_end, BLOCK_M):
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_m = o_m < row_end
        assignment = tl.load(p_order + o_m, mask=m_m, other=0)
        a_rows = _rows(A_ROWS, o_m, assignment, topk)
        g_rows = _rows(G_ROWS, o_m, assignment, topk)
        b_at = tl.load(p_a + a_rows[None, :] * stride_am + o_k[:, None] * stride_ak,
                       mask=m_k[:, None] & m_m[None, :], other=0.0)
        b_g = tl.load(p_g + g_rows[:, None] * stride_gm + o_n[None, :] * stride_gn,
                      mask=m_m[:, None] & m_n[None, :], other=0.0)
        if HAS_SCALE:
            b_s = tl.load(p_scale + assignment, mask=m_m, other=0.0).to(tl.float32)
            b_g = (b_g.to(tl.float32) * b_s[:, None]).to(b_at.dtype)
        if UPCAST:
            b_at = b_at.to(tl.float32)
            b_g = b_g.to(tl.float32)
        acc = tl.dot(b_at, b_g, acc, input_precision=DOT_PRECISION)
    p_dw_blk = p_dw + i_e.to(tl.int64) * stride_we + o_k[:, None] * stride_wk + o_n[None, :] * stride_wn
    tl.store(p_dw_blk, acc.to(p_dw.dtype.element_ty), mask=m_k[:, None] & m_n[None, :])
