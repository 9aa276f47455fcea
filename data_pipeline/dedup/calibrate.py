"""Per-encoder similarity thresholds: the dedup cosine cut and the hard-negative mining window.

A cosine cut belongs to an encoder (docs/facts.md s.4): BGE-M3's 0.80 was set by an LLM judge on pairs sampled
per similarity interval (54% duplicates in [0.80, 0.85), 22% in [0.75, 0.80)); multilingual-e5-small
scores even unrelated medical texts 0.79-0.84.  This tool reproduces that procedure for any encoder:

  python -m data_pipeline.dedup.calibrate model=NAME dedup.calibrate.mode=MODE [input=STORE]

mode=export  nearest-neighbour pairs of a text store (cfg.input, else the dedup stage's kept.jsonl, else
             the import store), `per_interval` sampled per cosine interval, written as JSON Lines
             {interval, cosine, id1, id2, text1, text2, label: null} for a person (or a judge) to label
             with 1 (duplicate) or 0.
mode=report  read a labelled export back (dedup.calibrate.labels=FILE): duplicate rate per interval.
mode=judge   label an export with an LLM behind any OpenAI-compatible chat endpoint
             (dedup.calibrate.judge.base_url / model; key from the env variable judge.api_key_env), then
             report.  Off unless asked for; nothing else needs it.
mode=pairs   no judge here, so the labels come from people: the human-labelled paraphrase pairs of the
             shared data (CHIP-STS, cMedQQ, KUAKE-QQR; `pair_sources`), cosine of each pair under this
             encoder, paraphrase rate per interval, and the thresholds that follow (see `suggest`).
mode=qa      the window of `mine.similarity=document` (query vs candidate answer), the same way: the import
             stage's labelled candidate lists (`qa_sources`: splits never trained on, e.g. cEpilepsyQA dev),
             query encoded as a query and each candidate as a document, the relevant-answer rate per
             interval; mine_doc_hi = where that rate reaches `crossing`, mine_doc_lo = the `mine_lo_quantile`
             quantile of the cosine of a query with another list's candidates.
Every mode writes `table.txt` and `calibration.json` under dedup.calibrate.out
(default {data_dir}/calibrate/<model name>/).  Texts are encoded as documents (`side: doc`), as the dedup
stage does; side=query measures the query side (question-question similarity, what mining compares).
"""
from __future__ import annotations

import json
import os
import random
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

import care  # noqa: F401  (registers the ${paths:...} resolver)
from care.config import CONF_DIR
from care.data.io import DataError, atomic_open, read_jsonl, read_jsonl_numbered, write_json, write_jsonl


def interval_of(cosines, edges: Sequence[float]) -> np.ndarray:
    """Index of the interval [edges[k], edges[k+1]) holding each cosine (the last one closed), -1 if none."""
    edges = np.asarray(edges, dtype=np.float64)
    if len(edges) < 2 or np.any(np.diff(edges) <= 0):
        raise ValueError(f"dedup.calibrate.edges must be increasing, got {edges.tolist()}")
    c = np.asarray(cosines, dtype=np.float64)
    k = np.searchsorted(edges, c, side="right") - 1
    k[c == edges[-1]] = len(edges) - 2
    k[(c < edges[0]) | (c > edges[-1])] = -1
    return k


def interval_name(edges: Sequence[float], k: int) -> str:
    return f"[{edges[k]:g}, {edges[k + 1]:g}{']' if k == len(edges) - 2 else ')'}"


def rate_table(cosines, labels, edges: Sequence[float]) -> list[dict]:
    """Pairs, positives and positive rate per interval (rate null for an empty interval)."""
    k, labels = interval_of(cosines, edges), np.asarray(labels, dtype=np.float64)
    rows = []
    for j in range(len(edges) - 1):
        sel = labels[k == j]
        rows.append({"interval": interval_name(edges, j), "lo": float(edges[j]), "hi": float(edges[j + 1]),
                     "pairs": len(sel), "positives": int(sel.sum()),
                     "rate": round(float(sel.mean()), 4) if len(sel) else None})
    return rows


def format_table(rows: list[dict], what: str = "duplicate rate") -> str:
    lines = [f"{'interval':<16}{'pairs':>8}{'positives':>11}{what:>18}"]
    for r in rows:
        rate = "-" if r["rate"] is None else f"{100 * r['rate']:.1f}%"
        lines.append(f"{r['interval']:<16}{r['pairs']:>8}{r['positives']:>11}{rate:>18}")
    return "\n".join(lines)


