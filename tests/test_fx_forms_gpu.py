"""Every FX form of ``benchmarks/bench_fx_forms.py`` compiled with moe_inductor and Inductor on the GPU: rewritten,
with no fallback to plain capture, and equal to eager forward and backward. A rewritten graph that Inductor cannot
compile falls back (do no harm), which costs the rewrite silently: the H100 did so for gathered weights at real widths
(a compile worker's error), which only this check at real widths shows.

    python tests/test_fx_forms_gpu.py --widths 2048 1408 64 6 --tokens 16   # one real width, every form, both modes
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_fx_forms import BF16_ONLY, FORMS  # noqa: E402


def run_form(form: str, widths: tuple[int, int, int, int], tokens: int, train: bool,
             device: str = "cuda") -> tuple[int, list[str], float]:
    """(layers rewritten, each fallback's reason with its traceback, relative error against eager) of one form
    compiled with ``backend="moe_inductor"`` (Inductor inside, the speed rule off), in bf16."""
    from torch._dynamo.utils import counters

    from moe_inductor import capture, config

    torch.manual_seed(0)
    dtype = BF16_ONLY.get(form, torch.bfloat16)
    model = FORMS[form](*widths).to(device, dtype)
    x = torch.randn(tokens, widths[0], device=device, dtype=dtype)
    fallbacks: list[str] = []
    real_note = capture.note_fallback

    def note(code, stage, error, also=()):
        fallbacks.append(f"{stage}: " + "".join(traceback.format_exception(error))[-3000:])
        return real_note(code, stage, error, also)

    before, config.speed_rule = config.speed_rule, False
    capture.note_fallback = note
    try:
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="moe_inductor")

        def step(run):
            xg = x.clone().requires_grad_(train)
            with torch.set_grad_enabled(train):
                out = run(xg)
            if not train:
                return out.float()
            grads = torch.autograd.grad(out.float().square().sum(), [xg, *model.parameters()])
            return torch.cat([out.float().flatten()] + [g.float().flatten() for g in grads])

        got, ref = step(compiled), step(model)
        rewrites = sum(counters["moe_inductor"].values())
    finally:
        capture.note_fallback, config.speed_rule = real_note, before
    err = ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()
    return rewrites, fallbacks, err


@pytest.mark.gpu
@pytest.mark.parametrize("train", [False, True], ids=["forward", "train"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_fx_form_is_rewritten_under_inductor_on_the_gpu(form, train):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rewrites, fallbacks, err = run_form(form, (256, 384, 8, 2), 16 if form == "gathered" else 96, train)
    assert not fallbacks, "\n".join(fallbacks)
    assert rewrites == 1
    assert err < 2e-2


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", nargs=4, type=int, metavar=("H", "I", "E", "K"), default=[256, 384, 8, 2])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--forms", nargs="*", default=sorted(FORMS), choices=sorted(FORMS))
    args = ap.parse_args(argv)
    for form in args.forms:
        for train in (False, True):
            try:
                rewrites, fallbacks, err = run_form(form, tuple(args.widths), args.tokens, train)
            except Exception as error:  # noqa: BLE001 - the point is to see it
                print(f"{form} {'train' if train else 'forward'}: RAISED {type(error).__name__}: {error}", flush=True)
                continue
            print(f"{form} {'train' if train else 'forward'} T={args.tokens}: rewrites {rewrites}, rel err {err:.2e}, "
                  f"fallbacks {len(fallbacks)}", flush=True)
            for f in fallbacks:
                print("  FALLBACK " + f.replace("\n", "\n  "), flush=True)


if __name__ == "__main__":
    main()
