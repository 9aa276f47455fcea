"""The source readers.  Counts on the real files are checked against the numbers the data README and each
folder's PROVENANCE.md publish (the independent reference); every kind of bad input is checked on small
files in tmp_path, under on_error=stop (raises, naming file, line and field) and on_error=skip (the row is
left out and reported, the good rows kept)."""
from __future__ import annotations

import csv
import hashlib
import json
from collections import Counter, defaultdict

import pytest
from omegaconf import OmegaConf

from care.config import load_config
from care.data.io import DataError
from care.data.records import Pair, Text, md5_key
from care.data.sources import read_source


@pytest.fixture(scope="module")
def shared_sources():
    """The default data set exactly as conf/data/shared.yaml composes it."""
    data = OmegaConf.to_container(load_config("data_pipeline").data, resolve=True)
    return data["root"], data["sources"]


@pytest.fixture(scope="module")
def real(shared_sources):
    """name -> (records split by kind, report): every shared source read once."""
    root, sources = shared_sources
    out = {}
    for name, opts in sources.items():
        records, report = read_source(name, opts, root)
        out[name] = (_by_kind(records), report)
    return out


def _by_kind(records):
    kinds = {"texts": {}, "pairs": [], "lists": []}
    for r in records:
        if isinstance(r, Text):
            assert kinds["texts"].setdefault(r.id, r.text) == r.text, f"id {r.id} names two texts"
        else:
            kinds["pairs" if isinstance(r, Pair) else "lists"].append(r)
    return kinds


def _per_split(items, labelled=None):
    return dict(Counter(x.split for x in items if labelled is None or (x.label is not None) == labelled))


def _rows(report):
    return {name: f["rows"] for name, f in report.as_dict()["files"].items()}


def _check_references(kinds):
    ids = kinds["texts"]
    for p in kinds["pairs"]:
        assert p.text1_id in ids and p.text2_id in ids
    for c in kinds["lists"]:
        assert c.query_id in ids and all(doc in ids for doc, _ in c.candidates)


# ---- the real files against the published counts ---------------------------------------------------

def test_cmedqa2_pairs_known_defect_filter(real, shared_sources):
    kinds, report = real["cmedqa2_pairs"]
    assert _rows(report) == {"dev.txt": 5475, "test.txt": 6149}
    hist = {split: {int(k): v for k, v in h.items()} for split, h in report.counts["positives_per_question"].items()}
    # README "Known defects": test 672 none / 112 one / 12 two / 101 with 3-17; dev 677 / 106 / 10; 895 and 897 questions
    assert [hist["test"].get(k, 0) for k in (0, 1, 2)] == [672, 112, 12]
    assert sum(v for k, v in hist["test"].items() if 3 <= k <= 17) == 101 and sum(hist["test"].values()) == 897
    assert [hist["dev"].get(k, 0) for k in (0, 1, 2)] == [677, 106, 10] and sum(hist["dev"].values()) == 895
    # only the 1..2-positive questions are kept, and the filter counts the rest
    assert _per_split(kinds["lists"]) == {"dev": 106 + 10, "test": 112 + 12}
    assert all(1 <= sum(label for _, label in c.candidates) <= 2 for c in kinds["lists"])
    assert report.filters["untrusted_positive_count"]["questions"] == (895 - 116) + (897 - 124)
    kept = sum(len(c.candidates) for c in kinds["lists"])
    assert report.filters["untrusted_positive_count"]["rows"] == 5475 + 6149 - kept
    _check_references(kinds)

    # the filter is configurable: with no bounds every question and every answer (PROVENANCE: 4,593 in dev)
    # comes through, csv-quoted fields unquoted
    root, sources = shared_sources
    opts = {**sources["cmedqa2_pairs"], "min_positives": 0, "max_positives": None, "files": {"dev": "dev.txt"}}
    records, report = read_source("cmedqa2_pairs", opts, root)
    everything = _by_kind(records)
    answers = [t for t in records if isinstance(t, Text) and t.role == "answer"]
    assert len({t.id for t in answers}) == 4593 and len(everything["lists"]) == 895 and not report.filters
    # dev.txt line 1 holds the field "...中医""乳癖""范畴..." (csv quoting of 中医"乳癖"范畴)
    assert any('中医"乳癖"范畴' in t.text for t in answers) and not any('""乳癖' in t.text for t in answers)


