"""Whether every compiled column of bench_hf.py runs compiled as many graphs as a static-shape cell should: one.

    python benchmarks/graphs_check.py bench_hf_smoke.json [more.json ...]

A prefill or training cell has one static shape, so each compiled column (every column but eager) should compile
one graph. More means recompiles or graph breaks, and the column's time measured those. A regression of that kind
once landed unseen, because the CPU suite never reached the GPU-only code that caused it (RESULTS.md, forty-first
session). Decode cells run ``generate``, whose prefill and decode steps are graphs of their own, so they are not
checked. A compiled row of a checked mode that ran nothing (skipped for time, or an error) fails too, as does a
run in which no row was checked: a check of nothing must not read as a pass. Exits 1, listing the offending rows;
0 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

#: the modes with one static shape per cell
CHECKED_MODES = ("prefill", "train")


def _checked(row: dict) -> bool:
    """Whether ``row`` is a compiled column's, in a static-shape mode."""
    return row.get("column") != "eager" and row.get("mode") in CHECKED_MODES


def offending(rows: list) -> list[str]:
    """The rows of compiled columns in static-shape modes that compiled other than one graph, or ran nothing
    (skipped, or an error), one line each."""
    out = []
    for row in filter(_checked, rows):
        where = f"{row.get('family')} {row['mode']} {row.get('size')} {row.get('column')}"
        if "value" not in row:
            out.append(f"{where}: ran nothing ({row.get('error') or row.get('skipped') or 'no value'})")
            continue
        graphs = row.get("graphs")
        if graphs != 1:
            out.append(f"{where}: {graphs} graphs ({row['value']:.2f} {row.get('unit', '')})")
    return out


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="bench_hf.py JSON files")
    args = ap.parse_args(argv)
    bad, checked = [], 0
    for path in args.runs:
        rows = json.loads(Path(path).read_text())["rows"]
        checked += sum(1 for r in rows if _checked(r) and "value" in r)
        bad += [f"{path}: {line}" for line in offending(rows)]
    for line in bad:
        print("FAILED:", line)
    print(f"graphs_check: {checked} compiled rows timed, {len(bad)} failing")
    return 1 if bad or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
