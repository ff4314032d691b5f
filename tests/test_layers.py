"""The package's layer rules (moe_inductor/__init__.py) hold in its imports."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "moe_inductor"


def _imports(path: Path) -> set[str]:
    """The moe_inductor modules ``path`` imports (relative imports resolved), at any depth in the file."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    package = parts if path.name == "__init__.py" else parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            names = [module] + [f"{module}.{a.name}" for a in node.names]
            out.update(n for n in names if n.startswith("moe_inductor"))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("moe_inductor"))
    return out


def _modules(sub: str) -> list[Path]:
    return sorted((PACKAGE / sub).rglob("*.py")) if (PACKAGE / sub).is_dir() else [PACKAGE / f"{sub}.py"]


RULES = [  # (files, module prefixes they must not import)
    ("kernels", [m for m in ("moe_inductor.ops", "moe_inductor.passes", "moe_inductor.backend", "moe_inductor.config",
                             "moe_inductor.capture", "moe_inductor.hf", "moe_inductor.report", "moe_inductor.explain",
                             "moe_inductor.lowerings")]),
    ("ops", ["moe_inductor.passes", "moe_inductor.backend", "moe_inductor.capture", "moe_inductor.hf",
             "moe_inductor.explain", "moe_inductor.lowerings"]),
    ("passes", ["moe_inductor.kernels", "moe_inductor.backend", "moe_inductor.explain"]),
    ("lowerings", ["moe_inductor.passes", "moe_inductor.backend", "moe_inductor.explain"]),
]


@pytest.mark.parametrize("layer,forbidden", RULES, ids=[r[0] for r in RULES])
def test_a_layer_imports_nothing_above_it(layer, forbidden):
    bad = {str(p.relative_to(PACKAGE)): sorted(i for i in _imports(p) if any(i == f or i.startswith(f + ".")
                                                                                for f in forbidden))
           for p in _modules(layer)}
    assert not {k: v for k, v in bad.items() if v}


def test_nothing_imports_the_user_facing_modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py") and path.parent == PACKAGE:
            continue
        hits = {i for i in _imports(path) if i in ("moe_inductor.explain", "moe_inductor.__main__")}
        assert not hits, f"{path.relative_to(PACKAGE)} imports {hits}"
