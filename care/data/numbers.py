"""How a number and a gain's interval read in every table the project writes: evaluate.py's report
(care.evaluation.report), the model card (care.export.card_sections), the trade-off and compare tables.  Here,
below both evaluation and export, so the two layers share one copy (docs/design.md, "Layers")."""
from __future__ import annotations


def fmt_number(value, digits: int = 2) -> str:
    """`value` with thousands separators and `digits` decimals; an absent value reads n/a."""
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}" if digits else f"{value:,.0f}"


def fmt_interval(interval: dict | None) -> str:
    """A gain's 95% interval {low, high}; `*` marks one that excludes 0 (more than the evaluation set's noise)."""
    if not interval:
        return ""
    mark = "*" if interval["low"] > 0 or interval["high"] < 0 else ""
    return f"[{interval['low']:+.2f}, {interval['high']:+.2f}]{mark}"
