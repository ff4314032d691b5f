"""``python -m moe_inductor inspect path/to/file.py:make_inputs_and_model [--summary] [--check]``

The callable takes no arguments and returns ``(model_or_fn, args)`` (a tuple or list of inputs); the CLI prints
``moe_inductor.explain(model_or_fn, *args)`` under ``torch.no_grad()`` (``--train``: with autograd recording, so that
each layer is judged for a training step): with ``--summary`` without the graph code. ``--check`` exits with
status 1 when the model's MoE code is not all rewritten (no rewrite at all, a graph break, or a region left alone),
so that a test suite can keep a model on the fast path.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any, Callable


_USAGE = "give <python file>:<callable>, e.g. `python -m moe_inductor inspect model.py:make`"


def _fail(message: str) -> None:
    """Exit with one line on stderr: what is wrong and how to fix it (no traceback of ours)."""
    raise SystemExit(f"moe_inductor inspect: {message}")


def _load(target: str) -> Callable:
    """The callable named by ``target`` (``path/to/file.py:name``), with a one-line error for each way it can be
    wrong."""
    path, _, name = target.rpartition(":") if ":" in target else (target, "", "")
    if not name or not path:
        _fail(f"{target!r} names no callable; {_USAGE}")
    if not os.path.isfile(path):
        _fail(f"no such file {path!r}; {_USAGE}")
    spec = importlib.util.spec_from_file_location("_moe_inductor_inspect_target", path)
    if spec is None or spec.loader is None:
        _fail(f"cannot load {path!r} as Python (is it a .py file?); {_USAGE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # errors in the user's own file keep their traceback: they are theirs to read
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == spec.name)
        _fail(f"{path} defines no callable {name!r}" + (f" (it defines {', '.join(found)})" if found else "")
              + "; the callable takes no arguments and returns (model_or_fn, args)")
    return fn


def _model_and_inputs(made: Any, name: str) -> tuple[Callable, tuple]:
    """``(model_or_fn, args)`` from what the target returned, or a one-line error saying what it must return."""
    fix = f"{name}() must return (model_or_fn, args), e.g. `return model, (input_ids,)`"
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        _fail(f"{name}() returned {type(made).__name__}, not a pair; {fix}")
    model, inputs = made
    if not callable(model):
        _fail(f"{name}() returned a {type(model).__name__} first, not a model or function; {fix}")
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)  # a single input is unambiguous
    return model, tuple(inputs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m moe_inductor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="print what moe_inductor rewrites in a model")
    inspect.add_argument("target", help="<python file>:<callable returning (model_or_fn, args)>")
    inspect.add_argument("--summary", action="store_true", help="the report without the graph code")
    inspect.add_argument("--check", action="store_true",
                         help="exit 1 unless something was rewritten, with no graph break and nothing left alone")
    inspect.add_argument("--train", action="store_true",
                         help="judge the layers for a training step (the inputs run with autograd recording); "
                              "by default for inference (under torch.no_grad())")
    args = ap.parse_args(argv)
    import torch

    from . import explain

    fn = _load(args.target)
    model, inputs = _model_and_inputs(fn(), args.target.rpartition(":")[2])
    with torch.set_grad_enabled(args.train):
        report = explain(model, *inputs)
    print(report.summary() if args.summary else report)
    if args.check:
        problems = [f"{report.graph_break_count} graph break(s)"] if report.graph_break_count else []
        problems += [f"{len(report.left_alone)} MoE-looking region(s) left alone"] if report.left_alone else []
        problems += ["no MoE rewrite"] if not report.rewrites else []
        if problems:
            print(f"moe_inductor check failed: {', '.join(problems)}", file=sys.stderr)
            raise SystemExit(1)


if __name__ == "__main__":
    main()
