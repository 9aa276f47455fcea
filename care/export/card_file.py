"""A model folder's README.md as two parts: the card care.export.card generates (the YAML front matter, which
the Hugging Face hub wants at the top, and the body between two markers) and the user's own text around the
body, which a rewrite of the card keeps.

    ---
    <front matter>
    ---
    <your text, kept>
    <!-- care-medical card: generated ... sha256:<digest of the front matter and the body> -->
    <body>
    <!-- care-medical card: end -->
    <your text, kept>

The digest in the first marker is how a rewrite knows the generated part is still the project's own: a
README whose front matter or body was edited (its digest no longer matches), or one with no markers (written
by hand, by another tool, or by the project before the markers), is left as it is and CardKept says so in
one line (evaluate.py prints it as a warning; the scores are written regardless).  What an editor does to a
whole file is not an edit: CRLF line ends (kept when the card is written again) and a last newline stripped.
"""
from __future__ import annotations

import hashlib
import re

BEGIN = ("<!-- care-medical card: generated from care_training.json (and evaluate.py's summary.json); text "
         "outside these markers is kept when the card is written again, edits inside them stop the rewrite. "
         "sha256:{digest} -->")
END = "<!-- care-medical card: end -->"
_BEGIN = re.compile(r"^<!-- care-medical card: generated .*? sha256:([0-9a-f]{64}) -->$", re.MULTILINE)
_END = re.compile(rf"\n{re.escape(END)}(?:\n|\Z)")  # the end marker may close the file (its newline stripped)


class CardKept(ValueError):
    """The README is not (or no longer) the project's own card: left as it is (the message says why)."""


def _digest(front: str, body: str) -> str:
    return hashlib.sha256(f"{front}\0{body}".encode()).hexdigest()


def _split_front(text: str) -> tuple[str, str]:
    """(the front matter block, with its --- lines, the rest); ('', text) without one."""
    if text.startswith("---\n") and (end := text.find("\n---\n", 3)) >= 0:
        return text[:end + 5], text[end + 5:]
    return "", text


def compose(card: str, existing: str | None, where: str = "README.md") -> str:
    """The README to write: `card` (the rendered card: front matter, then the body) with the user's text of
    `existing` kept around its body.  Raises CardKept when `existing` is not the project's own card."""
    front, body = _split_front(card)
    body = body.strip("\n")
    head, tail, crlf = "\n", "\n", False
    if existing is not None:
        crlf = "\r\n" in existing  # an editor's (Windows) line ends: read as \n, written back as they were
        old_front, rest = _split_front(existing.replace("\r\n", "\n"))
        begin = _BEGIN.search(rest)
        end = _END.search(rest, begin.end()) if begin is not None else None
        if begin is None or end is None:
            raise CardKept(f"{where}: not a care-medical card (no generated-card markers): left as it is; move it "
                           f"away to get the card written")
        if _digest(old_front, rest[begin.end() + 1:end.start()]) != begin.group(1):
            raise CardKept(f"{where}: its generated part (the front matter, or the text between the care-medical "
                           f"markers) was edited: left as it is; move your edits outside the markers (or remove "
                           f"the file) to get the card written")
        head, tail = rest[:begin.start()], rest[end.end():]
    text = f"{front}{head}{BEGIN.format(digest=_digest(front, body))}\n{body}\n{END}\n{tail}"
    return text.replace("\n", "\r\n") if crlf else text
