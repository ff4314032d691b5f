"""Backend options, given as ``torch.compile(m, backend="moe_inductor", options={...})``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

FORMS = ("hf_grouped_mm", "hf_batched_mm", "hf_eager_loop", "hf_llama4_dense", "hf_switch", "hf_dbrx", "gathered_weights",
         "dense_experts", "unrolled_loop", "sorted_grouped_mm", "padded_capacity", "split_loop",
         "moe_region")  # the last only notes, for explain(), a router feeding work that no form above took
INNER_COMPILERS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class BackendOptions:
    """``inner``: the compiler the rewritten graph is handed to ("inductor", or "aot_eager"/"eager" for tests).
    ``forms``: the MoE forms to rewrite (default all; an empty collection turns rewriting off).
    ``inductor``: every other option, an Inductor config setting (``max_autotune``, ``"triton.cudagraphs"``, ...)
    handed to the inner Inductor compile as config patches, as ``torch.compile(..., options=)`` does for
    ``backend="inductor"``."""

    inner: str = "inductor"
    forms: frozenset = field(default_factory=lambda: frozenset(FORMS))
    inductor: dict = field(default_factory=dict, hash=False)

    @classmethod
    def parse(cls, options: Optional[dict]) -> "BackendOptions":
        options = dict(options or {})
        inner = options.pop("inner", "inductor")
        forms = frozenset(options.pop("forms", FORMS))
        if inner not in INNER_COMPILERS:
            raise ValueError(f"inner={inner!r}; choose one of {INNER_COMPILERS}")
        unknown = forms - set(FORMS)
        if unknown:
            raise ValueError(f"unknown MoE forms {sorted(unknown)}; known: {FORMS}")
        if options:
            import torch._inductor.config as inductor_config

            known = inductor_config.get_config_copy()
            unknown = sorted(k for k in options if k not in known)
            if unknown:
                raise ValueError(f"unknown moe_inductor options {unknown}: the options are inner, forms and "
                                 "Inductor's config settings (torch._inductor.config, e.g. max_autotune)")
            if inner != "inductor":
                raise ValueError(f"Inductor options {sorted(options)} need inner='inductor', got inner={inner!r}")
        return cls(inner, forms, options)
