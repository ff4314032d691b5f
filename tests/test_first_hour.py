"""What a new user meets in the first hour: import without triton, the HF registry in any import order, explain()'s
claims, the CLI's errors, the packaging metadata. Most of it runs in fresh interpreters, where import order and
blocked modules can be set up exactly."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A meta-path finder that makes ``import triton`` fail, as on a machine without it.
_BLOCK_TRITON = """
import sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, _NoTriton())
"""

# A small unrolled-loop MoE, the first form a user writes by hand.
_LOOP_MOE = """
import torch, torch.nn as nn, torch.nn.functional as F
class LoopMoE(nn.Module):
    def __init__(self, E=3, k=2, H=16, I=8):
        super().__init__()
        self.E, self.k = E, k
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, pos = torch.where(ids == e)
            h = F.silu(x[tok] @ self.w1[e].T)
            out.index_add_(0, tok, (h @ self.w2[e].T) * weights[tok, pos, None])
        return out
"""


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter from the repository root; fail with its output when it fails."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    full_env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def test_import_backend_explain_and_cpu_op_without_triton():
    """macOS, Windows and CPU-only installs have no triton: everything but the GPU kernels must still work."""
    out = run_python(_BLOCK_TRITON + _LOOP_MOE + """
import moe_inductor
from torch._dynamo.utils import counters
assert not [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
torch.manual_seed(0)
model, x = LoopMoE(), torch.randn(6, 16)
ref = model(x)
compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
torch.testing.assert_close(compiled(x), ref)
assert sum(counters["moe_inductor"].values()) == 1, dict(counters["moe_inductor"])
report = moe_inductor.explain(model, x)
assert len(report.rewrites) == 1, str(report)
E, I, H = 3, 8, 16
w1, w2 = torch.randn(E, I, H), torch.randn(E, H, I)
ids, w = torch.randint(0, E, (6, 2)), torch.rand(6, 2)
y = moe_inductor.fused_experts(x, ids, w, w1, w2, activation="silu")
assert y.shape == x.shape
assert not [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
print("ok")
""")
    assert out.stdout.strip().endswith("ok")
