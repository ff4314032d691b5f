"""Backend options, given as ``torch.compile(m, backend="moe_inductor", options={...})``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

FORMS = ("hf_grouped_mm", "hf_batched_mm", "hf_eager_loop", "hf_llama4_dense", "hf_switch", "hf_dbrx", "gathered_weights",
         "dense_experts", "unrolled_loop", "sorted_grouped_mm", "padded_capacity")
INNER_COMPILERS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class BackendOptions:
    """``inner``: the compiler the rewritten graph is handed to ("inductor", or "aot_eager"/"eager" for tests).
    ``forms``: the MoE forms to rewrite (default all; an empty collection turns rewriting off)."""

    inner: str = "inductor"
    forms: frozenset = field(default_factory=lambda: frozenset(FORMS))

    @classmethod
    def parse(cls, options: Optional[dict]) -> "BackendOptions":
        options = dict(options or {})
        inner = options.pop("inner", "inductor")
        forms = frozenset(options.pop("forms", FORMS))
        if options:
            raise ValueError(f"unknown moe_inductor options {sorted(options)}; known: inner, forms")
        if inner not in INNER_COMPILERS:
            raise ValueError(f"inner={inner!r}; choose one of {INNER_COMPILERS}")
        unknown = forms - set(FORMS)
        if unknown:
            raise ValueError(f"unknown MoE forms {sorted(unknown)}; known: {FORMS}")
        return cls(inner, forms)
