"""HF transformers experts modules: run them as moe_inductor ops.

transformers (>= 5) decorates each experts class with ``use_experts_implementation``; its forward dispatches to
``"eager"`` (the data-dependent ``for e in expert_hit`` loop, which Dynamo cannot capture), ``"grouped_mm"`` (the
default) or ``"batched_mm"``. The three compute the same function of the module's weights, so during a moe_inductor
compile each of them is substituted, at trace time, by one call of ``moe_inductor::experts_forward`` on views of those
weights. A module whose semantics we cannot read off with certainty (a custom gate we do not know, a post-expert norm,
expert parallelism) keeps its original code.

Models whose MoE code sits outside that interface (Llama4's dense block, Switch Transformers' and DBRX's experts
loops) get their class forward wrapped instead (``install_class_wrappers``), with the same rule: the wrapper takes the
fused path only inside a moe_inductor compile and only when it can read the module's semantics.

``register_experts_interface()`` also adds ``"moe_inductor"`` to HF's experts registry, so
``set_experts_implementation("moe_inductor")`` runs the op in eager mode too.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional, Union

import torch

from . import capture, report
from .ops import fused_experts
from .ops.call import Activation, ExpertsCall, ExpertWeights, Routing, op_call
from .speed_rule import KEPT

_HF_MOE_MODULE = "transformers.integrations.moe"
#: the form a model reports whose experts already run the op (``experts_implementation="moe_inductor"``)
REGISTRY_FORM = "hf_registry"


@torch._dynamo.assume_constant_result
def layer_name(class_name: str) -> str:
    """``model.layers.3.mlp.experts (Qwen3MoeExperts)``: the path of the module Dynamo is tracing now, read at trace
    time from Dynamo's module stack, so that logs and explain() tell two layers apart; the class name alone where
    the stack cannot be read (a function compiled outside any module)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx().output.current_tx  # the innermost translator: its module stack
        path = next(reversed(tx.nn_module_stack.values()))[0]
    except Exception:  # not tracing, or Dynamo's internals changed: the class name still says what it is
        return class_name
    for root in ("L['self'].", "L['self']", "L['self_']."):
        if path.startswith(root):
            path = path[len(root):]
            break
    return f"{path} ({class_name})" if path else class_name


def _is_decorated_experts_forward(fwd: Any) -> bool:
    """``use_experts_implementation`` wraps forward with functools.wraps (so the name is the class's); the wrapper's
    globals give it away."""
    return (hasattr(fwd, "__wrapped__") and hasattr(fwd, "__globals__")
            and fwd.__globals__.get("__name__") == _HF_MOE_MODULE)


#: the torch functions themselves as an experts module's act_fn (LFM2-MoE's is F.silu), with their default arguments
_PLAIN_ACTIVATIONS = ((torch.nn.functional.silu, "silu"), (torch.nn.functional.relu, "relu"),
                      (torch.nn.functional.gelu, "gelu"), (torch.relu, "relu"))


def _unary_activation(act_fn: Any) -> Optional[str]:
    for fn, unary in _PLAIN_ACTIVATIONS:
        if act_fn is fn:
            return unary
    name = type(act_fn).__name__
    inner = getattr(act_fn, "act", None)
    if name in ("SiLUActivation", "SiLU"):
        return "silu"
    if name == "ReLU":
        return "relu"
    if name == "GELUActivation" and inner is torch.nn.functional.gelu:
        return "gelu"
    if name in ("GELUTanh", "PytorchGELUTanh") and getattr(inner, "keywords", {}).get("approximate") == "tanh":
        return "gelu_tanh"
    if name == "GELU":
        return "gelu_tanh" if getattr(act_fn, "approximate", "none") == "tanh" else "gelu"
    return None


def experts_spec(module: torch.nn.Module) -> Optional[dict]:
    """The fused_experts keyword arguments equal to this HF experts module, or None when not provably equal."""
    got = experts_spec_or_reason(module)
    return got if isinstance(got, dict) else None


