"""Inductor lowerings for moe_inductor ops.

None are registered yet: ``moe_inductor::experts_forward`` reaches Inductor as an opaque custom op (a fallback kernel
that calls our Triton launchers), which is what keeps it compilable on CPU too, where a ``triton_op`` run by the
interpreter is not. A visible lowering (so Inductor can fuse the routing prologue into the GEMM launch) is future work.
"""
