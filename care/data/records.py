"""The few record types every source reader yields, so nothing above the readers knows a source's format.

A reader turns its files into `Text`s (each text once, with an id unique across all sources), `Pair`s
(two text ids and a label: STS, paraphrase, query-title relevance) and `QueryCandidates` (one query with
its judged candidate list: answer selection, reranking, qrels).  Records refer to texts by id only.
`Example` is what the build stage makes of them: one training example (a query and its positives).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

Label = int | float | None  # None: an unlabelled split (e.g. a CBLUE leaderboard test set)


def md5_key(text: str) -> str:
    """The id of a text in a source that numbers none: the first 12 hex digits of its md5."""
    return hashlib.md5(text.encode("utf-8")).hexdigest()[:12]


def text_id(source: str, role: str, native: str) -> str:
    """`{source}:{role}:{native id}`, unique across sources; id-less sources pass `md5_key(text)`, so
    identical texts within one source and role share one id."""
    return f"{source}:{role}:{native}"


def native_id(text_id: str) -> str:
    """`source:role:native` -> native (text_id's inverse).  Exactly the first two fields go: cMedIR's natives
    are urls (`cmedir:title:http://...`), so splitting at the last ':' would cut them."""
    return text_id.split(":", 2)[2]


@dataclass(frozen=True)
class Text:
    id: str
    text: str
    source: str
    role: str  # question / answer / query / title / sentence / document

    @classmethod
    def of(cls, source: str, role: str, text: str, native: str | None = None) -> Text:
        """The text with its id: the source's own id when it has one, else the md5 key of the text."""
        return cls(text_id(source, role, native if native is not None else md5_key(text)), text, source, role)


@dataclass(frozen=True)
class Pair:
    id: str
    source: str
    split: str
    text1_id: str
    text2_id: str
    label: Label
    category: str | None = None  # CHIP-STS / CHIP2019 / nCoV carry a disease category per pair


@dataclass(frozen=True)
class QueryCandidates:
    id: str
    source: str
    split: str
    query_id: str
    candidates: list[tuple[str, Label]] = field(default_factory=list)  # (text id, label), judged order


def to_json(record: Text | Pair | QueryCandidates) -> dict:
    """The record as one JSON Lines row (the import stage's documented columns).  Built from __dict__,
    not dataclasses.asdict, whose deep copies made writing 360K rows the slowest part of the import."""
    row = dict(record.__dict__)
    if isinstance(record, QueryCandidates):
        row["candidates"] = [{"id": doc, "label": label} for doc, label in record.candidates]
    elif isinstance(record, Pair) and record.category is None:
        del row["category"]
    return row


@dataclass
class Example:
    """A training example of the build stage (data_pipeline/build.py): a query id, its positive ids, the
    build rule it came from and the pool its negatives are mined in; the leakage rule reads it too."""
    query_id: str
    pos_ids: list[str]
    rule: str
    pool: str

    def row(self) -> dict:
        return {"query_id": self.query_id, "pos_ids": self.pos_ids, "rule": self.rule, "pool": self.pool}
