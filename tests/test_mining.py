"""Hard-negative mining (data_pipeline/mining.py) on a real subset of cEpilepsyQA and cMedQQ with a tiny
encoder, checked against a brute-force numpy top-K written here from the rules in the module docstring."""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf, open_dict
from transformers import BertConfig, BertModel

from care.config import load_config
from care.data.io import DataError
from care.encoders import build_encoder
from care.models.tiny import chinese_tokenizer
from data_pipeline import mining
from data_pipeline.dedup.stage import ThresholdError

TOP_K = 30


def norm(text: str) -> str:
    """The normalisation mining uses for "same text" (NFKC, lowercase, collapsed whitespace), redone here."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def read_csv(path: Path, header: bool = True, **kw) -> list:
    """Rows of a CSV/TSV file: dicts by the header, or lists without one."""
    with open(path, encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh, **kw) if header else csv.reader(fh, **kw))


@pytest.fixture(scope="module")
def spread_bert(tmp_path_factory) -> Path:
    """A tiny BERT whose CLS cosines spread over ~0.25-0.87 on real text (the default init puts every pair
    near 1.0, which would leave no window to test)."""
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


@functools.cache
def base_config(build_dir: Path, model_dir: Path):
    return load_config("data_pipeline", [
        "model=tiny_bert", f"model.path={model_dir}", "model.max_length=64", f"mine.input_dir={build_dir}",
        f"mine.dedup_clusters={build_dir}/clusters.jsonl", f"mine.top_k={TOP_K}",
        f"mine.cache={build_dir}/embedding-cache"])


def compose(build_dir: Path, out: Path, model_dir: Path, *extra: str):
    """The real config (composed once: Hydra takes ~1 s a call here) with `key=value` overrides."""
    return OmegaConf.merge(base_config(build_dir, model_dir), OmegaConf.from_dotlist([f"out_root={out}", *extra]))


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def window(build_dir, spread_bert) -> tuple[float, float]:
    """A window over the upper middle of this encoder's query-query similarity distribution."""
    cfg = compose(build_dir, build_dir, spread_bert)
    texts = {r["id"]: r["text"] for r in load_rows(build_dir / "texts.jsonl")}
    queries = [texts[e["query_id"]] for e in load_rows(build_dir / "examples.jsonl")]
    q = build_encoder(cfg.model).encode_queries(queries).dense
    sims = (q @ q.T)[np.triu_indices(len(q), 1)]
    return round(float(np.quantile(sims, 0.55)), 3), round(float(np.quantile(sims, 0.97)), 3)


def reference(build_dir: Path, cfg, lo: float, hi: float, similarity: str):
    """Per example: the window negatives a brute-force search finds ({id: score}), ids within 1e-5 of a
    boundary (lo, hi or the k-th neighbour's score, where float differences may flip them), and the ids
    that may never be its negatives."""
    enc = build_encoder(cfg.model)
    texts = {r["id"]: r["text"] for r in load_rows(build_dir / "texts.jsonl")}
    examples = load_rows(build_dir / "examples.jsonl")
    edges = load_rows(build_dir / "clusters.jsonl")
    cluster = {}
    for e in edges:  # the planted chain is one cluster
        members = {e["kept_id"], *e["removed_ids"]}
        for m in list(members):
            members |= cluster.get(m, set())
        for m in members:
            cluster[m] = members
    removed = {r for e in edges for r in e["removed_ids"]}
    out = {}
    for pool in {e["pool"] for e in examples}:
        idx = [i for i, e in enumerate(examples) if e["pool"] == pool]
        ex = [examples[i] for i in idx]
        q = enc.encode_queries([texts[e["query_id"]] for e in ex]).dense
        q /= np.linalg.norm(q, axis=1, keepdims=True)
        if similarity == "question":
            cands, offers = q, [e["pos_ids"] for e in ex]
        else:
            docs = list(dict.fromkeys(p for e in ex for p in e["pos_ids"] if p not in removed))
            cands = enc.encode_documents([texts[d] for d in docs]).dense
            cands /= np.linalg.norm(cands, axis=1, keepdims=True)
            offers = [[d] for d in docs]
        sims = q @ cands.T
        for a, e in enumerate(ex):
            qa = e["query_id"]
            same = {
                b
                for b, f in enumerate(ex)
                if f["query_id"] == qa
                or norm(texts[f["query_id"]]) == norm(texts[qa])
                or (qa in cluster and f["query_id"] in cluster[qa])
            }
            banned = set(removed) | {p for b in same for p in ex[b]["pos_ids"]}
            for p in e["pos_ids"]:
                banned |= cluster.get(p, set())
            banned_text = {norm(texts[t]) for t in banned}
            k = TOP_K + (similarity == "question")
            kth = np.sort(sims[a])[::-1][k - 1]  # the k-th best score: ties there may go either way
            found, fuzzy = {}, set()
            for b in np.argsort(-sims[a], kind="stable"):
                s = float(sims[a, b])
                if s < kth - 1e-5:
                    break
                if similarity == "question" and b in same:
                    continue
                for d in offers[b]:
                    if d in banned or norm(texts[d]) in banned_text:
                        continue
                    if min(abs(s - lo), abs(s - hi), abs(s - kth)) < 1e-5:
                        fuzzy.add(d)
                    elif lo <= s < hi and d not in found:
                        found[d] = s
            out[idx[a]] = {
                "found": found,
                "fuzzy": fuzzy,
                "banned": banned,
                "pool_texts": {p for f in ex for p in f["pos_ids"]},
            }
    return examples, texts, out


