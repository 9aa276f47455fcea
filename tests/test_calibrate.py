"""Threshold calibration: interval binning and rates against plain-Python references, the suggestion rule,
export -> label -> report round trip against brute-force cosine, label errors, the LLM judge against a
local fake OpenAI-compatible server, and the human-labelled-pairs mode against an independent reader."""
from __future__ import annotations

import csv
import functools
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest

from care.config import load_config
from care.data.io import DataError
from care.encoders import build_encoder
from data_pipeline.dedup import calibrate, calibrate_labels, calibrate_rates
from data_pipeline.planted import shared_texts

EDGES = [0.70, 0.75, 0.80, 0.85, 0.90, 0.95, 1.0]


def ref_interval(c: float, edges) -> int:
    for k in range(len(edges) - 1):
        last = k == len(edges) - 2
        if edges[k] <= c < edges[k + 1] or (last and c == edges[k + 1]):
            return k
    return -1


def test_intervals_and_rates_match_plain_python():
    rng = np.random.default_rng(0)
    cos = np.concatenate([rng.uniform(0.6, 1.0, 2000), EDGES])     # edges themselves included
    labels = rng.integers(0, 2, len(cos))
    assert calibrate_rates.interval_of(cos, EDGES).tolist() == [ref_interval(c, EDGES) for c in cos]
    table = calibrate_rates.rate_table(cos, labels, EDGES)
    for k, row in enumerate(table):
        sel = [lab for c, lab in zip(cos, labels) if ref_interval(c, EDGES) == k]
        assert (row["pairs"], row["positives"]) == (len(sel), sum(sel))
        assert row["rate"] == pytest.approx(sum(sel) / len(sel), abs=1e-4)
    assert table[-1]["interval"] == "[0.95, 1]" and table[0]["interval"] == "[0.7, 0.75)"
    with pytest.raises(ValueError, match="increasing"):
        calibrate_rates.interval_of([0.5], [0.8, 0.7])


def _table(rates):
    return [{"lo": lo, "rate": r} for lo, r in zip(EDGES, rates)]


def test_suggestion_rule():
    random_cos = np.linspace(0.50, 0.70, 201)                      # its 95% quantile is 0.69
    got = calibrate_rates.suggest(_table([0.1, 0.3, 0.6, 0.4, 0.7, 0.9]), random_cos)
    assert got == {"dedup_cosine": 0.90, "mine_lo": 0.69, "mine_hi": 0.90}   # 0.4 at [0.85,0.90) breaks the run
    got = calibrate_rates.suggest(_table([0.1, 0.3, 0.55, None, 0.7, 0.9]), random_cos)
    assert got["dedup_cosine"] == 0.80                              # empty intervals do not break it
    with pytest.raises(ValueError, match="no interval"):
        calibrate_rates.suggest(_table([0.1, 0.1, 0.1, 0.2, 0.3, 0.4]), random_cos)
    with pytest.raises(ValueError, match="empty"):
        calibrate_rates.suggest(_table([0.1, 0.3, 0.6, 0.4, 0.7, 0.9]), np.full(10, 0.95))


@functools.cache
def _dedup_overrides() -> tuple[str, ...]:
    return () if "dedup" in load_config("data_pipeline") else ("+pipeline=dedup",)


def _cfg(tmp_path, tiny_bert_dir, *overrides):
    # mean pooling: a random-weight tiny BERT's CLS vectors all have cosine ~0.99998, mean-pooled ones spread
    return load_config("data_pipeline", [*_dedup_overrides(), "model=tiny_bert", f"model.path={tiny_bert_dir}",
                                         "model.pooling=mean",
                                         f"data_dir={tmp_path}", f"dedup.semantic.cache={tmp_path / 'cache'}",
                                         *overrides])


