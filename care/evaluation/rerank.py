"""evaluate.py's scorer for a cross-encoder row (the `reranker` family's `scorer` hook, care.families): the
reranking slots (CMed v1, CMed v2, Rerank: each query's candidate list) scored by the reranker; the retrieval
slots retrieve-then-rerank, `rerank.retriever`'s top `rerank.k` reordered by it (care.retrieval.rerank); STS
n/a.  The row's label says which first stage it reranks.

    python evaluate.py ckpt=outputs/train/<reranker run>/final [rerank.retriever=me5_small] [rerank.k=100]

`rerank.retriever` is a conf/model name or a model folder (a trained encoder's final/), scored through the
embedding cache as its own row would be, with evaluate.py's table method.  `check` refuses, in one line and
before anything is read or written, a `rerank.k` below 1, a retriever that is neither, and a benchmark with
no task a cross-encoder scores (STS only).  A folder without its trained head is refused when it loads
(care.encoders.cross_encoder); `rerank.allow_untrained_head=true` scores one made from `seed`, the row's
label says so and its model card is left alone.
"""
from __future__ import annotations

from pathlib import Path

from care.config import CONF_DIR, model_config
from care.encoders import build_encoder, build_pair_scorer, detect
from care.encoders.cache import EmbeddingCache
from care.evaluation.corpora import evaluation_model
from care.families import family_of
from care.retrieval.rerank import RerankerScorer
from care.retrieval.scorer import EncoderScorer


def retriever_config(name: str, cfg: dict) -> dict:
    """The first stage's model config; one line when `name` is neither a model folder nor a conf/model name."""
    folder = Path(str(name)).expanduser()
    known = ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
    takes = f"it takes an encoder's model folder (a trained encoder's final/) or a conf/model name ({known})"
    if folder.is_dir():
        found = detect(folder, {"name": folder.name})
        if found is None:
            raise ValueError(f"rerank.retriever={name}: {folder.resolve()} is no model folder; {takes}")
    elif "/" in str(name) or str(name).startswith((".", "~")):  # a path
        raise ValueError(f"rerank.retriever={name}: no such folder ({folder.resolve()}); {takes}")
    elif (CONF_DIR / "model" / f"{name}.yaml").is_file():
        found = model_config(str(name), cfg)
    else:
        raise ValueError(f"rerank.retriever={name}: no conf/model/{name}.yaml and no folder of that name; {takes}")
    if family_of(found).cross_encoder:
        raise ValueError(f"rerank.retriever={name}: a cross-encoder retrieves nothing (it scores pairs); {takes}")
    return found


def _rerankers(entries: list[dict]) -> list[dict]:
    return [e for e in entries if e.get("model") and family_of(e["model"]).cross_encoder]


def check(entries: list[dict], cfg: dict, loaded: list[tuple] | None = None) -> None:
    """Before anything is written, when a row is a cross-encoder: `rerank.k` a whole number >= 1 and
    `rerank.retriever` a first stage (before the benchmarks load); with `loaded`, a task it scores (STS is
    n/a for a reranker: a benchmark of STS only would leave its row, and its model card, empty)."""
    rows = _rerankers(entries)
    if not rows:
        return
    r = cfg["rerank"]
    if loaded is None:
        k = r.get("k")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"rerank.k={k}: the number of the first stage's documents the reranker reorders per "
                             "query, a whole number >= 1 (e.g. rerank.k=100)")
        retriever_config(r["retriever"], cfg)
        return
    types = {spec.type for _, tasks in loaded for spec, _ in tasks}
    if not types & set(RerankerScorer.tasks):
        names = ", ".join(b.name for b, _ in loaded)
        raise ValueError(f"model {rows[0]['name']}: nothing to score: a cross-encoder scores "
                         f"{', '.join(RerankerScorer.tasks)} tasks, and {names} holds only {', '.join(sorted(types))} "
                         "(a pair's relevance logit is no similarity); pick a benchmark with candidate lists or retrieval")


def reranker_scorer(entry: dict, cfg: dict, cache: EmbeddingCache) -> RerankerScorer:
    r = cfg["rerank"]  # conf/evaluate.yaml
    model = evaluation_model(entry["model"], cfg.get("max_length"))
    if r.get("allow_untrained_head"):  # asked for by name: a head the folder lacks is made from `seed`
        model["untrained_head_seed"] = int(cfg["seed"])
    cross = build_pair_scorer(model, device=cfg.get("device"))
    cross.load()  # a folder without its trained head is refused here, before its retriever is built
    if cross.untrained:
        entry["untrained_head"] = True
        entry["label"] = f"{entry['label']} [untrained head, seed {cross.head_seed}]"
    first = retriever_config(r["retriever"], cfg)
    encoder = build_encoder(evaluation_model(first, cfg.get("max_length")), device=cfg.get("device"),
                            backend=cfg.get("backend", "auto"))  # as its own row runs (conf/evaluate.yaml)
    retriever = EncoderScorer(encoder, cache, batch_size=cfg["batch_size"], heads=cfg.get("heads"),
                              hybrid_weights=cfg["hybrid_weights"], rerank_depth=cfg["rerank_depth"])
    method = cfg["table_method"] if cfg["table_method"] in retriever.methods else retriever.methods[0]
    first_label = first.get("label") or first.get("name") or Path(str(r["retriever"])).name
    entry["label"] = f"{entry['label']} [retrieval: reranks the top {int(r['k'])} of {first_label}]"
    return RerankerScorer(cross, retriever, int(r["k"]), method, batch_size=cfg["batch_size"], label=entry["label"])
