"""Inline expectations of small rewritten graphs, normalised (short target names, positional value labels) so that
they read the same on torch 2.11 and 2.13."""
import operator

import expecttest
import torch
from torch.fx import GraphModule, Node

from moe_inductor.passes import gathered_weights, padded_capacity
from tests.test_pass_gathered_weights import GatheredMoE
from tests.test_pass_padded_capacity import CapacityMoE


def _short(target) -> str:
    if isinstance(target, str):
        return f".{target}"
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


def normalise(gm: GraphModule) -> str:
    labels: dict[Node, str] = {}
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            labels[node] = f"in{len([n for n in labels.values() if n.startswith('in')])}"
            continue
        if node.op == "output":
            continue
        labels[node] = f"v{len(lines)}"

        def show(a):
            if isinstance(a, Node):
                return labels[a]
            if isinstance(a, (list, tuple)):
                return "(" + ", ".join(show(b) for b in a) + ")"
            return repr(a)

        args = [show(a) for a in node.args] + [f"{k}={show(v)}" for k, v in node.kwargs.items()]
        lines.append(f"{labels[node]} = {_short(node.target)}({', '.join(args)})")
    return "\n".join(lines)


def rewritten(model, x, rewrite=gathered_weights.rewrite) -> str:
    captured = []

    def backend(gm, example_inputs):
        rewrite(gm)
        captured.append(normalise(gm))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x)
    return captured[0]


class TestRewrittenGraphs(expecttest.TestCase):
    def test_gptfast_gathered_weights(self):
        torch.manual_seed(0)
        self.assertExpectedInline(rewritten(GatheredMoE("gptfast"), torch.randn(4, 16)), """\
v0 = .view(in0, -1, 16)
v1 = linear(v0, in1, None)
v2 = softmax(v1, dim=-1)
v3 = topk(v2, 2, dim=-1)
v4 = getitem(v3, 0)
v5 = getitem(v3, 1)
v6 = .sum(v4, dim=-1, keepdim=True)
v7 = truediv(v4, v6)
v8 = .to(v7, torch.float32)
v9 = .transpose(in2, 1, 2)
v10 = .transpose(in3, 1, 2)
v11 = .transpose(in4, 1, 2)
v12 = moe_inductor.experts_forward(v0, v5, v8, v9, v10, v11, None, None, None, 'silu_glu', 'output', 1.702, 7.0, None, True)
v13 = getitem(v12, 0)""")

    def test_switch_top1_padded_capacity(self):
        """The dispatch einsum, the padded expert buffer and the combine go; the routing that made the drops stays
        only as far as the op needs it (ids, gate, capacity 3); the gate reaches the op times ``gate != 0``, as a
        zero weight's choice is not dispatched (passes/zero_weights.py)."""
        torch.manual_seed(0)
        with torch.no_grad():
            graph = rewritten(CapacityMoE("top1"), torch.randn(6, 16), padded_capacity.rewrite)
        self.assertExpectedInline(graph, """\
v0 = linear(in1, in0, None)
v1 = softmax(v0, dim=-1)
v2 = argmax(v1, dim=-1)
v3 = one_hot(v2, num_classes=5)
v4 = cumsum(v3, dim=0)
v5 = sub(v4, 1)
v6 = lt(v5, 3)
v7 = mul(v3, v6)
v8 = mul(v1, v7)
v9 = .sum(v8, dim=1)
v10 = getitem(v9, (slice(None, None, None), None, None))
v11 = stack((v2), dim=1)
v12 = .reshape(v10, -1)
v13 = stack((v12), dim=1)
v14 = .to(v13, torch.float32)
v15 = eq(v14, 0)
v16 = invert(v15)
v17 = mul(v13, v16)
v18 = .to(v17, torch.float32)
v19 = .transpose(in2, 1, 2)
v20 = .transpose(in3, 1, 2)
v21 = .transpose(in4, 1, 2)
v22 = moe_inductor.experts_forward(in1, v11, v18, v19, v20, v21, None, None, None, 'silu_glu', 'output', 1.702, 7.0, 3, False)
v23 = getitem(v22, 0)""")
