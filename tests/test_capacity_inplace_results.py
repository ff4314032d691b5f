"""The padded-capacity proof (``capacity_gating.versions_sound``) reads every write ``passes/aliases.py`` reads: an
in-place function (``torch.relu_(g)``, ``F.hardtanh(g, inplace=True)``), an ``out=``, and a write through an in-place
op's result (``torch.relu_(g).mul_(2)`` writes ``g``), as well as the ``g.mul_(2)`` and ``g *= 2`` it read before.

Each look-alike is Switch's top-1 capacity gating whose gate, or combine, is changed in place through one of those
spellings after the proof's read of it: equal to eager, and left alone with the proof's reason. The genuine twin
writes the gate in place *before* the combine reads it (``gate.mul_(2)`` then the combine), which the proof reads as
its functional value, and is rewritten, equal to eager forward and backward."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from tests.helpers import assert_close, compile_moe

E, H, I, C = 5, 16, 8, 3

#: the proof's reason where a gate is changed after it is read (padded_capacity.py)
GATE_CHANGED = "a (T, E, C) combine over capacity slots whose gating tensors are changed in place after they are read"


class SwitchCapacity(nn.Module):
    """Switch Transformers' top-1 gating with capacity ``C``, one-hot dispatch and combine (T, E, C), experts on
    the padded (E, C, H) buffer. ``write`` names a change in place (see ``_WRITES``) and where it sits."""

    def __init__(self, write: str):
        super().__init__()
        self.write = write
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        gates = F.softmax(self.router(x), dim=-1)
        mask = F.one_hot(torch.argmax(gates, dim=-1), num_classes=E)
        loc = torch.cumsum(mask, dim=0) - 1
        mask = mask * torch.lt(loc, C)
        gate = (gates * mask).sum(dim=1)
        if self.write == "before-read":  # read as its functional value: the combine sees the doubled gate
            gate = gate.mul_(2.0)
        slot = F.one_hot(torch.sum(loc * mask, dim=1), num_classes=C)
        combine = gate[:, None, None] * mask[:, :, None] * slot[:, None, :]
        if self.write == "relu_-result":  # the gate doubled through relu_'s result (relu_ itself changes nothing)
            torch.relu_(gate).mul_(2.0)
        elif self.write == "out=":
            torch.mul(gate, 2.0, out=gate)
        elif self.write == "hardtanh-inplace":
            F.hardtanh(gate, 0.0, 0.2, inplace=True)
        elif self.write == "combine-through-relu_":  # the combine's expert 0 zeroed through relu_'s result
            torch.relu_(combine)[:, 0] = 0.0
        dispatch = combine.bool().to(x.dtype)
        expert_in = torch.einsum("tec,th->ech", dispatch, x)
        h = F.silu(torch.einsum("ech,eih->eci", expert_in, self.w1))
        out = torch.einsum("eci,ehi->ech", h, self.w2)
        return torch.einsum("tec,ech->th", combine, out)


@pytest.mark.parametrize("write", ["relu_-result", "out=", "hardtanh-inplace", "combine-through-relu_"])
def test_a_gating_tensor_changed_through_another_name_is_left_alone(write):
    torch.manual_seed(0)
    model, x = SwitchCapacity(write), torch.randn(13, H)  # 13 tokens, 5 experts of capacity 3: some dropped
    with torch.no_grad():  # the change would make eager's backward raise (the gate is saved for it)
        out, ref = compile_moe(model, x), model(x)
        left = moe_inductor.explain(model, x).left_alone
    assert counters["moe_inductor"]["padded_capacity"] == 0, dict(counters["moe_inductor"])
    assert_close(out, ref, torch.float32, write)
    assert [(a.form, a.reason) for a in left] == [("padded_capacity", GATE_CHANGED)], left


def test_a_gate_changed_before_its_read_is_rewritten_forward_and_backward():
    torch.manual_seed(0)
    model, x = SwitchCapacity("before-read"), torch.randn(13, H)
    xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = compile_moe(model, xc)
    assert counters["moe_inductor"]["padded_capacity"] == 1, dict(counters["moe_inductor"])
    ref = model(xe)
    assert_close(out, ref, torch.float32, "forward")
    probe = torch.randn_like(ref)
    got = torch.autograd.grad((out * probe).sum(), [xc, *model.parameters()])
    want = torch.autograd.grad((ref * probe).sum(), [xe, *model.parameters()])
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, torch.float32, f"gradient {i}")
