"""mteb 2.x on this project's models and Nano datasets, offline.

    MtebEncoder(encoder)              any care.encoders.Encoder as an mteb model (EncoderProtocol)
    nano_task(folder, split)          one split of a Nano folder (docs/nano.md s.10) as an mteb retrieval task
    run_mteb(encoder, folder)         mteb.evaluate on every split -> {split: {ndcg_at_10, recall_at_100, ...}}

    python -m care.evaluation.mteb_adapter model=tiny_bert nano=outputs/data/nano/CMedNanoOpen [reranking=true]
    python -m care.evaluation.mteb_adapter ckpt=outputs/train/<run>/final nano=<folder> [splits=a,b]

What mteb needs, and how it is given (mteb 2.26.24):
- A model is anything with `encode(DataLoader, *, task_metadata, hf_split, hf_subset, prompt_type, **kw)`,
  `similarity`, `similarity_pairwise` and `mteb_model_meta` (mteb.models.models_protocols.EncoderProtocol).
  The ModelMeta is built here (`loader=None`, name `care/<model>`, revision = the encoder's fingerprint), so
  mteb never resolves the model by name nor asks the hub for it.
- mteb's prompt type picks the side: `document` -> `encode_documents`, `query` and None (symmetric tasks:
  STS, clustering) -> `encode_queries`, as evaluate.py embeds both STS sides as queries.  The project task type
  (its instruction, for an instruction prompt) comes from the mteb task type (TASK_TYPES), or per task name or
  type from `task_types=`.  mteb's own task prompts are not used: each encoder applies its configured prompts.
- Scores: `similarity="auto"` is cosine, except for encoders whose dense vectors are not unit length by design
  (CARE's document prefix, a truncated or unnormalised dense model), which get the dot product that
  evaluate.py's EncoderScorer uses.  For unit vectors the two are the same number.
- Data: `nano_task(..., source="memory")` (default) fills `task.dataset` from care.data.nano.load_split, with
  in-memory `datasets.Dataset`s: it reads any Nano folder (NanoCMTEB's hub layout too) and writes nothing.
  `source="loader"` reads the folder's `mteb` subset (configs mteb-corpus, mteb-queries, mteb-qrels,
  mteb-top_ranked, written by data_pipeline/nano/layout.py) with mteb's stock RetrievalDatasetLoader; the
  `datasets` cache it needs is a temporary folder, deleted once the rows are copied to memory.
- Caching: `mteb.evaluate(..., cache=None)` saves no results.  `import mteb` itself creates its result-cache
  folder (`ResultCache()` at import time, `$MTEB_CACHE` or ~/.cache/mteb): this module points MTEB_CACHE at
  the project cache (`<cache>/mteb`) unless it is set, before it imports mteb.
- Reranking (`reranking=True`): the task carries `top_ranked` = the `reranking_hybrid` lists, and mteb scores
  exactly those candidates (type "Reranking", queries embedded for the project's `retrieval` task as
  evaluate.py's `<split>_hybrid` view does); a positive the list lacks counts as missed in both.
- Ties: mteb hands trec_eval the raw float32 scores (ties then go by doc id, descending), as evaluate.py's
  retrieval view does; its candidate views hand it ranks after a seeded shuffle, so there an exact tie keeps
  the shuffled order.  Scores computed by torch (mteb) and faiss/numpy (evaluate.py) may also differ in the
  last float32 bit, so only a model whose scores have no (near-)ties gives the very same rankings.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from care.data.nano import HYBRID, config_files, load_split, resolve
from care.data.nano import splits as nano_splits
from care.encoders import Encoder
from care.encoders.cache import EmbeddingCache, embed
from care.paths import cache_dir

#: mteb task type -> the project's task type (care.encoders.prompts: the query instruction it takes)
TASK_TYPES = {"Retrieval": "retrieval", "InstructionRetrieval": "retrieval", "Reranking": "reranking",
              "InstructionReranking": "reranking", "STS": "sts", "PairClassification": "sts"}
#: the scores run_mteb returns per split (mteb's names; mteb's k values are 1, 3, 5, 10, 20, 100, 1000)
MAIN_SCORES = ("ndcg_at_10", "recall_at_100", "mrr_at_10")
MTEB_SUBSET = "mteb"  # the README subset of mteb views (data_pipeline/nano/layout.py)
LANGUAGES = ["cmn-Hans"]


def import_mteb():
    """`import mteb` with its import-time result cache kept out of the user's home (see the docstring)."""
    if "mteb" not in sys.modules:
        os.environ.setdefault("MTEB_CACHE", str(cache_dir() / "mteb"))
    import mteb

    return mteb


