"""The cMedQA / cMedQA2 release folder (also cEpilepsyQA, which uses cMedQA2's exact format):

    question.csv            question_id,content          (cMedQA v1 names it questions.csv)
    answer.csv              ans_id,question_id,content   (v1: answers.csv)
    {split}_candidates.txt  question_id,ans_id,cnt,label        (dev/test: one row per judged candidate)
                            question_id,pos_ans_id,neg_ans_id   (the official train file: one row per pair)

Quirks handled here: a candidates file may repeat a (question, answer) row (cEpilepsyQA: 510 in dev, 515
in test, all label 0): repeats are collapsed and counted.  When train_candidates.txt is missing (not
shipped with cEpilepsyQA), the train questions are those in no candidates file, each judged by the
answers answer.csv links to it (label 1).  The official release ships zip files: unzip them first.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from care.data.io import DataError
from care.data.records import QueryCandidates, Text, text_id
from care.data.sources.common import Report, clean_text, delimited_rows, parse_label

JUDGED = ["question_id", "ans_id", "cnt", "label"]
PAIRED = ["question_id", "pos_ans_id", "neg_ans_id"]


def _find(folder: Path, names: tuple[str, ...]) -> Path:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"none of {', '.join(names)} in {folder} (unzip the release's .zip files first)")


def _new_id(path: Path, line: int, column: str, value: str, seen) -> str:
    if not value.strip() or value in seen:
        raise DataError(path, line, column, f"{'duplicate' if value.strip() else 'empty'} id {value!r}")
    return value


def read(opts: dict, root: Path, report: Report) -> Iterator[Text | QueryCandidates]:
    source, folder = report.source, root / opts["path"]
    splits = list(opts.get("splits", ["train", "dev", "test"]))
    q_path = _find(folder, ("question.csv", "questions.csv"))
    a_path = _find(folder, ("answer.csv", "answers.csv"))

    answers_of: dict[str, list[str]] = {}  # question id -> the answer ids answer.csv links to it (file order)
    for line, (qid, content) in delimited_rows(q_path, report, ["question_id", "content"]):
        with report.row(q_path, line):
            qid = _new_id(q_path, line, "question_id", qid, answers_of)
            text = clean_text(content, q_path, line, "content")
            answers_of[qid] = []
            yield Text(text_id(source, "question", qid), text, source, "question")

    answers: set[str] = set()
    for line, (aid, qid, content) in delimited_rows(a_path, report, ["ans_id", "question_id", "content"]):
        with report.row(a_path, line):
            aid = _new_id(a_path, line, "ans_id", aid, answers)
            if qid not in answers_of:
                raise DataError(a_path, line, "question_id", f"unknown question id {qid!r} (not in {q_path.name})")
            text = clean_text(content, a_path, line, "content")
            answers.add(aid)
            answers_of[qid].append(aid)
            yield Text(text_id(source, "answer", aid), text, source, "answer")

    def known(path: Path, line: int, column: str, value: str, ids, file: Path) -> str:
        if value not in ids:
            raise DataError(path, line, column, f"unknown id {value!r} (not in {file.name})")
        return value

    in_candidates: set[str] = set()
    for split in splits:
        path = folder / f"{split}_candidates.txt"
        if not path.is_file():
            continue
        with open(path, encoding="utf-8-sig", errors="replace") as fh:
            columns = PAIRED if fh.readline().strip() == ",".join(PAIRED) else JUDGED
        lists: dict[str, dict[str, int]] = {}  # question id -> {answer id: label}, in file order
        for line, cells in delimited_rows(path, report, columns):
            with report.row(path, line):
                qid = known(path, line, "question_id", cells[0], answers_of, q_path)
                if columns == PAIRED:
                    pos = known(path, line, "pos_ans_id", cells[1], answers, a_path)
                    neg = known(path, line, "neg_ans_id", cells[2], answers, a_path)
                    if pos == neg:
                        raise DataError(path, line, "neg_ans_id", f"answer {neg!r} is both the positive and the negative")
                    new = {pos: 1, neg: 0}
                else:
                    aid = known(path, line, "ans_id", cells[1], answers, a_path)
                    new = {aid: parse_label(cells[3], path, line, "label", allowed=(0, 1))}
                judged = lists.get(qid, {})
                for aid, label in new.items():
                    if judged.get(aid, label) != label:
                        raise DataError(path, line, "label", f"answer {aid!r} judged both 0 and 1 for question {qid!r}")
                if columns == JUDGED and cells[1] in judged:
                    report.filter(path, "repeated_candidate",
                                  "a (question, answer id) row repeated in a candidates file: collapsed to one candidate")
                lists.setdefault(qid, judged).update(new)
        in_candidates.update(lists)
        yield from _candidates(source, split, lists)

    if "train" in splits and not (folder / "train_candidates.txt").is_file():
        # No train file: every question outside dev/test is a train question, judged by its own answers.
        rest = [q for q in answers_of if q not in in_candidates]
        lists = {q: dict.fromkeys(answers_of[q], 1) for q in rest if answers_of[q]}
        report.counts["train_from_answer_links"] = {"questions": len(lists), "without_answers": len(rest) - len(lists)}
        yield from _candidates(source, "train", lists)


def _candidates(source: str, split: str, lists: dict[str, dict[str, int]]) -> Iterator[QueryCandidates]:
    for qid, judged in lists.items():
        yield QueryCandidates(f"{source}:{split}:{qid}", source, split, text_id(source, "question", qid),
                              [(text_id(source, "answer", aid), label) for aid, label in judged.items()])