def test_export_label_report_roundtrip(tmp_path, tiny_bert_dir):
    texts = random.Random(0).sample([t for t in shared_texts() if len(t) < 60], 120)
    store = tmp_path / "store.jsonl"
    store.write_text("".join(json.dumps({"id": f"s{i}", "text": t}, ensure_ascii=False) + "\n"
                             for i, t in enumerate(texts)), encoding="utf-8")
    enc = build_encoder(_cfg(tmp_path, tiny_bert_dir).model)
    v = enc.encode_documents(texts).dense.astype(np.float64)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    full = v @ v.T
    np.fill_diagonal(full, -np.inf)
    top = np.argsort(-full, axis=1)[:, :3]
    edges = [float(x) for x in np.quantile(full[np.isfinite(full)], [0.0, 0.9, 0.99])] + [1.0]
    edges_arg = "[" + ",".join(f"{e:.6f}" for e in edges) + "]"
    common = [f"++input={store}", f"dedup.calibrate.edges={edges_arg}", "dedup.calibrate.neighbours=3"]
    result = calibrate.run(_cfg(tmp_path, tiny_bert_dir, *common, "dedup.calibrate.mode=export",
                                "dedup.calibrate.per_interval=7"))
    rows = [json.loads(x) for x in Path(result["file"]).read_text(encoding="utf-8").splitlines()]
    pos = {f"s{i}": i for i in range(len(texts))}
    assert rows and all(r["label"] is None for r in rows)
    counts = {}
    for r in rows:
        a, b = pos[r["id1"]], pos[r["id2"]]
        assert (r["text1"], r["text2"]) == (texts[a], texts[b])
        assert r["cosine"] == pytest.approx(full[a, b], abs=1e-5)
        assert b in top[a] or a in top[b]                    # a nearest-neighbour pair
        k = ref_interval(r["cosine"], edges)
        assert r["interval"] == calibrate_rates.interval_name(edges, k)
        counts[k] = counts.get(k, 0) + 1
    assert max(counts.values()) <= 7 and len(rows) == len({(r["id1"], r["id2"]) for r in rows})

    # a person labels them (here: a rule), then the report reads the labels back
    for r in rows:
        r["label"] = int(r["cosine"] >= edges[2])
    rows[0]["label"] = None                                  # one left unlabelled
    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    rep = calibrate.run(_cfg(tmp_path, tiny_bert_dir, *common, "dedup.calibrate.mode=report",
                             f"dedup.calibrate.labels={labelled}"))
    assert rep["unlabelled"] == 1 and rep["labelled"] == len(rows) - 1
    for k, row in enumerate(rep["table"]):
        sel = [r["label"] for r in rows[1:] if ref_interval(r["cosine"], edges) == k]
        assert row["pairs"] == len(sel) and row["positives"] == sum(sel)
    out = tmp_path / "calibrate" / "tiny_bert"
    assert json.loads((out / "calibration.json").read_text())["mode"] == "report"
    assert "duplicate rate" in (out / "table.txt").read_text()


def test_bad_label_names_line_and_field(tmp_path):
    f = tmp_path / "l.jsonl"
    f.write_text('{"cosine": 0.9, "label": 1}\n{"cosine": 0.8, "label": "maybe"}\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        calibrate_labels.read_labels(f)
    assert (e.value.line, e.value.field) == (2, "label") and str(f) in str(e.value)
    f.write_text('{"cosine": "high", "label": 1}\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 1, field 'cosine'"):
        calibrate_labels.read_labels(f)


def test_judge_against_fake_openai_endpoint(tmp_path, tiny_bert_dir, monkeypatch):
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("Authorization"), body["model"]))
            prompt = body["messages"][0]["content"]
            t1 = prompt.split("文本1: ")[1].split("\n")[0]
            t2 = prompt.split("文本2: ")[1]
            answer = "Yes." if t1 == t2 else "no"
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rows = [{"interval": "x", "cosine": c, "id1": "a", "id2": "b", "text1": t1, "text2": t2, "label": None}
                for c, t1, t2 in [(0.99, "头痛", "头痛"), (0.96, "头痛", "发热"), (0.72, "咳嗽", "咳嗽")]]
        f = tmp_path / "to_label.jsonl"
        f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        monkeypatch.setenv("JUDGE_KEY", "sekrit")
        res = calibrate.run(_cfg(tmp_path, tiny_bert_dir, "dedup.calibrate.mode=judge", f"dedup.calibrate.labels={f}",
                                 "dedup.calibrate.edges=[0.7,0.75,0.95,1.0]",
                                 f"dedup.calibrate.judge.base_url=http://127.0.0.1:{server.server_port}/v1",
                                 "dedup.calibrate.judge.model=judge-model", "dedup.calibrate.judge.api_key_env=JUDGE_KEY"))
    finally:
        server.shutdown()
    assert seen[0] == ("/v1/chat/completions", "Bearer sekrit", "judge-model") and len(seen) == 3
    judged_file = tmp_path / "calibrate" / "tiny_bert" / "judged.jsonl"
    judged = [json.loads(x) for x in judged_file.read_text(encoding="utf-8").splitlines()]
    assert [r["label"] for r in judged] == [1, 0, 1]
    by = {r["interval"]: r for r in res["table"]}
    assert by["[0.95, 1]"]["rate"] == 0.5 and by["[0.7, 0.75)"]["rate"] == 1.0


