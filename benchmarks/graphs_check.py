"""Whether every compiled column of bench_hf.py runs compiled as many graphs as a static-shape cell should: one.

    python benchmarks/graphs_check.py bench_hf_smoke.json [more.json ...]

A prefill or training cell has one static shape, so each compiled column (every column but eager) should compile
one graph. More means recompiles or graph breaks, and the column's time measured those. A regression of that kind
once landed unseen, because the CPU suite never reached the GPU-only code that caused it (RESULTS.md, forty-first
session). Decode cells run ``generate``, whose prefill and decode steps are graphs of their own, so they are not
checked. Exits 1, listing the offending rows, where any row fails; 0 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

#: the modes with one static shape per cell
CHECKED_MODES = ("prefill", "train")


def offending(rows: list) -> list[str]:
    """The rows of compiled columns in static-shape modes that compiled other than one graph, one line each. A row
    that ran nothing (skipped, or an error: reported by bench_hf.py itself) is not judged."""
    out = []
    for row in rows:
        if row.get("column") == "eager" or row.get("mode") not in CHECKED_MODES or "value" not in row:
            continue
        graphs = row.get("graphs")
        if graphs != 1:
            out.append(f"{row.get('family')} {row['mode']} {row.get('size')} {row.get('column')}: {graphs} graphs "
                       f"({row['value']:.2f} {row.get('unit', '')})")
    return out


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="bench_hf.py JSON files")
    args = ap.parse_args(argv)
    bad, checked = [], 0
    for path in args.runs:
        rows = json.loads(Path(path).read_text())["rows"]
        checked += sum(1 for r in rows if r.get("mode") in CHECKED_MODES and r.get("column") != "eager"
                       and "value" in r)
        bad += [f"{path}: {line}" for line in offending(rows)]
    for line in bad:
        print("MORE THAN ONE GRAPH:", line)
    print(f"graphs_check: {checked} compiled rows checked, {len(bad)} with other than one graph")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
