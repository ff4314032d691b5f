"""Never slower, by construction: a rewrite is taken only where it was measured faster than Inductor's own handling of
the same layer, else the layer is left to Inductor and explain() says why.

The measurements ship as data beside the tuned kernel configs, one file per GPU (``kernels/tuned/whole_model/``):
for each layer kind (activation, gate/up layout, biases, the (H, I, E, k) it was measured at), moe_inductor's speed
over ``torch.compile``'s default in each mode ("prefill", "decode", "train"), from ``benchmarks/bench_hf.py``. The
rule reads shapes, dtypes and modes only (nothing on the device), so it costs nothing per call.

- A layer kind with a measured value below 1.0 in the current mode is left to Inductor. Where this GPU did not
  measure the mode itself, another GPU's value for the mode below ``UNMEASURED_GPU_MARGIN`` keeps it too; else the
  worst value this GPU measured for that layer kind decides (for prefill or decode, the worst of its inference
  values where it has one). The mode (``mode_of``) is "train" for a call that
  makes a gradient ("train_long" where its static token count is at least the long size training was measured
  at: then an entry's value for that size decides, where it has one; "train_static" for a shorter static count
  whose backward Inductor launches itself, ``TRAIN_STATIC``), "decode" or "prefill" by a static token count of the
  sizes those were measured at ("decode_batch" for a batched decode step, ``DECODE_BATCH``, judged by its own
  value where the entry has one, else by "decode"), else "inference", the worse of the two.
- On a GPU with no file, the rule is conservative: it uses the worst of the measurements of the GPUs that have one,
  and leaves a layer kind to Inductor unless it won there by ``UNMEASURED_GPU_MARGIN``.
- Layer kinds never measured are rewritten (the op benchmark, ``bench_experts.py``, shows the op ahead of
  sort + ``torch._grouped_mm`` on every measured shape).
- A measurement holds for the route it was made on (``"route"``: ``"hf"``, transformers' experts modules, the only
  route bench_hf.py measures). What Inductor makes of the user's own code depends on how it is written: for the FX
  forms (gathered weights, loops, capacity einsums) Inductor's path is the user's code, unmeasured as a whole model,
  so they count as never measured, except the FX layers over per-expert weights (a ModuleList of nn.Linear experts,
  run by the list op), route ``"fx_list"``, measured by ``benchmarks/bench_list_train.py``. A loop over the slices
  of stacked weights (``LOOP_FORMS``) is judged by those values too (``fx_route``): Inductor's path for it is the
  same per-expert GEMMs as for the ModuleList's loop, and ours reads the stack directly, without the list op's
  table or the stack its GPU backward makes, so the list op's ratio is the cautious one until such loops are
  measured themselves. ``benchmarks/bench_fx_forms.py`` measures each FX form over stacked weights on a route of
  its own (``FORM_ROUTES``: "fx_loop", "fx_gathered", "fx_capacity", "fx_sorted", "fx_dense"); once a GPU's file
  holds a route's values, they judge that form.
- It applies only when the inner compiler is Inductor: with ``inner="aot_eager"``/``"eager"`` (tests, explain())
  there is no Inductor path to compare against. On the CPU the experts run as ``lowerings/cpu.py`` lowers them,
  measured against Inductor's path on the quickstart model (``benchmarks/bench_cpu.py``; ``whole_model/cpu.json``,
  per mode and dtype): faster or tied in fp32, fp16 and bf16 inference and in fp32 and fp16 training steps, slower
  in a bf16 training step, where transformers' experts are left to Inductor.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from . import config
from .capture import static_token_count

_DATA_DIR = Path(__file__).parent / "kernels" / "tuned" / "whole_model"
#: on a GPU without measurements, a layer kind must have won by this much on the measured GPUs
UNMEASURED_GPU_MARGIN = 1.1


@dataclass(frozen=True)
class LayerKind:
    """What the measurements are keyed on: the layer's activation, gate/up layout and biases."""

    activation: str
    gate_up: str  # "concat", "interleaved" or "separate"
    bias: bool
    shape: tuple = ()  # (H, I, E, k): the measured layer of this kind nearest to it decides
    dtype: Optional[torch.dtype] = None  # the tokens' (the CPU's rule reads it; None where the caller did not say)


