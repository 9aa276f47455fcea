"""Shared by the build and leakage tests: the sources used, the leakage normalisation and Jaccard redone
independently, text ids, the restricted build config and a JSON Lines reader."""

from __future__ import annotations

import functools
import hashlib
import json
import unicodedata
from pathlib import Path

from omegaconf import open_dict

from care.config import load_config

SOURCES = ("cmedqa2_pairs", "kuake_qqr", "kuake_qtr")
NEAR = "请问医生"  # prepended to a test question to plant a near duplicate in the dev training split
# (source, file prefix, the two JSON fields, their roles) of the KUAKE sets used here.
KUAKE = (("kuake_qqr", "cblue_kuake_qqr/KUAKE-QQR", ("query1", "query2"), ("query", "query")),
         ("kuake_qtr", "cblue_kuake_qtr/KUAKE-QTR", ("query", "title"), ("query", "title")))


def norm(text: str) -> str:
    """The leakage normalisation (NFKC, lowercase, no punctuation, collapsed whitespace), redone here."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join("".join(c for c in text if not unicodedata.category(c).startswith("P")).split())


@functools.cache
def grams(text: str) -> frozenset[str]:
    return frozenset({text[i : i + 3] for i in range(len(text) - 2)} if len(text) > 3 else {text})


def jaccard(a: str, b: str) -> float:
    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def tid(source: str, role: str, split: str, text: str) -> str:
    return f"{source}:{role}:{split}:{hashlib.md5(text.encode()).hexdigest()[:12]}"


def compose(import_dir: Path, out: Path, *extra: str):
    """The real build config, its rules and evaluation sets restricted to the sources written above,
    with no max_examples caps (so every clean example must come out)."""
    cfg = load_config("data_pipeline", [f"data_dir={out}", f"build.input_dir={import_dir}", *extra])
    with open_dict(cfg):
        cfg.build.rules = [{**r, "max_examples": None} for r in cfg.build.rules if r.source in SOURCES]
        cfg.build.eval_sets = [e for e in cfg.build.eval_sets if e.source in SOURCES]
    return cfg


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
