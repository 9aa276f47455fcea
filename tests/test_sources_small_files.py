"""The source readers on small files in tmp_path: text ids, release folders and evaluation layouts, and every
kind of bad input, under on_error=stop (raises, naming file, line and field) and on_error=skip (the row is
left out and reported, the good rows kept)."""
from __future__ import annotations

import hashlib

import pytest
from _sources_helpers import _by_kind, _check_references

from care.data.io import DataError
from care.data.records import md5_key
from care.data.sources import read_source

# ---- ids ---------------------------------------------------------------------------------------------

def test_text_ids(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.txt").write_text("1\t头痛怎么办\t头疼怎么办\n0\t头痛怎么办\t胃痛怎么办\n", encoding="utf-8")
    records, _ = read_source("qq", {"reader": "chineseblue_pairs", "path": "d", "files": {"train": "train.txt"}}, tmp_path)
    kinds = _by_kind(records)
    assert len(kinds["texts"]) == 3  # the repeated text got one id
    assert f"qq:query:{hashlib.md5('头痛怎么办'.encode()).hexdigest()[:12]}" in kinds["texts"]
    assert md5_key("头痛怎么办") == hashlib.md5("头痛怎么办".encode()).hexdigest()[:12]
    assert [p.id for p in kinds["pairs"]] == ["qq:train:1", "qq:train:2"]


# ---- small release folders and the evaluation layouts ----------------------------------------------

def _write(root, files: dict):
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))


def test_cmedqa_v1_names_and_paired_train_file(tmp_path):
    """cMedQA v1 names (questions.csv / answers.csv) and the official pos/neg train_candidates.txt."""
    _write(tmp_path / "rel", {
        "questions.csv": "question_id,content\n1,头痛怎么办\n2,\"发烧,咳嗽\"\n",
        "answers.csv": "ans_id,question_id,content\n10,1,多休息\n11,1,吃药\n12,2,\"多喝水,\"\"休息\"\"\"\n",
        "train_candidates.txt": "question_id,pos_ans_id,neg_ans_id\n1,10,12\n1,11,12\n2,12,10\n",
        "test_candidates.txt": "question_id,ans_id,cnt,label\n2,12,0,1\n2,10,1,0\n2,10,2,0\n",
    })
    records, report = read_source("rel", {"reader": "cmedqa_release", "path": "rel"}, tmp_path)
    kinds = _by_kind(records)
    assert kinds["texts"]["rel:question:2"] == "发烧,咳嗽" and kinds["texts"]["rel:answer:12"] == '多喝水,"休息"'
    lists = {(c.split, c.query_id): c.candidates for c in kinds["lists"]}
    assert lists == {
        ("train", "rel:question:1"): [("rel:answer:10", 1), ("rel:answer:12", 0), ("rel:answer:11", 1)],
        ("train", "rel:question:2"): [("rel:answer:12", 1), ("rel:answer:10", 0)],
        ("test", "rel:question:2"): [("rel:answer:12", 1), ("rel:answer:10", 0)],
    }
    assert report.filters["repeated_candidate"]["rows"] == 1


def test_beir_folder(tmp_path):
    _write(tmp_path / "task", {
        "corpus.jsonl": '{"_id": "d1", "title": "高血压", "text": "高血压的饮食"}\n{"_id": "d2", "text": "糖尿病"}\n'
                        '{"_id": "d3", "title": "", "text": "感冒"}\n',
        "queries.jsonl": '{"_id": "q1", "text": "高血压吃什么"}\n{"_id": "q2", "text": "糖尿病症状"}\n',
        "qrels/test.tsv": "query-id\tcorpus-id\tscore\nq1\td1\t2\nq1\td3\t0\nq2\td2\t1\n",
        "qrels/dev.tsv": "query-id\tcorpus-id\tscore\nq2\td2\t1\n",
    })
    kinds = _by_kind(read_source("mine", {"reader": "beir", "path": "task"}, tmp_path)[0])
    assert kinds["texts"]["mine:document:d1"] == "高血压 高血压的饮食" and kinds["texts"]["mine:document:d3"] == "感冒"
    assert kinds["texts"]["mine:query:q2"] == "糖尿病症状"
    assert [(c.id, c.candidates) for c in kinds["lists"]] == [
        ("mine:dev:q2", [("mine:document:d2", 1)]),
        ("mine:test:q1", [("mine:document:d1", 2), ("mine:document:d3", 0)]),
        ("mine:test:q2", [("mine:document:d2", 1)]),
    ]