def suggest(rows: list[dict], random_cosines, crossing: float = 0.5, mine_lo_quantile: float = 0.95) -> dict:
    """The dedup cut: the lower edge of the lowest interval from which every non-empty interval upward has
    a positive rate >= `crossing` (the source's 0.80 had 54% in [0.80, 0.85)).  The mining window is
    [lo, cut): above the cut a "negative" is likely a duplicate of the positive; lo is the
    `mine_lo_quantile` quantile of the cosine of random (unrelated) pairs, so a mined negative is more
    similar to the query than that share of unrelated texts."""
    cut = None
    for r in reversed(rows):
        if r["rate"] is None:
            continue
        if r["rate"] < crossing:
            break
        cut = r["lo"]
    if cut is None:
        raise ValueError(f"no interval reaches a positive rate of {crossing:.0%}: widen dedup.calibrate.edges")
    lo = round(float(np.quantile(np.asarray(random_cosines, dtype=np.float64), mine_lo_quantile)), 2)
    if lo >= cut:
        raise ValueError(f"mining window [{lo}, {cut}) is empty: unrelated pairs score as high as duplicates")
    return {"dedup_cosine": cut, "mine_lo": lo, "mine_hi": cut}


# ---- export / report / judge -------------------------------------------------------------------------

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


# ---- pairs: human-labelled paraphrases -----------------------------------------------------------------

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


def labelled_rates(c: DictConfig, cos: np.ndarray, labels, random_cos: np.ndarray, positive: str) -> dict:
    """What the pairs and qa modes report of labelled cosines: the rate table, the cosine quantiles of the
    positive, the other and the random pairs, and how many fall below the first edge."""
    labels = np.asarray(labels)
    return {
        "table": rate_table(cos, labels, c.edges),
        "cosine_quantiles": {
            kind: {f"q{q}": round(float(np.quantile(v, q / 100)), 4) for q in (5, 25, 50, 75, 95)}
            for kind, v in ((positive, cos[labels == 1]), (f"not_{positive}", cos[labels == 0]),
                            ("random", random_cos))},
        "below_first_edge": int((cos < c.edges[0]).sum()),
    }


def suggestion(result: dict, random_cos: np.ndarray, c: DictConfig) -> dict | None:
    """`suggest` on the result's table; None, with the reason recorded in `result`, when there is none (the
    table is still worth having)."""
    try:
        return suggest(result["table"], random_cos, c.crossing, c.mine_lo_quantile)
    except ValueError as e:
        result["suggested_thresholds"], result["no_suggestion_because"] = None, str(e)
        return None


def calibrate_pairs(cfg: DictConfig, encoder) -> dict:
    c = cfg.dedup.calibrate
    pairs, labels, names = labelled_pairs(cfg)
    rng = random.Random(c.seed)
    pick = sorted(rng.sample(range(len(pairs)), min(c.pairs_limit, len(pairs))))
    pairs, labels, names = [pairs[i] for i in pick], [labels[i] for i in pick], [names[i] for i in pick]
    # Random pairs: two texts from different labelled pairs, i.e. (almost surely) unrelated.
    flat = [t for p in pairs for t in p]
    order = rng.sample(range(len(flat)), len(flat))
    vectors = encode(cfg, encoder, flat)
    cos = np.einsum("ij,ij->i", vectors[0::2], vectors[1::2])
    random_cos = np.einsum("ij,ij->i", vectors[order[0::2]], vectors[order[1::2]])
    result = {
        "mode": "pairs", "encoder": encoder_info(cfg, encoder), "side": c.side, "pairs": len(pairs),
        "sources": {n: names.count(n) for n in dict.fromkeys(names)}, "paraphrase_share": float(np.mean(labels)),
        **labelled_rates(c, cos, labels, random_cos, "paraphrase"),
    }
    if (th := suggestion(result, random_cos, c)) is None:
        return result
    result["suggested_thresholds"] = {
        **th, "calibrated_for": cfg.model.name,
        "how": (f"calibrate mode=pairs: {len(pairs)} human-labelled paraphrase pairs "
                f"({', '.join(result['sources'])}), {c.side} side; dedup_cosine = lowest interval edge from which the "
                f"paraphrase rate stays >= {c.crossing:.0%}; mine_lo = q{round(100 * c.mine_lo_quantile)} of "
                f"random-pair cosine")}
    return result


# ---- qa: labelled candidate answers (the document-mode mining window) -----------------------------------

def labelled_answers(cfg: DictConfig) -> tuple[list[tuple[str, str]], list[int], list[str]]:
    """(query text, candidate text) pairs of the import stage's candidate lists of `qa_sources` (source ->
    splits), 1 for a relevant candidate, and each pair's list id."""
    from care.data.io import read_text_store

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


