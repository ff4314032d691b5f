"""The one description of an experts call (ops/call.py): both routes build it, one function gives the op's arguments,
and ops/ prepares launches only through the kernels' host wrappers."""
import ast
import operator
from pathlib import Path

import pytest
import torch
from torch.fx import Graph

import moe_inductor
from moe_inductor.ops.activations import GPTOSS_ALPHA, GPTOSS_LIMIT
from moe_inductor.ops.call import Activation, ExpertsCall, ExpertWeights, Routing, from_op_args, op_call
from moe_inductor.ops.experts import Needs, experts_backward, experts_forward_impl
from moe_inductor.ops.reference import moe_reference
from moe_inductor.spec import MoESpec

PACKAGE = Path(moe_inductor.__file__).resolve().parent


def _stacked_call(T=5, H=8, I=6, E=3, k=2, capacity=None, save_pre=False):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(0, E, (T, k), generator=gen)
    tw = torch.rand(T, k, generator=gen)
    w1, w1_up, w2 = (torch.randn(E, H, I, generator=gen), torch.randn(E, H, I, generator=gen),
                     torch.randn(E, I, H, generator=gen))
    b2 = torch.randn(E, H, generator=gen)
    return ExpertsCall(x, Routing(ids, tw, capacity), ExpertWeights(w1, w1_up, w2, b2=b2),
                       Activation("gptoss_glu", 1.5, 6.0), "between", save_pre)