def test_cmteb_reranking_and_sts(tmp_path):
    _write(tmp_path / "r", {
        "test.jsonl": '{"query": "头痛", "positive": ["休息"], "negative": ["吃饭", "运动", "吃饭"]}\n'
                      '{"query": "头痛", "positive": ["喝水"], "negative": []}\n',
        "sts.jsonl": '{"sentence1": "头痛", "sentence2": "头疼", "score": 4.5}\n'
                     '{"sentence1": "头痛", "sentence2": "胃痛", "score": 1}\n',
    })
    records, report = read_source("rr", {"reader": "cmteb_reranking", "path": "r", "files": {"test": "test.jsonl"}}, tmp_path)
    kinds = _by_kind(records)
    (lst,) = kinds["lists"]
    assert [(kinds["texts"][d], label) for d, label in lst.candidates] == [("休息", 1), ("吃饭", 0), ("运动", 0), ("喝水", 1)]
    assert kinds["texts"][lst.query_id] == "头痛" and report.counts["repeated_candidates"] == {"test": 1}
    kinds = _by_kind(read_source("sts", {"reader": "sts_jsonl", "path": "r", "files": {"test": "sts.jsonl"}}, tmp_path)[0])
    assert [(kinds["texts"][p.text2_id], p.label) for p in kinds["pairs"]] == [("头疼", 4.5), ("胃痛", 1)]


# ---- bad input: stop names file, line and field; skip leaves the row out and reports it -----------------

REL = {"question.csv": "question_id,content\n1,头痛怎么办\n2,发烧\n",
       "answer.csv": "ans_id,question_id,content\n10,1,多休息\n11,2,多喝水\n"}

