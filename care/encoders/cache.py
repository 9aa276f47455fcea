"""An on-disk embedding cache, so re-runs and corpora shared between tasks are not encoded twice.

Layout: `<root>/<side fingerprint>/<side>-<heads>/<hash of a text list>.npz` (Encoder.side_fingerprint).  Each chunk holds the
embeddings of one list of unique texts plus the SHA-256 of every text in it.  A request whose text list
was cached as a whole is one file read; otherwise the cache looks every text up across the chunks of
that encoder and side, encodes only the missing ones and stores them as a new chunk (so a task whose
candidates are a subset of another task's corpus costs nothing).  Chunks are written to a temporary
file and renamed into place, so an interrupted run never leaves a half chunk; an unreadable chunk
(disk trouble, another version) is reported and ignored, never trusted.

Every chunk also records the side fingerprint it was written under (a `fingerprint` array).  A chunk
whose recorded fingerprint is not its folder's (copied or synced into the wrong folder: another document
tower's vectors) is refused with ForeignChunkError, naming the file and both fingerprints; its vectors
are never used.  Chunks written before the array existed carry none and stay readable.

`has_chunk` / `put_chunk` treat one text list as one chunk (encode.py: a shard of a corpus is one chunk,
so an interrupted run skips every finished shard).

numpy's .npz is the format: no library offers a content-addressed array store that is simpler.
"""
from __future__ import annotations

import hashlib
import logging
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from care.data.io import atomic_open
from care.encoders.base import Embeddings, Encoder
from care.paths import cache_dir

log = logging.getLogger(__name__)
# On-disk folder name of each side ("doc", not "document": the name existing caches were written under).
SIDE_DIRS = {"query": "query", "document": "doc"}
FINGERPRINT = "fingerprint"  # the array in every chunk naming the side fingerprint it was written under


def default_root() -> Path:
    return cache_dir() / "embeddings"


def text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()[:16]


def list_hash(keys: Sequence[bytes]) -> str:
    h = hashlib.sha256()
    for k in keys:
        h.update(k)
    return h.hexdigest()[:24]


class ForeignChunkError(ValueError):
    """A chunk that records another side fingerprint than its folder's: another encoder's vectors."""


def _pack(keys: list[bytes], emb: Embeddings, fingerprint: str) -> dict[str, np.ndarray]:
    arrays = {"keys": np.array(keys, dtype="V16"), "dense": np.asarray(emb.dense, np.float32),
              FINGERPRINT: np.array(fingerprint)}
    if emb.sparse is not None:
        # CSR layout: row i's token ids are indices[indptr[i]:indptr[i+1]].
        arrays["sparse_indptr"] = np.cumsum([0] + [len(d) for d in emb.sparse]).astype(np.int64)
        arrays["sparse_indices"] = np.array([t for d in emb.sparse for t in d], np.int64)
        arrays["sparse_values"] = np.array([w for d in emb.sparse for w in d.values()], np.float32)
    if emb.colbert is not None:
        arrays["colbert_offsets"] = np.cumsum([0] + [len(c) for c in emb.colbert]).astype(np.int64)
        width = emb.colbert[0].shape[1] if emb.colbert else 0
        arrays["colbert"] = (np.concatenate(emb.colbert).astype(np.float32) if emb.colbert
                             else np.zeros((0, width), np.float32))
    return arrays


def _unpack(arrays, rows: np.ndarray) -> Embeddings:
    """Embeddings for the given row numbers of one chunk."""
    dense = arrays["dense"][rows]
    sparse = colbert = None
    if "sparse_indptr" in arrays:
        ptr, idx, val = arrays["sparse_indptr"], arrays["sparse_indices"], arrays["sparse_values"]
        sparse = [dict(zip(idx[ptr[r]:ptr[r + 1]].tolist(), val[ptr[r]:ptr[r + 1]].tolist())) for r in rows]
    if "colbert_offsets" in arrays:
        off, vec = arrays["colbert_offsets"], arrays["colbert"]
        colbert = [vec[off[r]:off[r + 1]] for r in rows]
    return Embeddings(dense=dense, sparse=sparse, colbert=colbert)


def _concat(parts: list[Embeddings]) -> Embeddings:
    dense = np.concatenate([p.dense for p in parts])
    sparse = [d for p in parts for d in p.sparse] if parts[0].sparse is not None else None
    colbert = [c for p in parts for c in p.colbert] if parts[0].colbert is not None else None
    return Embeddings(dense=dense, sparse=sparse, colbert=colbert)