def calibrate_qa(cfg: DictConfig, encoder) -> dict:
    c = cfg.dedup.calibrate
    pairs, labels, lists = labelled_answers(cfg)
    rng = random.Random(c.seed)
    queries, answers = sorted({q for q, _ in pairs}), sorted({a for _, a in pairs})
    qv = dict(zip(queries, encode(cfg, encoder, queries, side="query")))
    av = dict(zip(answers, encode(cfg, encoder, answers, side="document")))
    cos = np.array([float(qv[q] @ av[a]) for q, a in pairs])
    # Random pairs: a query with a candidate of another list (unrelated to it, almost surely).
    shuffled = rng.sample(range(len(pairs)), len(pairs))
    random_cos = np.array([float(qv[pairs[i][0]] @ av[pairs[j][1]]) for i, j in zip(range(len(pairs)), shuffled)
                           if lists[i] != lists[j]])
    result = {
        "mode": "qa", "encoder": encoder_info(cfg, encoder), "side": "query vs document", "pairs": len(pairs),
        "lists": len(set(lists)), "sources": {k: list(v) for k, v in c.qa_sources.items()},
        "relevant_share": float(np.mean(labels)), **labelled_rates(c, cos, labels, random_cos, "relevant"),
    }
    if (th := suggestion(result, random_cos, c)) is None:
        return result
    result["suggested_thresholds"] = {
        "mine_doc_lo": th["mine_lo"], "mine_doc_hi": th["mine_hi"],
        "how_doc": (f"calibrate mode=qa: {len(pairs)} labelled (question, candidate answer) pairs of "
                    f"{len(set(lists))} lists ({', '.join(f'{k} {list(v)}' for k, v in c.qa_sources.items())}), query vs "
                    f"document side; mine_doc_hi = lowest interval edge from which the relevant rate stays >= "
                    f"{c.crossing:.0%}; mine_doc_lo = q{round(100 * c.mine_lo_quantile)} of random query-answer cosine")}
    return result


# ---- plumbing ---------------------------------------------------------------------------------------

def encoder_info(cfg: DictConfig, encoder) -> dict:
    return {"name": encoder.name, "label": cfg.model.get("label"), "fingerprint": encoder.fingerprint}


def encode(cfg: DictConfig, encoder, texts: list[str], side: str | None = None) -> np.ndarray:
    """Vectors of `side` (default `dedup.calibrate.side`), L2-normalised, through the project's embedding cache."""
    from care.encoders.cache import EmbeddingCache, embed
    from care.retrieval.index import unit_rows

    s = cfg.dedup.semantic
    cache = EmbeddingCache(s.cache) if s.cache else None
    return unit_rows(embed(encoder, texts, side or cfg.dedup.calibrate.side, cache, s.batch_size).dense)


def default_store(cfg: DictConfig) -> Path:
    if cfg.get("input"):
        return Path(cfg.input)
    kept = Path(cfg.data_dir) / "dedup" / "kept.jsonl"
    return kept if kept.exists() else Path(cfg.data_dir) / "import" / "texts.jsonl"


def run(cfg: DictConfig) -> dict:
    c = cfg.dedup.calibrate
    out = Path(c.out or Path(cfg.data_dir) / "calibrate" / cfg.model.name)
    mode = c.mode
    if mode not in ("pairs", "qa", "export", "report", "judge"):
        raise ValueError(f"dedup.calibrate.mode must be pairs, qa, export, report or judge, not {mode!r}")
    interval_of([], c.edges)  # validates the edges before any work
    what = {"pairs": "paraphrase rate", "qa": "relevant rate"}.get(mode, "duplicate rate")
    if mode in ("pairs", "qa", "export"):
        from care.encoders import build_encoder

        encoder = build_encoder(cfg.model)
    if mode == "pairs":
        result = calibrate_pairs(cfg, encoder)
    elif mode == "qa":
        result = calibrate_qa(cfg, encoder)
    elif mode == "export":
        from care.data.io import read_text_store

        store = read_text_store(default_store(cfg))
        ids, texts = list(store), list(store.values())
        rows = export_pairs(ids, texts, encode(cfg, encoder, texts), c.edges, c.per_interval, c.neighbours, c.seed)
        write_jsonl(out / "to_label.jsonl", rows)
        print(f"calibrate: {len(rows)} pairs to label in {out / 'to_label.jsonl'} (set each label to 1 or 0)")
        result = {"mode": "export", "encoder": encoder_info(cfg, encoder), "store": str(default_store(cfg)),
                  "file": str(out / "to_label.jsonl"),
                  "table": rate_table([r["cosine"] for r in rows], [0] * len(rows), c.edges)}
        what = "(unlabelled)"
    else:
        labels_file = Path(c.labels or out / "to_label.jsonl")
        if mode == "judge":
            rows = list(read_jsonl(labels_file, required=("text1", "text2", "cosine", "label")))
            for row in tqdm(rows, desc="judge", unit="pair"):
                row["label"] = judge_label(row["text1"], row["text2"], c.judge)
            labels_file = out / "judged.jsonl"
            write_jsonl(labels_file, rows)
        cosines, labels, unlabelled = read_labels(labels_file)
        result = {"mode": mode, "labels": str(labels_file), "labelled": len(labels), "unlabelled": unlabelled,
                  "table": rate_table(cosines, labels, c.edges)}
    table = format_table(result["table"], what)
    write_json(out / "calibration.json", result)
    with atomic_open(out / "table.txt") as fh:
        fh.write(table + "\n")
    print(table)
    if result.get("no_suggestion_because"):
        print(f"calibrate: no thresholds suggested: {result['no_suggestion_because']}")
    if result.get("suggested_thresholds"):
        block = OmegaConf.to_yaml({"thresholds": result["suggested_thresholds"]})
        print(f"thresholds for conf/model/{cfg.model.name}.yaml:\n{block}")
    return result


@hydra.main(config_path=str(CONF_DIR), config_name="data_pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
