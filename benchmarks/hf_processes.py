"""How ``bench_hf.py``'s driver splits cells over child processes and GPUs, and merges what they report."""
from __future__ import annotations

import statistics


def lanes_of(groups, gpus: int) -> list:
    """The groups' indices per GPU: each family keeps to one GPU (all its cells' columns are compared on the same
    device), families go round-robin over ``gpus``, and a GPU runs its groups one after another."""
    lane_of: dict = {}
    lanes: list = [[] for _ in range(max(1, gpus))]
    for i, cells in enumerate(groups):
        lane = lane_of.setdefault(cells[0][0], len(lane_of) % len(lanes))
        lanes[lane].append(i)
    return [lane for lane in lanes if lane]


def process_groups(cells, alone: bool, repeats: int = 1) -> list:
    """The cells each child process runs: consecutive cells of one family share a process, except that with ``alone``
    every column of a decode cell gets a process of its own. Decode is host-bound, and a process that compiled and
    ran another column first slows the host for the next one: with the columns of one cell in a shared process,
    whichever ran second lost (Qwen3 B=1 on the H200: 0.86x second, 1.06x first; not the garbage collector, which
    took 0.03 ms a generate; RESULTS.md). With ``repeats`` R > 1 each decode column runs in R processes, the
    columns' order reversed every other round (A B, B A, ...): one process's host speed varies from the next's by
    more than the columns differ (GPT-OSS, same kernels in both columns: 0.97x at B=1, 1.11x at B=16)."""
    groups: list = []
    for cell in cells:
        family, mode, size, cols = cell
        if alone and mode == "decode":
            for r in range(max(1, repeats)):
                groups += [[(family, mode, size, (c,))] for c in (cols if r % 2 == 0 else cols[::-1])]
            groups.append([])  # the family's next cells start a process of their own
        elif groups and groups[-1] and groups[-1][0][0] == family:
            groups[-1].append(cell)
        else:
            groups.append([cell])
    return [g for g in groups if g]


def merge_repeats(rows) -> list:
    """One row per (family, mode, size, column): where a column ran in several processes (``--decode-repeats``), its
    value is the median of theirs, which are kept in ``values``; the other fields are the first process's."""
    merged: dict = {}
    for row in rows:
        key = (row["family"], row["mode"], row["size"], row["column"])
        if key not in merged:
            merged[key] = dict(row)
            continue
        first = merged[key]
        if "value" in row:
            first.setdefault("values", [first["value"]] if "value" in first else []).append(row["value"])
    for row in merged.values():
        if "values" in row:
            row["value"] = statistics.median(row["values"])
    return list(merged.values())


def cpu_list(text: str) -> set:
    """The cores of a list like ``0-3,8,10-11``."""
    out: set = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out