# (case, reader options, files, the bad file, line, field, records of each kind kept under skip)
BAD = [
    ("truncated row", {"reader": "chineseblue_pairs", "files": {"train": "t.txt"}},
     {"t.txt": "1\t头痛\t头疼\n0\t头痛\n0\t胃痛\t头疼\n"}, "t.txt", 2, "text2", {"pairs": 2}),
    ("bad label (TSV)", {"reader": "chineseblue_qa", "files": {"dev": "d.txt"}},
     {"d.txt": "1\t头痛\t休息\nx\t头痛\t吃药\n0\t头痛\t运动\n"}, "d.txt", 2, "label", {"lists": 1}),
    ("empty text (TSV)", {"reader": "ncov", "files": {"train": "n.csv"}},
     {"n.csv": "感冒:头痛\t感冒:头疼\t1\n感冒:头痛\t感冒:  \t0\n"}, "n.csv", 2, "question2", {"pairs": 1}),
    ("missing category prefix", {"reader": "ncov", "files": {"train": "n.csv"}},
     {"n.csv": "感冒:头痛\t头疼\t1\n感冒:头痛\t感冒:发烧\t0\n"}, "n.csv", 1, "question2", {"pairs": 1}),
    ("undecodable bytes", {"reader": "chip2019", "files": {"train": "c.csv"}},
     {"c.csv": "question1,question2,label,category\n头痛,头疼,1,aids\n".encode() + b"\xff\xfe,x,0,aids\n"
      + "发烧,发热,1,aids\n".encode()}, "c.csv", 3, "question1", {"pairs": 2}),
    ("undecodable bytes (JSON Lines)", {"reader": "sts_jsonl", "files": {"test": "s.jsonl"}},
     {"s.jsonl": b'{"sentence1": "a", "sentence2": "b\xe4\xb8", "score": 1}\n{"sentence1": "a", "sentence2": "c", "score": 3}\n'},
     "s.jsonl", 1, "sentence2", {"pairs": 1}),
    ("unknown answer id", {"reader": "cmedqa_release", "splits": ["test"]},
     {**REL, "test_candidates.txt": "question_id,ans_id,cnt,label\n1,10,0,1\n1,99,1,0\n1,11,2,0\n"},
     "test_candidates.txt", 3, "ans_id", {"lists": 1}),
    ("unknown question id", {"reader": "cmedqa_release", "splits": ["test"]},
     {**REL, "test_candidates.txt": "question_id,ans_id,cnt,label\n7,10,0,1\n1,10,1,1\n"},
     "test_candidates.txt", 2, "question_id", {"lists": 1}),
    ("conflicting labels", {"reader": "cmedqa_release", "splits": ["test"]},
     {**REL, "test_candidates.txt": "question_id,ans_id,cnt,label\n1,10,0,1\n1,10,1,0\n"},
     "test_candidates.txt", 3, "label", {"lists": 1}),
    ("empty text (JSON array)", {"reader": "cblue", "files": {"dev": "q.json"}, "fields": ["query", "title"],
                                 "roles": ["query", "title"], "labels": [0, 1, 2, 3]},
     {"q.json": '[\n {"id": "s1", "query": "头痛", "title": "头疼", "label": "1"},\n'
                ' {"id": "s2", "query": "头痛",\n  "title": " ", "label": "2"}\n]\n'}, "q.json", 3, "title", {"pairs": 1}),
    ("bad label (JSON array)", {"reader": "cblue", "files": {"dev": "q.json"}, "fields": ["query1", "query2"],
                                "roles": ["query", "query"], "labels": [0, 1, 2]},
     {"q.json": '[{"id": "s8", "query1": "a", "query2": "b", "label": "2"},\n'
                '{"id": "s9", "query1": "a", "query2": "c", "label": "NA"}]'}, "q.json", 2, "label", {"pairs": 1}),
    ("missing label in a labelled split", {"reader": "cblue", "files": {"dev": "q.json"}, "fields": ["text1", "text2"],
                                           "roles": ["q", "q"], "labels": [0, 1], "unlabelled": ["test"]},
     {"q.json": '[{"id": "1", "text1": "a", "text2": "b"}, {"id": "2", "text1": "a", "text2": "c", "label": "1"}]'},
     "q.json", 1, "label", {"pairs": 1}),
    ("malformed JSON line", {"reader": "cmedir", "files": {"dev": "ir.json"}},
     {"ir.json": '{"query": "头痛", "documents": [{"url": "u1", "label": "2", "title": "头疼"}]}\n'
                 '{"query": "头痛", "documents": [{"url": "u2", \n'
                 '{"query": "发烧", "documents": [{"url": "u3", "label": "1", "title": "发热"}]}\n'},
     "ir.json", 2, None, {"lists": 2}),
    ("bad grade (JSON Lines)", {"reader": "cmedir", "files": {"dev": "ir.json"}},
     {"ir.json": '{"query": "头痛", "documents": [{"url": "u1", "label": "2", "title": "头疼"}, '
                 '{"url": "u2", "label": "7", "title": "x"}]}\n'
                 '{"query": "发烧", "documents": [{"url": "u3", "label": "1", "title": "发热"}]}\n'},
     "ir.json", 1, "documents[1].label", {"lists": 1}),
    ("unknown corpus id (qrels)", {"reader": "beir"},
     {"corpus.jsonl": '{"_id": "d1", "text": "头疼"}\n', "queries.jsonl": '{"_id": "q1", "text": "头痛"}\n',
      "qrels/test.tsv": "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td9\t1\n"}, "qrels/test.tsv", 3, "corpus-id",
     {"lists": 1}),
    ("empty text (reranking)", {"reader": "cmteb_reranking", "files": {"test": "r.jsonl"}},
     {"r.jsonl": '{"query": "头痛", "positive": ["休息"], "negative": ["", "运动"]}\n'
                 '{"query": "发烧", "positive": ["喝水"], "negative": ["运动"]}\n'}, "r.jsonl", 1, "negative[0]", {"lists": 1}),
    ("bad score (STS)", {"reader": "sts_jsonl", "files": {"test": "s.jsonl"}},
     {"s.jsonl": '{"sentence1": "a", "sentence2": "b", "score": "high"}\n{"sentence1": "a", "sentence2": "c", "score": 3}\n'},
     "s.jsonl", 1, "score", {"pairs": 1}),
]