@pytest.mark.parametrize("similarity", ["question", "document"])
def test_mined_negatives_match_brute_force(build_dir, spread_bert, window, tmp_path, similarity):
    lo, hi = window
    cfg = compose(
        build_dir, tmp_path, spread_bert, f"mine.window=[{lo},{hi}]", f"mine.similarity={similarity}"
    )
    stats = mining.run(cfg)
    rows = load_rows(tmp_path / "train" / "train.jsonl")
    examples, texts, ref = reference(build_dir, cfg, lo, hi, similarity)
    assert [r["query_id"] for r in rows] == [e["query_id"] for e in examples]
    surely_short = maybe_short = 0
    for i, r in enumerate(rows):
        n_window = len(r["neg_ids"]) - r["fallback"]
        window_ids = r["neg_ids"][:n_window]
        want = ref[i]
        # The window part is exactly the brute-force set (up to float ties at a boundary), most similar first.
        assert set(window_ids) - want["fuzzy"] == set(want["found"]) - want["fuzzy"], f"example {i}"
        for d, s in zip(window_ids, r["neg_scores"]):
            assert lo <= s < hi
            if d in want["found"]:
                assert s == pytest.approx(want["found"][d], abs=1e-5)
        assert r["neg_scores"][:n_window] == sorted(r["neg_scores"][:n_window], reverse=True)
        # Never a positive, a same-question answer, a positive's cluster member or a dedup-removed text;
        # always a text of the example's own pool.
        assert not set(r["neg_ids"]) & want["banned"]
        assert not {norm(texts[d]) for d in r["neg_ids"]} & {norm(texts[p]) for p in want["banned"]}
        assert set(r["neg_ids"]) <= want["pool_texts"]
        assert len(set(r["neg_ids"])) == len(r["neg_ids"])
        assert all(s < hi for s in r["neg_scores"])  # the fallback never crosses hi either
        if len(want["found"]) + len(want["fuzzy"]) < 9:  # short: filled up to 9 (the pools are big enough)
            surely_short += 1
            assert len(r["neg_ids"]) == 9 and r["fallback"] == 9 - n_window
        elif len(want["found"]) >= 9:
            assert r["fallback"] == 0
        else:
            maybe_short += 1
    assert surely_short <= stats["examples_short_before_fallback"] <= surely_short + maybe_short
    assert surely_short > 0  # the window leaves some examples short, so the fallback was exercised
    # The planted cases by name: the duplicate question's answer is never example 0's negative, and Y (in
    # P0's cluster) never example 0's; P0 and Z, removed by dedup, are nobody's.
    p0, y = examples[0]["pos_ids"][0], examples[7]["pos_ids"][0]
    dup = next(r for r in rows if r["query_id"] == "dup:question")
    assert dup["pos_ids"][0] not in rows[0]["neg_ids"]
    assert y not in rows[0]["neg_ids"]
    assert not any({p0, "dedup:Z"} & set(r["neg_ids"]) for r in rows)
    assert stats["window"] == {
        "lo": lo,
        "hi": hi,
        "source": "explicit override (mine.window)",
        "calibrated_for": None,
    }
    assert stats["encoder"]["fingerprint"] == build_encoder(cfg.model).fingerprint


