"""ChineseBLUE TSVs (no header, csv-style quoting: a field may be "..." with "" inside):

    cMedQA (cMedQA2 text)  label \\t question \\t answer    -> `read_qa`: one candidate list per question
    cMedQQ                 label \\t query1 \\t query2      -> `read_pairs`: labelled pairs

Quirk handled here (data README, Known defects): in the cMedQA files most questions have no positive, and
those with 3-17 "positives" are scrambled.  Only questions with min_positives..max_positives positives
(default 1..2; max_positives null = no cap) are kept; the others are counted by filter, and the
positives-per-question histogram of every split goes to stats.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from care.data.io import DataError
from care.data.records import Pair, QueryCandidates, Text, md5_key
from care.data.sources.common import Report, clean_text, delimited_rows, parse_label


def read_qa(opts: dict, root: Path, report: Report) -> Iterator[Text | QueryCandidates]:
    source, folder = report.source, root / opts["path"]
    low, high = opts.get("min_positives", 1), opts.get("max_positives", 2)
    histograms = report.counts.setdefault("positives_per_question", {})
    for split, name in opts["files"].items():
        path = folder / name
        groups: dict[str, dict[str, int]] = {}  # question -> {answer: label}, in file order
        rows: Counter[str] = Counter()  # question -> rows kept for it (what the filter drops)
        for line, (label, question, answer) in delimited_rows(path, report, ["label", "question", "answer"],
                                                              delimiter="\t", header=False):
            with report.row(path, line):
                label = parse_label(label, path, line, "label", allowed=(0, 1))
                question = clean_text(question, path, line, "question")
                answer = clean_text(answer, path, line, "answer")
                judged = groups.setdefault(question, {})
                if judged.get(answer, label) != label:
                    raise DataError(path, line, "label", "the same (question, answer) row appears with labels 0 and 1")
                if answer in judged:
                    report.filter(path, "repeated_candidate", "a (question, answer) row repeated: collapsed")
                else:
                    rows[question] += 1
                judged[answer] = label

        positives = {q: sum(judged.values()) for q, judged in groups.items()}
        histograms[split] = {str(k): v for k, v in sorted(Counter(positives.values()).items())}
        for question, judged in groups.items():
            if positives[question] < low or (high is not None and positives[question] > high):
                report.filter(path, "untrusted_positive_count",
                              f"questions with fewer than {low} or more than {high} positives (known defect)"
                              if high is not None else f"questions with fewer than {low} positives",
                              rows=rows[question], questions=1)
                continue
            query = Text.of(source, "question", question)
            docs = [Text.of(source, "answer", answer) for answer in judged]
            yield query
            yield from docs
            yield QueryCandidates(f"{source}:{split}:{md5_key(question)}", source, split, query.id,
                                  [(doc.id, label) for doc, label in zip(docs, judged.values())])


def read_pairs(opts: dict, root: Path, report: Report) -> Iterator[Text | Pair]:
    source, folder, role = report.source, root / opts["path"], opts.get("role", "query")
    for split, name in opts["files"].items():
        path = folder / name
        for line, (label, text1, text2) in delimited_rows(path, report, ["label", "text1", "text2"],
                                                          delimiter="\t", header=False):
            with report.row(path, line):
                label = parse_label(label, path, line, "label", allowed=(0, 1))
                t1 = Text.of(source, role, clean_text(text1, path, line, "text1"))
                t2 = Text.of(source, role, clean_text(text2, path, line, "text2"))
                yield t1
                yield t2
                yield Pair(f"{source}:{split}:{line}", source, split, t1.id, t2.id, label)