def experts_spec_or_reason(module: torch.nn.Module) -> Union[dict, str]:
    """``experts_spec``'s answer, or why the module is not provably one the op computes (explain() reports it)."""
    name = type(module).__name__
    if getattr(module, "_is_expert_parallel", False):
        return f"{name} is expert-parallel"
    if getattr(module, "has_post_expert_norm", False):
        return f"{name} normalises after the experts (has_post_expert_norm)"
    if not hasattr(module, "has_gate") or not hasattr(module, "down_proj"):
        return f"{name} lacks transformers' experts attributes (has_gate, down_proj)"
    from transformers.integrations.moe import _default_apply_gate

    gate_fn = getattr(type(module), "_apply_gate", None)
    kw: dict[str, Any] = dict(layout="kn" if module.is_transposed else "nk",
                              gate_up="concat" if module.is_concatenated else "interleaved")
    if module.has_gate:
        if gate_fn is _default_apply_gate:
            unary = _unary_activation(module.act_fn)
            if unary is None:
                return f"{name}'s activation {type(module.act_fn).__name__} is not one the op knows"
            if not module.is_concatenated:  # the default gate chunks: concatenated only
                return f"{name} applies the default (chunking) gate to interleaved gate/up weights"
            kw["activation"] = f"{unary}_glu"
        elif name == "GptOssExperts" and not module.is_concatenated:
            kw.update(activation="gptoss_glu", alpha=float(module.alpha), limit=float(module.limit))
        else:
            return f"{name} has its own _apply_gate"
        kw["w1"] = module.gate_up_proj
        kw["b1"] = module.gate_up_proj_bias if module.has_bias else None
    else:
        unary = _unary_activation(module.act_fn)
        if unary is None:
            return f"{name}'s activation {type(module.act_fn).__name__} is not one the op knows"
        kw["activation"] = unary
        kw["w1"] = module.up_proj
        kw["b1"] = module.up_proj_bias if module.has_bias else None
    kw["w2"] = module.down_proj
    kw["b2"] = module.down_proj_bias if module.has_bias else None
    return kw


def _run_spec(kw: dict, hidden_states, top_k_index, top_k_weights, name: Optional[str] = None):
    kw = dict(kw)
    w1, w2 = kw.pop("w1"), kw.pop("w2")
    y = fused_experts(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), w1, w2, name=name, **kw)
    return y.to(hidden_states.dtype)


def moe_inductor_experts_forward(module, hidden_states, top_k_index, top_k_weights, fallback=None):
    """An HF experts forward that runs ``fused_experts``; ``fallback`` runs when the module is not supported."""
    kw = experts_spec(module)
    if kw is None:
        if fallback is None:
            raise NotImplementedError(f"moe_inductor cannot run {type(module).__name__} (unsupported variant)")
        return fallback(module, hidden_states, top_k_index, top_k_weights)
    if torch.compiler.is_compiling():  # the user's own choice of the op counts as a rewrite in explain() and logs
        report.record_rewrite(REGISTRY_FORM, layer_name(type(module).__qualname__), int(kw["w1"].shape[0]),
                               int(top_k_index.shape[-1]), kw["activation"],
                               (tuple(kw["w1"].shape), tuple(kw["w2"].shape)), 'experts_implementation="moe_inductor"')
    return _run_spec(kw, hidden_states, top_k_index, top_k_weights)


def _speed_rule_verdict(form: str, kw: dict, hidden_states: torch.Tensor, top_k: int) -> str:
    """The speed rule's word on this module (speed_rule.py): why Inductor's path is kept, or why ours is taken."""
    from .speed_rule import mode_of

    gated = kw["activation"].endswith("_glu")
    gate_up = kw.get("gate_up", "concat") if gated else "separate"
    bias = kw.get("b1") is not None or kw.get("b2") is not None
    E, *inner = kw["w2"].shape
    H, I = inner if kw["layout"] == "nk" else inner[::-1]
    shape = (int(H), int(I), int(E), int(top_k))
    mode = mode_of(hidden_states, (kw["w1"], kw["w2"]), shape, bias)
    return capture.speed_rule_verdict(form, kw["activation"], gate_up, bias, shape, str(hidden_states.device), mode,
                                      hidden_states.dtype)


#: the substitutions whose original code multiplies by autocast ops (``F.linear``, ``@``, ``bmm``); transformers'
#: ``grouped_mm`` casts the tokens to the weights' dtype itself (``_grouped_mm`` is no autocast op), as the op computes
_AUTOCAST_FORMS = frozenset({"hf_eager_loop", "hf_batched_mm", "hf_llama4_dense", "hf_switch", "hf_dbrx"})
#: those of them whose every floating-point step past the matmuls follows the matmuls' dtype, and whose result is
#: the tokens' dtype: the op computes them in autocast's dtype, its inputs cast as autocast casts the matmuls'
_AUTOCAST_CAST_FORMS = frozenset({"hf_eager_loop", "hf_batched_mm"})


