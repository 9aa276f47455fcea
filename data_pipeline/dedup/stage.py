"""`python -m data_pipeline stage=dedup`: exact -> MinHash -> semantic deduplication of a text store.

Reads `{"id","text",...}` JSON Lines (cfg.input, else {data_dir}/import/texts.jsonl), restricted to the
roles/sources in `dedup.roles` / `dedup.sources` (`auto`: dedup.import_filter's on the import store, none
with input=; see `row_filters`); writes to cfg.out (else {data_dir}/dedup/), refusing files there that an
earlier dedup run did not write (force=true overwrites):
  kept.jsonl         the surviving rows, unchanged, in input order
  clusters.jsonl     one line per cluster a stage merged: stage, kept_id, removed_ids, similarity of
                     each removed text to the kept one, the weakest edge that joined the cluster
  stats.json         texts in/out, clusters and the 10 largest, seconds per stage, the thresholds and
                     the encoder they belong to, the MinHash S-curve, the stage fingerprint
  nn_similarity.png  histogram of each text's nearest-neighbour cosine, threshold marked
Each stage passes its survivors on in input order, and every cluster keeps its earliest member.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from omegaconf import DictConfig, OmegaConf

from care.data import stage_cache
from care.data.io import DataError, file_digest, read_text_rows, save_figure, write_jsonl
from care.data.stage_start import stage_start
from care.encoders.prompts import legacy_keyed
from care.families import require
from care.models.hub import weights_digest
from data_pipeline.dedup.clusters import Cluster, clusters_from_edges, survivors
from data_pipeline.dedup.exact import exact_clusters
from data_pipeline.dedup.minhash import minhash_pairs, s_curve
from data_pipeline.dedup.minhash_reference import jaccard, shingles
from data_pipeline.dedup.normalize import Normalizer
from data_pipeline.distributed.search import search_identity, stage_settings

STAGES = ("exact", "minhash", "semantic")
ENGINES = ("native", "datatrove")   # dedup.engine: data_pipeline/distributed/dedup_engine.py runs the second
# the dedup keys that choose how the stage runs, not what it computes (kept out of the fingerprint)
ENGINE_KEYS = ("engine", "executor", "tasks", "workers", "local", "slurm", "ray", "work_dir", "keep_work")
OUTPUTS = ("kept.jsonl", "clusters.jsonl", "nn_similarity.png", "stats.json")
AUTO = "auto"


class ThresholdError(ValueError):
    """Semantic dedup refused: the model's thresholds are missing, invalid or belong to another encoder."""


def encoder_thresholds(model: DictConfig, needed: tuple[str, ...], what: str, override_hint: str) -> dict:
    """The model's calibrated thresholds.  Refuses missing values and thresholds calibrated for another
    encoder: a cosine cut or window does not transfer between encoders (docs/facts.md s.4)."""
    name = model.get("name")
    where = f"model config '{name}' (conf/model/{name}.yaml)"
    th = OmegaConf.to_container(model.thresholds, resolve=True) if model.get("thresholds") else {}
    if any(th.get(k) is None for k in needed):
        raise ThresholdError(
            f"{where} has no thresholds.{'/'.join(needed)}. {what} belongs to an encoder (docs/facts.md s.4): "
            f"calibrate it (python -m data_pipeline.dedup.calibrate model={name}"
            f"{' dedup.calibrate.mode=qa' if 'mine_doc_lo' in needed else ''}) and add a thresholds "
            f"block, or pass {override_hint} to override explicitly.")
    if th.get("calibrated_for") != name:
        raise ThresholdError(
            f"{where}: thresholds.calibrated_for is {th.get('calibrated_for')!r}, not this encoder {name!r}; "
            f"{what.lower()} does not transfer between encoders. Re-calibrate, or pass {override_hint} to "
            f"override explicitly.")
    return th


def semantic_thresholds(cfg: DictConfig) -> dict:
    """The cosine cut (and mining window) to use, with where they came from.  Refuses thresholds that
    are missing or were calibrated for another encoder unless dedup.semantic.cosine overrides them."""
    model = cfg.model
    where = f"model config '{model.get('name')}' (conf/model/{model.get('name')}.yaml)"
    override = cfg.dedup.semantic.get("cosine")
    if override is None:
        th = encoder_thresholds(model, ("dedup_cosine",), "A cosine cut", "dedup.semantic.cosine=VALUE")
        source = "model.thresholds"
    else:
        th = OmegaConf.to_container(model.thresholds, resolve=True) if model.get("thresholds") else {}
        th = {**th, "dedup_cosine": float(override), "how": "explicit override (dedup.semantic.cosine)"}
        source = "override"
    if not -1.0 <= float(th["dedup_cosine"]) <= 1.0:
        raise DataError(where, None, "thresholds.dedup_cosine", f"{th['dedup_cosine']} is not a cosine in [-1, 1]")
    lo, hi = th.get("mine_lo"), th.get("mine_hi")
    if (lo is None) != (hi is None):
        raise DataError(where, None, "thresholds.mine_lo" if lo is None else "thresholds.mine_hi",
                        "the mining window needs both mine_lo and mine_hi")
    if lo is not None and not float(lo) < float(hi):
        raise DataError(where, None, "thresholds.mine_lo", f"mining window [{lo}, {hi}) is empty (lo >= hi)")
    return {**th, "source": source}


