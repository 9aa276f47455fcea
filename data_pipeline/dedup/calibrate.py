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
The modes that encode (pairs, qa, export) take any model whose family gives dense vectors (care/families.py;
CARE's too, its document or query side); any other (a reranker's pair scores) is refused in one line.
Every mode writes `table.txt` and `calibration.json` under dedup.calibrate.out
(default {data_dir}/calibrate/<model name>/).  Texts are encoded as documents (`side: doc`), as the dedup
stage does; side=query measures the query side (question-question similarity, what mining compares).

The work is split in three files: this one (the CLI: encoding, the modes, the files written),
calibrate_labels.py (where the labels come from: pairs to label, label files, the judge, the labelled
sources) and calibrate_rates.py (the maths: intervals, rates, suggested thresholds).
"""
from __future__ import annotations

import random
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

import care  # noqa: F401  (registers the ${paths:...} resolver)
from care.config import CONF_DIR
from care.data.io import atomic_open, read_jsonl, read_text_store, write_json, write_jsonl
from care.errors import app_errors
from care.families import require
from care.progress import progress
from data_pipeline.dedup.calibrate_labels import (
    export_pairs,
    judge_label,
    labelled_answers,
    labelled_pairs,
    read_labels,
)
from data_pipeline.dedup.calibrate_rates import (
    format_table,
    interval_of,
    labelled_rates,
    rate_table,
    suggestion,
)

# ---- pairs and qa: labels that already exist, cosines from this encoder ----------------------------------

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

        require(cfg.model, "calibration")  # cosines of dense vectors
        encoder = build_encoder(cfg.model)
    if mode == "pairs":
        result = calibrate_pairs(cfg, encoder)
    elif mode == "qa":
        result = calibrate_qa(cfg, encoder)
    elif mode == "export":
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
            for row in progress(rows, desc="judge", unit="pair"):
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


APP = "python -m data_pipeline.dedup.calibrate"


@hydra.main(config_path=str(CONF_DIR), config_name="data_pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with app_errors(APP, cfg, writes_to=cfg.get("data_dir")):
        run(cfg)


if __name__ == "__main__":
    main()
