"""How moe_inductor ops reach Inductor.

``moe_inductor::experts_forward`` reaches Inductor as an opaque custom op (a fallback kernel that calls our Triton
launchers through the dispatcher); that is what keeps it compilable on the CPU too, where a ``triton_op`` run by the
interpreter is not. On the GPU, ``visible.py`` swaps it for ``experts_forward_visible``, a ``triton_op`` that
Inductor traces into, so that its generated wrapper launches our kernels itself (``config.visible_kernels``, on by
default outside CUDA graphs). Fusing the routing prologue into Inductor's own kernels is future work.
"""
