"""The grouped GEMM's row and scale modes (kernels/grouped_gemm.py explains them), in a module without triton, so
that the host code and the CPU path can name them without importing the kernels."""
from __future__ import annotations

ROWS_SORTED = 0
ROWS_TOKEN = 1
ROWS_ASSIGNMENT = 2

SCALE_NONE = 0
SCALE_ACC = 1  # routing weight scales the GEMM result before bias/activation (weight on the expert input)
SCALE_OUT = 2  # routing weight scales the epilogue output
