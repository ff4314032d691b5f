"""The speed rule's data for a GPU, from bench_hf.py's measurements: merge the values of runs with the experts kept
and every proven layer rewritten (``bash benchmarks/device_run.sh rule`` on that GPU) into
``moe_inductor/kernels/tuned/whole_model/<GPU>.json``, the file ``moe_inductor/speed_rule.py`` reads.

    python benchmarks/rule_file.py bench_hf_rule.json [more.json ...] [--write] [--out-dir DIR]
    python benchmarks/rule_file.py --fx-logs bench_fx_forms_mixtral.log [more.log ...] [--write]

Each family measured becomes one layer kind (its activation, gate/up layout, biases and (H, I, E, k) at the real
widths bench_hf.py builds), with one value per mode measured: the worst over the sizes measured, since the rule
decides from the mode (and, in training, whether the step is long: ``speed_rule.TRAIN_LONG``), not the
size. A training step of ``speed_rule.TRAIN_LONG_MIN_TOKENS`` tokens or more also files its value as "train_long",
the value such steps are judged by; "train" stays the worst over every training size. A training row whose own
backward was the visible one (a run with it on, ``meta["visible_backward"]``, and a layer and size it takes:
``speed_rule.backward_traced``, the engine's traced backward counted where ``meta["visible_engine_backward"]``)
files no "train", the opaque ops' value: a shorter step files "train_static" instead (``speed_rule.filed_modes``).
A batched decode row (8 to 16 tokens: B=16) also files its value as "decode_batch", the value such steps are judged
by; "decode" stays the worst over every batch (``speed_rule.DECODE_BATCH``).
A GPU without a file is judged by the other GPUs' files with a margin (``speed_rule.UNMEASURED_GPU_MARGIN``);
with one, a layer kind below 1.0 in a mode keeps Inductor's path there.
Entries of the file that the runs do not measure are kept as they are. Without ``--write`` the merged file is only
printed. Runs with a cell whose two columns compiled different numbers of graphs (``graphs`` in the rows:
recompiles or graph breaks in one of them) are refused whole, nothing filed: that value measured those, not the
rewrite.

``--fx-logs`` takes bench_fx_forms.py's logs instead (or as well): their ``RULE {...}`` lines are the FX routes'
entries, one value per mode, with any mode a line lacks made from its section's timed rows (a log written before
"train_long" was filed); where several logs measured the same layer, each mode takes the worst of them. Each entry
replaces the modes of the file's entry with the same route and shape, or is added. The GPU is the one each log's
first line names.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.hf_families import FAMILIES, MODES  # noqa: E402
from benchmarks.hf_tables import rule_values  # noqa: E402
from benchmarks.bench_fx_forms import floor2, rule_entries  # noqa: E402
from moe_inductor.speed_rule import (DECODE_BATCH, TRAIN_LONG, TRAIN_STATIC, backward_traced,  # noqa: E402
                                     filed_modes)

DATA_DIR = Path(__file__).resolve().parent.parent / "moe_inductor" / "kernels" / "tuned" / "whole_model"

_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
#: bench_hf families whose MoE blocks the FX passes rewrite (user code, not transformers' experts modules): their
#: values would misstate the "hf" route's, so they are never filed under it
NOT_HF_ROUTE = frozenset({"gpt_oss_v4"})


def layer_kind(family: str) -> dict:
    """The speed rule's key for a bench_hf family: its name, route, activation, gate/up layout, biases and shape."""
    name, widths = FAMILIES[family][1], FAMILIES[family][3]
    inner = widths.get("moe_intermediate_size", widths["intermediate_size"])
    experts = next(widths[key] for key in _EXPERTS if key in widths)
    gptoss = family == "gpt_oss"  # transformers' GPT-OSS experts: clamped glu, interleaved gate/up, biases
    return {"name": name, "route": "hf", "activation": "gptoss_glu" if gptoss else "silu_glu",
            "gate_up": "interleaved" if gptoss else "concat", "bias": gptoss,
            "shape": [widths["hidden_size"], inner, experts, widths["num_experts_per_tok"]]}


def traced_in(meta: dict, tokens: int, kind: dict) -> bool:
    """Whether a training row of ``tokens`` tokens of a run with the visible backward on (its ``meta``) had its
    backward traced into Inductor's graph (``speed_rule.backward_traced``), under the run's own
    ``visible_engine_backward`` (which the run's meta records; a run without it had it off), not this process's."""
    from moe_inductor import config

    saved = config.visible_engine_backward
    config.visible_engine_backward = bool(meta.get("visible_engine_backward"))
    try:
        return backward_traced(tokens, kind["shape"], kind["bias"])
    finally:
        config.visible_engine_backward = saved