class EmbeddingCache:
    """`cache.get(fingerprint, side, heads, texts, encode)` returns embeddings for `texts` in order,
    calling `encode(missing_texts)` only for texts this encoder has never embedded on that side."""

    def __init__(self, root: str | Path | None = None, enabled: bool = True):
        self.root = Path(root) if root is not None else default_root()
        self.enabled = enabled
        self.hits = self.misses = 0  # texts served from disk / encoded, for reports and benches

    def folder(self, fingerprint: str, side: str, heads: Sequence[str]) -> Path:
        """Where the chunks of one encoder side and set of heads live."""
        if side not in SIDE_DIRS:
            raise ValueError(f"side must be one of {tuple(SIDE_DIRS)}, got {side!r}")
        return self.root / fingerprint / f"{SIDE_DIRS[side]}-{'+'.join(heads)}"

    @staticmethod
    def _read(path: Path, fingerprint: str, names: Sequence[str] | None = None) -> dict | None:
        """A chunk's arrays (only `names` when given), or None when the file cannot be read.  A chunk that
        records another fingerprint than `fingerprint` (its folder's) is refused: ForeignChunkError."""
        try:
            with np.load(path) as z:
                recorded = str(z[FINGERPRINT]) if FINGERPRINT in z.files else None  # None: written before the array
                arrays = {k: z[k] for k in (z.files if names is None else names)}
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
            log.warning("ignoring unreadable embedding chunk %s (%s)", path, e)
            return None
        if recorded is not None and recorded != fingerprint:
            raise ForeignChunkError(
                f"embedding chunk {path} was written by another encoder side (fingerprint {recorded}) but lies in "
                f"the folder of fingerprint {fingerprint}: its vectors are not this encoder's and are never used. "
                f"Delete it (or move it to {path.parents[2] / recorded / path.parent.name}) and rerun.")
        return arrays

    def _write(self, path: Path, keys: list[bytes], emb: Embeddings, fingerprint: str, n_texts: int) -> dict:
        if len(emb) != n_texts:
            raise RuntimeError(f"encoder returned {len(emb)} embeddings for {n_texts} texts")
        arrays = _pack(keys, emb, fingerprint)
        with atomic_open(path, "wb") as fh:
            np.savez(fh, **arrays)
        return arrays

    def _locate(self, folder: Path, whole: Path, fingerprint: str) -> dict[bytes, tuple[Path, int]]:
        """Where each cached text lives: one read when a chunk holds exactly the requested list, else the
        keys of every readable chunk of this encoder and side."""
        if whole.exists() and (index := self._read(whole, fingerprint, ["keys"])) is not None:
            return {bytes(k): (whole, row) for row, k in enumerate(index["keys"])}
        where: dict[bytes, tuple[Path, int]] = {}
        for path in sorted(p for p in folder.glob("*.npz") if p != whole):
            index = self._read(path, fingerprint, ["keys"])
            # "V16", not "S16": numpy strips trailing NUL bytes from S keys, losing ~1 key in 256.
            for row, k in enumerate([bytes(k) for k in index["keys"]] if index is not None else []):
                where.setdefault(k, (path, row))
        return where

    # ---- one text list = one chunk (encode.py's shards) ---------------------------------------------------

    def chunk_path(self, fingerprint: str, side: str, heads: Sequence[str], texts: Sequence[str]) -> Path:
        """The file holding exactly `texts` (duplicates once) as one chunk: the one `get` reads for that list."""
        unique = list(dict.fromkeys(text_key(t) for t in texts))
        return self.folder(fingerprint, side, tuple(heads)) / f"{list_hash(unique)}.npz"

    def has_chunk(self, fingerprint: str, side: str, heads: Sequence[str], texts: Sequence[str]) -> bool:
        """Whether `texts` are stored, whole, as one readable chunk (ForeignChunkError when another
        encoder's chunk sits under that name)."""
        path = self.chunk_path(fingerprint, side, heads, texts)
        if not path.exists() or (index := self._read(path, fingerprint, ["keys"])) is None:
            return False
        return [bytes(k) for k in index["keys"]] == list(dict.fromkeys(text_key(t) for t in texts))

    def put_chunk(self, fingerprint: str, side: str, heads: Sequence[str], texts: Sequence[str],
                  encode: Callable[[list[str]], Embeddings]) -> Path:
        """Encode `texts` (duplicates once) as a whole and store them as one chunk, atomically, whatever
        else the cache holds: a shard's vectors depend on the shard alone, not on what was cached before."""
        todo = list(dict.fromkeys(texts))
        path = self.chunk_path(fingerprint, side, heads, todo)
        self._write(path, [text_key(t) for t in todo], encode(todo), fingerprint, len(todo))
        self.misses += len(todo)
        return path

    def check_folder(self, fingerprint: str, side: str, heads: Sequence[str]) -> int:
        """Refuse (ForeignChunkError) a folder holding any chunk another encoder wrote; the number of chunks."""
        folder = self.folder(fingerprint, side, tuple(heads))
        paths = sorted(folder.glob("*.npz"))
        for path in paths:
            self._read(path, fingerprint, [])
        return len(paths)

    def lookup(self, fingerprint: str, side: str, heads: Sequence[str], texts: Sequence[str]
               ) -> tuple[np.ndarray, np.ndarray]:
        """(found: bool per text, dense vectors of the found texts in order): what the cache already holds
        for `texts`, encoding nothing (the scale benchmark's real vectors)."""
        folder = self.folder(fingerprint, side, tuple(heads))
        where = self._locate(folder, folder / "-", fingerprint) if folder.is_dir() else {}
        keys = [text_key(t) for t in texts]
        found = np.array([k in where for k in keys], dtype=bool)
        rows_of: dict[Path, list[tuple[int, int]]] = {}
        for pos, k in enumerate(keys):
            if k in where:
                path, row = where[k]
                rows_of.setdefault(path, []).append((pos, row))
        width = None
        out: dict[int, np.ndarray] = {}
        for path, pairs in rows_of.items():
            dense = (self._read(path, fingerprint, ["dense"]) or {}).get("dense")
            if dense is None:
                found[[p for p, _ in pairs]] = False
                continue
            width = dense.shape[1]
            for pos, row in pairs:
                out[pos] = dense[row]
        vectors = np.stack([out[p] for p in np.flatnonzero(found)]) if found.any() else np.zeros((0, width or 0))
        return found, vectors.astype(np.float32)

    # ---- any text list ------------------------------------------------------------------------------------

    def get(self, fingerprint: str, side: str, heads: Sequence[str], texts: Sequence[str],
            encode: Callable[[list[str]], Embeddings]) -> Embeddings:
        heads = tuple(heads)
        if not self.enabled or not texts:
            self.misses += len(texts)
            return encode(list(texts))
        keys = [text_key(t) for t in texts]
        unique = list(dict.fromkeys(keys))
        folder = self.folder(fingerprint, side, heads)

        where = self._locate(folder, folder / f"{list_hash(unique)}.npz", fingerprint)
        chunks: dict[Path, dict] = {}
        missing = [k for k in unique if k not in where]
        if missing:
            first = {k: i for i, k in reversed(list(enumerate(keys)))}
            new_texts = [texts[first[k]] for k in missing]
            path = folder / f"{list_hash(missing)}.npz"
            chunks[path] = self._write(path, missing, encode(new_texts), fingerprint, len(new_texts))
            where.update({k: (path, row) for row, k in enumerate(missing)})
        self.misses += len(missing)
        self.hits += len(unique) - len(missing)

        # Read rows chunk by chunk (one fancy index per chunk), then put them in the requested order.
        rows_of: dict[Path, tuple[list[int], list[int]]] = {}
        for pos, k in enumerate(unique):
            path, row = where[k]
            rows_of.setdefault(path, ([], []))
            rows_of[path][0].append(row)
            rows_of[path][1].append(pos)
        parts, order = [], []
        for path, (rows, positions) in rows_of.items():
            arrays = chunks.get(path) or self._read(path, fingerprint)
            if arrays is None:
                raise RuntimeError(f"embedding chunk {path} became unreadable during the run; delete it and rerun")
            parts.append(_unpack(arrays, np.array(rows, dtype=np.int64)))
            order.extend(positions)
        merged = _concat(parts)
        # merged row j holds unique text order[j]; request row i wants unique text position[keys[i]].
        where_in_merged = {unique[p]: j for j, p in enumerate(order)}
        return merged.select([where_in_merged[k] for k in keys])


def embed(encoder: Encoder, texts: Sequence[str], side: str, cache: EmbeddingCache | None = None,
          batch_size: int = 32, heads: Sequence[str] = ("dense",), show_progress: bool = True,
          task: str | None = None) -> Embeddings:
    """`texts` embedded by `encoder` on `side` ("query" or "document"), through `cache` when given: the one
    way evaluation, mining and dedup encode.  The cache is keyed by that side's fingerprint only, so a
    document cache survives a new query tower."""
    encode_side = encoder.encode_queries if side == "query" else encoder.encode_documents

    def encode(todo: list[str]) -> Embeddings:
        return encode_side(todo, batch_size=batch_size, heads=tuple(heads), show_progress=show_progress, task=task)

    if cache is None:
        return encode(list(texts))
    return cache.get(encoder.side_fingerprint(side, task), side, tuple(heads), list(texts), encode)