def row_filters(cfg: DictConfig) -> tuple[list[str] | None, list[str] | None]:
    """(roles, sources) to keep, None = every row.  `auto` means dedup.import_filter's list on the
    pipeline's own import store and no filter on a store given with input= (a plain {"id","text"} store
    has neither field); any other value is an explicit choice and applies in both modes."""
    d = cfg.dedup
    own_import = not cfg.get("input")
    chosen = []
    for key in ("roles", "sources"):
        value = d.get(key)
        if isinstance(value, str):
            if value != AUTO:
                raise ValueError(f"dedup.{key} must be a list, null (every row) or {AUTO!r}, not {value!r}")
            value = (d.get("import_filter") or {}).get(key) if own_import else None
        chosen.append([str(v) for v in value] if value is not None else None)
    return chosen[0], chosen[1]


def filtered_rows(path: Path, roles, sources, counts: dict) -> Iterator[tuple[int, dict]]:
    """(line number, row) of the rows of the text store that pass the role/source filters, in file order;
    duplicate ids and empty texts are errors (care.data.io.read_text_rows: a store whose ids repeat cannot
    say which text a cluster kept).  `counts` gets rows_read and rows_filtered_out."""
    counts.update(rows_read=0, rows_filtered_out=0)
    wanted = {"role": set(roles) if roles else None, "source": set(sources) if sources else None}
    for lineno, row in read_text_rows(path):
        counts["rows_read"] += 1
        for field, allowed in wanted.items():
            if allowed is not None and field not in row:
                raise DataError(path, lineno, field, f"missing, but dedup.{field}s filters on it "
                                f"(pass dedup.{field}s=null to take every row)")
        if all(allowed is None or row[field] in allowed for field, allowed in wanted.items()):
            yield lineno, row
        else:
            counts["rows_filtered_out"] += 1


def load_rows(path: Path, roles, sources) -> tuple[list[dict], dict]:
    """The rows `filtered_rows` keeps, and what was read and filtered out."""
    counts: dict = {}
    rows = [row for _, row in filtered_rows(path, roles, sources, counts)]
    return rows, {**counts, "roles": list(roles) if roles else None, "sources": list(sources) if sources else None}


def _cluster_lines(stage: str, clusters: list[Cluster], ids: list[str], sim_to_kept) -> list[dict]:
    return [{"stage": stage, "kept_id": ids[c.kept], "removed_ids": [ids[r] for r in c.removed],
             "similarity_to_kept": [round(float(sim_to_kept(c.kept, r)), 4) for r in c.removed],
             "min_edge_similarity": round(c.min_edge, 4)} for c in clusters]


def _largest(clusters: list[Cluster], ids: list[str], texts: list[str], k: int = 10) -> list[dict]:
    top = sorted(clusters, key=lambda c: (-c.size, c.kept))[:k]
    return [{"kept_id": ids[c.kept], "size": c.size, "text": texts[c.kept][:80]} for c in top]


