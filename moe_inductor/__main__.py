"""``python -m moe_inductor inspect path/to/file.py:make_inputs_and_model [--summary] [--check]``

The callable takes no arguments and returns ``(model_or_fn, args)`` (a tuple or list of inputs); the CLI prints
``moe_inductor.explain(model_or_fn, *args)``: with ``--summary`` without the graph code. ``--check`` exits with
status 1 when the model's MoE code is not all rewritten (no rewrite at all, a graph break, or a region left alone),
so that a test suite can keep a model on the fast path.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys


def _load(target: str):
    path, _, name = target.partition(":")
    if not name:
        raise SystemExit(f"expected <python file>:<callable>, got {target!r}")
    spec = importlib.util.spec_from_file_location("_moe_inductor_inspect_target", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m moe_inductor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="print what moe_inductor rewrites in a model")
    inspect.add_argument("target", help="<python file>:<callable returning (model_or_fn, args)>")
    inspect.add_argument("--summary", action="store_true", help="the report without the graph code")
    inspect.add_argument("--check", action="store_true",
                         help="exit 1 unless something was rewritten, with no graph break and nothing left alone")
    args = ap.parse_args(argv)
    from . import explain

    model, inputs = _load(args.target)()
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
