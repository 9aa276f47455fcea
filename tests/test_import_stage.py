"""The import stage run as the CLI runs it: the real conf/ tree composed by Hydra (care.config.load_config),
outputs written to tmp_path, counts checked against the data README, an unchanged re-run skipped."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from care.config import load_config
from care.data.io import DataError
from data_pipeline import import_stage

# a quick subset that still yields every record kind, a filter and an unlabelled split
LEFT_OUT = ["cepilepsyqa", "kuake_qtr", "chip_sts", "chip2019", "cmedqq", "cmedir"]


def _config(out, *overrides):
    return load_config("data_pipeline", [f"data_dir={out}", "stage=import", *overrides])


def _lines(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _outputs(out):
    d = out / "import"
    return {name: _lines(d / f"{name}.jsonl") for name in ("texts", "pairs", "candidates")}, \
        json.loads((d / "stats.json").read_text(encoding="utf-8"))


def _check_files(files):
    texts, pairs, lists = files["texts"], files["pairs"], files["candidates"]
    assert all(set(t) == {"id", "text", "source", "role"} and t["text"].strip() for t in texts)
    ids = [t["id"] for t in texts]
    assert len(ids) == len(set(ids))  # every text once
    assert all({"id", "source", "split", "text1_id", "text2_id", "label"} <= set(p) for p in pairs)
    assert all(set(c) == {"id", "source", "split", "query_id", "candidates"} for c in lists)
    for name in ("pairs", "candidates"):
        record_ids = [r["id"] for r in files[name]]
        assert len(record_ids) == len(set(record_ids))
    known = set(ids)
    assert all(p["text1_id"] in known and p["text2_id"] in known for p in pairs)
    assert all(c["query_id"] in known and all(d["id"] in known for d in c["candidates"]) for c in lists)


def test_import_through_hydra_and_skip_on_rerun(tmp_path, capsys):
    cfg = _config(tmp_path, *(f"~data.sources.{name}" for name in LEFT_OUT))
    stats = import_stage.run(cfg)
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("cmedqa2_pairs", "kuake_qqr", "ncov"))

    files, on_disk = _outputs(tmp_path)
    assert on_disk == json.loads(json.dumps(stats)) and on_disk["fingerprint"]
    _check_files(files)
    pairs = Counter((p["source"], p["split"], p["label"] is None) for p in files["pairs"])
    assert pairs == {  # README: KUAKE-QQR 15,000 / 1,600 (less disputed s9) / 1,596 unlabelled; nCoV 8,747 / 2,002
        ("kuake_qqr", "train", False): 15000, ("kuake_qqr", "dev", False): 1600 - 1, ("kuake_qqr", "test", True): 1596,
        ("ncov", "train", False): 8747, ("ncov", "dev", False): 2002}
    assert all(p["category"] and ":" not in p["category"] for p in files["pairs"] if p["source"] == "ncov")
    lists = Counter((c["source"], c["split"]) for c in files["candidates"])
    assert lists == {("cmedqa2_pairs", "dev"): 106 + 10, ("cmedqa2_pairs", "test"): 112 + 12}  # README known defects
    qqr = stats["sources"]["kuake_qqr"]
    assert qqr["files"]["KUAKE-QQR_dev.json"] == {"rows": 1600, "kept": 1599, "rejected": 0, "filtered": 1}
    assert qqr["filters"]["dev:s9"]["rows"] == 1 and qqr["rejected"] == []
    assert stats["sources"]["cmedqa2_pairs"]["filters"]["untrusted_positive_count"]["questions"] == 895 - 116 + 897 - 124
    assert stats["outputs"] == {"texts": len(files["texts"]), "pairs": len(files["pairs"]),
                                "candidate_lists": len(files["candidates"])}

    # unchanged inputs, config and code: skipped, nothing rewritten
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "import").iterdir()}
    again = import_stage.run(cfg)
    assert again["skipped"] is True and again["fingerprint"] == stats["fingerprint"]
    assert "skipped" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "import").iterdir()} == mtimes

    # force re-runs; a changed reader option re-runs with its effect
    forced = import_stage.run(_config(tmp_path, *(f"~data.sources.{name}" for name in LEFT_OUT), "force=true"))
    assert "skipped" not in forced and forced["fingerprint"] == stats["fingerprint"]
    wider = import_stage.run(_config(tmp_path, *(f"~data.sources.{name}" for name in LEFT_OUT),
                                     "data.sources.cmedqa2_pairs.max_positives=3"))
    assert "skipped" not in wider and wider["fingerprint"] != stats["fingerprint"]
    hist = wider["sources"]["cmedqa2_pairs"]["counts"]["positives_per_question"]
    assert wider["sources"]["cmedqa2_pairs"]["records"]["candidate_lists"] == {
        split: sum(n for k, n in hist[split].items() if 1 <= int(k) <= 3) for split in ("dev", "test")}


BAD_NCOV = "感冒:头痛\t感冒:头疼\t1\n感冒:头痛\t感冒:发烧\tmaybe\n肺炎:咳嗽\t肺炎:咳嗽怎么办\t0\n"


def _own_data(tmp_path, on_error):
    (tmp_path / "mine").mkdir(exist_ok=True)
    (tmp_path / "mine" / "train.csv").write_text(BAD_NCOV, encoding="utf-8")
    return _config(tmp_path / "out", f"data.root={tmp_path}", f"data.on_error={on_error}", "~data.sources",
                   "+data.sources={mine: {reader: ncov, path: mine, files: {train: train.csv}}}")


def test_on_error_from_config(tmp_path):
    with pytest.raises(DataError, match=r"train\.csv, line 2, field 'label'"):
        import_stage.run(_own_data(tmp_path, "stop"))
    assert not (tmp_path / "out" / "import" / "stats.json").exists()

    stats = import_stage.run(_own_data(tmp_path, "skip"))
    mine = stats["sources"]["mine"]
    # stats.json names no machine path (care.paths.portable): a file outside the roots by its name
    assert mine["rejected"] == [{"file": "train.csv", "line": 2, "field": "label",
                                 "reason": mine["rejected"][0]["reason"]}]
    assert "maybe" in mine["rejected"][0]["reason"]
    assert mine["files"]["train.csv"] == {"rows": 3, "kept": 2, "rejected": 1, "filtered": 0}
    files, _ = _outputs(tmp_path / "out")
    assert [(p["id"], p["label"], p["category"]) for p in files["pairs"]] == [
        ("mine:train:1", 1, "感冒"), ("mine:train:3", 0, "肺炎")]
    assert sorted(t["text"] for t in files["texts"]) == sorted(["头痛", "头疼", "咳嗽", "咳嗽怎么办"])


@pytest.mark.slow
def test_full_import(tmp_path):
    """The whole default data set (about 10 s of CPU on 2 cores; slower when the machine is shared)."""
    stats = import_stage.run(_config(tmp_path))
    files, _ = _outputs(tmp_path)
    _check_files(files)
    assert set(stats["sources"]) == {"cmedqa2_pairs", "cepilepsyqa", *LEFT_OUT, "kuake_qqr", "ncov"}
    assert all(not s["rejected"] for s in stats["sources"].values())
    pairs = Counter(p["source"] for p in files["pairs"])  # README row counts (less the two documented drops)
    assert pairs == {"kuake_qtr": 24174 + 2913 + 5465 - 1, "kuake_qqr": 15000 + 1600 + 1596 - 1,
                     "chip_sts": 16000 + 4000 + 10000, "chip2019": 20000 + 10000, "cmedqq": 16071 + 1793 + 1935,
                     "ncov": 8747 + 2002}
    lists = Counter((c["source"], c["split"]) for c in files["candidates"])
    assert lists == {("cmedqa2_pairs", "dev"): 116, ("cmedqa2_pairs", "test"): 124, ("cepilepsyqa", "dev"): 490,
                     ("cepilepsyqa", "test"): 490, ("cepilepsyqa", "train"): 4900 - 980,
                     ("cmedir", "dev"): 4298, ("cmedir", "test"): 4287}
