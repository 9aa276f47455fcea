"""Shared by the source reader tests: records split by kind; the check that every referenced id exists."""
from __future__ import annotations

from care.data.records import Pair, Text


def _by_kind(records):
    kinds = {"texts": {}, "pairs": [], "lists": []}
    for r in records:
        if isinstance(r, Text):
            assert kinds["texts"].setdefault(r.id, r.text) == r.text, f"id {r.id} names two texts"
        else:
            kinds["pairs" if isinstance(r, Pair) else "lists"].append(r)
    return kinds


def _check_references(kinds):
    ids = kinds["texts"]
    for p in kinds["pairs"]:
        assert p.text1_id in ids and p.text2_id in ids
    for c in kinds["lists"]:
        assert c.query_id in ids and all(doc in ids for doc, _ in c.candidates)
