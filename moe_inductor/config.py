"""Process-wide settings of moe_inductor. Change them as attributes: ``moe_inductor.config.autotune = True``."""
from __future__ import annotations

import os

#: Tune kernel configs on the GPU on first use of each (E, N, K, dtype, rows-per-expert bucket); prints a line each.
autotune: bool = os.environ.get("MOE_INDUCTOR_AUTOTUNE", "0") == "1"

#: Run the Triton kernels on CPU tensors too (only meaningful under TRITON_INTERPRET=1; used by the kernel tests).
triton_on_cpu: bool = os.environ.get("MOE_INDUCTOR_TRITON_ON_CPU", "0") == "1"

#: Check topk ids against [0, E) in the eager entry point on the GPU (one host sync). CPU checks are always on.
validate_routing: bool = True

#: Raise when an FX pass fails instead of logging a warning and leaving the graph unchanged (the tests set it).
strict_passes: bool = os.environ.get("MOE_INDUCTOR_STRICT_PASSES", "0") == "1"

#: Hand Inductor our experts forward as a ``triton_op`` it traces into, so that its generated wrapper launches our
#: kernels (no dispatcher or Python of ours per call; lowerings/visible.py). On: on the H200 it beat the opaque op
#: at T = 512 in every same-process measurement (1.08x to 2.4x) and tied it at T >= 4096 (RESULTS.md). Only the
#: Inductor inner compiler in modes without CUDA graphs is affected (backend.py).
visible_kernels: bool = os.environ.get("MOE_INDUCTOR_VISIBLE_KERNELS", "1") == "1"

#: With ``visible_kernels``, the backward of a visible call as ``triton_op``\ s too, where the ``torch._grouped_mm``
#: engine cannot take it and the row count is static (lowerings/visible_backward.py): a short training step is
#: host-bound, and the opaque backward ops' Python is host time Inductor's own path does not spend.
visible_backward: bool = os.environ.get("MOE_INDUCTOR_VISIBLE_BACKWARD", "1") == "1"

#: With ``visible_backward``, a backward the ``torch._grouped_mm`` engine takes is traced too where its row count is
#: static: the engine's GEMMs become ``aten._grouped_mm`` nodes of the compiled backward and our kernels around them
#: launch from Inductor's wrapper, without the opaque ops' Python per call (which made OLMoE's 1024-token step
#: host-bound: RESULTS.md, fortieth session). The GEMMs are the same ``torch._grouped_mm`` calls either way, so what
#: it changes is host time; the H100 measured it level or ahead in every family and size it ran (RESULTS.md,
#: forty-second to forty-fifth sessions). Off (env ``MOE_INDUCTOR_VISIBLE_ENGINE_BACKWARD=0``): the opaque ops.
visible_engine_backward: bool = os.environ.get("MOE_INDUCTOR_VISIBLE_ENGINE_BACKWARD", "1") == "1"

#: Our Inductor compiles give each traced kernel write its own empty buffer again where AOT autograd's CSE merged
#: identical allocations (lowerings/unshared_buffers.py): else Inductor copies the shared one before every write but
#: the last. Only where the user set no ``post_grad_custom_pre_pass`` of their own.
unshared_buffers: bool = os.environ.get("MOE_INDUCTOR_UNSHARED_BUFFERS", "1") == "1"

#: Who runs the experts op's GEMMs: "auto" (our fused Triton kernels, except in the compute-bound regime below, where
#: ``torch._grouped_mm`` does; ops/grouped_mm_engine.py), "triton" (always ours), "grouped_mm" (torch's wherever the
#: layout allows).
gemm_engine: str = os.environ.get("MOE_INDUCTOR_GEMM_ENGINE", "auto")

#: Let the forward grouped GEMM run each expert's last, partial tile apart, in smaller tiles (a second launch), where
#: the tuned table holds a "tail" config for the shape: that is where the pair was measured faster than one launch
#: (kernels/grouped_gemm.py, SPLIT). Off: one launch, one tile size, always (env MOE_INDUCTOR_TAIL_SPLIT=0).
gemm_tail_split: bool = os.environ.get("MOE_INDUCTOR_TAIL_SPLIT", "1") == "1"

#: Whether the forward grouped GEMM reads its weights (and the down projection its sorted token rows) through TMA
#: descriptors (kernels/grouped_gemm.py, ``B_DESC``, ``A_DESC``): "tuned" (the default) where the tuned table of this
#: GPU holds a TMA entry for the launch's key (``...|tma``) that is not POINTERS, in the persistent variant with
#: descriptors made in the kernel; "auto" (Hopper and later GPUs, 16-bit weights, a static token count of at least
#: ``tma_min_rows_per_expert`` rows per expert on average); "on" (any static count); "off". How "auto" and "on" make
#: their descriptors: ``gemm_tma_descriptors``. No one variant won for every shape on the H200 (RESULTS.md,
#: twenty-fourth to twenty-sixth sessions): made in the kernel and walked persistently, the loads gained the op alone
#: 1.10x on OLMoE's shapes and lost 0.80x on Qwen1.5-MoE's at T = 4096. So the choice is per key, measured by the
#: tuner (benchmarks/tune_gemm.py, or ``autotune`` on a Hopper GPU, which measures each key it meets), and a key
#: without an entry keeps the pointer loads. Entries are per weight layout: the shipped ones are for K-contiguous
#: views, the forward's on HF's weights, whose backward GEMMs read the other layout and find none
#: (env MOE_INDUCTOR_TMA_WEIGHTS).
gemm_tma_weights: str = os.environ.get("MOE_INDUCTOR_TMA_WEIGHTS", "tuned")

