"""Trace into the visible experts op symbolically and print the shape guards that added, as JSON.

    python -m tests.visible_guards             # Dynamo and AOT autograd, the token count dynamic
    python -m tests.visible_guards every-dim   # make_fx with every dimension symbolic (what opcheck's
                                               # test_aot_dispatch_dynamic does), weights included
    python -m tests.visible_guards launches static|symbolic   # the kernels a traced op launches, in order

Run in a process without TRITON_INTERPRET (tests/test_visible_kernels.py does): Dynamo runs the op's fake
implementation through ``wrap_triton``, which the interpreter cannot do. Nothing is launched.
"""
import json
import sys

import torch
from torch._dynamo.backends.common import aot_autograd

from moe_inductor import config
from moe_inductor.ops import expert_weight_views
from tests.helpers import make_problem

config.triton_on_cpu = True
import moe_inductor.lowerings.visible  # noqa: E402,F401  (registers the op)


class _Captured(Exception):
    pass


def every_dim_symbolic() -> dict:
    """The guards of a make_fx trace in which every input dimension is symbolic, and the token count's symbol."""
    from torch.fx.experimental.proxy_tensor import make_fx

    p = make_problem(17, 16, 8, 5, 2, requires_grad=False)
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")

    def f(x, ids, tw, g, u, d):
        return torch.ops.moe_inductor.experts_forward_visible(x, ids, tw, g, u, d, None, None, None, "silu_glu",
                                                              "output", 1.702, 7.0, None, False)[0]

    gm = make_fx(f, tracing_mode="symbolic")(p.x, p.topk_ids, p.topk_weights, g, u, d)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tokens = placeholders[0].meta["val"].shape[0]
    return {"guards": [str(guard.expr) for guard in tokens.node.shape_env.guards], "tokens": str(tokens)}


def launches(dynamic_tokens: bool) -> list[str]:
    """The Triton kernels the visible op launches, in order, once AOT autograd has traced into it with a static or a
    dynamic token count."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    names = []

    def read_launches(gm, example_inputs):
        names.extend(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in gm.graph.nodes
                     if "triton_kernel_wrapper" in str(n.target))
        raise _Captured

    p = make_problem(3, 16, 8, 5, 2, requires_grad=False)  # 6 rows: one routing chunk
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")

    def f(x, ids, tw):
        return torch.ops.moe_inductor.experts_forward_visible(x, ids, tw, g, u, d, None, None, None, "silu_glu",
                                                              "output", 1.702, 7.0, None, False)[0]

    if dynamic_tokens:
        for t in (p.x, p.topk_ids, p.topk_weights):
            torch._dynamo.mark_dynamic(t, 0)
    try:
        torch.compile(f, backend=aot_autograd(fw_compiler=read_launches), dynamic=dynamic_tokens)(
            p.x, p.topk_ids, p.topk_weights)
    except Exception as e:  # the compiler stops the compile on purpose once the launches are read
        if not isinstance(e, _Captured) and "_Captured" not in repr(e):
            raise
    return names


def main() -> None:
    if sys.argv[1:2] == ["launches"]:
        print(json.dumps(launches(sys.argv[2] == "symbolic")))
        return
    if sys.argv[1:] == ["every-dim"]:
        print(json.dumps(every_dim_symbolic()))
        return
    guards = []

    def read_guards(gm, example_inputs):  # after AOT autograd traced into the op: its guards are in the shape env
        fake_mode = torch._guards.TracingContext.get().fake_mode
        guards.extend(str(g.expr) for g in fake_mode.shape_env.guards)
        raise _Captured

    backend = aot_autograd(fw_compiler=read_guards)

    p = make_problem(17, 16, 8, 5, 2, requires_grad=False)  # one routing chunk at this size: the guard-prone case
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")

    def f(x, ids, tw):
        return torch.ops.moe_inductor.experts_forward_visible(x, ids, tw, g, u, d, None, None, None, "silu_glu",
                                                              "output", 1.702, 7.0, None, False)[0]

    for t in (p.x, p.topk_ids, p.topk_weights):
        torch._dynamo.mark_dynamic(t, 0)
    try:
        torch.compile(f, backend=backend)(p.x, p.topk_ids, p.topk_weights)
    except Exception as e:  # the backend stops the compile on purpose once the guards are read
        if not isinstance(e, _Captured) and "_Captured" not in repr(e):
            raise
    print(json.dumps(guards))


if __name__ == "__main__":
    main()
