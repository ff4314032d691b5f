"""CPU benchmarks, random data (fp32; ``--dtype bfloat16`` or ``float16`` for a whole model in that dtype).

    python benchmarks/bench_cpu.py                       # the op's plain-torch path against transformers' eager loop
    python benchmarks/bench_cpu.py --model quickstart    # the quickstart model: eager, inductor, moe_inductor
    python benchmarks/bench_cpu.py --model quickstart --train   # its training step: forward, loss.backward()
    python benchmarks/bench_cpu.py --model gptoss        # a tiny GPT-OSS: biases, clamped glu, interleaved gate/up
    python benchmarks/bench_cpu.py --model quickstart --dtype bfloat16   # the model's weights and activations in bf16

The op mode reports wall-clock means over repeated calls. The model mode builds the model ``examples/quickstart.py``
builds on the CPU (a tiny random Qwen3-MoE), or a tiny GPT-OSS, compiles it with ``torch.compile``'s default backend
and with ``backend="moe_inductor"`` in the same process, and times the three in interleaved rounds: each round times
a block of calls of every candidate, in a rotating order, so that a busy machine slows all of them alike; the table
gives the median over rounds of the per-call time, and the quartiles over rounds of moe_inductor's time over
inductor's. Each token count is compiled afresh (``torch._dynamo.reset``), so both backends see one static shape.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

import moe_inductor

SHAPES = [(16, 64, 32, 8, 2), (256, 256, 128, 16, 4), (1024, 512, 256, 32, 4), (64, 2048, 768, 128, 8)]  # T H I E k
QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"


def mean_ms(fn, reps: int = 40) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def op_table() -> None:
    """The op's plain-torch path against transformers' eager experts loop, per (T, H, I, E, k)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| T | H | I | E | k | HF eager ms | ours ms | ours / HF | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T, H, I, E, k in SHAPES:
        torch.manual_seed(0)
        experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                                 num_experts_per_tok=k))
        experts.config._experts_implementation = "eager"
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.05)
        x, w = torch.randn(T, H), torch.rand(T, k)
        ids = torch.randn(T, E).topk(k, -1).indices
        ours = lambda: moe_inductor.fused_experts(x, ids, w, experts.gate_up_proj, experts.down_proj)  # noqa: E731
        with torch.no_grad():
            t_hf, t_ours = mean_ms(lambda: experts(x, ids, w)), mean_ms(ours)
            diff = (experts(x, ids, w) - ours()).abs().max().item()
        print(f"| {T} | {H} | {I} | {E} | {k} | {t_hf:.3f} | {t_ours:.3f} | {t_ours / t_hf:.2f} | {diff:.1e} |")


def gptoss_model() -> tuple[torch.nn.Module, int]:
    """A tiny random GPT-OSS (2 layers, H=64, 8 experts of I=64, k=2) on the CPU, fp32, and its vocab size: biases,
    the clamped glu and the interleaved (E, H, 2I) gate/up weight, the layout the quickstart model lacks."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                       layer_types=["full_attention"] * 2)
    return GptOssForCausalLM(cfg).float().eval(), cfg.vocab_size


def llama_model() -> tuple[torch.nn.Module, int]:
    """The do-no-harm control: a tiny random dense Llama (2 layers, H=64, no MoE layer) on the CPU, fp32, and its
    vocab size. Nothing in it is rewritten, so moe_inductor's time should be Inductor's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return LlamaForCausalLM(cfg).float().eval(), cfg.vocab_size


def quickstart_model() -> tuple[torch.nn.Module, int]:
    """The model ``examples/quickstart.py`` builds on the CPU (loaded from the example itself), and its vocab size."""
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, _, _ = module.build("cpu")
    return model, model.config.vocab_size


#: the whole models ``--model`` times
MODELS: dict[str, Callable[[], tuple[torch.nn.Module, int]]] = {"quickstart": quickstart_model, "gptoss": gptoss_model,
                                                                 "llama": llama_model}


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int, calls: int,
                   clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Per-call ms of each of ``fns`` in each of ``rounds`` rounds (``calls`` calls per block), the order rotated
    every round, read off ``clock``."""
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            t0 = clock()
            for _ in range(calls):
                fn()
            samples[name].append((clock() - t0) / calls * 1e3)
    return samples


def round_ratio_quartiles(ours: list[float], theirs: list[float]) -> tuple[float, float]:
    """The first and third quartiles over rounds of ``ours[r] / theirs[r]``: within a round both blocks ran close
    together, so the spread of these ratios shows how far the machine's load moved one median against the other."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    if len(ratios) < 2:
        return ratios[0], ratios[0]
    q = statistics.quantiles(ratios, n=4)
    return q[0], q[2]


