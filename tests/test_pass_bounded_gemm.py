"""The split loop's bounded-slices spelling (passes/bounded_gemm.py): ArcticTraining's ``torch_group_gemm_fn``, a
zeros buffer filled by ``C[cum[e-1]:cum[e]] = A[cum[e-1]:cum[e]] @ B[e]`` per expert, over rows sorted by expert as
the cat of one one-hot's ``where`` rows.

Genuine spellings, rewritten and equal to eager forward and backward: ArcticTraining's own layer (tests/corpus, with
its load-balancing hook made strong enough to show in the gradients, so a rewrite that dropped it would fail), gate
and up as the two halves of the fused projection with ``torch.mm``, two separate gate and up buffers, the bounds
read by ``cum.tolist()`` with ``@`` and ``C[s:e]``, and the token-major flattening (``slots // k``).
Look-alikes, not rewritten and equal to eager, each with the reason explain() gives: a slice one row too long,
bounds from the cumsum of other counts, a buffer of ones, a buffer written besides its loop, a buffer read between
its writes, the wrong expert's weight, rows gathered in another order than the counts', the scores of other slots,
a loop that leaves the last expert out, and the experts' activation read besides the second GEMM.

Before torch 2.13, Dynamo cannot trace the slice writes between data-dependent bounds (it falls back, as the corpus
declares for ArcticTraining): there the genuine spellings are skipped, and the look-alikes only stay eager-equal.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from moe_inductor import report
from tests.corpus.arctic_training_moe import _build as arctic
from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 5, 2
BEFORE_2_13 = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13)
TRACED = pytest.mark.skipif(BEFORE_2_13, reason="Dynamo before 2.13 cannot trace slice writes at .item() bounds")


def group_gemm(A, B, cum, variant):
    """ArcticTraining's ``torch_group_gemm_fn``, with the variant's change; and what the variant reads of the
    buffer between its writes (0.0 for none)."""
    seen = 0.0
    fill = torch.ones if variant == "ones_buffer" else torch.zeros
    C = fill((cum[-1], B.shape[-1]), device=A.device, dtype=A.dtype)
    bounds = cum.tolist() if variant == "tolist" else cum
    experts = len(cum) - 1 if variant == "missing_expert" else len(cum)
    for i in range(experts):
        start = 0 if i == 0 else bounds[i - 1]
        end = bounds[i]
        if variant == "one_row_long" and i == 1:
            end = end + 1
        w = B[(i + 1) % len(cum)] if variant == "wrong_expert" else B[i]
        if variant == "mm":
            C[start:end, :] = torch.mm(A[start:end, :], w)
        elif variant == "tolist":
            C[start:end] = A[start:end] @ w
        else:
            C[start:end, :] = torch.matmul(A[start:end, :], w)
        if variant == "read_between" and i == 1:
            seen = C.sum()
    if variant == "written_besides":
        C[0] = 0.5
    return C, seen


class BoundedGemmMoE(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.router = nn.Parameter(torch.randn(E, H) * H ** -0.5)
        two = variant == "two_buffers"
        self.w_gate_up = nn.Parameter(torch.randn(E, H, I if two else 2 * I) * H ** -0.5)
        self.w_up = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.w_down = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)

    def forward(self, x):
        v, T = self.variant, x.shape[0]
        weights, ids = torch.topk(F.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32), K, dim=-1)
        token_major = v == "token_major"
        flat_ids = ids.reshape(-1) if token_major else ids.t().reshape(-1)
        flat_w = weights.reshape(-1) if token_major else weights.t().reshape(-1)
        hot = F.one_hot(flat_ids, num_classes=E).t()
        slots = torch.cat([torch.where(hot[i])[0] for i in range(E)])
        scores = (flat_w.flip(0) if v == "other_scores" else flat_w)[slots]
        tok = slots // K if token_major else slots % T
        counts = hot.sum(dim=-1)
        cum = (counts.flip(0) if v == "other_cumsum" else counts).cumsum(0)
        if v == "other_rows":  # the rows sorted by the experts in reverse, the counts in order
            rows = x[torch.cat([torch.where(hot[i])[0] for i in reversed(range(E))]) % T]
        else:
            rows = x[tok]
        h, seen = group_gemm(rows, self.w_gate_up, cum, v)
        if v == "two_buffers":
            h = F.silu(h) * group_gemm(rows, self.w_up, cum, v)[0]
        elif v == "mm":
            h = F.silu(h[..., :I]) * h[..., I:]
        else:
            h = (h[..., 1::2] + 0.0) * F.silu(h[..., 0::2] * 1.0)
        if v == "hidden_read":  # the activation also read outside the experts
            seen = h.sum()
        ys = group_gemm(h, self.w_down, cum, v)[0]
        out = torch.zeros((ys.shape[0] // K, H), dtype=ys.dtype, device=ys.device)
        out.index_add_(0, tok, ys * scores[:, None])
        return out + seen


GENUINE = ["matmul", "mm", "two_buffers", "tolist", "token_major"]


@TRACED
@pytest.mark.parametrize("variant", GENUINE)
def test_bounded_slices_grouped_gemms_are_rewritten(variant):
    torch.manual_seed(0)
    for T in (3, 11):  # 6 assignments over 5 experts at T = 3: an expert may get none
        assert_rewritten_like_eager(BoundedGemmMoE(variant), torch.randn(T, H), "split_loop", f"{variant} T={T}")
        counters.clear()
        torch._dynamo.reset()


@TRACED
def test_arctic_training_layer_is_rewritten_and_keeps_its_gradient_hook():
    torch.manual_seed(0)
    model = arctic()
    model._config.loss_coeff = 50.0  # the hook's gradient well above the tolerance: dropping it would show
    assert_rewritten_like_eager(model, torch.randn(1, 9, H), "split_loop", "arctic")


@pytest.mark.parametrize("variant, said", [
    ("one_row_long", "write e covers rows cum[e-1]:cum[e]"),  # expert 1 also writes expert 2's first row
    ("other_cumsum", "not running sums of each expert's number of slots"),
    ("ones_buffer", "only into a buffer of zeros"),
    ("written_besides", "changed in place otherwise than by its E writes"),
    ("read_between", "read before its last write"),
    ("wrong_expert", "multiplied by the e-th weight"),
    ("other_rows", "rows are not x at the tokens"),
    ("other_scores", "not flattened like the ids"),
    ("missing_expert", "every expert 0..E-1 writes its rows"),
    ("hidden_read", "an intermediate of the experts is read outside the MoE"),
])
def test_look_alikes_are_left_alone_and_equal_to_eager(variant, said):
    torch.manual_seed(0)
    model = BoundedGemmMoE(variant)
    x = torch.randn(9, H)
    with torch.no_grad(), report.collecting(report.Report()) as seen:
        out = compile_moe(model, x)
        ref = model(x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, ref, torch.float32, variant)
    if not BEFORE_2_13:
        reasons = [m.reason for m in seen.left_alone if m.form == "split_loop"]
        assert len(reasons) == 1 and said in reasons[0], [(m.form, m.reason) for m in seen.left_alone]