#: the CPU's measurements (``cpu_measured``), beside the GPUs' files, which are named by the GPU
_CPU_FILE = "cpu"


@functools.lru_cache(maxsize=None)
def _tables() -> dict[str, list[dict]]:
    """GPU name -> its measured layers."""
    out = {}
    for path in sorted(_DATA_DIR.glob("*.json")):
        if path.stem != _CPU_FILE:
            out[path.stem] = json.loads(path.read_text())["layers"]
    return out


@functools.lru_cache(maxsize=None)
def cpu_measured() -> dict[tuple[str, torch.dtype], float]:
    """(mode, dtype) -> Inductor's time over ours for transformers' experts on the CPU (``whole_model/cpu.json``,
    from bench_cpu.py on the quickstart model); the cells not listed were not measured slower."""
    path = _DATA_DIR / f"{_CPU_FILE}.json"
    if not path.exists():
        return {}
    return {(e["mode"], getattr(torch, e["dtype"])): float(e["value"]) for e in json.loads(path.read_text())["layers"]
            if e.get("route", "hf") == "hf"}


def _gpu_tag(device: torch.device) -> str:
    return torch.cuda.get_device_name(device).replace(" ", "_")


def _nearest(layers: list[dict], kind: LayerKind, route: str) -> Optional[dict]:
    """The measured entry of ``kind``'s activation, gate/up layout, biases and route nearest its shape, or None."""
    same_kind = [e for e in layers if (e["activation"], e["gate_up"], bool(e["bias"]), e.get("route", "hf"))
                 == (kind.activation, kind.gate_up, kind.bias, route)]
    return min(same_kind, key=lambda e: _distance(kind.shape, e["shape"])) if same_kind else None


def _exact(entry: dict, mode: str) -> Optional[float]:
    """The entry's value for ``mode`` itself ("inference": the worse of prefill and decode; ``TRAIN_LONG`` and
    ``TRAIN_STATIC``: its own value where the entry has one, else "train", the worst over every measured size of
    the opaque backward's steps, the slower of the two backward paths), None if unmeasured."""
    if mode == "inference":
        measured = [float(entry[m]) for m in ("prefill", "decode") if entry.get(m) is not None]
        return min(measured) if measured else None
    if mode in (TRAIN_LONG, TRAIN_STATIC) and entry.get(mode) is None:
        mode = "train"
    if mode == DECODE_BATCH and entry.get(mode) is None:
        mode = "decode"
    return float(entry[mode]) if entry.get(mode) is not None else None


def _among_inference(entry: dict, mode: str) -> bool:
    """Whether ``_worst`` reads only the entry's inference values for ``mode``: an inference mode, measured in one."""
    return mode in ("prefill", "decode", DECODE_BATCH, "inference") and _exact(entry, "inference") is not None


def _mode_words(entry: dict, mode: str) -> str:
    """How explain() names the value ``_exact`` read for ``mode``: a long training step's own value, or "train"
    (an entry without one, whose training value then judges every size)."""
    if mode == TRAIN_LONG:
        return f"training at {TRAIN_LONG_MIN_TOKENS}+ tokens" if entry.get(TRAIN_LONG) is not None else "train"
    if mode == TRAIN_STATIC:
        return (f"training at a static {TRAIN_STATIC_MIN_TOKENS}-{TRAIN_LONG_MIN_TOKENS - 1} tokens"
                if entry.get(TRAIN_STATIC) is not None else "train")
    if mode == DECODE_BATCH:
        return (f"decode at a batch of {DECODE_BATCH_MIN_TOKENS}-{DECODE_MAX_TOKENS} tokens"
                if entry.get(DECODE_BATCH) is not None else "decode")
    return mode


def _worst(entry: dict, mode: str) -> Optional[float]:
    """The entry's value for ``mode`` (``_exact``), else the worst value it measured: for an inference mode, the
    worst of its inference values where it has one (a training step's loss is its backward's, which inference does
    not run), else the worst in any mode."""
    exact = _exact(entry, mode)
    if exact is not None:
        return exact
    if _among_inference(entry, mode):
        return _exact(entry, "inference")
    measured = [float(entry[m]) for m in ("prefill", "decode", DECODE_BATCH, "train", TRAIN_LONG, TRAIN_STATIC)
                if entry.get(m) is not None]
    return min(measured) if measured else None