# ---- the model ---------------------------------------------------------------------------------------------

def default_similarity(encoder: Encoder) -> str:
    """"dot" for encoders whose dense vectors are not unit length by design (evaluate.py scores every encoder
    by the dot product), else "cosine"."""
    from care.encoders.care import CAREEncoder

    if isinstance(encoder, CAREEncoder) or not getattr(encoder, "normalize", True) \
            or getattr(encoder, "truncate_dim", None):
        return "dot"
    return "cosine"


def model_meta(encoder: Encoder, similarity: str, name: str | None = None, revision: str | None = None):
    """mteb's ModelMeta for a project encoder: no loader (mteb never builds or looks the model up)."""
    import_mteb()
    from mteb.models.model_meta import ModelMeta

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name or encoder.name).strip("_") or "encoder"
    prompts = encoder.prompts
    return ModelMeta(
        loader=None, name=slug if "/" in slug else f"care/{slug}", revision=revision or encoder.fingerprint,
        release_date=None, languages=LANGUAGES, n_parameters=encoder.online_parameters,
        n_embedding_parameters=encoder.online_embedding_parameters or None, memory_usage_mb=None,
        max_tokens=getattr(encoder, "max_length", None), embed_dim=None, license=None, open_weights=None,
        public_training_code=None, public_training_data=None, framework=["PyTorch"], reference=None,
        similarity_fn_name=similarity,
        use_instructions=bool(prompts.query or prompts.document or prompts.instructions),
        training_datasets=None, modalities=["text"], model_type=["dense"])


class MtebEncoder:
    """A project Encoder as an mteb 2.x encoder (EncoderProtocol): dense vectors, float32 numpy.

    task_types: {mteb task name or type: project task type}, ahead of TASK_TYPES.
    cache: a care.encoders.cache.EmbeddingCache to share vectors with evaluate.py (none by default)."""

    def __init__(self, encoder: Encoder, *, similarity: str = "auto", task_types: Mapping[str, str] | None = None,
                 cache: EmbeddingCache | None = None, batch_size: int | None = None, name: str | None = None,
                 revision: str | None = None):
        if similarity == "auto":
            similarity = default_similarity(encoder)
        if similarity not in ("cosine", "dot"):
            raise ValueError(f"similarity must be auto, cosine or dot, got {similarity!r}")
        self.encoder, self.similarity_name, self.cache, self.batch_size = encoder, similarity, cache, batch_size
        self.task_types = dict(task_types or {})
        self.mteb_model_meta = model_meta(encoder, similarity, name, revision)

    def with_task_types(self, task_types: Mapping[str, str]) -> MtebEncoder:
        """A wrapper of the same encoder (shared, not copied) with more task-type overrides."""
        other = copy.copy(self)
        other.task_types = {**self.task_types, **task_types}
        return other

    def project_task(self, task_metadata) -> str | None:
        t = self.task_types
        return t.get(task_metadata.name) or t.get(task_metadata.type) or TASK_TYPES.get(task_metadata.type)

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None,
               **kwargs: Any) -> np.ndarray:
        texts = [t for batch in inputs for t in batch["text"]]
        side = "document" if str(getattr(prompt_type, "value", prompt_type)) == "document" else "query"
        batch_size = self.batch_size or kwargs.get("batch_size") or 32
        emb = embed(self.encoder, texts, side, self.cache, batch_size, ("dense",),
                    bool(kwargs.get("show_progress_bar", False)), self.project_task(task_metadata))
        return np.ascontiguousarray(emb.dense, dtype=np.float32)

    def similarity(self, embeddings1, embeddings2):
        from mteb.similarity_functions import cos_sim, dot_score

        return (cos_sim if self.similarity_name == "cosine" else dot_score)(embeddings1, embeddings2)

    def similarity_pairwise(self, embeddings1, embeddings2):
        from mteb.similarity_functions import pairwise_cos_sim, pairwise_dot_score

        pairwise = pairwise_cos_sim if self.similarity_name == "cosine" else pairwise_dot_score
        return pairwise(embeddings1, embeddings2)

    def __repr__(self) -> str:
        return f"MtebEncoder({self.encoder.name}, similarity={self.similarity_name})"


