"""Shared fixtures.  Tests run with no network, no GPU and wandb disabled."""
from __future__ import annotations

import csv
import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

import care  # noqa: F401  (registers config resolvers)
from care.paths import shared_data


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy 2-core machine OpenMP's spinning threads
    made their tests ~10x slower.  Use per module (`pytestmark = pytest.mark.usefixtures("one_thread")`);
    the thread count is restored afterwards for the other test modules of the process."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shared():
    root = shared_data()
    if not root.exists():
        pytest.fail(f"shared data not found at {root}; set CARE_SHARED_DATA")
    return root


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A saved tiny BERT folder (real bert-base-chinese vocabulary, random weights)."""
    from care.models.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-bert"), "bert")


# ---- evaluation tests (test_evaluation_runners, test_embedding_cache, test_benchmarks) ---------------

@pytest.fixture(scope="module")
def samples(shared, tmp_path_factory):
    """A BEIR folder (12 KUAKE-QTR dev queries, their titles + 40 train titles, graded qrels), a reranking file
    (cMedIR test, label >= 2 positive) and an STS file (KUAKE-QQR dev), all small."""
    from _evaluation_helpers import kuake_qtr_beir

    from care.data.io import write_jsonl

    tmp = tmp_path_factory.mktemp("tasks")
    retrieval, corpus, queries, qrels = kuake_qtr_beir(shared, tmp / "retrieval", 12, 40)

    rows, groups = [], {}
    for line in (shared / "chineseblue_cmedir" / "test.json").read_text(encoding="utf-8").splitlines()[:120]:
        r = json.loads(line)
        for d in r["documents"]:
            groups.setdefault(r["query"], {})[d["title"].lstrip(":")] = int(d["label"])
    for query, judged in groups.items():
        pos = [t for t, g in judged.items() if g >= 2]
        neg = [t for t, g in judged.items() if g < 2]
        if pos and neg:
            rows.append({"query": query, "positive": pos, "negative": neg})
    reranking = tmp / "rerank.jsonl"
    write_jsonl(reranking, rows[:15])

    qqr = json.loads((shared / "cblue_kuake_qqr" / "KUAKE-QQR_dev.json").read_text(encoding="utf-8"))
    sts = tmp / "sts.jsonl"
    write_jsonl(sts, ({"sentence1": r["query1"], "sentence2": r["query2"], "score": int(r["label"])}
                      for r in qqr[10:50]))
    return {"retrieval": retrieval, "reranking": reranking, "sts": sts, "qrels": qrels, "corpus": corpus,
            "queries": queries}


# ---- build and leakage tests (test_build, test_leakage) ----------------------------------------------

@pytest.fixture(scope="module")
def import_dir(tmp_path_factory, shared) -> Path:
    """cMedQA2 pairs dev + test (trusted questions, 1-2 positives, as the import stage keeps them) with one
    planted near duplicate; KUAKE-QQR train + dev, plus a dev query planted as a training positive; KUAKE-QTR
    train + dev, plus a dev pair planted in train."""
    from _build_helpers import KUAKE, NEAR, jaccard, norm, tid

    out = tmp_path_factory.mktemp("import")
    texts, pairs, lists = {}, [], []

    def text(source, role, split, value):
        key = tid(source, role, split, value)
        texts[key] = {"id": key, "text": value, "source": source, "role": role}
        return key

    groups = {}
    for split in ("dev", "test"):
        grouped = defaultdict(list)
        with open(shared / "chineseblue_cmedqa2_pairs" / f"{split}.txt", encoding="utf-8", newline="") as fh:
            rows = list(csv.reader(fh, delimiter="\t"))
        for label, q, a in rows:
            grouped[q.strip()].append((a.strip(), int(label)))
        groups[split] = {q: c for q, c in grouped.items() if 1 <= sum(lab for _, lab in c) <= 2}
    test_only = [q for q in groups["test"] if q not in groups["dev"] and len(norm(q)) >= 20]
    planted = NEAR + test_only[0]
    assert jaccard(norm(planted), norm(test_only[0])) >= 0.8  # a near duplicate by the rule's own measure
    groups["dev"][planted] = groups["dev"][next(iter(groups["dev"]))]
    for split, grouped in groups.items():
        for q, cands in grouped.items():
            qid = text("cmedqa2_pairs", "question", split, q)
            lists.append(
                {
                    "id": f"cmedqa2_pairs:{split}:{qid}",
                    "source": "cmedqa2_pairs",
                    "split": split,
                    "query_id": qid,
                    "candidates": [
                        {"id": text("cmedqa2_pairs", "answer", split, a), "label": lab} for a, lab in cands
                    ],
                }
            )
    for source, folder, (f1, f2), roles in KUAKE:
        for split, limit in (("train", 2000), ("dev", 300)):
            for row in json.loads((shared / f"{folder}_{split}.json").read_text(encoding="utf-8"))[:limit]:
                if source == "kuake_qqr" and split == "dev" and row["id"] == "s9":
                    continue
                pairs.append(
                    {
                        "id": f"{source}:{split}:{row['id']}",
                        "source": source,
                        "split": split,
                        "text1_id": text(source, roles[0], split, row[f1]),
                        "text2_id": text(source, roles[1], split, row[f2]),
                        "label": int(row["label"]),
                    }
                )
    # A KUAKE-QTR dev (query, relevant title) pair planted as a training pair: a relevant-pair leak.
    dev = next(p for p in pairs if p["source"] == "kuake_qtr" and p["split"] == "dev" and p["label"] == 3)
    pairs.append(
        {
            **dev,
            "id": "kuake_qtr:train:planted",
            "split": "train",
            "text1_id": text("kuake_qtr", "query", "train", texts[dev["text1_id"]]["text"]),
            "text2_id": text("kuake_qtr", "title", "train", texts[dev["text2_id"]]["text"]),
        }
    )
    # A KUAKE-QQR dev query planted as the paraphrase (the positive) of a training query: a text leak.
    train = next(p for p in pairs if p["source"] == "kuake_qqr" and p["split"] == "train" and p["label"] == 2)
    dev = next(p for p in pairs if p["source"] == "kuake_qqr" and p["split"] == "dev")
    pairs.append(
        {
            **train,
            "id": "kuake_qqr:train:planted",
            "text2_id": text("kuake_qqr", "query", "train", texts[dev["text1_id"]]["text"]),
        }
    )
    for name, rows in (("texts", texts.values()), ("pairs", pairs), ("candidates", lists)):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return out


# ---- mining tests (test_mining, test_mining_stage) ----------------------------------------------------

@pytest.fixture(scope="module")
def spread_bert(tmp_path_factory) -> Path:
    """A tiny BERT whose CLS cosines spread over ~0.25-0.87 on real text (the default init puts every pair
    near 1.0, which would leave no window to test)."""
    import torch
    from transformers import BertConfig, BertModel

    from care.models.tiny import chinese_tokenizer

    tok = chinese_tokenizer()
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        initializer_range=0.5,
    )
    out = tmp_path_factory.mktemp("spread-bert")
    BertModel(cfg, add_pooling_layer=False).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory, shared) -> Path:
    """The build stage's files for a real subset: 100 cEpilepsyQA train questions -> their answers (pool
    answers) and 60 cMedQQ paraphrase pairs (pool questions), plus planted cases:
    - "dup:question": a second example asking example 0's question (another id), another real answer;
    - example 1 gets a second positive (another question's answer);
    - examples 60-79 get a second positive each: a copy of example 10-29's answer (a leading space);
    - a dedup chain: exact kept P0 (example 0's answer) and removed Z; MinHash kept Y (example 7's answer)
      and removed P0.  So {Y, P0, Z} is one cluster; P0 and Z were removed by dedup."""
    from _mining_helpers import read_csv

    out = tmp_path_factory.mktemp("build")
    folder = shared / "cepilepsyqa"
    questions = {r["question_id"]: r["content"] for r in read_csv(folder / "question.csv")}
    answers = read_csv(folder / "answer.csv")
    held = {r["question_id"] for s in ("dev", "test") for r in read_csv(folder / f"{s}_candidates.txt")}
    train = [a for a in answers if a["question_id"] not in held][:106]
    texts, examples = {}, []
    for a in train[:100]:
        q, d = f"cepilepsyqa:question:{a['question_id']}", f"cepilepsyqa:answer:{a['ans_id']}"
        texts[q], texts[d] = questions[a["question_id"]], a["content"]
        examples.append({"query_id": q, "pos_ids": [d], "rule": "cepilepsyqa", "pool": "answers"})
    spare = [f"cepilepsyqa:answer:{a['ans_id']}" for a in train[100:]]
    for a in train[100:]:
        texts[f"cepilepsyqa:answer:{a['ans_id']}"] = a["content"]
    texts["dup:question"] = texts[examples[0]["query_id"]] + " "  # same question after normalisation
    examples.append({"query_id": "dup:question", "pos_ids": [spare[0]], "rule": "planted", "pool": "answers"})
    examples[1]["pos_ids"].append(spare[1])
    # Copies of example k's answer (equal after normalisation) answering example k + 50.
    for k in range(10, 30):
        texts[f"copy:{k}"] = " " + texts[examples[k]["pos_ids"][0]]
        examples[k + 50]["pos_ids"].append(f"copy:{k}")
    rows = read_csv(shared / "chineseblue_cmedqq" / "train.txt", header=False, delimiter="\t")
    for label, q1, q2 in [r for r in rows if r[0] == "1"][:60]:
        i1, i2 = (f"cmedqq:query:{hashlib.md5(t.encode()).hexdigest()[:12]}" for t in (q1, q2))
        texts[i1], texts[i2] = q1, q2
        examples.append({"query_id": i1, "pos_ids": [i2], "rule": "cmedqq", "pool": "questions"})
    p0, y = examples[0]["pos_ids"][0], examples[7]["pos_ids"][0]
    texts["dedup:Z"] = texts[p0] + "。"
    with open(out / "texts.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"id": k, "text": v}, ensure_ascii=False) + "\n" for k, v in texts.items())
    with open(out / "examples.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in examples)
    (out / "leakage.json").write_text("{}", encoding="utf-8")
    with open(out / "clusters.jsonl", "w", encoding="utf-8") as fh:
        fh.write(json.dumps({"stage": "exact", "kept_id": p0, "removed_ids": ["dedup:Z"]}) + "\n")
        fh.write(json.dumps({"stage": "minhash", "kept_id": y, "removed_ids": [p0]}) + "\n")
    return out


@pytest.fixture(scope="module")
def window(build_dir, spread_bert) -> tuple[float, float]:
    """A window over the upper middle of this encoder's query-query similarity distribution."""
    import numpy as np
    from _mining_helpers import compose, load_rows

    from care.encoders import build_encoder

    cfg = compose(build_dir, build_dir, spread_bert)
    texts = {r["id"]: r["text"] for r in load_rows(build_dir / "texts.jsonl")}
    queries = [texts[e["query_id"]] for e in load_rows(build_dir / "examples.jsonl")]
    q = build_encoder(cfg.model).encode_queries(queries).dense
    sims = (q @ q.T)[np.triu_indices(len(q), 1)]
    return round(float(np.quantile(sims, 0.55)), 3), round(float(np.quantile(sims, 0.97)), 3)