def test_pairs_mode_on_human_labels(tmp_path, tiny_bert_dir, shared):
    overrides = ["dedup.calibrate.mode=pairs", "dedup.calibrate.pairs_limit=150",
                 "~dedup.calibrate.pair_sources.chip_sts", "~dedup.calibrate.pair_sources.kuake_qqr",
                 "dedup.calibrate.edges=[-1.0,0.9,0.94,0.96,1.0]"]
    cfg = _cfg(tmp_path, tiny_bert_dir, *overrides)
    pairs, labels, names = calibrate_labels.labelled_pairs(cfg)
    # independent reader of the cMedQQ TSV (label \t q1 \t q2)
    with open(shared / "chineseblue_cmedqq" / "train.txt", encoding="utf-8", newline="") as fh:
        ref = [(r[1].strip(), r[2].strip(), int(r[0])) for r in csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)]
    assert len(pairs) == len(ref) == 16071 and set(names) == {"cmedqq"}
    assert sum(labels) == sum(r[2] for r in ref)
    assert set(zip(pairs, labels)) == {((a, b), lab) for a, b, lab in ref}

    res = calibrate.run(cfg)
    assert res["pairs"] == 150 and sum(r["pairs"] for r in res["table"]) + res["below_first_edge"] == 150
    # re-derive the table from scratch: same sample, own cosines
    pick = sorted(random.Random(cfg.dedup.calibrate.seed).sample(range(len(pairs)), 150))
    enc = build_encoder(cfg.model)
    a = enc.encode_documents([pairs[i][0] for i in pick]).dense
    b = enc.encode_documents([pairs[i][1] for i in pick]).dense
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    edges = list(cfg.dedup.calibrate.edges)
    for k, row in enumerate(res["table"]):
        sel = [labels[i] for i, c in zip(pick, cos) if ref_interval(c, edges) == k]
        assert row["pairs"] == len(sel) and row["positives"] == sum(sel)
    if res["suggested_thresholds"]:
        cut = res["suggested_thresholds"]["dedup_cosine"]
        assert all(r["rate"] >= 0.5 for r in res["table"] if r["lo"] >= cut and r["rate"] is not None)
        assert res["suggested_thresholds"]["calibrated_for"] == "tiny_bert"
    else:
        assert res["no_suggestion_because"]


def _candidate_lists(root: Path, texts: list[str], lists: int = 12, per_list: int = 6) -> list[tuple]:
    """An import stage's texts.jsonl and candidates.jsonl: `lists` dev lists of a query and `per_list` real
    candidate texts, the first relevant (and one train list, which qa_sources leaves out)."""
    (root / "import").mkdir(parents=True)
    store, rows, truth = {}, [], []
    for k in range(lists + 1):
        q, *cands = texts[k * (per_list + 1):(k + 1) * (per_list + 1)]
        store[f"q{k}"] = q
        for j, c in enumerate(cands):
            store[f"a{k}.{j}"] = c
            if k < lists:
                truth.append((q, c, int(j == 0)))
        rows.append({"id": f"l{k}", "source": "cepilepsyqa", "split": "dev" if k < lists else "train",
                     "query_id": f"q{k}", "candidates": [{"id": f"a{k}.{j}", "label": int(j == 0)}
                                                         for j in range(len(cands))]})
    for name, items in (("texts", [{"id": i, "text": t} for i, t in store.items()]), ("candidates", rows)):
        (root / "import" / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items),
                                                       encoding="utf-8")
    return truth


def test_qa_mode_on_labelled_candidate_lists(tmp_path, tiny_bert_dir):
    """mode=qa: the document-mode window from labelled (question, candidate answer) lists, each pair's cosine
    query side vs document side, binned against a brute-force re-derivation; keys mine_doc_lo / mine_doc_hi."""
    texts = random.Random(1).sample([t for t in shared_texts() if len(t) < 60], 13 * 7)
    truth = _candidate_lists(tmp_path, texts)
    cfg = _cfg(tmp_path, tiny_bert_dir, "dedup.calibrate.mode=qa", "dedup.calibrate.edges=[-1.0,0.5,0.8,0.9,1.0]")
    res = calibrate.run(cfg)
    assert res["pairs"] == len(truth) == 12 * 6 and res["lists"] == 12
    enc = build_encoder(cfg.model)
    q = enc.encode_queries([t[0] for t in truth]).dense
    d = enc.encode_documents([t[1] for t in truth]).dense
    cos = (q * d).sum(1) / np.linalg.norm(q, axis=1) / np.linalg.norm(d, axis=1)
    for k, row in enumerate(res["table"]):
        sel = [t[2] for t, c in zip(truth, cos) if ref_interval(c, list(cfg.dedup.calibrate.edges)) == k]
        assert row["pairs"] == len(sel) and row["positives"] == sum(sel)
    th = res["suggested_thresholds"]
    if th:
        assert set(th) == {"mine_doc_lo", "mine_doc_hi", "how_doc"} and th["mine_doc_lo"] < th["mine_doc_hi"]
    else:
        assert res["no_suggestion_because"]
    with pytest.raises(DataError, match="no candidate list"):
        calibrate.run(_cfg(tmp_path, tiny_bert_dir, "dedup.calibrate.mode=qa",
                           "~dedup.calibrate.qa_sources.cepilepsyqa"))