# ---- the tasks -----------------------------------------------------------------------------------------------

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


# ---- running -------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_datasets():
    """No `datasets` progress bars while mteb maps its small in-memory datasets (restored afterwards)."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def run_mteb(encoder: Encoder | MtebEncoder, folder: str | Path, splits: Sequence[str] | None = None,
             reranking: bool = False, source: str = "memory", batch_size: int = 64,
             scores: Sequence[str] | None = MAIN_SCORES, **task_options) -> dict[str, dict[str, float]]:
    """mteb.evaluate on each split of a Nano folder, nothing cached or written: {split: {score: value}} with
    mteb's `scores` (all of them when None) and its `main_score`."""
    mteb = import_mteb()
    folder = resolve(folder)
    chosen = list(splits or nano_splits(folder))
    tasks = [nano_task(folder, s, reranking=reranking, source=source, **task_options) for s in chosen]
    model = encoder if isinstance(encoder, MtebEncoder) else MtebEncoder(encoder)
    model = model.with_task_types({t.metadata.name: t.care_task_type for t in tasks})
    with _quiet_datasets():
        result = mteb.evaluate(model, tasks, cache=None, co2_tracker=False, show_progress_bar=False,
                               encode_kwargs={"batch_size": batch_size, "show_progress_bar": False})
    out = {}
    for split, task_result in zip(chosen, result.task_results):
        row = next(r for r in task_result.scores[split] if r["hf_subset"] == "default")
        keep = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out[split] = {k: float(keep[k]) for k in scores if k in keep} if scores else keep
        out[split]["main_score"] = float(row["main_score"])
    return out


def encoder_from_config(overrides: Sequence[str]) -> Encoder:
    """The encoder evaluate.py builds for the same overrides: `model=<conf/model name>`, or a checkpoint folder
    as `ckpt=<folder>` or `model=<folder>` (built like evaluate.py's ckpt=, from the folder's own record or
    the `model` config), plus any evaluate override (`model.path=...`, `max_length=...`, `device=...`)."""
    from omegaconf import OmegaConf

    from care.config import load_config
    from care.encoders import build_encoder, detect
    from care.evaluation.corpora import evaluation_model

    rest = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "model" and ("/" in value or Path(value).expanduser().is_dir()):  # a folder, not a config name
            o = f"ckpt={value}"
        rest.append(o)
    cfg = OmegaConf.to_container(load_config("evaluate", rest), resolve=True)
    model = cfg["model"]
    if cfg.get("ckpt"):
        folder = Path(cfg["ckpt"]).expanduser().resolve()
        model = detect(folder, model) if folder.is_dir() else None
        if model is None:
            raise FileNotFoundError(f"ckpt={cfg['ckpt']}: not a model folder (no config.json, care_training.json "
                                    "or M3 head files)")
    return build_encoder(evaluation_model(model, cfg.get("max_length")), device=cfg.get("device"))


def main(argv: Sequence[str]) -> dict:
    """`model=... nano=<folder> [splits=a,b] [reranking=true] [source=loader]`; the rest are evaluate overrides."""
    own = {"nano": None, "splits": None, "reranking": "false", "source": "memory"}
    overrides = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq:
            raise ValueError(f"argument {arg!r}: expected key=value")
        if key in own:
            own[key] = value
        else:
            overrides.append(arg)
    if not own["nano"]:
        raise ValueError("nano=<folder>: give a Nano dataset folder (python -m data_pipeline stage=nano builds one)")
    encoder = encoder_from_config(overrides)
    reranking = own["reranking"].lower() in ("1", "true", "yes")
    splits = own["splits"].split(",") if own["splits"] else None
    got = run_mteb(encoder, own["nano"], splits, reranking=reranking, source=own["source"])
    names = [*MAIN_SCORES, "main_score"]
    print(f"mteb {import_mteb().__version__} | {encoder.name} | {resolve(own['nano'])}"
          + (" | reranking reranking_hybrid" if reranking else " | full-corpus retrieval"))
    print("| split | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for split, s in got.items():
        print(f"| {split} | " + " | ".join(f"{100 * s[n]:.2f}" if n in s else "-" for n in names) + " |")
    return got


if __name__ == "__main__":
    import care  # noqa: F401  (registers the config resolvers)
    from care.config import BAD_INPUT

    try:
        main(sys.argv[1:])
    except BAD_INPUT as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