def _same(a, b) -> bool:
    """Field by field identity (tensors are compared as objects, not by value)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a is b or (not isinstance(a, torch.Tensor) and a == b)


def test_op_call_gives_the_schema_order_and_from_op_args_reads_it_back():
    call = _stacked_call(capacity=4, save_pre=True)
    op, args = op_call(call)
    assert op is torch.ops.moe_inductor.experts_forward.default
    names = [a.name for a in op._schema.arguments]
    got = dict(zip(names, args))
    assert got["x"] is call.x and got["topk_ids"] is call.routing.topk_ids and got["w1_up"] is call.weights.w1_up
    assert got["b2"] is call.weights.b2 and got["b1"] is None
    assert (got["activation"], got["weight_position"], got["alpha"], got["limit"], got["capacity"],
            got["save_pre"]) == ("gptoss_glu", "between", 1.5, 6.0, 4, True)
    assert _same(from_op_args(args), call)


def test_the_op_run_from_op_call_matches_the_reference_and_fused_experts():
    call = _stacked_call()
    op, args = op_call(call)
    w, r = call.weights, call.routing
    want = moe_reference(call.x, r.topk_ids, r.topk_weights, w.w1, w.w1_up, w.w2, b2=w.b2, activation="gptoss_glu",
                         weight_position="between", alpha=1.5, limit=6.0)
    torch.testing.assert_close(op(*args)[0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts_forward_impl(*args)[0], want, rtol=1e-5, atol=1e-5)
    got = moe_inductor.fused_experts(call.x, r.topk_ids, r.topk_weights, (w.w1, w.w1_up), w.w2, b2=w.b2,
                                     activation="gptoss_glu", layout="kn", weight_position="between", alpha=1.5,
                                     limit=6.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_per_expert_weights_call_the_list_op_with_their_capacity_and_refuse_what_it_lacks():
    gen = torch.Generator().manual_seed(1)
    E, H, I, T = 3, 8, 4, 5
    w_in = tuple(torch.randn(I, H, generator=gen) for _ in range(E))
    w_out = tuple(torch.randn(H, I, generator=gen) for _ in range(E))
    x, ids, tw = torch.randn(T, H, generator=gen), torch.randint(0, E, (T, 1), generator=gen), torch.ones(T, 1)
    call = ExpertsCall(x, Routing(ids, tw), ExpertWeights(w_in, None, w_out, layout="nk"), Activation("relu"))
    op, args = op_call(call)
    assert op is torch.ops.moe_inductor.experts_forward_list.default
    assert args[3] == list(w_in) and args[4] == [] and args[6:9] == ([], [], []) and args[12] == "nk"
    assert args[13] is None  # no capacity
    ref = torch.stack([torch.relu(x[t] @ w_in[ids[t, 0]].t()) @ w_out[ids[t, 0]].t() for t in range(T)])
    torch.testing.assert_close(op(*args)[0], ref, rtol=1e-5, atol=1e-5)
    # a capacity is the list op's last argument: each expert keeps its first 2 tokens, the others get zeros
    op, args = op_call(call._replace(routing=Routing(ids, tw, 2)))
    assert op is torch.ops.moe_inductor.experts_forward_list.default and args[13] == 2
    seen = [int((ids[:t, 0] == ids[t, 0]).sum()) for t in range(T)]
    kept = torch.tensor([s < 2 for s in seen]).unsqueeze(1)
    torch.testing.assert_close(op(*args)[0], torch.where(kept, ref, 0.0), rtol=1e-5, atol=1e-5)
    for bad in (call._replace(weights=call.weights._replace(b2=torch.zeros(E, H))),
                call._replace(activation=Activation("gptoss_glu", 1.0))):
        with pytest.raises(ValueError, match="list op"):
            op_call(bad)


def test_the_emitter_builds_the_op_call_from_a_spec():
    """The FX route: emit_experts turns a MoESpec into the op call whose arguments from_op_args reads as that spec."""
    from moe_inductor.passes.emit import emit_experts

    graph = Graph()
    values = dict(x=torch.randn(4, 8), ids=torch.zeros(4, 2, dtype=torch.long), weights=torch.rand(4, 2),
                  gate=torch.randn(3, 12, 8), down=torch.randn(3, 8, 6), b1=torch.randn(3, 12))
    nodes = {}
    for name, v in values.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["example_value"] = v
    out = graph.output(None)
    spec = MoESpec(nodes["x"], nodes["ids"], nodes["weights"], nodes["gate"], None, nodes["down"], "nk", "gptoss_glu",
                   capacity=3, gate_up="interleaved", b1=nodes["b1"], alpha=1.25, limit=5.0)
    y = emit_experts(graph, spec, out, torch.float32)
    assert y.target is operator.getitem
    op_node = y.args[0]
    assert op_node.target is torch.ops.moe_inductor.experts_forward.default
    call = from_op_args(op_node.args)
    assert call.x is nodes["x"] and call.routing.topk_ids is nodes["ids"] and call.routing.capacity == 3
    assert call.routing.topk_weights.target == "to"  # the routing weights in x's dtype
    assert call.activation == Activation("gptoss_glu", 1.25, 5.0) and call.weight_position == "output"
    assert call.weights.w1.target == "transpose" and call.weights.w1_up.target == "transpose"  # "nk" -> (E, K, N)
    assert call.weights.b1.target is operator.getitem and call.weights.b1_up.target is operator.getitem


def test_needs_are_read_by_name_in_the_schemas_order():
    assert Needs._fields == ("x", "topk_weights", "w1", "w1_up", "w2", "b1", "b1_up", "b2", "combined_gate_up",
                             "gate_up_pairs")
    assert Needs(*[False] * 8).combined_gate_up is False and Needs(*[False] * 8).gate_up_pairs is False
    call = _stacked_call(save_pre=True)
    y, pre, order, sorted_expert, offsets = experts_forward_impl(*op_call(call)[1])
    w = call.weights
    grads = experts_backward(torch.ones_like(y), call.x, call.routing.topk_ids, call.routing.topk_weights, w.w1,
                             w.w1_up, w.w2, None, None, w.b2, pre, order, sorted_expert, offsets, "gptoss_glu",
                             "between", 1.5, 6.0, False, list(Needs(False, False, False, False, True, False, False,
                                                                    True)))
    assert [g.numel() > 0 for g in grads] == [False, False, False, False, True, False, False, True]


def test_gptoss_defaults_are_one_named_value():
    assert Activation().alpha == GPTOSS_ALPHA and Activation().limit == GPTOSS_LIMIT
    assert (MoESpec.alpha, MoESpec.limit) == (GPTOSS_ALPHA, GPTOSS_LIMIT)
    for path in [*(PACKAGE / "ops").rglob("*.py"), *(PACKAGE / "kernels").rglob("*.py"), PACKAGE / "spec.py"]:
        if path.name != "activations.py":
            assert "1.702" not in path.read_text(), path


#: what only a kernel's host wrapper (kernels/launch.py) may use: grids, blocks, configs, raw launches
_LAUNCH_DETAILS = {"launch_kernel", "LazyKernel", "device_guard", "cdiv", "next_pow2", "static_dim", "configs",
                   "interpreting", "size_hint"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "ops").rglob("*.py")), ids=lambda p: p.name)
def test_ops_launch_kernels_only_through_their_host_wrappers(path):
    """ops/ prepares the routing once and calls kernels/launch.py's wrappers; it sizes no grid and picks no block
    itself, so that following topk_ids down to a kernel never climbs back up into ops/."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kernels"):
            used |= {a.name for a in node.names} & _LAUNCH_DETAILS
            if node.module == "kernels.configs":
                used.add("configs")
    assert not used, f"{path.name} uses {sorted(used)}"
