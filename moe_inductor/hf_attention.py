"""Attention with per-head sinks (GPT-OSS) as one fused SDPA call, under moe_inductor compiles.

transformers' GPT-OSS attention has no SDPA path: its ``eager_attention_forward`` materialises the (B, H, T, S)
scores, appends one learned logit per head (the sink), takes the softmax over S + 1 and drops the sink's column
before multiplying by the values. At T = 4096 that is gigabytes of scores per layer, and it is most of the model's
time under ``torch.compile`` (RESULTS.md). The same attention is one SDPA call over one extra key:

    queries  q' = [q, hi_h, lo_h, 0...]       hi_h + lo_h = sink_h / scaling, split so that bf16 keeps it exact
    keys     k' = [k, 0, 0, 0...] for the S real keys, and [0..., 1, 1, 0...] for the sink key
    values   v' = v for the real keys, and 0 for the sink key
    mask     the user's additive mask, with 0 for the sink key

so each query's score against the sink key is ``scaling * (hi_h + lo_h) = sink_h``, its scores against real keys are
unchanged, and the sink key adds its weight to the softmax's denominator but nothing to the output: exactly the
eager softmax over ``cat([scores + mask, sink])`` with the sink's column dropped. Autograd gives the sinks their
gradient through q' (the hi/lo split passes it once). The head dimension is padded to a multiple of 8 for the
fused kernels (64 -> 72 for GPT-OSS).

While moe_inductor traces (not in plain fallbacks, not for other backends), the function is answered so only where
that identity holds as written and where it was measured (RESULTS.md): on a device of
``config.sink_attention_devices`` (the GPU, in bf16 or fp16), with more than one query (prefill, training; decode
steps keep the eager function), no dropout in effect, an additive floating mask of the query's dtype (or none)
over the S keys, queries, keys and values of one head dimension, and ``module.sinks`` of one logit per query head.
Any other call runs the original. The attention weights it returns are eager's formula: the compiled graph drops
them as dead code when nothing reads them (the decoder layers discard them unless attentions are recorded; when
they are, both forms run).
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import capture, config, report

_MODULES = ("transformers.models.gpt_oss.modeling_gpt_oss",)
_KNOWN_PARAMS = ({"module", "query", "key", "value", "attention_mask", "scaling", "dropout", "kwargs"},)
#: what the eager function's body must contain (transformers 5): scores plus mask, the sinks appended, the
#: softmax over both, the sink's column dropped
_BODY = ("attn_weights + attention_mask", "module.sinks", "torch.cat([attn_weights, sinks], dim=-1)", "softmax(",
         "[..., :-1]")
NOTE = ("GPT-OSS's attention with sinks runs as one fused SDPA call (the sink as one extra key of zero value), "
        "not as its eager softmax over materialised scores")


def applies(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: Any, dropout: Any) -> bool:
    """Whether the SDPA form computes what the eager function computes for these arguments (facts a compiled
    graph is specialised on: dtypes, ranks, sizes, Python values)."""
    if not isinstance(scaling, (int, float)):  # SDPA takes its scale as a number
        return False
    sinks = getattr(module, "sinks", None)
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors) or not isinstance(sinks, torch.Tensor):
        return False
    if not query.dtype.is_floating_point or any(t.dtype != query.dtype or t.device != query.device for t in tensors):
        return False
    if query.device.type not in config.sink_attention_devices:  # measured faster on the GPU only
        return False
    if query.is_cuda and query.dtype not in (torch.bfloat16, torch.float16):
        return False  # measured in bf16; float32 takes other SDPA kernels, not measured
    if dropout != 0 and module.training:
        return False
    B, H, T, D = query.shape
    if T < 2:  # a decode step: not measured against Inductor's fusion of the eager function, which is kept there
        return False
    groups = getattr(module, "num_key_value_groups", None)
    if not isinstance(groups, int) or groups < 1 or key.shape[1] * groups != H:
        return False
    if key.shape != value.shape or key.shape[0] != B or key.shape[-1] != D or sinks.shape != (H,):
        return False
    if attention_mask is None:
        return True
    return (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == query.dtype
            and attention_mask.dim() == 4 and attention_mask.shape[-1] == key.shape[-2]
            and attention_mask.shape[0] in (1, B) and attention_mask.shape[1] in (1, H)
            and attention_mask.shape[2] in (1, T) and not attention_mask.requires_grad)


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv * groups, S, D), query head h reading key head h // groups (as repeat_kv does)."""
    if groups == 1:
        return x
    B, Hkv, S, D = x.shape
    return x[:, :, None].expand(B, Hkv, groups, S, D).reshape(B, Hkv * groups, S, D)


def sinks_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """The attention output, (B, T, H, D) contiguous, computed by one SDPA call with the sink as an extra key."""
    B, H, T, D = query.shape
    S = key.shape[-2]
    padded = -(-(D + 2) // 8) * 8
    groups = module.num_key_value_groups
    wide = torch.promote_types(query.dtype, torch.float32)
    sink = module.sinks.to(wide) / scaling
    hi = sink.to(query.dtype)
    lo = (sink - hi.to(wide)).to(query.dtype)
    q = torch.cat([query, torch.stack([hi, lo], -1).view(1, H, 1, 2).expand(B, H, T, 2),
                   query.new_zeros(B, H, T, padded - D - 2)], -1)
    sink_key = torch.cat([query.new_zeros(D), query.new_ones(2), query.new_zeros(padded - D - 2)])
    k = torch.cat([F.pad(_repeat_heads(key, groups), (0, padded - D)), sink_key.expand(B, H, 1, padded)], -2)
    v = F.pad(_repeat_heads(value, groups), (0, padded - D, 0, 1))
    mask = None
    if attention_mask is not None:
        # zero-padded to a multiple of 16 keys and sliced back: the sink key's column is 0 (never masked), and the
        # row stride stays aligned as the memory-efficient kernel wants it
        width = -(-(S + 1) // 16) * 16
        mask = F.pad(attention_mask, (0, width - S))[..., : S + 1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scaling)
    return out[..., :D].transpose(1, 2).contiguous()


def _eager_weights(module: Any, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                   scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """The attention weights as the eager function returns them (its probabilities without the sink's column)."""
    scores = torch.matmul(query, _repeat_heads(key, module.num_key_value_groups).transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    sinks = module.sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
    logits = torch.cat([scores, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(dtype)


def _make_polyfill(original_clone: Callable) -> Callable:
    def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if not capture.capturing_at_trace_time() or not applies(module, query, key, value, attention_mask, scaling,
                                                                 dropout):
            return original_clone(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        report.record_note_once(NOTE)
        out = sinks_sdpa(module, query, key, value, attention_mask, scaling)
        return out, _eager_weights(module, query, key, attention_mask, scaling, value.dtype)

    return eager_attention_forward


@functools.lru_cache(maxsize=None)  # asked at the start of every compile; the source does not change
def _is_sink_softmax(fn: Callable) -> bool:
    """The function's body is the one the module docstring describes: the sinks appended to the scores, the
    softmax, the sink's column dropped. A release that computes something else there keeps its own code."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return all(part in source for part in _BODY)


def _substitutions() -> list[tuple[Callable, Callable]]:
    found = []
    for name in _MODULES:
        fn = getattr(sys.modules.get(name), "eager_attention_forward", None)
        if fn is not None and set(inspect.signature(fn).parameters) in _KNOWN_PARAMS and _is_sink_softmax(fn):
            found.append((fn, _make_polyfill))
    return found


def install() -> None:
    """Look for the sink attention at the start of each moe_inductor compile (imports nothing)."""
    capture.add_substitution_source(_substitutions)
