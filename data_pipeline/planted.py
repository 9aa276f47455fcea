"""Planted duplicates: real texts plus copies whose relation to their original is known exactly.

`plant()` takes real texts and appends
- exact copies (verbatim),
- variants that differ only in what the default normalisation folds (full-width Latin letters and
  digits, case, whitespace runs and leading/trailing whitespace),
- near duplicates made by random character edits (substitute, insert, delete a character drawn from
  the corpus), edited until the exact character n-gram Jaccard with the original falls to a target drawn
  uniformly from `near_range`; the Jaccard actually reached is measured and returned,
then shuffles everything.  The rest of the texts are left untouched.  The ground truth is the list of
(original id, copy id, kind, Jaccard) pairs; recall of a dedup method is the share of those pairs it
puts in one cluster.

`shared_texts()` gives real Chinese medical texts from the shared data (cEpilepsyQA answers and
questions: short and long texts, the same shape as the training documents).
"""
from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from care.paths import shared_data
from data_pipeline.dedup.minhash_reference import jaccard, shingles
from data_pipeline.dedup.normalize import Normalizer

KINDS = ("exact", "variant", "near")


@dataclass
class PlantedPair:
    original: str
    copy: str
    kind: str        # exact | variant | near
    jaccard: float   # exact n-gram Jaccard of the (normalised) texts
    edits: int       # character edits applied (near only)


def shared_texts(limit: int | None = None, folder: str | Path | None = None) -> list[str]:
    """Distinct cEpilepsyQA answers then questions (release-format CSVs, column `content`)."""
    folder = Path(folder or shared_data() / "cepilepsyqa")
    seen: dict[str, None] = {}
    for name in ("answer.csv", "question.csv"):
        with open(folder / name, encoding="utf-8", newline="") as fh:
            for row in csv.DictReader(fh):
                if row["content"].strip():
                    seen.setdefault(row["content"].strip(), None)
    texts = list(seen)
    return texts[:limit] if limit else texts


def _fullwidth(text: str, rng: random.Random) -> str:
    """Noise the default normalisation folds: ASCII letters/digits to full width or upper case, each
    existing space to a run of mixed whitespace, whitespace added at both ends."""
    out = []
    for c in text:
        if c.isascii() and c.isalnum() and rng.random() < 0.5:
            c = chr(ord(c) + 0xFEE0) if rng.random() < 0.5 else c.upper()
        elif c == " ":
            c = rng.choice(["  ", "\u3000", " \t"])
        out.append(c)
    return rng.choice([" ", "\u3000", "\n"]) + "".join(out) + rng.choice([" ", "\t "])


def edit_until(text: str, target: float, ngram: int, alphabet: Sequence[str], rng: random.Random):
    """Random character edits until the Jaccard with `text` is <= target (or the text is worn out)."""
    original, chars, edits = shingles(text, ngram), list(text), 0
    current = 1.0
    while current > target and edits < 4 * len(text):
        op = rng.random()
        pos = rng.randrange(len(chars)) if chars else 0
        if op < 0.5 and chars:
            chars[pos] = rng.choice(alphabet)
        elif op < 0.75 or not chars:
            chars.insert(pos, rng.choice(alphabet))
        elif len(chars) > 1:
            del chars[pos]
        edits += 1
        current = jaccard(original, shingles("".join(chars), ngram))
    return "".join(chars), current, edits


def plant(texts: Sequence[str], n_exact: int, n_variant: int, n_near: int, ngram: int = 3,
          near_range: tuple[float, float] = (0.6, 1.0), seed: int = 0, id_prefix: str = "t"):
    """Return (rows, pairs): rows are shuffled `{"id", "text"}` dicts (originals `t{i}`, copies
    `t{i}-{kind}{k}`), pairs the ground truth.  Texts are normalised first (default Normalizer) so the
    Jaccard measured here is the one the dedup stages see."""
    rng = random.Random(seed)
    norm = Normalizer()
    base = [norm(t) for t in texts]
    alphabet = sorted({c for t in base for c in t if not c.isspace()})
    rows = [{"id": f"{id_prefix}{i}", "text": t} for i, t in enumerate(base)]
    pairs: list[PlantedPair] = []
    counts = dict(zip(KINDS, (n_exact, n_variant, n_near)))
    for kind, count in counts.items():
        for k in range(count):
            i = rng.randrange(len(base))
            orig_id, copy_id = f"{id_prefix}{i}", f"{id_prefix}{i}-{kind}{k}"
            if kind == "exact":
                text, jac, edits = base[i], 1.0, 0
            elif kind == "variant":
                text, jac, edits = _fullwidth(base[i], rng), 1.0, 0
            else:
                text, jac, edits = edit_until(base[i], rng.uniform(*near_range), ngram, alphabet, rng)
            rows.append({"id": copy_id, "text": text})
            pairs.append(PlantedPair(orig_id, copy_id, kind, jac, edits))
    rng.shuffle(rows)
    return rows, pairs