#: the largest relative error of moe_inductor's output against eager's that the model mode accepts, per dtype; in
#: bf16 twice inductor's own where that is more (both reorder bf16 roundings, and on some models, GPT-OSS's clamped
#: glu, that moves the output by a few percent)
ERROR_BOUND = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def model_table(tokens: list[int], rounds: int, calls: int, backends: Optional[list[str]] = None,
                clock: str = "wall", train: bool = False, model_name: str = "quickstart",
                dtype: torch.dtype = torch.float32) -> list[dict]:
    """Time the quickstart model at each token count (one sequence of T tokens) under eager, inductor and
    moe_inductor; print a markdown table and return its rows. ``clock``: "wall" (``time.perf_counter``) or "cpu"
    (``time.thread_time``, the CPU time of this thread: on a machine shared with other work it leaves out the time
    the thread waits for a core; it needs one intra-op thread). ``train``: time a training step instead (the
    forward with ``labels=``, then ``loss.backward()`` and the gradients set to None), the error then that of the
    loss and of the gradients' norm. ``dtype``: the model's parameters (and so its activations) in this dtype."""
    backends = backends or ["eager", "inductor", "moe_inductor"]
    if clock == "cpu" and torch.get_num_threads() != 1:
        raise ValueError("the cpu clock reads this thread only: run with --threads 1")
    if dtype not in ERROR_BOUND:
        raise ValueError(f"dtype must be one of {sorted(map(str, ERROR_BOUND))}; got {dtype}")
    model, vocab = MODELS[model_name]()
    model.to(dtype).train(train)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {model_name} model (CPU build), "
          f"{str(dtype).removeprefix('torch.')}, "
          f"{'training step' if train else 'inference'}, median of {rounds} interleaved rounds of {calls} calls, "
          f"{clock} clock")
    print("| T | " + " | ".join(f"{b} ms" for b in backends)
          + " | moe_inductor / inductor | per-round ratio, quartiles | rel. err vs eager |")
    print("|---|" + "---|" * (len(backends) + 3))
    rows = []
    for T in tokens:
        torch._dynamo.reset()
        torch.manual_seed(T)
        ids = torch.randint(0, vocab, (1, T))
        fns = {}
        for b in backends:
            compiled = model if b == "eager" else torch.compile(model, backend=b)
            fns[b] = (lambda c=compiled: _train_step(model, c, ids)) if train else (lambda c=compiled: c(ids).logits)
        with torch.set_grad_enabled(train):
            ref = fns["eager"]() if "eager" in fns else (_train_step(model, model, ids) if train else model(ids).logits)
            errs = {b: ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
                    for b, fn in fns.items()}  # compiles here
            for fn in fns.values():  # warm caches and the allocator outside the timing
                for _ in range(3):
                    fn()
            samples = interleaved_ms(fns, rounds, calls, time.thread_time if clock == "cpu" else time.perf_counter)
        med = {b: statistics.median(s) for b, s in samples.items()}
        paired = {"moe_inductor", "inductor"} <= med.keys()
        ratio = med["moe_inductor"] / med["inductor"] if paired else float("nan")
        spread = round_ratio_quartiles(samples["moe_inductor"], samples["inductor"]) if paired else (ratio, ratio)
        err = max(errs.get("moe_inductor", 0.0), errs.get("inductor", 0.0))
        print(f"| {T} | " + " | ".join(f"{med[b]:.3f}" for b in backends)
              + f" | {ratio:.2f} | {spread[0]:.2f}-{spread[1]:.2f} | {err:.1e} |")
        rows.append(dict(T=T, ms=med, err=errs, ratio=ratio, ratio_quartiles=spread))
        bound = ERROR_BOUND[dtype]
        if dtype != torch.float32 and "inductor" in errs:  # a model whose bf16 error Inductor shares (GPT-OSS's)
            bound = max(bound, 2 * errs["inductor"])
        if errs.get("moe_inductor", 0.0) > bound:
            raise SystemExit(f"moe_inductor's logits differ from eager's at T={T}: relative error {errs}")
    return rows


def _train_step(model: torch.nn.Module, fn: Callable, ids: torch.Tensor) -> torch.Tensor:
    """One training step of ``fn`` (``model`` or a compile of it): the loss and every parameter's gradient norm, as
    one tensor to compare across backends; the gradients are set to None after."""
    loss = fn(ids, labels=ids).loss
    loss.backward()
    norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return torch.stack([loss.detach()] + norms)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), help="time a whole model instead of the op")
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--calls", type=int, default=10, help="calls per candidate per round")
    p.add_argument("--backends", nargs="+", choices=["eager", "inductor", "moe_inductor"])
    p.add_argument("--threads", type=int, help="torch.set_num_threads (1 on a machine shared with other work)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="see model_table")
    p.add_argument("--train", action="store_true", help="with --model: time a training step (see model_table)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="with --model: the model's dtype")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        model_table(args.tokens, args.rounds, args.calls, args.backends, args.clock, args.train, args.model,
                    getattr(torch, args.dtype))
    else:
        op_table()


if __name__ == "__main__":
    main()
