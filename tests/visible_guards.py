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


def _problem(T: int):
    """T tokens, H 16, I 8, E 5, k 2: the problem and its (gate, up, down) weight views."""
    p = make_problem(T, 16, 8, 5, 2, requires_grad=False)
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")
    return p, (g, u, d)


def _visible(x, ids, tw, g, u, d):
    return torch.ops.moe_inductor.experts_forward_visible(x, ids, tw, g, u, d, None, None, None, "silu_glu",
                                                          "output", 1.702, 7.0, None, False)[0]


def _trace_with_aot(fw_compiler, T: int, dynamic_tokens: bool, dynamic) -> None:
    """Compile the visible op over T tokens through Dynamo and AOT autograd up to ``fw_compiler``, which reads what
    it needs from the traced graph and raises _Captured to stop the compile there."""
    p, weights = _problem(T)
    if dynamic_tokens:
        for t in (p.x, p.topk_ids, p.topk_weights):
            torch._dynamo.mark_dynamic(t, 0)
    try:
        torch.compile(lambda x, ids, tw: _visible(x, ids, tw, *weights), backend=aot_autograd(fw_compiler=fw_compiler),
                      dynamic=dynamic)(p.x, p.topk_ids, p.topk_weights)
    except Exception as e:  # stopped on purpose once the graph was read
        if not isinstance(e, _Captured) and "_Captured" not in repr(e):
            raise


def every_dim_symbolic() -> dict:
    """The guards of a make_fx trace in which every input dimension is symbolic, and the token count's symbol."""
    from torch.fx.experimental.proxy_tensor import make_fx

    p, weights = _problem(17)
    gm = make_fx(_visible, tracing_mode="symbolic")(p.x, p.topk_ids, p.topk_weights, *weights)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tokens = placeholders[0].meta["val"].shape[0]
    return {"guards": [str(guard.expr) for guard in tokens.node.shape_env.guards], "tokens": str(tokens)}


def launches(dynamic_tokens: bool) -> list[str]:
    """The Triton kernels the visible op launches, in order, once AOT autograd has traced into it with a static or a
    dynamic token count (3 tokens, 6 rows: one routing chunk)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    names = []

    def read_launches(gm, example_inputs):
        names.extend(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in gm.graph.nodes
                     if "triton_kernel_wrapper" in str(n.target))
        raise _Captured

    _trace_with_aot(read_launches, 3, dynamic_tokens, dynamic=dynamic_tokens)
    return names


def dynamic_token_guards() -> list[str]:
    """The shape guards of a trace with the token count dynamic (17 tokens: one routing chunk, the guard-prone
    case)."""
    guards = []

    def read_guards(gm, example_inputs):  # after AOT autograd traced into the op: its guards are in the shape env
        fake_mode = torch._guards.TracingContext.get().fake_mode
        guards.extend(str(g.expr) for g in fake_mode.shape_env.guards)
        raise _Captured

    _trace_with_aot(read_guards, 17, True, dynamic=None)
    return guards


def main() -> None:
    if sys.argv[1:2] == ["launches"]:
        print(json.dumps(launches(sys.argv[2] == "symbolic")))
    elif sys.argv[1:] == ["every-dim"]:
        print(json.dumps(every_dim_symbolic()))
    else:
        print(json.dumps(dynamic_token_guards()))


if __name__ == "__main__":
    main()