#: How the TMA weight loads get their descriptors: "device" (the default) makes them in the kernel
#: (``tl.make_tensor_descriptor``), so Inductor can trace the launches and the visible op keeps them, and the sorted
#: token rows of the down projection are read through a descriptor too; "host" passes ``TensorDescriptor`` objects
#: made per launch, which only the opaque op can (env MOE_INDUCTOR_TMA_DESCRIPTORS).
gemm_tma_descriptors: str = os.environ.get("MOE_INDUCTOR_TMA_DESCRIPTORS", "device")

#: "auto"'s row rule for TMA weight loads: the op alone lost at 16 to 34 rows per expert (0.68x to 0.99x, T = 512).
tma_min_rows_per_expert: int = 128

#: Who runs the backward's GEMMs: None follows ``gemm_engine``; "auto", "triton" or "grouped_mm" choose for the
#: backward alone. The forward keeps the raw up projection in one sorted layout whoever ran it, so any pairing is
#: valid. With "auto" (either way) the backward has its own rule: ``grouped_mm_backward_min_rows_per_expert`` rows
#: and no size rule, because on the H200 our fused forward followed by CUTLASS's backward GEMMs beat the fused
#: backward on every measured shape, small experts included (1.17-1.35x fwd+bwd; RESULTS.md, sixth session).
gemm_engine_backward: str | None = os.environ.get("MOE_INDUCTOR_GEMM_ENGINE_BACKWARD") or None

#: The backward's "auto" rule: at least this many rows per expert on average (the fewest measured: DeepSeek-V3 at
#: T = 4096, 128 rows each, 1.17x). Below it the backward stays on the fused kernels (not measured there).
grouped_mm_backward_min_rows_per_expert: int = 128

#: "auto"'s compute-bound regime: at least this many rows (token choices) per expert on average ...
grouped_mm_min_rows_per_expert: int = 1024

#: ... and experts of at least this many weights per projection (H * I). Measured on the H200: Mixtral's 4096 x 14336
#: experts go faster through CUTLASS at 1024 rows each, while Qwen3's and OLMoE's small ones stay faster fused.
grouped_mm_min_expert_weights: int = 32 * 1024 * 1024

#: "auto"'s rule for layers with biases (GPT-OSS's kind), any expert size: the forward's GEMMs go to
#: ``torch._grouped_mm`` from this many rows per expert on average (ops/grouped_mm_engine.py). Measured on the H200
#: inside GPT-OSS at T = 4096 (512 rows each): 1.15x our fused forward. Op-alone, at uniform routing, the two tie
#: from 512 rows and the engine is 6% slower at 256 (RESULTS.md, fifteenth session).
grouped_mm_biased_min_rows_per_expert: int = 512

#: ... and the backward's: from this many rows per expert. Op-alone (GPT-OSS's shape), forward + backward through
#: the engine took 0.86x the fused time at 256 rows each, 0.82x at 512 and 0.75x at 2048. Inside GPT-OSS's compiled
#: training step at 128 rows each (T = 1024), the engine's backward made the step 0.93x Inductor's, against 0.88x
#: with the fused backward (RESULTS.md, eighteenth session).
grouped_mm_biased_backward_min_rows_per_expert: int = 128

#: ... both for experts of at least this many weights per projection (H * I): GPT-OSS's 2880 x 2880 is the one
#: size measured; smaller experts with biases stay fused.
grouped_mm_biased_min_expert_weights: int = 4 * 1024 * 1024

#: Per-expert weights (the list op, a ModuleList of experts): the forward reads them in place through a table of their
#: places instead of stacking every expert at each call (ops/expert_lists.py, kernels/weight_table.py). On an H100
#: (DeepSeek-V2-Lite's widths, RESULTS.md, thirty-first session) the tables were 1.03x to 1.48x the stack from 16
#: tokens up in two runs; at 1 and 2 tokens, where the call is bound by the host, 0.97x / 0.98x before the per-call
#: checks were made cheaper and 1.16x / 1.04x after (env MOE_INDUCTOR_LIST_TABLES=0 turns them off).
list_weight_tables: bool = os.environ.get("MOE_INDUCTOR_LIST_TABLES", "1") == "1"

#: ... from this many rows (T*k) per expert on average; below it the list op stacks the weights. 0: every call.
list_weight_tables_min_rows_per_expert: float = 0.0

#: Take a rewrite only where the whole-model measurements say it is faster than Inductor (speed_rule.py). Off, every
#: proven MoE layer is rewritten: that is how the measurements themselves are taken (env MOE_INDUCTOR_SPEED_RULE=0).
speed_rule: bool = os.environ.get("MOE_INDUCTOR_SPEED_RULE", "1") == "1"

#: Devices on which GPT-OSS's attention with sinks runs as one SDPA call (``hf_attention.py``): where it was measured
#: faster than Inductor's fusion of the eager function (the H200: 2.51x prefill, 1.65x training step at T = 4096,
#: RESULTS.md). The CPU has no such measurement, so it keeps the eager function unless "cpu" is added here.
sink_attention_devices: tuple = ("cuda",)


def settings() -> tuple[tuple[str, object], ...]:
    """Every setting above as (name, value), by name: what a compile's choices depend on (the compile-cache tag,
    ``backend.cache_tag``; the loops remembered as unproven, ``unproven_loops.key_of``)."""
    return tuple((name, value) for name, value in sorted(globals().items())
                 if not name.startswith("_") and isinstance(value, (bool, int, float, str, tuple, type(None))))
