"""Loops that no rewrite took, remembered so that the frames Dynamo compiles after the fallback do not trace them
unrolled again.

A speculated loop (a skip of an expert with no rows assumed away, speculation.py; a loop over the experts that got
rows unrolled over every expert, hit_loops.py) stays only where a rewrite takes its body; otherwise the frame falls
back to plain capture, which breaks the graph at the loop as ``backend="inductor"`` does. Dynamo then compiles the
frames around that break on their own (the decoder layer's forward, the MoE block's, the experts' forward, their
resume functions), and each of them would unroll the same loop again, run the passes, and fail alike: transformers'
LongCat-Flash, while no rewrite took its zero experts (passes/zero_experts.py does now), made 14 such attempts and
compiled 4x slower than plain capture.

So a loop whose body no rewrite took is remembered, by everything its proof depends on: the module whose forward
holds it (its ``self``, held weakly), the loop's code and offset, the shapes, dtypes and devices of that forward's
tensor arguments (the speed rule judges by shape; a symbolic size reads as ``?``), the forms asked for, the grad
mode, and ``config``'s settings. Where all of them match, the loop is not speculated again (its refusal says why),
and the frame goes to plain capture at once. Another instance of the same class, another shape or another setting
is tried afresh; a loop in a function with no module ``self`` is never remembered.
"""
from __future__ import annotations

import re
import weakref
from typing import Iterable, Optional

import torch

#: module -> the keys (``key_of``) of its loops that no rewrite took
_unproven: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()


def _self_module(tx) -> Optional[torch.nn.Module]:
    """The module whose method the traced frame ``tx`` runs, when its ``self`` is one."""
    from torch._dynamo.variables.lazy import LazyVariableTracker

    var = getattr(tx, "symbolic_locals", {}).get("self")
    if var is None:
        return None
    if isinstance(var, LazyVariableTracker):  # read without realizing it: that would add guards on it
        if not var.is_realized():
            obj = var.peek_value() if hasattr(var, "peek_value") else None
            return obj if isinstance(obj, torch.nn.Module) else None
        var = var.realize()
    obj = getattr(var, "value", None)
    if obj is None and getattr(var, "module_key", None) is not None:
        try:
            obj = tx.output.get_submodule(var.module_key)
        except Exception:  # noqa: BLE001  (a module Dynamo holds otherwise: not remembered)
            obj = None
    return obj if isinstance(obj, torch.nn.Module) else None


def _arguments(tx) -> Optional[tuple]:
    """The shapes, dtypes and devices of the frame's tensor arguments; None when one cannot be read."""
    from torch._dynamo.variables import TensorVariable

    code = tx.f_code
    out = []
    for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        var = tx.symbolic_locals.get(name)
        if not isinstance(var, TensorVariable):
            continue
        value = var.as_proxy().node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            return None
        out.append((name, tuple(d if isinstance(d, int) else "?" for d in value.shape), value.dtype,
                    value.device.type))
    return tuple(out)


def key_of(tx, loop_head: int) -> Optional[tuple[torch.nn.Module, tuple]]:
    """(the module, the key) of the loop whose FOR_ITER is at ``loop_head`` in the frame ``tx`` traces, as traced
    now; None where the loop is not to be remembered."""
    from . import capture, config

    module, arguments, state = _self_module(tx), _arguments(tx), capture.current()
    if module is None or arguments is None or state is None:
        return None
    try:  # a module class that defines __eq__ without __hash__ cannot key the memory: never remembered
        hash(module)
    except TypeError:
        return None
    return module, (tx.f_code, loop_head, arguments, state.forms, torch.is_grad_enabled(), module.training,
                    config.settings())


def remember(key: Optional[tuple[torch.nn.Module, tuple]], left_alone: Iterable) -> None:
    """File a loop (``key_of``, taken when it was speculated) whose body no rewrite took, where a matcher said why
    for a line of the loop's own function (``report.LeftAlone``): a pass that failed on something else in the graph
    says nothing of the loop, and a smaller frame may still take it."""
    if key is None:
        return
    code = key[1][0]
    lines = {line for _, _, line in code.co_lines() if line is not None}
    file = code.co_filename.rsplit("/", 1)[-1]
    for record in left_alone:  # its where: "file.py:LINE: the source line"
        found = re.match(r"(.*?):(\d+)", str(getattr(record, "where", "")))
        if found and found[1].rsplit("/", 1)[-1] == file and int(found[2]) in lines:
            _unproven.setdefault(key[0], set()).add(key[1])
            return


def known_unproven(key: Optional[tuple[torch.nn.Module, tuple]]) -> bool:
    """Whether an earlier compile found no rewrite for this very loop under the same conditions."""
    return key is not None and key[1] in _unproven.get(key[0], ())


def forget_all() -> None:
    """Forget every remembered loop (tests; a user who changed the matchers' code in the process)."""
    _unproven.clear()



#: the refusal a remembered loop gets (explain() shows it with the frame's fallback)
REFUSAL = ("an earlier compile of this module's loop, with the same argument shapes and settings, found no rewrite "
           "for its body: not unrolled again, the frame goes to plain capture at once")
