"""The source readers on the real shared files, their counts checked against the numbers the data README and
each folder's PROVENANCE.md publish (the independent reference)."""
from __future__ import annotations

import csv
import json
from collections import Counter, defaultdict

import pytest
from _sources_helpers import _by_kind, _check_references
from omegaconf import OmegaConf

from care.config import load_config
from care.data.records import Text
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


def _per_split(items, labelled=None):
    return dict(Counter(x.split for x in items if labelled is None or (x.label is not None) == labelled))


def _rows(report):
    return {name: f["rows"] for name, f in report.as_dict()["files"].items()}


# ---- the real files against the published counts ---------------------------------------------------

def test_cmedqa2_pairs_known_defect_filter(real, shared_sources):
    kinds, report = real["cmedqa2_pairs"]
    assert _rows(report) == {"dev.txt": 5475, "test.txt": 6149}
    hist = {split: {int(k): v for k, v in h.items()} for split, h in report.counts["positives_per_question"].items()}
    # the shared data's known defects (docs/data.md, "What the import stage reads"): test 672 none / 112 one /
    # 12 two / 101 with 3-17; dev 677 / 106 / 10; 895 and 897 questions
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
