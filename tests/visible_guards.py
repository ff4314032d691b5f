"""Trace into the visible experts op symbolically (Dynamo and AOT autograd, the token count dynamic) and print the
shape guards that added.

Run in a process without TRITON_INTERPRET (tests/test_visible_kernels.py does): Dynamo runs the op's fake
implementation through ``wrap_triton``, which the interpreter cannot do. Nothing is launched.
"""
import json

import torch
from torch._dynamo.backends.common import aot_autograd

from moe_inductor import config
from moe_inductor.ops import expert_weight_views
from tests.helpers import make_problem

config.triton_on_cpu = True
import moe_inductor.lowerings.visible  # noqa: E402,F401  (registers the op)


class _Captured(Exception):
    pass


def main() -> None:
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
