"""How moe_inductor ops reach Inductor.

``moe_inductor::experts_forward`` reaches Inductor as an opaque custom op (a fallback kernel that calls our Triton
launchers through the dispatcher); that is what keeps it compilable on the CPU too, where a ``triton_op`` run by the
interpreter is not. On the GPU, ``visible.py`` swaps it for ``experts_forward_visible``, a ``triton_op`` that
Inductor traces into, so that its generated wrapper launches our kernels itself (``config.visible_kernels``, on by
default outside CUDA graphs). On the CPU, ``cpu.py`` swaps it in inference graphs for the same forward in aten ops
around one opaque per-expert matmul op, so that Inductor fuses the routing, gather, activation and combine into its
own kernels. Fusing the routing prologue into Inductor's own kernels on the GPU is future work.
"""
