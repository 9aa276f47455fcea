"""cMedIR (ChineseBLUE): JSON Lines, two judged page titles a line, queries repeating across lines:

    {"query": str, "documents": [{"url": str, "label": "0".."4", "title": str}, ...]}

Grouped by query into one graded candidate list per (split, query).  Quirks handled here: in 5,000 of
each file's 10,000 lines the second title carries a stray leading ':' (the same url appears elsewhere
without it): it is cut and counted.  A document's id is its url; the rare url seen with two different
titles (one in dev) gets `url#md5(title)` for each, so an id never names two texts.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

from care.data.io import DataError
from care.data.records import QueryCandidates, Text, md5_key
from care.data.sources.common import Report, clean_text, field_of, jsonl_rows, parse_label


def read(opts: dict, root: Path, report: Report) -> Iterator[Text | QueryCandidates]:
    source, folder = report.source, root / opts["path"]
    groups: dict[tuple[str, str], dict[tuple[str, str], int]] = {}  # (split, query) -> {(url, title): label}
    titles: defaultdict[str, set[str]] = defaultdict(set)  # url -> its titles (ids are decided after reading)
    stray, repeats = Counter(), Counter()
    for split, name in opts["files"].items():
        path = folder / name
        for line, row in jsonl_rows(path, report):
            with report.row(path, line):
                query = clean_text(field_of(row, "query", path, line), path, line, "query")
                docs = field_of(row, "documents", path, line)
                if not isinstance(docs, list) or not docs or not all(isinstance(d, dict) for d in docs):
                    raise DataError(path, line, "documents", "expected a non-empty list of objects")
                judged, cut = {}, 0
                for i, doc in enumerate(docs):
                    where = f"documents[{i}]."
                    url = clean_text(field_of(doc, "url", path, line, where), path, line, where + "url")
                    title = field_of(doc, "title", path, line, where)
                    if isinstance(title, str) and title.startswith(":"):
                        title, cut = title[1:], cut + 1
                    title = clean_text(title, path, line, where + "title")
                    label = parse_label(field_of(doc, "label", path, line, where), path, line, where + "label",
                                        allowed=range(5))
                    if judged.setdefault((url, title), label) != label:
                        raise DataError(path, line, where + "label", f"{url} judged twice with different labels")
                group = groups.get((split, query), {})
                for key, label in judged.items():
                    if group.get(key, label) != label:
                        raise DataError(path, line, "documents", f"{key[0]} judged {group[key]} and {label} for one query")
                repeats[split] += sum(key in group for key in judged)
                stray[split] += cut
                groups.setdefault((split, query), group).update(judged)
                for url, title in judged:
                    titles[url].add(title)
    report.counts.update(titles_with_stray_colon=dict(stray), repeated_judgements=dict(repeats),
                         urls_with_several_titles=sum(len(t) > 1 for t in titles.values()))

    def doc(url: str, title: str) -> Text:
        return Text.of(source, "title", title, url if len(titles[url]) == 1 else f"{url}#{md5_key(title)}")

    for (split, query), group in groups.items():
        q = Text.of(source, "query", query)
        docs = [doc(url, title) for url, title in group]
        yield q
        yield from docs
        yield QueryCandidates(f"{source}:{split}:{md5_key(query)}", source, split, q.id,
                              [(d.id, label) for d, label in zip(docs, group.values())])
