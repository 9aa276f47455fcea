"""The text normalisation every dedup stage sees (configured by `dedup.normalize`).

Applied in this order, each step switchable:
1. `nfkc`: Unicode NFKC, which folds full-width Latin letters, digits and punctuation (Ａ１，) to their
   half-width forms (A1,) and the ideographic space U+3000 to a plain space.  CJK ideographs are unchanged.
2. `lowercase`: str.lower() (after NFKC, so full-width capitals are folded too).
3. `strip_punctuation`: drop every character whose Unicode category is punctuation (P*), Chinese
   (，。！？【】) and Latin alike.  Off by default: "是否。" and "是否？" are different questions.
4. `collapse_whitespace`: every run of whitespace (spaces, tabs, newlines) becomes one space, and the
   ends are stripped.

The exact stage hashes the normalised text with MD5; MinHash shingles it.  The original text is what
`kept.jsonl` carries: normalisation only decides what counts as equal.
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Normalizer:
    nfkc: bool = True
    lowercase: bool = True
    strip_punctuation: bool = False
    collapse_whitespace: bool = True

    def __call__(self, text: str) -> str:
        if self.nfkc:
            text = unicodedata.normalize("NFKC", text)
        if self.lowercase:
            text = text.lower()
        if self.strip_punctuation:
            text = "".join(c for c in text if not unicodedata.category(c).startswith("P"))
        if self.collapse_whitespace:
            text = _WHITESPACE.sub(" ", text).strip()
        return text


def normalised_md5(normalised: str) -> str:
    return hashlib.md5(normalised.encode("utf-8")).hexdigest()