def test_cepilepsyqa_release_folder(real, shared):
    kinds, report = real["cepilepsyqa"]
    roles = Counter(t.split(":")[1] for t in kinds["texts"])
    assert roles == {"question": 4900, "answer": 4900}
    assert _rows(report) == {"question.csv": 4900, "answer.csv": 4900,
                             "dev_candidates.txt": 49000, "test_candidates.txt": 49000}
    lists = defaultdict(list)
    for c in kinds["lists"]:
        lists[c.split].append(c)
    assert {s: len(v) for s, v in lists.items()} == {"dev": 490, "test": 490, "train": 4900 - 980}
    for c in lists["dev"] + lists["test"]:  # README: 95-100 unique candidates after collapsing, one positive
        assert 95 <= len(c.candidates) <= 100 and len({d for d, _ in c.candidates}) == len(c.candidates)
        assert sum(label for _, label in c.candidates) == 1
    # the repeats, counted independently with the csv module (README: 515 in test; dev has 510)
    for split in ("dev", "test"):
        with open(shared / "cepilepsyqa" / f"{split}_candidates.txt", newline="", encoding="utf-8") as fh:
            pairs = Counter((r["question_id"], r["ans_id"]) for r in csv.DictReader(fh))
        repeats = sum(n - 1 for n in pairs.values())
        assert report.files[f"{split}_candidates.txt"].filtered == repeats
        assert report.files[f"{split}_candidates.txt"].as_dict()["kept"] == 49000 - repeats
    assert report.files["test_candidates.txt"].filtered == 515
    _check_references(kinds)


@pytest.mark.parametrize("name, rows, labelled, unlabelled", [
    ("kuake_qtr", {"KUAKE-QTR_train.json": 24174, "KUAKE-QTR_dev.json": 2913, "KUAKE-QTR_test.json": 5465},
     {"train": 24174, "dev": 2913}, {"test": 5465 - 1}),  # test s4127 has an empty title
    ("kuake_qqr", {"KUAKE-QQR_train.json": 15000, "KUAKE-QQR_dev.json": 1600, "KUAKE-QQR_test.json": 1596},
     {"train": 15000, "dev": 1600 - 1}, {"test": 1596}),  # dev s9 is disputed
    ("chip_sts", {"CHIP-STS_train.json": 16000, "CHIP-STS_dev.json": 4000, "CHIP-STS_test.json": 10000},
     {"train": 16000, "dev": 4000}, {"test": 10000}),
    ("chip2019", {"train.csv": 20000, "dev_id.csv": 10000}, {"train": 20000}, {"dev": 10000}),
    ("cmedqq", {"train.txt": 16071, "dev.txt": 1793, "test.txt": 1935},
     {"train": 16071, "dev": 1793, "test": 1935}, {}),
    ("ncov", {"train.csv": 8747, "dev.csv": 2002}, {"train": 8747, "dev": 2002}, {}),
])
def test_pair_sources_counts(real, name, rows, labelled, unlabelled):
    kinds, report = real[name]
    assert _rows(report) == rows
    assert _per_split(kinds["pairs"], labelled=True) == labelled
    assert _per_split(kinds["pairs"], labelled=False) == unlabelled
    assert not report.rejected and not kinds["lists"]
    _check_references(kinds)