def measured(runs: Iterable[dict]) -> tuple[Optional[str], dict]:
    """(the GPU the runs measured, {family: {mode: worst value over its sizes}}) from bench_hf JSON documents. Runs
    of different GPUs are refused: one file holds one GPU's measurements."""
    gpus, worst = set(), {}
    for run in runs:
        meta = run.get("meta", {})
        gpus.add(meta.get("device"))
        visible = bool(meta.get("visible_backward"))  # the run's training rows file as speed_rule.filed_modes says
        for v in rule_values(run["rows"]):
            if v["family"] in NOT_HF_ROUTE:
                continue
            kept_graphs, rewritten_graphs = v["graphs"]
            if kept_graphs != rewritten_graphs:  # one column timed recompiles or graph breaks: it would mislead
                raise ValueError(f"{v['family']} {v['mode']} {v['size']}: the kept column compiled {kept_graphs} "
                                 f"graph(s), the rewritten one {rewritten_graphs}; that cell measured recompiles or "
                                 "graph breaks, not the rewrite: nothing is filed (fix them and measure again)")
            modes = worst.setdefault(v["family"], {})
            kind = layer_kind(v["family"])  # whether this row's own backward was the visible one
            row_visible = visible and traced_in(meta, v["size"], kind)
            for mode in filed_modes(v["mode"], v["size"], row_visible):
                modes[mode] = min(modes.get(mode, float("inf")), v["value"])
    gpus.discard(None)
    if len(gpus) > 1:
        raise ValueError(f"the runs measured different GPUs: {sorted(gpus)}")
    return (gpus.pop() if gpus else None), worst


def merged(existing: Optional[dict], worst: dict, sources: list[str]) -> dict:
    """The file's document with ``worst``'s values put in: a family's layer kind is updated in place (its other
    modes kept) or added; ``sources`` the file's ``_source`` lacks join it."""
    doc = existing or {"_what": "what rewriting the experts buys over leaving them to Inductor, per layer kind and "
                                "mode, measured on this GPU by benchmarks/bench_hf.py: the model's time with the "
                                "experts left to Inductor over its time with every proven layer rewritten (>= 1.0: "
                                "the rewrite is faster); written by benchmarks/rule_file.py", "layers": []}
    layers = doc["layers"]
    for family, modes in sorted(worst.items()):
        kind = layer_kind(family)
        entry = next((e for e in layers if e.get("name") == kind["name"]), None)
        if entry is None:
            entry = dict(kind)
            layers.append(entry)
        entry.update({mode: floor2(value) for mode, value in modes.items()})  # 0.996x is a loss, not a tie
    before = doc.get("_source") or ""
    doc["_source"] = "; ".join(s for s in (before, *(s for s in sources if s not in before)) if s)
    return doc


def _fx_row(line: str) -> Optional[dict]:
    """One timed row of a bench_fx_forms.py table (``| form | mode | T | column | ms | ... | rewrites |``), or None."""
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 10 or not cells[2].isdigit():
        return None
    return dict(form=cells[0], mode=cells[1], T=int(cells[2]), column=cells[3], ms=float(cells[4]),
                rewrites=int(cells[9]))


def fx_log_entries(text: str) -> tuple[Optional[str], list[dict]]:
    """(the GPU a bench_fx_forms.py log measured, its entries): its ``RULE {...}`` lines, with any mode a line
    lacks made from the timed rows of its section (``bench_fx_forms.rule_entries``), so a log written before a mode
    was filed (``speed_rule.TRAIN_LONG``) still gives it; a log without RULE lines gives the entries its rows make.
    A form with rows but no RULE line in a log that has RULE lines was cut off before its line, so it gives nothing.
    Each section of the log starts with a line ``torch <version>, <GPU>, H=.. I=.. E=.. k=..``."""
    gpu = None
    ruled: list[tuple[int, dict]] = []  # (the section it was printed in, the entry)
    sections: list[tuple[list[int], list[dict], bool]] = []
    for line in text.splitlines():
        if line.startswith("torch "):
            parts = [p.strip() for p in line.split(",")]
            gpu = gpu or (parts[1] if len(parts) > 2 else None)
            widths = [re.search(rf"\b{name}=(\d+)", line) for name in ("H", "I", "E", "k")]
            if all(widths):  # a log written before the visible backward says nothing of it: it was off
                sections.append(([int(m.group(1)) for m in widths], [], "visible backward on" in line))
        elif line.startswith("RULE "):
            ruled.append((len(sections) - 1, json.loads(line[len("RULE "):])))
        elif line.startswith("| ") and sections and (row := _fx_row(line)) is not None:
            sections[-1][1].append(row)
    remade = [rule_entries(rows, widths, visible) for widths, rows, visible in sections]
    for section, entry in ruled:  # the RULE line's values (from unrounded times) stand; the rows add what it lacks
        same = next((e for e in (remade[section] if section >= 0 else [])
                     if (e["route"], e["shape"]) == (entry["route"], entry["shape"])), {})
        entry.update({mode: value for mode, value in same.items() if mode in FX_MODES and mode not in entry})
    return gpu, [entry for _, entry in ruled] or [e for entries in remade for e in entries]


