"""Bucketed inference: run a causal LM at a few static sequence lengths instead of every length it is called with.

    model = torch.compile(model, backend="moe_inductor", dynamic=False)     # static graphs (and CUDA graphs) ...
    model = moe_inductor.bucketed(model, buckets=(128, 512, 2048, 8192))    # ... one per bucket, at most

Each call right-pads the sequence to the smallest bucket that fits, masks the padding out and slices the logits back.
For a causal decoder that is exact: a real position attends only to earlier (real) positions, and token-choice
routing sends every token on its own. It is *not* exact for encoders, encoder-decoders or routing with a capacity
(padding tokens would take capacity), so those models are refused. Prefill only: a cache would keep the padding.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _config_of(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("moe_inductor.bucketed needs a transformers causal LM (a module with a .config)")
    return config


def _check_causal_lm(model: nn.Module) -> None:
    config = _config_of(model)
    name = type(getattr(model, "_orig_mod", model)).__name__
    if getattr(config, "is_encoder_decoder", False) or not name.endswith("ForCausalLM"):
        raise ValueError(f"moe_inductor.bucketed pads the sequence, which is exact only for causal decoders; "
                         f"{name} is not a *ForCausalLM")
    if getattr(config, "expert_capacity", None) or getattr(config, "capacity_factor", None):
        raise ValueError("moe_inductor.bucketed: this model routes with an expert capacity, which padding tokens "
                         "would take up; run it without buckets")


class BucketedCausalLM(nn.Module):
    """See the module docstring. ``model`` may be compiled or not; its outputs keep their type, with logits for the
    real positions only."""

    def __init__(self, model: nn.Module, buckets: Sequence[int] = DEFAULT_BUCKETS, pad_token_id: Optional[int] = None):
        super().__init__()
        _check_causal_lm(model)
        if not buckets or any(int(b) <= 0 for b in buckets):
            raise ValueError(f"buckets must be positive sequence lengths, got {buckets!r}")
        self.model = model
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        config = _config_of(model)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (getattr(config, "pad_token_id", None) or 0)

    def bucket_for(self, length: int) -> int:
        """The smallest bucket that holds ``length`` tokens; ``length`` itself past the largest bucket."""
        for b in self.buckets:
            if b >= length:
                return b
        return length

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> Any:
        for key in ("past_key_values", "cache", "cache_position", "position_ids", "inputs_embeds"):
            if kwargs.get(key) is not None:
                raise ValueError(f"moe_inductor.bucketed is for prefill of plain input_ids; got {key}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        kwargs.pop("use_cache", None)  # a cache would keep the padding
        batch, length = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        pad = self.bucket_for(length) - length
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=self.pad_token_id)
            attention_mask = torch.nn.functional.pad(attention_mask, (0, pad), value=0)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
        if pad:
            out.logits = out.logits[:, :length]
        return out


def bucketed(model: nn.Module, buckets: Sequence[int] = DEFAULT_BUCKETS,
             pad_token_id: Optional[int] = None) -> BucketedCausalLM:
    """Wrap a (compiled) causal LM so that it only ever sees the sequence lengths in ``buckets``.

    Args:
        model: a transformers ``*ForCausalLM``, typically ``torch.compile(m, backend="moe_inductor", dynamic=False)``.
        buckets: the sequence lengths to pad to; longer inputs run unpadded.
        pad_token_id: the id written into padding (masked out); default the config's, else 0.
    Returns:
        A module called like the model on ``input_ids`` (and an optional ``attention_mask``) for prefill.
    Raises:
        ValueError: for models where padding would change the result (not a causal decoder, or capacity routing).
    """
    return BucketedCausalLM(model, buckets, pad_token_id)
