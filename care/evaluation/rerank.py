"""evaluate.py's scorer for a cross-encoder row (the `reranker` family's `scorer` hook, care.families): the
reranking slots (CMed v1, CMed v2, Rerank: each query's candidate list) scored by the reranker; the retrieval
slots retrieve-then-rerank, `rerank.retriever`'s top `rerank.k` reordered by it (care.retrieval.rerank); STS
n/a.  The row's label says which first stage it reranks.

    python evaluate.py ckpt=outputs/train/<reranker run>/final [rerank.retriever=me5_small] [rerank.k=100]

`rerank.retriever` is a conf/model name or a model folder (a trained encoder's final/), scored through the
embedding cache as its own row would be, with evaluate.py's table method.
"""
from __future__ import annotations

from pathlib import Path

from care.config import model_config
from care.encoders import build_encoder, build_pair_scorer, detect
from care.encoders.cache import EmbeddingCache
from care.evaluation.corpora import evaluation_model
from care.retrieval.rerank import RerankerScorer
from care.retrieval.scorer import EncoderScorer


def retriever_config(name: str, cfg: dict) -> dict:
    folder = Path(str(name)).expanduser()
    if folder.is_dir():
        found = detect(folder, {"name": folder.name})
        if found is None:
            raise ValueError(f"rerank.retriever={name}: {folder} is no model folder")
        return found
    return model_config(str(name), cfg)


def reranker_scorer(entry: dict, cfg: dict, cache: EmbeddingCache) -> RerankerScorer:
    r = cfg["rerank"]  # conf/evaluate.yaml
    cross = build_pair_scorer(evaluation_model(entry["model"], cfg.get("max_length")), device=cfg.get("device"))
    first = retriever_config(r["retriever"], cfg)
    encoder = build_encoder(evaluation_model(first, cfg.get("max_length")), device=cfg.get("device"),
                            backend=cfg.get("backend", "auto"))  # as its own row runs (conf/evaluate.yaml)
    retriever = EncoderScorer(encoder, cache, batch_size=cfg["batch_size"], heads=cfg.get("heads"),
                              hybrid_weights=cfg["hybrid_weights"], rerank_depth=cfg["rerank_depth"])
    method = cfg["table_method"] if cfg["table_method"] in retriever.methods else retriever.methods[0]
    first_label = first.get("label") or first.get("name") or Path(str(r["retriever"])).name
    entry["label"] = f"{entry['label']} [retrieval: reranks the top {int(r['k'])} of {first_label}]"
    return RerankerScorer(cross, retriever, int(r["k"]), method, batch_size=cfg["batch_size"], label=entry["label"])