@pytest.mark.parametrize("case, opts, files, bad_file, line, field, kept", BAD, ids=[c[0] for c in BAD])
def test_bad_input_stop(tmp_path, case, opts, files, bad_file, line, field, kept):
    _write(tmp_path / "src", files)
    with pytest.raises(DataError) as err:
        read_source("src", {**opts, "path": "src"}, tmp_path, on_error="stop")
    e = err.value
    assert (e.path, e.line, e.field) == (str(tmp_path / "src" / bad_file), line, field)
    assert str(tmp_path / "src" / bad_file) in str(e) and f"line {line}" in str(e)


@pytest.mark.parametrize("case, opts, files, bad_file, line, field, kept", BAD, ids=[c[0] for c in BAD])
def test_bad_input_skip(tmp_path, case, opts, files, bad_file, line, field, kept):
    _write(tmp_path / "src", files)
    records, report = read_source("src", {**opts, "path": "src"}, tmp_path, on_error="skip")
    assert [(r["file"], r["line"], r["field"]) for r in report.rejected] == [(str(tmp_path / "src" / bad_file), line, field)]
    assert report.rejected[0]["reason"]
    assert report.files[bad_file].rejected == 1
    kinds = _by_kind(records)
    assert {k: len(kinds[k]) for k in kept} == kept
    _check_references(kinds)


@pytest.mark.parametrize("on_error", ["stop", "skip"])
@pytest.mark.parametrize("case, opts, files, bad_file, line, field", [
    ("wrong header", {"reader": "chip2019", "files": {"train": "c.csv"}},
     {"c.csv": "question1,q2,label,category\n头痛,头疼,1,aids\n"}, "c.csv", 1, "question2"),
    ("wrong qrels header", {"reader": "beir"},
     {"corpus.jsonl": '{"_id": "d1", "text": "头疼"}\n', "queries.jsonl": '{"_id": "q1", "text": "头痛"}\n',
      "qrels/test.tsv": "qid\tdocid\tscore\nq1\td1\t1\n"}, "qrels/test.tsv", 1, "query-id"),
    ("truncated JSON array", {"reader": "cblue", "files": {"dev": "q.json"}, "fields": ["query", "title"],
                              "roles": ["query", "title"], "labels": [0, 1]},
     {"q.json": '[\n{"id": "s1", "query": "a", "title": "b", "label": "1"},\n{"id": "s2", "query": "a",\n'},
     "q.json", 4, None),
])
def test_bad_file_stops_in_both_modes(tmp_path, on_error, case, opts, files, bad_file, line, field):
    """A wrong header or an unparseable JSON array leaves no row to trust: it stops even under skip."""
    _write(tmp_path / "src", files)
    with pytest.raises(DataError) as err:
        read_source("src", {**opts, "path": "src"}, tmp_path, on_error=on_error)
    assert (err.value.path, err.value.line, err.value.field) == (str(tmp_path / "src" / bad_file), line, field)


def test_unknown_reader_and_missing_path(tmp_path):
    with pytest.raises(ValueError, match="unknown reader"):
        read_source("x", {"reader": "nope", "path": "."}, tmp_path)
    with pytest.raises(FileNotFoundError, match="data.root"):
        read_source("x", {"reader": "beir", "path": "absent"}, tmp_path)