def plot_nn_histogram(path: Path, nn: np.ndarray, threshold: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(nn, bins=100, color="steelblue")
    ax.axvline(threshold, color="crimson", linestyle="--", label=f"dedup cosine {threshold:.3f}")
    ax.set(xlabel="cosine to nearest neighbour", ylabel="texts", title=title)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def print_table(stats: dict) -> None:
    print(f"{'dedup':<10}{'in':>10}{'out':>10}{'clusters':>10}{'removed':>10}{'seconds':>9}")
    for name in stats["stage_order"]:
        s = stats["stages"][name]
        print(f"{name:<10}{s['in']:>10,}{s['out']:>10,}{s['clusters']:>10,}{s['in'] - s['out']:>10,}"
              f"{s['seconds']:>9.1f}")


def run(cfg: DictConfig) -> dict:
    d = cfg.dedup
    order = list(d.stages)
    unknown = [s for s in order if s not in STAGES]
    if unknown:
        raise ValueError(f"dedup.stages: unknown {unknown}; choose from {list(STAGES)}")
    src = Path(cfg.get("input") or Path(cfg.data_dir) / "import" / "texts.jsonl")
    out = Path(cfg.get("out") or Path(cfg.data_dir) / "dedup")
    semantic = "semantic" in order
    if semantic:  # dense vectors, keyed by one weights folder
        require(cfg.model, "the dedup stage's semantic step", one_backbone=True)
    thresholds = semantic_thresholds(cfg) if semantic else None  # refuse before any work

    roles, sources = row_filters(cfg)
    if d.get("engine", "native") not in ENGINES:
        raise ValueError(f"dedup.engine={d.get('engine')!r}: choose from {list(ENGINES)}")
    # how the stage runs (engine, executor, tasks) is not what it computes: either engine's folder is up to
    # date for the other, and the fingerprint is the one written before the engines existed
    what = {k: v for k, v in OmegaConf.to_container(d, resolve=True).items() if k not in ENGINE_KEYS}
    what["semantic"] = search_identity(what["semantic"])  # dedup.semantic.engine, ...: how, not what
    fp_config = {"dedup": what, "input": str(src), "filters": {"roles": roles, "sources": sources}}
    if semantic:
        fp_config["model"] = legacy_keyed(OmegaConf.to_container(cfg.model, resolve=True))  # fingerprints predating `prompts:`
        fp_config["weights"] = weights_digest(cfg.model.path)
    fp = stage_cache.fingerprint([src], fp_config)
    with stage_start(cfg, "dedup", out, fp, OUTPUTS, legacy_keys=("stage_order",)) as start:
        if start.done:
            return start.skip(f"dedup: inputs and config unchanged since the last run, skipped ({out}; "
                              "force=true re-runs)")
        stats = _dedup(cfg, src, fp, thresholds, (roles, sources), start)
    print_table(stats)
    print(f"dedup: {stats['texts_in']:,} -> {stats['texts_out']:,} texts; outputs in {out}")
    return stats


def stats_header(src: Path, out: Path, fp: str, read_stats: dict, order: list[str]) -> dict:
    """stats.json's first keys, the same for both engines."""
    return {"stage": "dedup", "input": str(src), "input_digest": file_digest(src), "output": str(out),
            "fingerprint": fp, **read_stats, "stage_order": order, "stages": {}}


def _dedup(cfg: DictConfig, src: Path, fp: str, thresholds: dict | None, filters, start) -> dict:
    """The stages of dedup.stages in order over the filtered rows; the outputs and stats.json (last)."""
    d, out, order = cfg.dedup, start.out, list(cfg.dedup.stages)
    if d.get("engine", "native") == "datatrove":
        from data_pipeline.distributed.dedup_engine import datatrove_dedup

        parts = SimpleNamespace(filtered_rows=filtered_rows, cluster_lines=_cluster_lines, largest=_largest,
                                semantic=_semantic, stats_header=stats_header)
        return datatrove_dedup(cfg, src, fp, thresholds, filters, start, parts)
    semantic = "semantic" in order
    rows, read_stats = load_rows(src, *filters)
    ids, texts = [r["id"] for r in rows], [r["text"] for r in rows]
    normalise = Normalizer(**d.normalize)
    normalised = [normalise(t) for t in texts]
    alive = np.arange(len(rows))  # positions (in rows) still in play
    stats = stats_header(src, out, fp, read_stats, order)
    cluster_lines: list[dict] = []
    start.writing()  # the semantic stage writes its histogram mid-way

    def record(name, t0, clusters, sim_to_kept, extra=None):
        nonlocal alive
        local_ids, local_texts = [ids[i] for i in alive], [texts[i] for i in alive]
        cluster_lines.extend(_cluster_lines(name, clusters, local_ids, sim_to_kept))
        before = len(alive)
        alive = alive[survivors(len(alive), clusters)]
        stats["stages"][name] = {"in": before, "out": len(alive), "clusters": len(clusters),
                                 "largest_clusters": _largest(clusters, local_ids, local_texts),
                                 "seconds": round(time.perf_counter() - t0, 3), **(extra or {})}

    for name in order:
        t0 = time.perf_counter()
        norm = [normalised[i] for i in alive]
        if name == "exact":
            record(name, t0, exact_clusters(norm), lambda a, b: 1.0)
        elif name == "minhash":
            record(name, t0, *_minhash(d.minhash, norm))
        else:
            record(name, t0, *_semantic(cfg, [texts[i] for i in alive], thresholds, out))

    kept_rows = [rows[i] for i in alive]
    if not semantic:  # no histogram this run: do not leave an earlier run's beside the new files
        (out / "nn_similarity.png").unlink(missing_ok=True)
    stats.update(texts_in=len(rows), texts_out=len(kept_rows), thresholds=thresholds)
    write_jsonl(out / "kept.jsonl", kept_rows)
    write_jsonl(out / "clusters.jsonl", cluster_lines)
    return start.finish(stats)


def _minhash(m: DictConfig, norm: list[str]):
    """MinHash pairs -> clusters; returns record()'s arguments after t0."""
    res = minhash_pairs(norm, m.ngram, m.threshold, m.num_perm, m.target_recall, m.seed)
    grid = np.round(np.arange(0.5, 1.0001, 0.05), 2)
    extra = {"ngram": m.ngram, "threshold": m.threshold, "num_perm": m.num_perm, "bands": res.bands,
             "rows_per_band": res.rows_per_band, "candidate_pairs": res.candidates, "verified_pairs": len(res.sims),
             "p_candidate_at_threshold": round(float(s_curve(m.threshold, res.bands, res.rows_per_band)), 4),
             "s_curve": {f"{g:.2f}": round(float(p), 4) for g, p in zip(grid, s_curve(grid, res.bands,
                                                                                       res.rows_per_band))}}
    clusters = clusters_from_edges(len(norm), res.rows, res.cols, res.sims)
    return clusters, (lambda a, b: jaccard(shingles(norm[a], m.ngram), shingles(norm[b], m.ngram))), extra


def _semantic(cfg: DictConfig, texts: list[str], thresholds: dict, out: Path):
    """Encode (through the cache), search, cluster; returns record()'s arguments after t0."""
    from care.encoders import build_encoder
    from care.encoders.cache import EmbeddingCache, embed
    from data_pipeline.dedup.semantic import cosine_pairs, nearest_neighbour_cosine

    s = cfg.dedup.semantic
    encoder = build_encoder(cfg.model)
    thresholds["encoder"] = {"name": encoder.name, "label": cfg.model.get("label"),
                             "fingerprint": encoder.fingerprint, "path": str(cfg.model.path)}
    cut = float(thresholds["dedup_cosine"])
    extra = {"cosine": cut}
    if len(texts) < 2:
        return [], (lambda a, b: 1.0), {**extra, "note": "fewer than two texts: nothing to compare"}
    t_enc = time.perf_counter()
    cache = EmbeddingCache(s.cache) if s.cache else None
    sharded = stage_settings(s, cfg.dedup, cfg.cache_root, "dedup.semantic")  # None: native
    if sharded is not None:  # the encoding as tasks first (data_pipeline/distributed/encode_tasks.py)
        from data_pipeline.distributed.encode_tasks import encode_as_tasks

        if cache is None:
            raise ValueError("dedup.semantic.engine=sharded encodes as tasks into the embedding cache: "
                             "dedup.semantic.cache cannot be null")
        extra["engine"] = {"name": "sharded", "tasks": sharded.tasks, "encode": encode_as_tasks(
            encoder, OmegaConf.to_container(cfg.model, resolve=True), {"document": texts}, cache, s.batch_size,
            sharded.encode_shard, sharded)}
    vectors = embed(encoder, texts, "document", cache, s.batch_size).dense
    extra["cache_hits"], extra["encoded"] = (cache.hits, cache.misses) if cache else (0, len(texts))
    extra["encode_seconds"] = round(time.perf_counter() - t_enc, 3)
    if extra["encoded"]:
        extra["encode_texts_per_s"] = round(extra["encoded"] / max(extra["encode_seconds"], 1e-9), 1)
    found = cosine_pairs(vectors, cut, s.search, s.topk, s.block,
                         index=OmegaConf.to_container(s.index, resolve=True) if s.get("index") else None,
                         sharded=sharded)
    nn = nearest_neighbour_cosine(vectors, s.block, sharded=sharded)
    plot_nn_histogram(out / "nn_similarity.png", nn, cut,
                      f"{encoder.name}: nearest-neighbour cosine of {len(texts):,} texts")
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    extra.update(search=found.method, pairs=len(found.sims), saturated_rows=found.saturated,
                 nn_cosine_quantiles={f"q{q}": round(float(np.quantile(nn, q / 100)), 4)
                                      for q in (1, 5, 25, 50, 75, 95, 99)},
                 nn_at_or_above_cut=int((nn >= cut).sum()))
    clusters = clusters_from_edges(len(texts), found.rows, found.cols, found.sims)
    return clusters, (lambda a, b: float(unit[a] @ unit[b])), extra


def summary(stats: dict) -> str:
    per = " -> ".join(f"{s}: {v.get('out', '?'):,}" for s, v in stats.get("stages", {}).items()
                      if isinstance(v, dict) and isinstance(v.get("out"), int))
    return f"{stats.get('texts_in', 0):,} -> {stats.get('texts_out', 0):,} texts ({per})"