#: the modes an FX entry files
FX_MODES = (*MODES, TRAIN_LONG, TRAIN_STATIC, DECODE_BATCH)


def worst_of_runs(entries: list[dict]) -> list[dict]:
    """One entry per (route, shape): where several logs measured the same layer, each mode's worst value (a layer
    at about 1.0x is judged by its slower run, not by whichever log came last). "train", the worst over every
    training size, is never above "train_long" (the two can differ in the last digit: one from unrounded times,
    the other from a log's rows)."""
    out: dict[tuple, dict] = {}
    for entry in entries:
        key = (entry["route"], tuple(entry["shape"]))
        if key not in out:
            out[key] = dict(entry)
            continue
        for mode in FX_MODES:
            if mode in entry:
                out[key][mode] = min(out[key].get(mode, entry[mode]), entry[mode])
    for entry in out.values():
        if "train" in entry and TRAIN_LONG in entry:
            entry["train"] = min(entry["train"], entry[TRAIN_LONG])
    return list(out.values())


def merged_fx(doc: dict, entries: list[dict]) -> dict:
    """``doc`` (``merged``'s) with bench_fx_forms.py's entries put in: an entry of the same route and shape has its
    measured modes replaced (its name and other modes kept), else the entry is added."""
    layers = doc["layers"]
    for new in entries:
        entry = next((e for e in layers if e.get("route") == new["route"] and e.get("shape") == new["shape"]), None)
        if entry is None:
            layers.append(dict(new))
            continue
        entry.update({mode: new[mode] for mode in FX_MODES if mode in new})
    return doc


def main(argv: Optional[list] = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="bench_hf.py --json outputs with both moe_inductor_experts_kept and "
                                            "moe_inductor_rule_off columns")
    ap.add_argument("--fx-logs", nargs="*", default=[],
                    help="bench_fx_forms.py / bench_list_train.py logs (their RULE lines and rows)")
    ap.add_argument("--gpu", default=None, help="the GPU's name, where the runs' meta does not say it")
    ap.add_argument("--out-dir", default=str(DATA_DIR))
    ap.add_argument("--write", action="store_true", help="write the merged file (else print it only)")
    args = ap.parse_args(argv)
    if not args.runs and not args.fx_logs:
        ap.error("give bench_hf.py runs, --fx-logs, or both")
    gpu, worst = measured(json.loads(Path(p).read_text()) for p in args.runs)
    fx = [fx_log_entries(Path(p).read_text()) for p in args.fx_logs]
    gpus = {g for g in [gpu, *(g for g, _ in fx)] if g}
    if len(gpus) > 1:
        raise SystemExit(f"rule_file.py: the runs and logs measured different GPUs: {sorted(gpus)}")
    gpu = args.gpu or (gpus.pop() if gpus else None)
    if not gpu or gpu == "cpu":
        raise SystemExit("rule_file.py: the runs name no GPU (pass --gpu); the CPU's rule is whole_model/cpu.json")
    entries = worst_of_runs([e for _, found in fx for e in found])
    if args.runs and not worst:
        raise SystemExit("rule_file.py: no cell ran both moe_inductor_experts_kept and moe_inductor_rule_off")
    if args.fx_logs and not entries:
        raise SystemExit("rule_file.py: the bench_fx_forms.py logs hold no entry (no form was rewritten)")
    path = Path(args.out_dir) / f"{gpu.replace(' ', '_')}.json"
    existing = json.loads(path.read_text()) if path.exists() else None
    sources = [f"benchmarks/rule_file.py {' '.join(Path(p).name for p in args.runs)}"] if args.runs else []
    sources += [f"bench_fx_forms.py logs {' '.join(Path(p).name for p in args.fx_logs)}"] if args.fx_logs else []
    doc = merged_fx(merged(existing, worst, sources), entries)
    text = json.dumps(doc, indent=1) + "\n"
    print(text)
    if args.write:
        path.write_text(text)
        print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
