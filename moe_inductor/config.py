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

#: EXPERIMENTAL, off until the GPU suite has run with it: launch the grouped GEMM through Triton's compiled kernel
#: directly after its first launch (skips ``JITFunction.run``'s per-call binding; see kernels/launch.py).
fast_launch: bool = os.environ.get("MOE_INDUCTOR_FAST_LAUNCH", "0") == "1"

#: EXPERIMENTAL, off until measured on the GPU: hand Inductor our experts forward as a ``triton_op`` it traces into,
#: so that its generated wrapper launches our kernels (no dispatcher or Python of ours per call; lowerings/visible.py).
visible_kernels: bool = os.environ.get("MOE_INDUCTOR_VISIBLE_KERNELS", "0") == "1"

#: EXPERIMENTAL, off until measured on the GPU: load the grouped GEMM's weight tiles through TMA descriptors (Hopper's
#: bulk tensor copies) where the weight layout allows (kernels/launch.py ``_weight_descriptor``).
tma_weights: bool = os.environ.get("MOE_INDUCTOR_TMA", "0") == "1"