@pytest.mark.parametrize("name, split, labels", [  # label distributions from each PROVENANCE.md
    ("kuake_qtr", "dev", {0: 495, 1: 652, 2: 653, 3: 1113}),
    ("kuake_qqr", "train", {0: 8946, 1: 2603, 2: 3451}),
    ("kuake_qqr", "dev", {0: 1006, 1: 260, 2: 334 - 1}),  # s9 (label 2) dropped
    ("chip_sts", "train", {0: 7989, 1: 8011}),
    ("chip2019", "train", {0: 10000, 1: 10000}),
    ("cmedqq", "test", {0: 976, 1: 959}),
    ("ncov", "train", {0: 5250, 1: 3497}),
])
def test_pair_label_distributions(real, name, split, labels):
    kinds, _ = real[name]
    assert Counter(p.label for p in kinds["pairs"] if p.split == split) == labels


def test_cblue_quirks(real):
    qqr, qqr_report = real["kuake_qqr"]
    assert "kuake_qqr:dev:s9" not in {p.id for p in qqr["pairs"]}
    assert qqr_report.filters["dev:s9"]["rows"] == 1 and "disputed" in qqr_report.filters["dev:s9"]["reason"]
    qtr, qtr_report = real["kuake_qtr"]
    assert qtr_report.filters["test:s4127"]["rows"] == 1
    dev = defaultdict(list)  # README: 1,990 of 2,369 dev queries have a title labelled >= 1
    for p in qtr["pairs"]:
        if p.split == "dev":
            dev[p.text1_id].append(p.label)
    assert len(dev) == 2369 and sum(max(v) >= 1 for v in dev.values()) == 1990
    sts, sts_report = real["chip_sts"]  # PROVENANCE: five categories (one test row misspells 'daibetes')
    assert {p.category for p in sts["pairs"]} == {"diabetes", "hypertension", "hepatitis", "aids", "breast_cancer"}
    assert sts_report.counts["categories_mended"] == {"daibetes": 1}
    chip, _ = real["chip2019"]  # PROVENANCE: diabetes 10,000, the other four 2,500 each (train)
    assert Counter(p.category for p in chip["pairs"] if p.split == "train") == {
        "diabetes": 10000, "hypertension": 2500, "hepatitis": 2500, "aids": 2500, "breast_cancer": 2500}


def test_ncov_category_prefix_is_cut(real, shared):
    kinds, _ = real["ncov"]
    with open(shared / "ncov2019_sim" / "dev.csv", encoding="utf-8") as fh:
        raw = [line.rstrip("\n").split("\t") for line in fh]
    pairs = [p for p in kinds["pairs"] if p.split == "dev"]
    assert len(pairs) == len(raw)
    for p, (q1, q2, _) in zip(pairs, raw):
        category, _, text = q1.partition(":")
        assert p.category == category and kinds["texts"][p.text1_id] == text.strip()
        assert kinds["texts"][p.text2_id] == q2.partition(":")[2].strip()


def test_cmedir_grouped_by_query(real, shared):
    kinds, report = real["cmedir"]
    assert _rows(report) == {"dev.json": 10000, "test.json": 10000}
    assert _per_split(kinds["lists"]) == {"dev": 4298, "test": 4287}  # PROVENANCE unique queries
    test = [c for c in kinds["lists"] if c.split == "test"]
    strong = sum(any(label >= 2 for _, label in c.candidates) for c in test)
    assert abs(strong - 2950) <= 50  # README: "only ~2,950 of 4,287 test queries have a title labelled >= 2"
    assert all(0 <= label <= 4 for c in kinds["lists"] for _, label in c.candidates)
    assert not any(t.startswith(":") for t in kinds["texts"].values())
    assert report.counts["titles_with_stray_colon"] == {"dev": 5000, "test": 5000}
    # independent: each (query, url) judged in the raw file is in that query's list with the same label
    with open(shared / "chineseblue_cmedir" / "test.json", encoding="utf-8") as fh:
        raw = {(row["query"], d["url"]): int(d["label"]) for row in map(json.loads, fh) for d in row["documents"]}
    got = {(kinds["texts"][c.query_id], doc.split(":", 2)[2].split("#")[0]): label
           for c in test for doc, label in c.candidates}
    assert got == raw
    _check_references(kinds)


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