def _distance(a: tuple, b: list) -> float:
    """How far apart two (H, I, E, k) shapes are: the sum of their log-ratios (0 for equal shapes)."""
    if len(a) != len(b):
        return 0.0
    return sum(abs(math.log(max(x, 1) / max(y, 1))) for x, y in zip(a, b))


def route_of(form: str) -> str:
    """The route a rewrite takes: "hf" for transformers' experts modules (forms ``hf_*``), "fx" for the FX passes."""
    return "hf" if form.startswith("hf_") else "fx"


#: the FX forms whose user code is a loop over the experts (what Inductor compiles into per-expert GEMMs)
LOOP_FORMS = frozenset({"unrolled_loop", "split_loop"})
#: the route each FX form's own measurements over stacked weights are filed under (benchmarks/bench_fx_forms.py)
FORM_ROUTES = {"unrolled_loop": "fx_loop", "split_loop": "fx_loop", "gathered_weights": "fx_gathered",
               "padded_capacity": "fx_capacity", "sorted_grouped_mm": "fx_sorted", "dense_experts": "fx_dense"}


def _measured(route: str) -> bool:
    return any(e.get("route", "hf") == route for layers in _tables().values() for e in layers)


def fx_route(form: str, per_expert: bool) -> tuple[Optional[str], str]:
    """The route whose measurements judge an FX layer, and what explain() adds to say so: "fx_list" for per-expert
    weights (the list op); the form's own route (``FORM_ROUTES``) where some GPU measured it; for a loop over
    stacked weights measured nowhere, "fx_list" (the same loop under Inductor; the module docstring says why the
    list op's values are the cautious ones); else the form's own route, which then says "never measured"."""
    if per_expert:
        return "fx_list", ""
    own = FORM_ROUTES.get(form)
    if own is not None and _measured(own):
        return own, ""
    if form in LOOP_FORMS:
        return "fx_list", (" (a loop over stacked weights, judged by the ModuleList loop's values: Inductor runs the "
                           "same per-expert GEMMs for both)")
    return own, ""


#: The inner compiler the rule judges for, where it is not the one the graph is handed to: explain() compiles with a
#: light one, but says (and does) what the user's ``backend="moe_inductor"`` compile, Inductor's, would. Per thread:
#: Dynamo compiles in the calling thread, so an explain() in one thread must not change how another thread's compile
#: is judged.
_judging = threading.local()


@contextlib.contextmanager
def judging_as(inner: Optional[str]) -> Iterator[None]:
    """Inside the block (in this thread), the rule judges as if the inner compiler were ``inner`` (None: the real
    one)."""
    before = getattr(_judging, "inner", None)
    _judging.inner = inner
    try:
        yield
    finally:
        _judging.inner = before


def judged_inner(inner: str) -> str:
    """The inner compiler the rule judges a compile by: ``judging_as``'s inside its block in this thread, else the
    compile's own."""
    return getattr(_judging, "inner", None) or inner