def test_fallback_fills_from_below_then_random(build_dir, spread_bert, window, tmp_path):
    """A window so narrow that most examples need the fallback: nearest below lo first, flagged."""
    hi = window[1]
    cfg = compose(
        build_dir, tmp_path, spread_bert, f"mine.window=[{hi - 0.01},{hi}]", "mine.fallback=[below]"
    )
    stats = mining.run(cfg)
    rows = load_rows(tmp_path / "train" / "train.jsonl")
    assert stats["examples_with_fallback"] > len(rows) // 2
    for r in rows:
        n_window = len(r["neg_ids"]) - r["fallback"]
        below = r["neg_scores"][n_window:]
        assert all(s < hi - 0.01 for s in below) and below == sorted(below, reverse=True)
    cfg = compose(build_dir, tmp_path, spread_bert, "mine.window=[0.999,0.9999]", "mine.fallback=[random]")
    stats = mining.run(cfg)  # nothing in the window and no `below`: random candidates under hi
    rows = load_rows(tmp_path / "train" / "train.jsonl")
    assert stats["examples_short_after_fallback"] == 0
    for r in rows:
        n_window = len(r["neg_ids"]) - r["fallback"]
        assert len(r["neg_ids"]) == 9 and all(0.999 <= s < 0.9999 for s in r["neg_scores"][:n_window])
        assert all(s < 0.9999 for s in r["neg_scores"][n_window:])
    assert sum(r["fallback"] for r in rows) > 8 * len(rows)


def test_stage_outputs_and_rerun_skipped(build_dir, spread_bert, window, tmp_path):
    lo, hi = window
    cfg = compose(build_dir, tmp_path, spread_bert, f"mine.window=[{lo},{hi}]")
    first = mining.run(cfg)
    out = tmp_path / "train"
    assert {p.name for p in out.iterdir()} == {
        "train.jsonl",
        "texts.jsonl",
        "flag_train.jsonl",
        "leakage.json",
        "stats.json",
        "neg_similarity.png",
    }
    assert (out / "neg_similarity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    store = {r["id"] for r in load_rows(out / "texts.jsonl")}
    rows = load_rows(out / "train.jsonl")
    assert {t for r in rows for t in [r["query_id"], *r["pos_ids"], *r["neg_ids"]]} == store
    assert len(load_rows(out / "flag_train.jsonl")) == len(rows)
    again = mining.run(cfg)
    assert again.get("skipped") and again["fingerprint"] == first["fingerprint"]
    assert (
        mining.run(compose(build_dir, tmp_path, spread_bert, f"mine.window=[{lo},{hi + 0.01}]")).get(
            "skipped"
        )
        is None
    )


def test_window_and_thresholds_refused(build_dir, spread_bert, tmp_path):
    with pytest.raises(DataError, match=r"lo >= hi"):
        mining.run(compose(build_dir, tmp_path, spread_bert, "mine.window=[0.8,0.8]"))
    with pytest.raises(ThresholdError, match="no thresholds.mine_lo"):
        mining.run(compose(build_dir, tmp_path, spread_bert))
    cfg = compose(build_dir, tmp_path, spread_bert)
    with open_dict(cfg):
        cfg.model.thresholds = {"mine_lo": 0.5, "mine_hi": 0.8, "calibrated_for": "bge_m3"}
    with pytest.raises(ThresholdError, match="calibrated_for is 'bge_m3'"):
        mining.run(cfg)
    cfg.model.thresholds.calibrated_for = "tiny_bert"
    assert mining.mining_window(cfg) == {
        "lo": 0.5,
        "hi": 0.8,
        "source": "model.thresholds",
        "calibrated_for": "tiny_bert",
    }
    with pytest.raises(ValueError, match="mine.similarity"):
        mining.run(
            compose(build_dir, tmp_path, spread_bert, "mine.window=[0.5,0.8]", "mine.similarity=answer")
        )


def test_bad_inputs(build_dir, spread_bert, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("texts.jsonl", "leakage.json"):
        (bad / name).write_bytes((build_dir / name).read_bytes())
    ok = (build_dir / "examples.jsonl").read_text(encoding="utf-8").splitlines()
    cases = {
        "unknown": (
            ok[:3] + [json.dumps({"query_id": "nope", "pos_ids": ["x"], "pool": "answers"})],
            r"examples.jsonl, line 4, field 'query_id': unknown text id 'nope'",
        ),
        "empty": ([], r"no training examples"),
        "nopos": (
            [json.dumps({"query_id": json.loads(ok[0])["query_id"], "pos_ids": [], "pool": "answers"})],
            r"line 1, field 'pos_ids': an example with no positive",
        ),
    }
    for lines, message in cases.values():
        (bad / "examples.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        with pytest.raises(DataError, match=message):
            mining.run(compose(bad, tmp_path, spread_bert, "mine.window=[0.5,0.8]", f"mine.input_dir={bad}"))
    (bad / "examples.jsonl").write_text("\n".join(ok) + "\n", encoding="utf-8")
    dup = (build_dir / "texts.jsonl").read_text(encoding="utf-8").splitlines()
    (bad / "texts.jsonl").write_text("\n".join(dup + dup[:1]) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"texts.jsonl, line {len(dup) + 1}, field 'id': duplicate id"):
        mining.run(compose(bad, tmp_path, spread_bert, "mine.window=[0.5,0.8]", f"mine.input_dir={bad}"))
    assert not (tmp_path / "train").exists()  # nothing written by a refused run
