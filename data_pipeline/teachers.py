"""The teachers of the score stage (data_pipeline/score.py): what `teacher=` names, and how it scores pairs.

What a teacher is (`resolve_teacher`), in this order:
1. an existing folder
   - holding care_training.json (a training run's final/ or best/): the model its record names, a
     cross-encoder when its family is one (`python train.py model=me5_reranker`), else a bi-encoder;
   - whose config.json names a `*ForSequenceClassification` architecture: a cross-encoder when the model has
     one label (bge-reranker-v2-m3 has), refused otherwise (a classifier, not a relevance scorer);
   - else a folder care.encoders.detect recognises (M3 head files, or a Hugging Face config.json): a
     bi-encoder built like `model=` (pooling, prefixes), as evaluate.py's ckpt= builds one;
   - else refused, in one line naming the folder and what was expected;
2. else the name of a conf/model/<name>.yaml: a bi-encoder, composed under this run's roots;
3. else refused.

How each scores a (query, passage) pair:
- cross-encoder: the raw logit of the pair tokenized as a pair (truncated, longest first, to max_length), as
  FlagEmbedding's reranker returns it without normalisation (no sigmoid): care.encoders.cross_encoder's
  score_pairs, the one scoring path evaluation uses too.  Scores are cached in chunks
  (PairScoreCache) under the teacher's fingerprint: its folder's weights_digest (care/models/hub.py), the token
  limit, the truncation and the score it returns.
- bi-encoder: the score evaluate.py's retrieval gives (care/retrieval/scorer.py EncodedPair.score): the inner
  product of the dense vectors, query side against document side, or with several heads their `hybrid`
  weighted mean.  Every distinct text is embedded once, through the embedding cache (care/encoders/cache.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from care.config import CONF_DIR, model_config
from care.data.io import atomic_open
from care.encoders import build_encoder, detect
from care.encoders.cache import EmbeddingCache, list_hash, text_key
from care.encoders.cross_encoder import CrossEncoder, pair_fingerprint
from care.encoders.prompts import legacy_keyed
from care.encoders.registry import TRAINING_RECORD
from care.evaluation.corpora import evaluation_model
from care.families import family_of, tower_configs
from care.models.hub import weights_digest
from care.progress import progress

log = logging.getLogger(__name__)
NO_TEACHER = ("no teacher given: pass teacher=FOLDER (a cross-encoder folder such as bge-reranker-v2-m3, or an "
              "encoder folder such as a training run's final/) or teacher=NAME (a conf/model name, e.g. me5_small)")


def folder_kind(folder: Path) -> str | None:
    """"cross-encoder" for a one-label sequence classifier folder, "classifier" for one with more labels, None
    for anything else (a training record comes first: its family says, whatever the config says)."""
    if (folder / TRAINING_RECORD).is_file():
        record = json.loads((folder / TRAINING_RECORD).read_text(encoding="utf-8"))
        return "cross-encoder" if family_of(record.get("model") or {}).cross_encoder else None
    if not (folder / "config.json").is_file():
        return None
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return None
    # transformers writes id2label for any label count but its default (2), which it leaves out
    labels = len(config["id2label"]) if config.get("id2label") else int(config.get("num_labels", 2))
    return "cross-encoder" if labels == 1 else f"classifier with {labels} labels"


def resolve_teacher(name, cfg) -> dict:
    """{"name", "kind", "folder" (cross-encoder) or "model" (bi-encoder config)} for `teacher=name`."""
    if name is None or not str(name).strip():
        raise ValueError(NO_TEACHER)
    name = str(name)
    folder = Path(name).expanduser()
    if folder.is_dir():
        folder = folder.resolve()
        kind = folder_kind(folder)
        if kind == "cross-encoder":
            return {"name": name, "kind": kind, "folder": str(folder)}
        if kind is not None:
            raise ValueError(f"teacher={name}: {folder} is a sequence {kind} (config.json); a cross-encoder "
                             "teacher has one output, its relevance logit (num_labels 1)")
        model = detect(folder, OmegaConf.to_container(cfg.model, resolve=True) if OmegaConf.is_config(cfg)
                       else dict(cfg["model"]))
        if model is None:
            raise ValueError(
                f"teacher={name}: {folder} is neither a cross-encoder folder (config.json naming a "
                "*ForSequenceClassification architecture with one label) nor an encoder folder "
                "(care_training.json, M3 head files or a Hugging Face config.json)")
        return {"name": name, "kind": "bi-encoder", "model": model}
    if (CONF_DIR / "model" / f"{name}.yaml").is_file():
        return {"name": name, "kind": "bi-encoder", "model": model_config(name, cfg)}
    known = ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
    raise ValueError(f"teacher={name}: no such folder ({folder.resolve()}) and no conf/model/{name}.yaml "
                     f"(a model name is one of: {known})")


def teacher_identity(spec: dict, opts: dict) -> dict:
    """What the teacher's scores depend on, without loading it (the stage fingerprint: a skipped run loads
    nothing)."""
    if spec["kind"] == "cross-encoder":
        return {"kind": spec["kind"], "folder": spec["folder"],
                "fingerprint": cross_fingerprint(spec["folder"], opts)}
    model = evaluation_model(spec["model"], opts.get("max_length"))
    return {"kind": spec["kind"], "model": legacy_keyed(model),
            "weights": [weights_digest(t["path"]) for t in tower_configs(model)],
            "heads": opts.get("heads"), "hybrid_weights": opts.get("hybrid_weights")}


def cross_fingerprint(folder: str, opts: dict) -> str:
    return pair_fingerprint(folder, int(opts["max_length"]))


def pair_key(query: str, passage: str) -> bytes:
    return hashlib.sha256(text_key(query) + text_key(passage)).digest()[:16]


class PairScoreCache:
    """`<root>/<teacher fingerprint>/<list_hash of the chunk's pair keys>.npz`, each chunk holding `keys` (one
    16-byte pair_key per pair), `scores` (float32) and the `fingerprint` it was written under; written
    atomically (care.data.io.atomic_open), so an interrupted run leaves whole chunks only.  `load` reads every
    chunk of the teacher; an unreadable or inconsistent one is reported and ignored (its pairs scored again)."""

    def __init__(self, root: str | Path | None, fingerprint: str):
        self.fingerprint = fingerprint
        self.folder = Path(root) / fingerprint if root else None
        self.chunks_read = self.chunks_written = 0

    def load(self) -> dict[bytes, float]:
        known: dict[bytes, float] = {}
        for path in sorted(self.folder.glob("*.npz")) if self.folder and self.folder.is_dir() else []:
            try:
                with np.load(path) as z:
                    keys, scores, fp = [bytes(k) for k in z["keys"]], z["scores"], str(z["fingerprint"])
            except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
                log.warning("teacher score chunk %s is unreadable (%s): ignored, its pairs scored again", path, e)
                continue
            if fp != self.fingerprint or len(keys) != len(scores) or list_hash(keys) != path.stem \
                    or not np.isfinite(scores).all():
                log.warning("teacher score chunk %s does not match its name or teacher: ignored", path)
                continue
            known.update(zip(keys, scores.tolist()))
            self.chunks_read += 1
        return known

    def put(self, keys: list[bytes], scores: np.ndarray) -> None:
        if self.folder is None:
            return
        with atomic_open(self.folder / f"{list_hash(keys)}.npz", "wb") as fh:
            np.savez(fh, keys=np.array(keys, dtype="V16"), scores=np.asarray(scores, np.float32),
                     fingerprint=np.array(self.fingerprint))
        self.chunks_written += 1


class CrossEncoderTeacher:
    kind = "cross-encoder"
    scale = "raw logit"

    def __init__(self, spec: dict, opts: dict):
        self.folder, self.opts = spec["folder"], opts
        self.name = spec["name"]
        self.fingerprint = cross_fingerprint(self.folder, opts)
        self.cache = PairScoreCache(opts.get("cache"), self.fingerprint)
        self.scorer = CrossEncoder(self.folder, max_length=int(opts["max_length"]), device=opts.get("device"),
                                   batch_size=int(opts["batch_size"]))
        self.counts = {"pairs_computed": 0, "pairs_cached": 0}

    def _score_chunk(self, pairs: list[tuple[str, str]], bar) -> np.ndarray:
        """Raw logits of one chunk of (query, passage) pairs (care.encoders.cross_encoder)."""
        return self.scorer.score_pairs([q for q, _ in pairs], [p for _, p in pairs], progress=bar)

    def score(self, queries: list[str], docs: list[str], pairs: np.ndarray) -> np.ndarray:
        keys = [pair_key(queries[q], docs[d]) for q, d in pairs.tolist()]
        known = self.cache.load()
        scores = np.array([known.get(k, np.nan) for k in keys], dtype=np.float64)
        missing = np.flatnonzero(np.isnan(scores))
        self.counts = {"pairs_computed": len(missing), "pairs_cached": len(keys) - len(missing)}
        step = int(self.opts["chunk_pairs"])
        with progress(total=len(keys), initial=len(keys) - len(missing), desc=f"score {Path(self.folder).name}",
                      unit="pair") as bar:
            for s in range(0, len(missing), step):
                rows = missing[s:s + step]
                chunk = self._score_chunk([(queries[q], docs[d]) for q, d in pairs[rows].tolist()], bar)
                self.cache.put([keys[i] for i in rows], chunk)
                scores[rows] = chunk
        return scores

    def cache_stats(self) -> dict:
        return {**self.counts, "chunks_read": self.cache.chunks_read, "chunks_written": self.cache.chunks_written,
                "folder": str(self.cache.folder) if self.cache.folder else None}


class BiEncoderTeacher:
    kind = "bi-encoder"

    def __init__(self, spec: dict, opts: dict):
        from care.retrieval.scorer import EncoderScorer

        self.opts, self.name = opts, spec["model"].get("label") or spec["model"].get("name") or spec["name"]
        self.model = evaluation_model(spec["model"], opts.get("max_length"))
        self.encoder = build_encoder(self.model, device=opts.get("device"))
        self.fingerprint = self.encoder.fingerprint
        self.cache = EmbeddingCache(opts["embedding_cache"]) if opts.get("embedding_cache") else None
        self.scorer = EncoderScorer(self.encoder, self.cache, batch_size=int(opts["batch_size"]),
                                    heads=opts.get("heads"), hybrid_weights=opts.get("hybrid_weights"))
        self.method = "hybrid" if "hybrid" in self.scorer.methods else self.scorer.methods[0]  # its one head
        self.scale = (f"{self.method} inner product" if self.method != "hybrid" else
                      "hybrid of " + " + ".join(f"{w:g}*{h}" for h, w in self.scorer.hybrid_weights.items()
                                                if h in self.scorer.heads and w) + " (/ their sum)")

    def score(self, queries: list[str], docs: list[str], pairs: np.ndarray) -> np.ndarray:
        scores = np.empty(len(pairs), dtype=np.float64)
        if not len(pairs):
            return scores
        encoded = self.scorer.prepare(queries, docs)
        order = np.argsort(pairs[:, 0], kind="stable")
        starts = np.flatnonzero(np.diff(pairs[order, 0], prepend=-1))
        for rows in progress(np.split(order, starts[1:]), desc="score pairs", unit="query", leave=False):
            scores[rows] = encoded.score(self.method, int(pairs[rows[0], 0]), pairs[rows, 1])
        return scores

    def cache_stats(self) -> dict:
        # the scorer's cache: a disabled one (embedding_cache=null) still counts the texts it encoded
        return {"embedding_cache": str(self.cache.root) if self.cache else None,
                "texts_cached": self.scorer.cache.hits, "texts_encoded": self.scorer.cache.misses}


def load_teacher(spec: dict, opts: dict):
    return (CrossEncoderTeacher if spec["kind"] == "cross-encoder" else BiEncoderTeacher)(spec, opts)
