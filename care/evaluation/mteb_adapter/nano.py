"""The splits of a Nano folder (docs/nano.md s.10) as mteb retrieval tasks, and mteb.evaluate on them.

    load_with_mteb_loader(folder, split)  mteb's stock RetrievalDatasetLoader on the folder's `mteb` subset
    load_in_memory(folder, split)         the same data from care.data.nano.load_split, in memory
    nano_task(folder, split)              one split as an mteb AbsTaskRetrieval (retrieval, or reranking)
    run_mteb(encoder, folder)             mteb.evaluate on every split -> {split: {ndcg_at_10, recall_at_100, ...}}
                                          (results=<folder>: also mteb's result files there)
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from care.data.nano import HYBRID, config_files, load_split, resolve
from care.data.nano import splits as nano_splits
from care.encoders import Encoder
from care.evaluation.mteb_adapter.model import LANGUAGES, MtebEncoder, import_mteb, mteb_evaluate

#: the scores run_mteb returns per split (mteb's names; mteb's k values are 1, 3, 5, 10, 20, 100, 1000)
MAIN_SCORES = ("ndcg_at_10", "recall_at_100", "mrr_at_10")
MTEB_SUBSET = "mteb"  # the README subset of mteb views (data_pipeline/nano/layout.py)


def split_revision(folder: Path, split: str) -> str:
    """A digest of the split's files (every config), as the task's dataset revision."""
    h = hashlib.sha256()
    for config, by_split in sorted(config_files(folder).items()):
        for f in by_split.get(split, []):
            h.update(config.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _materialise(ds):
    """A loaded (cache-backed) datasets.Dataset copied into memory."""
    from datasets import Dataset

    return Dataset.from_dict(ds.to_dict(), features=ds.features)


def load_with_mteb_loader(folder: str | Path, split: str, config: str = MTEB_SUBSET) -> dict:
    """mteb's stock RetrievalDatasetLoader on the folder's `mteb` subset: corpus, queries (only those with
    qrels), relevant_docs {qid: {did: int score}}, top_ranked {qid: [dids]} (or None without the config).
    The `datasets` cache is a temporary folder; the rows are returned in memory."""
    import_mteb()
    import datasets
    from mteb.abstasks.retrieval_dataset_loaders import RetrievalDatasetLoader

    folder = Path(folder)
    missing = [c for c in ("corpus", "queries", "qrels") if f"{config}-{c}" not in config_files(folder)]
    if missing:
        raise FileNotFoundError(f"{folder}: no {', '.join(f'{config}-{c}' for c in missing)} config (the mteb views "
                                "data_pipeline/nano/layout.py writes); use source='memory' for this folder")
    saved = datasets.config.HF_DATASETS_CACHE
    with tempfile.TemporaryDirectory(prefix="care-mteb-datasets-") as tmp:
        datasets.config.HF_DATASETS_CACHE = Path(tmp)
        try:
            data = RetrievalDatasetLoader(hf_repo=str(folder), revision="local", split=split, config=config).load()
            data["corpus"], data["queries"] = _materialise(data["corpus"]), _materialise(data["queries"])
        finally:
            datasets.config.HF_DATASETS_CACHE = saved
    return data


def load_in_memory(folder: str | Path, split: str, reranking: bool = False, safeguard: bool = True,
                   candidates: str = HYBRID) -> dict:
    """The same RetrievalSplitData from care.data.nano.load_split (qrels scored 1; `safeguard=False` drops the
    rank-101 safeguard positive from each candidate list, HAKARI's without_safeguard)."""
    from datasets import Dataset

    s = load_split(folder, split)
    queries = {q: t for q, t in s.queries.items() if s.qrels.get(q)}
    top_ranked = None
    if reranking:
        if candidates not in s.candidates:
            raise FileNotFoundError(f"{folder}: split {split} has no {candidates!r} candidate config")
        top_ranked = {q: [d for d in s.candidates[candidates][q] if safeguard or d != s.safeguards.get(q)]
                      for q in queries}
    return {"corpus": Dataset.from_dict({"id": list(s.corpus), "text": list(s.corpus.values())}),
            "queries": Dataset.from_dict({"id": list(queries), "text": list(queries.values())}),
            "relevant_docs": {q: dict(s.qrels[q]) for q in queries}, "top_ranked": top_ranked}


@functools.cache
def _task_class():
    """The AbsTaskRetrieval subclass, defined on first use (mteb is imported lazily)."""
    import_mteb()
    from mteb.abstasks.retrieval import AbsTaskRetrieval

    class NanoTask(AbsTaskRetrieval):
        """One Nano split.  mteb wants `metadata` on the class (AbsTask.unload_data drops an instance's own
        copy), so nano_task makes one subclass per task."""

        #: evaluate.py embeds a Nano split's queries for retrieval in every view, reranking included
        care_task_type = "retrieval"

        def __init__(self, folder: Path, split: str, reranking: bool, source: str, safeguard: bool,
                     candidates: str, **kwargs: Any):
            self.folder, self.split, self.reranking, self.source = folder, split, reranking, source
            self.safeguard, self.candidates = safeguard, candidates
            super().__init__(**kwargs)

        def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
            if self.data_loaded:
                return
            if self.source == "loader":
                data = load_with_mteb_loader(self.folder, self.split)
                if not self.reranking:
                    data["top_ranked"] = None
                elif data["top_ranked"] is None:
                    raise FileNotFoundError(f"{self.folder}: no {MTEB_SUBSET}-top_ranked config to rerank")
            else:
                data = load_in_memory(self.folder, self.split, self.reranking, self.safeguard, self.candidates)
            self.dataset = {"default": {self.split: data}}
            self.data_loaded = True

    return NanoTask


def nano_task(folder: str | Path, split: str, reranking: bool = False, source: str = "memory",
              safeguard: bool = True, candidates: str = HYBRID):
    """One Nano split as an mteb AbsTaskRetrieval: full-corpus retrieval, or (`reranking=True`) reranking of
    the stored `candidates` lists.  source: "memory" (care.data.nano) or "loader" (mteb's loader on the
    `mteb` subset, whose top_ranked is always reranking_hybrid with its safeguard)."""
    import_mteb()
    from mteb.abstasks.task_metadata import TaskMetadata

    if source not in ("memory", "loader"):
        raise ValueError(f"source must be memory or loader, got {source!r}")
    if source == "loader" and (not safeguard or candidates != HYBRID):
        raise ValueError("source='loader' reads the mteb-top_ranked view as written (reranking_hybrid, with its "
                         "safeguard); use source='memory' for other candidate lists")
    folder = resolve(folder)
    if split not in nano_splits(folder):
        raise ValueError(f"{folder}: no split {split!r} (splits: {', '.join(nano_splits(folder))})")
    view = ""
    if reranking:
        view = ("_hybrid" if candidates == HYBRID else f"_{candidates}") + ("" if safeguard else "_nosg")
    what = ("full-corpus retrieval" if not reranking else
            f"reranking of the stored {candidates} candidates" + ("" if safeguard else ", safeguard removed"))
    metadata = TaskMetadata(
        name=f"{folder.name}_{split}{view}", description=f"Nano split {split} of {folder}: {what}",
        dataset={"path": str(folder), "revision": split_revision(folder, split)},
        type="Reranking" if reranking else "Retrieval", category="t2t", modalities=["text"], eval_splits=[split],
        eval_langs=LANGUAGES, main_score="ndcg_at_10", domains=["Medical"], license="not specified",
        annotations_creators="derived", dialect=[], sample_creation="found", bibtex_citation="")
    cls = type("Nano" + re.sub(r"\W", "", metadata.name.title()), (_task_class(),), {"metadata": metadata})
    return cls(folder, split, reranking, source, safeguard, candidates)


def run_mteb(encoder: Encoder | MtebEncoder, folder: str | Path, splits: Sequence[str] | None = None,
             reranking: bool = False, source: str = "memory", batch_size: int = 64,
             scores: Sequence[str] | None = MAIN_SCORES, results: str | os.PathLike | None = None,
             name: str | None = None, meta: Mapping[str, Any] | None = None,
             **task_options) -> dict[str, dict[str, float]]:
    """mteb.evaluate on each split of a Nano folder: {split: {score: value}} with mteb's `scores` (all of them
    when None) and its `main_score`.  Nothing is written unless `results` names a folder: mteb's result cache
    there (one `<folder name>_<split>[_hybrid].json` per split; results.py).  `name`, `meta`: the ModelMeta's
    name and caller-set fields (MtebEncoder), for an Encoder (an MtebEncoder carries its own)."""
    folder = resolve(folder)
    chosen = list(splits or nano_splits(folder))
    tasks = [nano_task(folder, s, reranking=reranking, source=source, **task_options) for s in chosen]
    if not isinstance(encoder, MtebEncoder) and (name or meta):
        encoder = MtebEncoder(encoder, name=name, meta=meta)
    result = mteb_evaluate(encoder, tasks, batch_size, results=results)
    out = {}
    for split, task_result in zip(chosen, result.task_results):
        row = next(r for r in task_result.scores[split] if r["hf_subset"] == "default")
        keep = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out[split] = {k: float(keep[k]) for k in scores if k in keep} if scores else keep
        out[split]["main_score"] = float(row["main_score"])
    return out
