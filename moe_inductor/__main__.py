"""``python -m moe_inductor inspect path/to/file.py:make_inputs_and_model``

The callable takes no arguments and returns ``(model_or_fn, args)`` (a tuple or list of inputs); the CLI prints
``moe_inductor.explain(model_or_fn, *args)``.
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
    args = ap.parse_args(argv)
    from . import explain

    model, inputs = _load(args.target)()
    print(explain(model, *inputs))


if __name__ == "__main__":
    main()