def verdict(kind: LayerKind, device: torch.device, mode: str, inner: str, form: str = "hf_grouped_mm",
            route: Optional[str] = None) -> str:
    """The rule's word on one layer, for explain(): "kept Inductor's path: ..." (the measurement that says our
    rewrite would be slower) or "speed rule: ..." (why the rewrite is taken). ``mode`` is "train" (a
    differentiable call; ``TRAIN_LONG`` one of a static long size, ``TRAIN_STATIC`` a shorter static one with the
    visible backward), "prefill" or "decode" (``mode_of``), or
    "inference" (the worse of those two). ``route`` overrides the form's (``route_of``): "fx_list" for an FX layer
    over per-expert weights (the list op)."""
    inner = judged_inner(inner)
    if not config.speed_rule:
        return "speed rule: off (moe_inductor.config.speed_rule = False)"
    if inner != "inductor":
        return f"speed rule: not applied (inner compiler {inner!r}, no Inductor path to compare with)"
    # the CPU's training value (bench_cpu.py's quickstart model, the worse of its sizes) judges every size
    cpu_mode = "train" if mode in (TRAIN_LONG, TRAIN_STATIC) else "decode" if mode == DECODE_BATCH else mode
    on_cpu = cpu_measured().get((cpu_mode, kind.dtype)) if device.type == "cpu" and route_of(form) == "hf" else None
    if on_cpu is not None and on_cpu < 1.0:
        return (f"{KEPT}: transformers' experts in a {str(kind.dtype).removeprefix('torch.')} {cpu_mode} step on the "
                f"CPU ran at {on_cpu:.2f}x Inductor's speed on the quickstart model "
                f"(benchmarks/bench_cpu.py, RESULTS.md)")
    if device.type != "cuda":
        slower = cpu_measured().items()
        kept = ", ".join(sorted(f"{str(d).removeprefix('torch.')} {m}" for (m, d), v in slower if v < 1.0))
        return (f"speed rule: not applied on {device.type} (measured on CUDA GPUs"
                f"{f', and slower on the CPU only in: {kept}' if kept else ' only'})")
    tables = _tables()
    tag = _gpu_tag(device)
    route = route or route_of(form)
    own = _nearest(tables.get(tag, []), kind, route)
    others = [(gpu, e) for gpu, layers in tables.items() if gpu != tag
              for e in [_nearest(layers, kind, route)] if e is not None]
    where = "" if tag in tables else f" (no measurements for {tag}; at least {UNMEASURED_GPU_MARGIN}x asked)"
    # this GPU's own measurement of the mode decides; where it has none, the other GPUs' measurements of the mode
    # with a margin; then this GPU's worst measured mode; then the others' worst, with the margin
    steps = (([(tag, own)], 1.0, True), (others, UNMEASURED_GPU_MARGIN, True), ([(tag, own)], 1.0, False),
             (others, UNMEASURED_GPU_MARGIN, False))
    for sources, threshold, exact in steps:
        found = [(value, gpu, e) for gpu, e in sources if e is not None
                 for value in [_exact(e, mode) if exact else _worst(e, mode)] if value is not None]
        if not found:
            continue
        worst, gpu, entry = min(found, key=lambda f: f[0])
        named = _mode_words(entry, mode)
        among = "inference " if _among_inference(entry, mode) else ""
        measured = named if exact else f"its worst measured {among}mode (no {named} value)"
        if gpu == tag or tag not in tables:
            note = where
        else:
            note = f" ({tag} has no {named} value for this kind; at least {threshold}x asked)"
        if worst < threshold:
            return (f"kept Inductor's path: {entry['name']}-style layers ran at {worst:.2f}x Inductor's speed in "
                    f"{measured} on {gpu}{note} (benchmarks/RESULTS.md)")
        if exact and threshold > 1.0 and own is not None:
            continue  # another GPU's win does not speak for this one: this GPU's own values (any mode) do
        return f"speed rule: {entry['name']}-style layers ran at {worst:.2f}x Inductor's speed in {measured} on {gpu}"
    return (f"speed rule: this layer kind was never measured as a whole model on the {route} route; rewritten (the "
            f"op benchmark has the op ahead of sort + grouped_mm)")


def keeps_inductor(kind: LayerKind, device: torch.device, mode: str, inner: str,
                   form: str = "hf_grouped_mm") -> Optional[str]:
    """Why this layer is left to Inductor (the measurement that says our rewrite would be slower), or None to
    rewrite it (``verdict`` says why)."""
    said = verdict(kind, device, mode, inner, form)
    return said if said.startswith(KEPT) else None


#: how a verdict that leaves the layer to Inductor starts
KEPT = "kept Inductor's path"


