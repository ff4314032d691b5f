"""The tables ``bench_hf.py`` prints and writes: one line per (family, mode, size) with every column, and the
speed rule's values where a cell ran with the experts kept and with every layer rewritten, and the other
moe_inductor columns (a setting changed) against the default one."""
from __future__ import annotations

try:  # as benchmarks.hf_tables, or beside bench_hf.py run as a script
    from .hf_families import EXPERTS_KEPT, FAMILIES, MOE_COLUMNS, RULE_OFF
except ImportError:
    from hf_families import EXPERTS_KEPT, FAMILIES, MOE_COLUMNS, RULE_OFF


def _cells(rows) -> dict:
    """The rows by cell, (family, layers, mode, size), then by column."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["family"], r["layers"], r["mode"], r["size"]), {})[r["column"]] = r
    return cells


def rule_values(rows) -> list[dict]:
    """Per (family, mode, size) with both ``EXPERTS_KEPT`` and ``RULE_OFF``: the speed rule's value, the model's time
    with the experts left to Inductor over its time with every proven layer rewritten (> 1: rewriting is faster),
    everything else compiled alike. ``graphs``: (kept, rewritten), the graphs each column compiled; where they
    differ, one column timed recompiles or graph breaks the other did not, and the value measured those, not the
    rewrite."""
    cells = _cells([r for r in rows if "value" in r])
    out = []
    for (family, layers, mode, size), c in cells.items():
        kept, rewritten = c.get(EXPERTS_KEPT), c.get(RULE_OFF)
        if kept is None or rewritten is None:
            continue
        ratio = kept["value"] / rewritten["value"]
        value = ratio if kept["unit"] == "ms" else 1.0 / ratio
        graphs = (int(kept.get("graphs", 1)), int(rewritten.get("graphs", 1)))
        out.append(dict(family=family, layers=layers, mode=mode, size=size, unit=kept["unit"], kept=kept["value"],
                        rewritten=rewritten["value"], value=value, graphs=graphs))
    return out


def rule_markdown(rows) -> str:
    """The speed rule's values (``rule_values``) as a table; empty where no cell ran both moe_inductor columns."""
    values = rule_values(rows)
    if not values:
        return ""
    lines = ["| family (layers) | mode | unit | experts kept | every proven layer rewritten | rewriting buys |",
             "|---|---|---|---|---|---|"]
    for v in values:
        fmt = "{:.0f}" if v["unit"] != "ms" else "{:.2f}"
        kept_graphs, rewritten_graphs = v["graphs"]
        flag = (f" (graphs: {kept_graphs} kept, {rewritten_graphs} rewritten: not a measure of the rewrite)"
                if kept_graphs != rewritten_graphs else "")
        lines.append(f"| {FAMILIES[v['family']][1]} ({v['layers']}) | {v['mode']} {v['size']} | {v['unit']} | "
                     f"{fmt.format(v['kept'])} | {fmt.format(v['rewritten'])} | {v['value']:.2f}{flag} |")
    return "\n".join(lines)


def markdown(rows) -> str:
    """One line per (family, mode, size): each column's value, then moe_inductor against inductor and against eager
    (> 1 is faster), the first call's seconds, the error against eager and the peak memory."""
    cells = _cells(rows)
    head = ("| family (layers) | mode | unit | eager | inductor | max-autotune-no-cg | moe_inductor | vs inductor | "
            "vs eager | first call s (ind / moe) | err vs eager (ind / moe) | peak MiB (ind / moe) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def val(r):
        if r is None:
            return "–"
        if "value" not in r:
            return "skipped" if "skipped" in r else "error"
        fmt = "{:.0f}" if r["unit"] != "ms" else "{:.2f}"
        several = r.get("values") or r.get("rounds")
        spread = f" ({fmt.format(min(several))}-{fmt.format(max(several))})" if several else ""
        return fmt.format(r["value"]) + spread  # a median over processes or rounds shows their range

    def pair(c, key, fmt):
        out = []
        for name in ("inductor", "moe_inductor"):
            v = c.get(name, {}).get(key)
            out.append(fmt.format(v) if v is not None else "–")
        return " / ".join(out)

    for (family, layers, mode, size), c in cells.items():
        unit = next((r["unit"] for r in c.values() if "unit" in r), "")
        moe = c.get("moe_inductor", {}).get("value")

        def ratio(name):
            other = c.get(name, {}).get("value")
            if moe is None or other is None:
                return "–"
            return f"{(moe / other if unit != 'ms' else other / moe):.2f}"

        label = {"prefill": f"prefill T={size}", "train": f"train T={size}", "decode": f"decode B={size}"}[mode]
        lines.append(f"| {FAMILIES[family][1]} ({layers}) | {label} | {unit} | {val(c.get('eager'))} | "
                     f"{val(c.get('inductor'))} | {val(c.get('max-autotune-no-cudagraphs'))} | "
                     f"{val(c.get('moe_inductor'))} | {ratio('inductor')} | {ratio('eager')} | "
                     f"{pair(c, 'first_call_s', '{:.0f}')} | {pair(c, 'err', '{:.1e}')} | "
                     f"{pair(c, 'peak_mib', '{:.0f}')} |")
    rounds = {len(r["rounds"]) for r in rows if r.get("rounds")}
    if rounds:
        lines.append(f"\nTimes with a range are the median of {'/'.join(map(str, sorted(rounds)))} interleaved rounds "
                     "(the columns' order reversed every other round) and their range.")
    return "\n".join(lines)


def variants_markdown(rows) -> str:
    """Each cell's moe_inductor columns other than the default one (``MOE_COLUMNS``: a setting changed) against the
    default, with the peak memory of both; empty where no cell ran one. > 1: the variant is faster."""
    cells = _cells(rows)
    lines = ["| family (layers) | mode | column | unit | moe_inductor | column's | column vs moe_inductor | "
             "peak MiB (moe / column) |", "|---|---|---|---|---|---|---|---|"]
    for (family, layers, mode, size), c in cells.items():
        base = c.get("moe_inductor")
        for name in MOE_COLUMNS[1:]:
            r = c.get(name)
            if r is None:
                continue
            if base is None or "value" not in base or "value" not in r:
                lines.append(f"| {FAMILIES[family][1]} ({layers}) | {mode} {size} | {name} | | | "
                             f"{r.get('error', r.get('skipped', '–'))[:60]} | | |")
                continue
            fmt = "{:.0f}" if r["unit"] != "ms" else "{:.2f}"
            speed = base["value"] / r["value"] if r["unit"] == "ms" else r["value"] / base["value"]
            peaks = " / ".join(f"{x['peak_mib']:.0f}" if x.get("peak_mib") is not None else "–" for x in (base, r))
            lines.append(f"| {FAMILIES[family][1]} ({layers}) | {mode} {size} | {name} | {r['unit']} | "
                         f"{fmt.format(base['value'])} | {fmt.format(r['value'])} | {speed:.2f} | {peaks} |")
    return "\n".join(lines) if len(lines) > 2 else ""
