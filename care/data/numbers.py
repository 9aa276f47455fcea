"""How a number and a gain's interval read in every table the project writes: evaluate.py's report
(care.evaluation.report), the model card (care.export.card_sections), the trade-off and compare tables.  Here,
below both evaluation and export, so the two layers share one copy (docs/design.md, "Layers")."""
from __future__ import annotations

import math


def fmt_number(value, digits: int = 2) -> str:
    """`value` with thousands separators and `digits` decimals; an absent or undefined (NaN) value reads n/a."""
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:,.{digits}f}" if digits else f"{value:,.0f}"


def fmt_interval(interval: dict | None) -> str:
    """A gain's 95% interval {low, high}; `*` marks one that excludes 0 (more than the evaluation set's noise).
    An undefined one (low/high None or NaN: care.evaluation.significance `undefined` says why) reads n/a."""
    if not interval:
        return ""
    if any(interval.get(k) is None or math.isnan(interval[k]) for k in ("low", "high")):
        return "n/a"
    mark = "*" if interval["low"] > 0 or interval["high"] < 0 else ""
    return f"[{interval['low']:+.2f}, {interval['high']:+.2f}]{mark}"


def fmt_gain(value, reference=0.0) -> str:
    """A gain, `value - reference`, signed with 2 decimals (a difference already taken: `fmt_gain(d)`); n/a when
    either is absent or undefined (NaN)."""
    return "n/a" if value is None or reference is None or math.isnan(value - reference) else f"{value - reference:+.2f}"


#: The efficiency columns of an evaluation table (evaluate.py's report, the model card): (the key in a row's
#: "efficiency", the column's title, the scale it is shown at, its decimals).
EFFICIENCY = [("online_parameters", "Online params (M)", 1e-6, 1),
              ("online_parameters_without_embeddings", "w/o token embeddings (M)", 1e-6, 1),
              ("query_latency_ms_p50", "Query ms p50", 1, 1), ("query_latency_ms_p95", "Query ms p95", 1, 1),
              ("docs_per_second", "Docs/s", 1, 0)]
EFFICIENCY_TITLES = [title for _, title, _, _ in EFFICIENCY]


def efficiency_cells(efficiency: dict | None) -> list[str]:
    """A row's efficiency columns, each at its scale and decimals (n/a where not measured)."""
    eff = efficiency or {}
    return [fmt_number(eff[k] * scale if eff.get(k) is not None else None, d) for k, _, scale, d in EFFICIENCY]


def gain_rows(label: str, scores: dict, reference: dict, intervals: dict | None, keys: list[str]) -> list[str]:
    """A gain's Markdown rows in a table of the columns `keys` then the efficiency columns (left empty): `label`
    and each column's gain over `reference`; then, where any interval was computed, the 95% intervals."""
    rows = [[label] + [fmt_gain(scores.get(k), reference.get(k)) for k in keys]]
    if intervals and any(intervals.values()):
        rows.append(["95% interval of that gain"] + [fmt_interval(intervals.get(k)) for k in keys])
    return ["| " + " | ".join(cells + [""] * len(EFFICIENCY)) + " |" for cells in rows]