#: the sizes the modes were measured at (benchmarks/bench_hf.py): decode at batch 1 and 16, prefill from 512 tokens
DECODE_MAX_TOKENS = 16
PREFILL_MIN_TOKENS = 512
#: a decode step of a static ``DECODE_BATCH_MIN_TOKENS`` to ``DECODE_MAX_TOKENS`` tokens (a batch of sequences,
#: one new token each). Its value is filed apart (bench_hf.py's B=16 rows, rule_file.py), as a long training
#: step's is: at batch 1 the step is host-bound and our rewrite ties Inductor, at 16 it skips the untouched
#: experts' weights and wins by far more, and "decode", the worse of the two, would hold B=16 back. An entry
#: without the value judges these steps by "decode"
DECODE_BATCH = "decode_batch"
DECODE_BATCH_MIN_TOKENS = 8
#: a training step of a static ``TRAIN_LONG_MIN_TOKENS`` tokens or more, the size bench_fx_forms.py and
#: bench_list_train.py train at besides 16 tokens. Their "train" value is the worse of the two sizes, and the
#: 16-token step is a graph of small launches where ours can lose to Inductor's few while the same layer wins at
#: the sizes people train at; their "train_long" value (the worst over the training rows from this size) judges
#: these steps where an entry has one, else "train" does. bench_hf.py trains at 1024 and 4096 tokens: its
#: "train" is the worse of the two (a 1024-token step is host-bound, and our backward's opaque ops cost host time
#: Inductor's path does not), its "train_long" the 4096-token value. A step between 16 and this size was measured
#: at neither long size, so "train" judges it
TRAIN_LONG = "train_long"
TRAIN_LONG_MIN_TOKENS = 4096
#: a training step of a static count from ``TRAIN_STATIC_MIN_TOKENS`` (the shorter size bench_hf.py trains at) to
#: under ``TRAIN_LONG_MIN_TOKENS`` whose backward Inductor launches itself (``backward_visible``:
#: lowerings/visible_backward.py). Such a step spends less host time than one through the opaque backward ops,
#: which a symbolic count takes, and so does a static count the ``torch._grouped_mm`` engine may take. So its value
#: is filed apart (rule_file.py files a training row here when its own backward was the visible one), and "train"
#: stays the opaque ops' value. An entry without this value judges such steps by "train", the slower path's. A
#: shorter static step was measured at no such size with the visible backward, so "train" judges it too
TRAIN_STATIC = "train_static"
TRAIN_STATIC_MIN_TOKENS = 1024


def filed_modes(mode: str, tokens: int, visible: bool) -> tuple[str, ...]:
    """The modes a benchmark row of a static ``tokens`` count is filed under (benchmarks/rule_file.py,
    bench_fx_forms.py), the inverse of ``mode_from``: a forward row its own mode ("inference" is never filed), a
    training row "train" (the worst over every size) and ``TRAIN_LONG`` from ``TRAIN_LONG_MIN_TOKENS`` tokens. A
    training row whose backward was the visible one (``visible``: ``backward_visible`` of its layer, in a run with
    the visible backward on) never files "train", the value that judges the opaque ops: from
    ``TRAIN_STATIC_MIN_TOKENS`` to the long size it files ``TRAIN_STATIC`` instead, and below that nothing (such
    steps are judged by "train")."""
    if mode != "train":
        judged = mode_from(False, tokens)
        if judged == DECODE_BATCH:  # "decode" is the worst over every batch, as "train" is over every size
            return ("decode", DECODE_BATCH)
        return () if judged == "inference" else (judged,)
    if tokens >= TRAIN_LONG_MIN_TOKENS:
        return (TRAIN_LONG,) if visible else ("train", TRAIN_LONG)
    if visible:
        return (TRAIN_STATIC,) if tokens >= TRAIN_STATIC_MIN_TOKENS else ()
    return ("train",)


def visible_backward_on() -> bool:
    """Whether the settings let a static count's backward be launched by Inductor (the visible forward, the visible
    backward, and no host-made TMA descriptors, which only the opaque ops take: ``visible_backward``)."""
    return config.visible_kernels and config.visible_backward and config.gemm_tma_descriptors != "host"


