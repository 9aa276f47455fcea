"""Where the labels of threshold calibration come from (calibrate.py runs the modes that use them).

- mode=export / report: nearest-neighbour pairs sampled per cosine interval for a person to label
  (`export_pairs`), and the labelled file read back (`read_labels`);
- mode=judge: an LLM behind an OpenAI-compatible chat endpoint labels them instead (`judge_label`);
- mode=pairs: human-labelled paraphrase pairs of the shared data, through the import stage's source
  readers (`labelled_pairs`);
- mode=qa: the import stage's labelled candidate-answer lists (`labelled_answers`).
No encoder here: calibrate.py encodes the texts and calibrate_rates.py does the maths.
"""
from __future__ import annotations

import json
import os
import random
import urllib.request
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from care.data.io import DataError, read_jsonl, read_jsonl_numbered, read_text_store
from data_pipeline.dedup.calibrate_rates import interval_name, interval_of


def export_pairs(ids: list[str], texts: list[str], vectors: np.ndarray, edges, per_interval: int,
                 neighbours: int, seed: int) -> list[dict]:
    """Each text's `neighbours` nearest neighbours (FAISS top-k, never N x N), unique pairs binned by
    cosine, up to `per_interval` sampled from each interval, label left empty (null)."""
    from care.retrieval.index import flat_index, unit_rows

    x = unit_rows(vectors)
    index = flat_index(x)
    D, I = index.search(x, min(neighbours + 1, len(x)))
    q = np.repeat(np.arange(len(x)), I.shape[1])
    i, d = I.ravel(), D.ravel()
    keep = (i >= 0) & (i != q)
    a, b = np.minimum(q[keep], i[keep]), np.maximum(q[keep], i[keep])
    pairs = {(int(u), int(v)): float(c) for u, v, c in zip(a, b, d[keep])}
    keys = sorted(pairs)
    k = interval_of([pairs[p] for p in keys], edges)
    rng = random.Random(seed)
    out = []
    for j in range(len(edges) - 1):
        members = [p for p, kk in zip(keys, k) if kk == j]
        for u, v in sorted(rng.sample(members, min(per_interval, len(members)))):
            out.append({"interval": interval_name(edges, j), "cosine": round(pairs[(u, v)], 6), "id1": ids[u],
                        "id2": ids[v], "text1": texts[u], "text2": texts[v], "label": None})
    return out


def duplicate_label(value, path, line: int):
    """A hand label of a sampled pair: 1 (duplicate), 0 (not) or None (not labelled yet)."""
    if value is None:
        return None
    if isinstance(value, bool) or value in (0, 1):
        return int(value)
    raise DataError(path, line, "label", f"{value!r} is not a label: use 1 (duplicate), 0 (not) or null (unlabelled)")


def read_labels(path: str | Path) -> tuple[list[float], list[int], int]:
    """(cosines, labels) of the labelled rows, and the number left unlabelled."""
    cosines, labels, unlabelled = [], [], 0
    for line, row in read_jsonl_numbered(path, required=("cosine", "label")):
        label = duplicate_label(row["label"], path, line)
        if not isinstance(row["cosine"], (int, float)):
            raise DataError(path, line, "cosine", f"{row['cosine']!r} is not a number")
        if label is None:
            unlabelled += 1
            continue
        cosines.append(float(row["cosine"]))
        labels.append(label)
    return cosines, labels, unlabelled


JUDGE_PROMPT = ("下面两段中文医疗文本是否是重复内容（表达的意思基本相同，保留一段即可）？只回答 yes 或 no。\n"
                "Are these two Chinese medical texts duplicates (essentially the same content)? Answer yes or no.\n"
                "文本1: {text1}\n文本2: {text2}")


def judge_label(text1: str, text2: str, judge: DictConfig) -> int:
    """One chat completion from an OpenAI-compatible endpoint: 1 for yes/是, 0 for no/否."""
    if not judge.base_url or not judge.model:
        raise ValueError("mode=judge needs dedup.calibrate.judge.base_url and judge.model")
    body = {"model": judge.model, "temperature": 0,
            "messages": [{"role": "user", "content": JUDGE_PROMPT.format(text1=text1, text2=text2)}]}
    headers = {"Content-Type": "application/json"}
    if key := os.environ.get(judge.api_key_env or ""):
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(str(judge.base_url).rstrip("/") + "/chat/completions",
                                 data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=judge.timeout_s) as resp:
        answer = json.load(resp)["choices"][0]["message"]["content"].strip().lower()
    if answer.startswith(("yes", "是")):
        return 1
    if answer.startswith(("no", "否", "不")):
        return 0
    raise ValueError(f"judge answered {answer[:80]!r}, neither yes nor no")


def labelled_pairs(cfg: DictConfig) -> tuple[list[tuple[str, str]], list[int], list[str]]:
    """(text1, text2) pairs, 1 for a paraphrase, and the source of each, read through the import
    stage's source readers (conf/data: the readers know each file's quirks)."""
    from care.data.records import Pair, Text
    from care.data.sources import read_source

    texts, labels, names = [], [], []
    for name, want in cfg.dedup.calibrate.pair_sources.items():
        records, _ = read_source(name, OmegaConf.to_container(cfg.data.sources[name], resolve=True), cfg.data.root)
        by_id = {r.id: r.text for r in records if isinstance(r, Text)}
        for p in records:
            if isinstance(p, Pair) and p.split in want.splits and p.label is not None:
                texts.append((by_id[p.text1_id], by_id[p.text2_id]))
                labels.append(int(p.label in want.paraphrase))
                names.append(name)
    return texts, labels, names


def labelled_answers(cfg: DictConfig) -> tuple[list[tuple[str, str]], list[int], list[str]]:
    """(query text, candidate text) pairs of the import stage's candidate lists of `qa_sources` (source ->
    splits), 1 for a relevant candidate, and each pair's list id."""
    c, root = cfg.dedup.calibrate, Path(cfg.data_dir) / "import"
    want = {name: set(splits) for name, splits in c.qa_sources.items()}
    texts = read_text_store(root / "texts.jsonl")
    pairs, labels, lists = [], [], []
    for row in read_jsonl(root / "candidates.jsonl", ("source", "split", "query_id", "candidates")):
        if row["split"] in want.get(row["source"], ()):
            for cand in row["candidates"]:
                pairs.append((texts[row["query_id"]], texts[cand["id"]]))
                labels.append(int(cand["label"] > 0))
                lists.append(row["id"])
    if not pairs:
        raise DataError(root / "candidates.jsonl", None, "source",
                        f"no candidate list of {dict(c.qa_sources)}: run stage import, or set dedup.calibrate.qa_sources")
    return pairs, labels, lists