def _autocast_dtype(form: str, module: torch.nn.Module, hidden_states: torch.Tensor,
                    *weights: torch.Tensor) -> Union[torch.dtype, bool, None]:
    """Where autocast to another dtype than the tokens' and weights' is on (read while Dynamo traces, which guards
    on it) and ``form``'s original code computes in that dtype: the dtype, for a form the op computes in it
    (``_AUTOCAST_CAST_FORMS``), else True (noted as left alone). None where autocast changes nothing."""
    from .passes.grad_modes import autocast_reason

    if form not in _AUTOCAST_FORMS:
        return None
    device_type = hidden_states.device.type
    reason = autocast_reason(device_type, {hidden_states.dtype, *(w.dtype for w in weights)})
    if reason is None:
        return None
    if form in _AUTOCAST_CAST_FORMS:
        return torch.get_autocast_dtype(device_type)
    report.record_left_alone(form, layer_name(type(module).__qualname__), reason)
    return True


def _autocast_kept(form: str, module: torch.nn.Module, hidden_states: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether autocast leaves ``form`` to its original code (``_autocast_dtype``; said in explain())."""
    return _autocast_dtype(form, module, hidden_states, *weights) is True


def _cast_spec(kw: dict, dtype: torch.dtype) -> dict:
    """The experts' weights and biases in ``kw`` cast to ``dtype``, as autocast casts a matmul's operands."""
    return {key: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for key, v in kw.items()}


def _make_polyfill(form: str) -> Callable[[Callable], Callable]:
    def make(original_clone: Callable) -> Callable:
        def polyfill(self, hidden_states, top_k_index, top_k_weights):
            if not capture.rewriting_enabled(form):
                return original_clone(self, hidden_states, top_k_index, top_k_weights)
            kw = experts_spec_or_reason(self)
            if isinstance(kw, str):
                report.record_left_alone(form, layer_name(type(self).__qualname__), kw)
                return original_clone(self, hidden_states, top_k_index, top_k_weights)
            cast = _autocast_dtype(form, self, hidden_states, kw["w1"], kw["w2"])
            if cast is True:
                return original_clone(self, hidden_states, top_k_index, top_k_weights)
            tokens = hidden_states if cast is None else hidden_states.to(cast)
            name = layer_name(type(self).__qualname__)
            said = _speed_rule_verdict(form, kw, tokens, top_k_index.shape[-1])
            if said.startswith(KEPT):
                report.record_left_alone(form, name, said)
                return original_clone(self, hidden_states, top_k_index, top_k_weights)
            if cast is not None:
                from .passes.grad_modes import autocast_note

                said = "; ".join(t for t in (said, autocast_note(cast)) if t)
            report.record_rewrite(form, name, int(kw["w1"].shape[0]), int(top_k_index.shape[-1]),
                                   kw["activation"], (tuple(kw["w1"].shape), tuple(kw["w2"].shape)), note=said)
            if cast is None:
                return _run_spec(kw, hidden_states, top_k_index, top_k_weights, name)
            # the original code returns the tokens' dtype (a cast after its sum, or its fp32 buffer's)
            return _run_spec(_cast_spec(kw, cast), tokens, top_k_index, top_k_weights, name).to(hidden_states.dtype)

        return polyfill

    return make


def _llama4_moe_forward(original: Callable) -> Callable:
    """Llama4's MoE block runs every expert on every token, scaled on the input by a score that is zero off the
    top-k (sigmoid of -inf). With no expert biases a zero input gives a zero output, so only the top-k work is
    needed: one fused op with the weight on the expert input. Outside moe_inductor compiles this runs ``original``.
    """

    @functools.wraps(original)
    def forward(self, hidden_states):
        unary = _llama4_activation(self)
        if unary is None or not capture.rewriting_enabled("hf_llama4_dense") or _autocast_kept(
                "hf_llama4_dense", self, hidden_states, self.experts.gate_up_proj, self.experts.down_proj):
            return original(self, hidden_states)
        experts = self.experts
        report.record_rewrite("hf_llama4_dense", layer_name(type(self).__qualname__), int(experts.gate_up_proj.shape[0]),
                               int(self.router.top_k), f"{unary}_glu",
                               (tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape)))
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = torch.nn.functional.linear(hidden_states, self.router.weight, self.router.bias)
        top_value, top_index = torch.topk(router_logits, self.router.top_k, dim=1)
        scores = torch.sigmoid(top_value.float()).to(router_logits.dtype)
        routed = fused_experts(hidden_states, top_index, scores, experts.gate_up_proj, experts.down_proj,
                               activation=f"{unary}_glu", layout="kn", gate_up="concat", weight_position="input")
        out = self.shared_expert(hidden_states)
        out.add_(routed)
        return out, router_logits

    forward._moe_inductor_original = original
    return forward


def _switch_spec(experts: torch.nn.Module) -> Optional[tuple[str, list, list]]:
    """(activation, wi weights, wo weights) when ``experts`` is exactly HF's Switch experts in a state we can run:
    no biases, dropout inactive, a known activation."""
    mod = sys.modules.get("transformers.models.switch_transformers.modeling_switch_transformers")
    if mod is None or type(experts) is not mod.SwitchTransformersExperts:
        return None
    members = [experts[f"expert_{i}"] for i in range(experts.num_experts)]
    acts = {_unary_activation(m.act) for m in members}
    if len(acts) != 1 or None in acts:
        return None
    for m in members:
        if type(m) is not mod.SwitchTransformersDenseActDense or m.wi.bias is not None or m.wo.bias is not None:
            return None
        if (m.training and m.dropout.p > 0) or m.wi.weight.dtype != m.wo.weight.dtype:
            return None
    return acts.pop(), [m.wi.weight for m in members], [m.wo.weight for m in members]


def _switch_experts_forward(original: Callable) -> Callable:
    """Switch's experts loop over a data-dependent ``expert_hit`` (Dynamo cannot capture it). Its router already
    applied the capacity: a dropped token's one-hot row is all zeros. So the experts are the list op over top-1 ids,
    with dropped tokens given the out-of-range id E, which the op skips. Outside moe_inductor compiles this runs
    ``original``."""

    @functools.wraps(original)
    def forward(self, hidden_states, selected_experts, routing_weights):
        spec = _switch_spec(self) if capture.rewriting_enabled("hf_switch") else None
        if spec is None or _autocast_kept("hf_switch", self, hidden_states, *spec[1], *spec[2]):
            return original(self, hidden_states, selected_experts, routing_weights)
        activation, w_in, w_out = spec
        E = len(w_in)
        report.record_rewrite("hf_switch", layer_name(type(self).__qualname__), E, 1, activation,
                               ((E,) + tuple(w_in[0].shape), (E,) + tuple(w_out[0].shape)),
                               "capacity drops kept as the router made them")
        mask = selected_experts.reshape(hidden_states.shape[0], E)
        kept = mask.sum(-1, keepdim=True) > 0
        ids = torch.where(kept, mask.argmax(-1, keepdim=True), E)
        weights = routing_weights.reshape(-1, 1).to(hidden_states.dtype)
        wants_grad = torch.is_grad_enabled() and (hidden_states.requires_grad or w_in[0].requires_grad)
        op, args = op_call(ExpertsCall(hidden_states, Routing(ids, weights),
                                       ExpertWeights(tuple(w_in), None, tuple(w_out), layout="nk"),
                                       Activation(activation), save_pre=wants_grad))
        y, *_ = op(*args)
        return y

    forward._moe_inductor_original = original
    return forward


def _dbrx_experts_forward(original: Callable) -> Callable:
    """DBRX's experts loop over a data-dependent ``expert_hit``, on weights stored flat as (E*I, H). As (E, I, H)
    views, w1 and v1 are (out, in) and w2 is (in, out): one fused op reads them in place."""

    @functools.wraps(original)
    def forward(self, hidden_states, top_k_index, top_k_weights):
        unary = _dbrx_activation(self) if capture.rewriting_enabled("hf_dbrx") else None
        if unary is None or _autocast_kept("hf_dbrx", self, hidden_states, self.mlp.w1, self.mlp.v1, self.mlp.w2):
            return original(self, hidden_states, top_k_index, top_k_weights)
        mlp, E, I, H = self.mlp, self.num_experts, self.ffn_hidden_size, self.hidden_size
        report.record_rewrite("hf_dbrx", layer_name(type(self).__qualname__), E, int(top_k_index.shape[-1]), f"{unary}_glu",
                               ((E, I, H), (E, I, H)))
        x = hidden_states.reshape(-1, H)
        y = fused_experts(x, top_k_index, top_k_weights.to(x.dtype),
                          (mlp.w1.view(E, I, H).transpose(1, 2), mlp.v1.view(E, I, H).transpose(1, 2)),
                          mlp.w2.view(E, I, H), activation=f"{unary}_glu", layout="kn")
        return y.view(hidden_states.shape[0], -1, H)

    forward._moe_inductor_original = original
    return forward


def _dbrx_activation(experts: torch.nn.Module) -> Optional[str]:
    mod = sys.modules.get("transformers.models.dbrx.modeling_dbrx")
    if mod is None or type(experts) is not mod.DbrxExperts or type(experts.mlp) is not mod.DbrxExpertGLU:
        return None
    return _unary_activation(experts.mlp.activation_fn)


_WRAPPED_FORWARDS = {  # module -> (class, wrapper): class forwards Dynamo calls as bound methods
    "transformers.models.llama4.modeling_llama4": ("Llama4TextMoe", _llama4_moe_forward),
    "transformers.models.switch_transformers.modeling_switch_transformers": ("SwitchTransformersExperts",
                                                                             _switch_experts_forward),
    "transformers.models.dbrx.modeling_dbrx": ("DbrxExperts", _dbrx_experts_forward),
}


def install_class_wrappers() -> None:
    """Route the forwards in ``_WRAPPED_FORWARDS`` through their wrappers (once, when the model code is loaded).

    Dynamo does not apply ``substitute_in_graph`` to a forward called as a bound method, so there the class
    attribute itself is wrapped; each wrapper takes the original path everywhere except inside a moe_inductor
    compile.
    """
    for module_name, (class_name, wrap) in _WRAPPED_FORWARDS.items():
        mod = sys.modules.get(module_name)
        cls = getattr(mod, class_name, None) if mod is not None else None
        if cls is not None and not hasattr(cls.forward, "_moe_inductor_original"):
            cls.forward = wrap(cls.forward)


def _llama4_activation(block: torch.nn.Module) -> Optional[str]:
    """The activation when ``block`` is exactly HF's Llama4 MoE (no subclass, router or experts swapped)."""
    mod = sys.modules.get("transformers.models.llama4.modeling_llama4")
    if mod is None or type(block) is not mod.Llama4TextMoe:
        return None
    if type(block.experts) is not mod.Llama4TextExperts or type(block.router) is not mod.Llama4Router:
        return None
    return _unary_activation(block.experts.act_fn)


def _hf_substitutions() -> list[tuple[Callable, Callable]]:
    """The HF experts forwards present now: the two shared implementations and every loaded class's eager loop."""
    moe = sys.modules.get(_HF_MOE_MODULE)
    if moe is None:
        return []
    register_experts_interface()
    out = [(moe.grouped_mm_experts_forward, _make_polyfill("hf_grouped_mm")),
           (moe.batched_mm_experts_forward, _make_polyfill("hf_batched_mm"))]
    for name, mod in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            fwd = getattr(obj, "forward", None) if isinstance(obj, type) else None
            if fwd is not None and obj.__module__ == name and _is_decorated_experts_forward(fwd):
                out.append((fwd.__wrapped__, _make_polyfill("hf_eager_loop")))
    install_class_wrappers()
    return out


_registered = False


def register_experts_interface() -> bool:
    """Add "moe_inductor" to HF's experts registry (``set_experts_implementation("moe_inductor")``).

    Returns False when transformers (>= 5, with ExpertsInterface) is not importable.
    """
    global _registered
    if _registered:
        return True
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register("moe_inductor", moe_inductor_experts_forward)
    _registered = True
    return True


class _RegisterOnImport:
    """A one-shot meta-path finder: when ``transformers.integrations.moe`` (HF's experts registry) is first imported,
    it adds "moe_inductor" to the registry right after the module runs.

    So ``from_pretrained(..., experts_implementation="moe_inductor")``, ``_from_config`` and
    ``set_experts_implementation`` work whether transformers is imported before or after moe_inductor, without
    moe_inductor importing transformers itself.
    """

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _HF_MOE_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            register_experts_interface()

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Hook HF experts into moe_inductor compiles, and into HF's experts registry. Imports nothing of transformers:
    the substitutions are looked for at compile start, and the registry entry is added when HF's registry module
    loads (now, if it already has)."""
    capture.add_substitution_source(_hf_substitutions)
    if _HF_MOE_MODULE in sys.modules:
        register_experts_interface()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