@torch._dynamo.assume_constant_result
def backward_visible(tokens: Optional[int], shape: tuple, bias: bool, dtype: Optional[torch.dtype] = None,
                     device: Optional[torch.device] = None) -> bool:
    """Whether a static training step of ``tokens`` tokens through a stacked-weights layer of ``shape`` (H, I, E, k)
    runs the backward Inductor launches, by the same functions that decide it while compiling: the settings
    (``visible_backward_on``), the compile being traced (Inductor without CUDA graphs: ``capture``'s
    ``visible_ops``), the forward swapped in (``grouped_mm_engine.may_take_experts_of`` says no) and its
    backward traceable (``visible_backward.backward_traceable``: no engine for it either). Shapes only, through meta
    tensors. ``dtype`` None reads as bf16, the engine's dtype: the answer that keeps a step on "train". ``device``:
    the tokens' (our kernels run on CUDA tensors, or on CPU ones under ``config.triton_on_cpu``); None: a GPU's.

    ``mode_of`` asks it inside the polyfills Dynamo traces, so it is a constant of the graph: traced, its read of
    ``capture``'s thread-local compile stack would become a guard that fails on every call (the stack is empty at
    run time), and the frame would be compiled again at each step. So, as with the verdict, a setting changed after
    a compile does not re-judge a layer already compiled."""
    from .capture import current
    from .ops.grouped import triton_device

    if device is not None and not triton_device(device):
        return False

    state = current()  # a compile whose Inductor replays CUDA graphs (or is no Inductor) keeps the opaque ops
    if state is not None and state.ours and not state.visible_ops:
        return False
    return visible_backward_on() and backward_traced(tokens, shape, bias, dtype)


def backward_traced(tokens: Optional[int], shape: tuple, bias: bool, dtype: Optional[torch.dtype] = None) -> bool:
    """``backward_visible`` but for the settings that switch the visible backward on (the benchmarks' filers ask it
    of a run that had them on). A backward the ``torch._grouped_mm`` engine takes counts where
    ``config.visible_engine_backward`` traces it too (``visible_backward.engine_backward_traceable``)."""
    if tokens is None or len(shape) != 4:
        return False
    from .lowerings.visible_backward import backward_traceable, engine_backward_traceable
    from .ops import grouped_mm_engine

    H, I, E, k = (int(n) for n in shape)
    dtype = dtype or torch.bfloat16
    w2 = torch.empty((E, I, H), dtype=dtype, device="meta")
    rows = tokens * k
    if grouped_mm_engine.may_take_experts_of(w2, bias, rows):
        return False
    x = torch.empty((tokens, H), dtype=dtype, device="meta")
    return backward_traceable(x, w2, bias, rows) or engine_backward_traceable(x, w2, bias, rows)


def mode_of(x: torch.Tensor, weights: tuple, shape: tuple = (), bias: bool = False) -> str:
    """"train" where the call builds a graph for the backward (``TRAIN_LONG`` where its token count is static and
    at least ``TRAIN_LONG_MIN_TOKENS``, ``TRAIN_STATIC`` where it is static, shorter, at least
    ``TRAIN_STATIC_MIN_TOKENS`` and its backward the visible one: ``backward_visible`` of the layer's ``shape``
    (H, I, E, k) and ``bias``). Otherwise, where the token count is static (the graph is specialised on it
    already), "decode" up to ``DECODE_MAX_TOKENS`` tokens and "prefill" from ``PREFILL_MIN_TOKENS``: the sizes
    those modes were measured at. Between them, and wherever the count is symbolic (never read,
    ``capture.static_token_count``: a comparison would add a guard and a recompile), "inference": the worse of
    the two."""
    train = torch.is_grad_enabled() and any(w is not None and w.requires_grad for w in (x, *weights))
    tokens = static_token_count(x)
    return mode_from(train, tokens, train and backward_visible(tokens, shape, bias, x.dtype, x.device))


def mode_from(train: bool, tokens: Optional[int], visible: bool = False) -> str:
    """``mode_of``'s rule on what it reads: whether the call makes a gradient, its static token count (None where
    symbolic), and whether its backward is the visible one (``backward_visible``). The FX passes judge a traced
    region with it."""
    if train:
        if tokens is None:
            return "train"
        if tokens >= TRAIN_LONG_MIN_TOKENS:
            return TRAIN_LONG
        return TRAIN_STATIC if tokens >= TRAIN_STATIC_MIN_TOKENS and visible else "train"
    if tokens is not None and tokens <= DECODE_MAX_TOKENS:
        return DECODE_BATCH if tokens >= DECODE_BATCH_MIN_TOKENS else "decode"
    if tokens is not None and tokens >= PREFILL_MIN_TOKENS:
        return "prefill"
    return "inference"
