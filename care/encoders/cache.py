"""An on-disk embedding cache, so re-runs and corpora shared between tasks are not encoded twice.

Layout: `<root>/<side fingerprint>/<side>-<heads>/<hash of a text list>.npz` (Encoder.side_fingerprint: an
ONNX side's includes the digest of the verified export that made its vectors, care/encoders/onnx_backend.py
export_identity, so a damaged export's vectors are never served as the model's).  Each chunk holds the
embeddings of one list of unique texts plus the SHA-256 of every text in it.  A request whose text list
was cached as a whole is one file read; otherwise the cache looks every text up across the chunks of
that encoder and side, encodes only the missing ones and stores them as a new chunk (so a task whose
candidates are a subset of another task's corpus costs nothing).

One chunk file (its arrays, the digests every read checks, the side fingerprint it records, atomic writes)
is care.encoders.cache_chunks.  A chunk that cannot be read or fails its digests (disk trouble, another
version) is reported once per cache object (a warning naming the file and what failed) and ignored, never
trusted: its texts count as missing, so they are encoded again and the chunk rewritten in place (`get`, when
the request holds every text of the chunk, and encode.py's `has_chunk`/`put_chunk`); a damaged chunk `get`
cannot rewrite whole is renamed `<name>.npz.damaged`, out of every later lookup.  A chunk of another
encoder side lying in this side's folder is refused (cache_chunks.ForeignChunkError).

`has_chunk` / `put_chunk` treat one text list as one chunk (encode.py: a shard of a corpus is one chunk,
so an interrupted run skips every finished shard).

numpy's .npz is the format: no library offers a content-addressed array store that is simpler.
"""
from __future__ import annotations

import hashlib
import logging
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from care.encoders.base import Embeddings, Encoder
from care.encoders.cache_chunks import (
    DamagedChunkError,
    concat,
    quarantine,
    read_chunk,
    unpack_rows,
    write_chunk,
)

log = logging.getLogger(__name__)
# On-disk folder name of each side ("doc", not "document": the name existing caches were written under).
SIDE_DIRS = {"query": "query", "document": "doc"}


def text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()[:16]


def list_hash(keys: Sequence[bytes]) -> str:
    h = hashlib.sha256()
    for k in keys:
        h.update(k)
    return h.hexdigest()[:24]


class EmbeddingCache:
    """`cache.get(fingerprint, side, heads, texts, encode)` returns embeddings for `texts` in order,
    calling `encode(missing_texts)` only for texts this encoder has never embedded on that side."""

    def __init__(self, root: str | Path | None, enabled: bool = True):
        # No default folder: every app passes its config's cache.dir (under cache_root, conf/roots.yaml), so a
        # cache the user moved is never silently read or filled at the default place.
        if root is None and enabled:
            raise ValueError("EmbeddingCache: an enabled cache needs its folder (the app config's cache.dir)")
        self.root = Path(root) if root is not None else None
        self.enabled = enabled
        self.hits = self.misses = 0  # texts served from disk / encoded, for reports and benches
        # per side (`embed`): texts encoded and the seconds spent encoding them (evaluate.py's per-row counts
        # and timings; a model's texts are encoded once per tower, the rest served from here)
        self.encoded = {side: 0 for side in SIDE_DIRS}
        self.encode_seconds = {side: 0.0 for side in SIDE_DIRS}
        self.damaged: list[Path] = []  # chunks found unreadable or damaged (each once), then ignored
        self.upgrade_legacy = True  # give a chunk written before digests its digests when first read whole

    def folder(self, fingerprint: str, side: str, heads: Sequence[str]) -> Path:
        """Where the chunks of one encoder side and set of heads live."""
        if side not in SIDE_DIRS:
            raise ValueError(f"side must be one of {tuple(SIDE_DIRS)}, got {side!r}")
        return self.root / fingerprint / f"{SIDE_DIRS[side]}-{'+'.join(heads)}"

    def _report(self, path: Path, what: str) -> None:
        """Warn once (per cache object) that a chunk is not trusted, naming it and what failed."""
        if path in self.damaged:
            return
        self.damaged.append(path)
        log.warning("ignoring %s embedding chunk %s: %s; its texts are encoded again and the chunk rewritten",
                    "unreadable" if what.startswith("cannot be read") else "damaged", path, what)

    def _read(self, path: Path, fingerprint: str, names: Sequence[str] | None = None) -> dict | None:
        """A chunk's arrays (only `names` when given; cache_chunks.read_chunk), or None when the file cannot be
        read or an array does not match its digest (reported once).  ForeignChunkError passes through."""
        try:
            return read_chunk(path, fingerprint, names, upgrade_legacy=self.upgrade_legacy)
        except DamagedChunkError as e:
            self._report(path, str(e))
            return None

    def _write(self, path: Path, keys: list[bytes], emb: Embeddings, fingerprint: str) -> dict:
        arrays = write_chunk(path, keys, emb, fingerprint)
        if path in self.damaged:  # rewritten: a later damage is reported again
            self.damaged.remove(path)
        return arrays

    def _locate(self, folder: Path, whole: Path, fingerprint: str, skip: frozenset[Path] | set[Path] = frozenset()
                ) -> dict[bytes, tuple[Path, int]]:
        """Where each cached text lives: one read when a chunk holds exactly the requested list, else the
        keys of every readable chunk of this encoder and side (but the chunks in `skip`: found damaged)."""
        if whole not in skip and whole.exists() and (index := self._read(whole, fingerprint, ["keys"])) is not None:
            return {bytes(k): (whole, row) for row, k in enumerate(index["keys"])}
        where: dict[bytes, tuple[Path, int]] = {}
        for path in sorted(p for p in folder.glob("*.npz") if p != whole and p not in skip):
            index = self._read(path, fingerprint, ["keys"])
            # "V16", not "S16": numpy strips trailing NUL bytes from S keys, losing ~1 key in 256.
            for row, k in enumerate([bytes(k) for k in index["keys"]] if index is not None else []):
                where.setdefault(k, (path, row))
        return where

    def _keys_of(self, path: Path) -> list[bytes] | None:
        """The keys of a damaged chunk, when they can be read and are those its name stands for (a chunk is
        named by the hash of its keys), else None: which texts rewriting it in place needs."""
        try:
            with np.load(path) as z:
                keys = [bytes(k) for k in z["keys"]]
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):
            return None
        return keys if keys and list_hash(keys) == path.stem else None

    # ---- one text list = one chunk (encode.py's shards) ---------------------------------------------------

    def chunk_path(self, fingerprint: str, side: str, heads: Sequence[str], texts: Sequence[str]) -> Path:
        """The file holding exactly `texts` (duplicates once) as one chunk: the one `get` reads for that list."""
        unique = list(dict.fromkeys(text_key(t) for t in texts))
        return self.folder(fingerprint, side, tuple(heads)) / f"{list_hash(unique)}.npz"

    def chunk_state(self, fingerprint: str, side: str, heads: Sequence[str], texts: Sequence[str]) -> str:
        """"ok" when `texts` are stored, whole, as one chunk whose every array matches its digest; "missing"
        when no such file exists; "damaged" when it exists but cannot be trusted (reported once; `put_chunk`
        rewrites it).  ForeignChunkError when another encoder's chunk sits under that name."""
        path = self.chunk_path(fingerprint, side, heads, texts)
        if not path.exists():
            return "missing"
        if (arrays := self._read(path, fingerprint)) is None:
            return "damaged"
        if [bytes(k) for k in arrays["keys"]] != list(dict.fromkeys(text_key(t) for t in texts)):
            self._report(path, "its keys are not those of the texts its name stands for")
            return "damaged"
        return "ok"

    def has_chunk(self, fingerprint: str, side: str, heads: Sequence[str], texts: Sequence[str]) -> bool:
        """Whether `texts` are stored, whole, as one chunk that passes its digests (see chunk_state)."""
        return self.chunk_state(fingerprint, side, heads, texts) == "ok"

    def put_chunk(self, fingerprint: str, side: str, heads: Sequence[str], texts: Sequence[str],
                  encode: Callable[[list[str]], Embeddings]) -> Path:
        """Encode `texts` (duplicates once) as a whole and store them as one chunk, atomically, whatever
        else the cache holds: a shard's vectors depend on the shard alone, not on what was cached before."""
        todo = list(dict.fromkeys(texts))
        path = self.chunk_path(fingerprint, side, heads, todo)
        self._write(path, [text_key(t) for t in todo], encode(todo), fingerprint)
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
        """Embeddings of `texts` in order (a repeated text is looked up and encoded once): the texts this encoder
        side has cached are read, the rest encoded by `encode(missing_texts)` and stored as one new chunk.  A
        chunk that fails its check when read counts as missing: its texts are encoded again (into the same file
        when this request holds all of them, else it is moved aside) and the lookup runs once more without it."""
        heads = tuple(heads)
        if not self.enabled or not texts:
            self.misses += len(texts)
            return encode(list(texts))
        keys = [text_key(t) for t in texts]
        unique = list(dict.fromkeys(keys))
        folder = self.folder(fingerprint, side, heads)
        whole = folder / f"{list_hash(unique)}.npz"  # the chunk of exactly this list, when it was stored whole
        skip: set[Path] = set()  # chunks found damaged and not rewritten: every lookup passes them over
        seen: set[Path] = set()  # every chunk this call found damaged (each rewritten or moved aside once)
        encoded = 0
        while True:  # one round, and one more for each chunk found damaged while reading the rows
            where = self._locate(folder, whole, fingerprint, skip)
            missing = [k for k in unique if k not in where]
            stored = self._store_missing(folder, missing, sorted(skip - seen), keys, texts, encode, fingerprint)
            fresh = {path: arrays for path, _, arrays in stored}
            where.update({k: (path, row) for path, group, _ in stored for row, k in enumerate(group)})
            for path in skip - seen - set(fresh):
                quarantine(path)  # damaged, and this request does not hold all of its texts to rewrite it
            seen |= skip
            skip -= set(fresh)  # rewritten in place: sound again
            encoded += len(missing)
            self.misses += len(missing)
            merged, row_of, damaged = self._gather(unique, where, fresh, fingerprint)
            if damaged is None:
                break
            if damaged in seen:  # rewritten by this call, yet failing again: the disk, not the chunk
                raise RuntimeError(f"embedding chunk {damaged} failed its check again after being rewritten")
            skip.add(damaged)
        self.hits += len(unique) - encoded
        return merged.select([row_of[k] for k in keys])

    def _store_missing(self, folder: Path, missing: list[bytes], damaged: list[Path], keys: list[bytes],
                       texts: Sequence[str], encode: Callable[[list[str]], Embeddings], fingerprint: str
                       ) -> list[tuple[Path, list[bytes], dict]]:
        """Encode the texts of the `missing` keys and store them: a `damaged` chunk whose texts are all missing is
        rewritten in place (its name is the hash of its keys), the rest become one new chunk.  (path, keys, the
        arrays written) for each chunk written."""
        todo = set(missing)
        groups = []
        for path in damaged:
            old = self._keys_of(path)
            if old and set(old) <= todo:
                groups.append((path, old))
                todo -= set(old)
        if rest := [k for k in missing if k in todo]:
            groups.append((folder / f"{list_hash(rest)}.npz", rest))
        if not groups:
            return []
        text_of = {k: t for k, t in reversed(list(zip(keys, texts)))}  # a key's first text
        return [(path, group, self._write(path, group, encode([text_of[k] for k in group]), fingerprint))
                for path, group in groups]

    def _gather(self, unique: list[bytes], where: dict[bytes, tuple[Path, int]], fresh: dict[Path, dict],
                fingerprint: str) -> tuple[Embeddings | None, dict[bytes, int], Path | None]:
        """The rows of the `unique` keys, read chunk by chunk (one fancy index per chunk; the chunks just written
        from memory): (the rows, each key's row among them, None), or (None, {}, the chunk) when a chunk fails
        its check."""
        rows_of: dict[Path, tuple[list[int], list[bytes]]] = {}
        for k in unique:
            path, row = where[k]
            rows, chunk_keys = rows_of.setdefault(path, ([], []))
            rows.append(row)
            chunk_keys.append(k)
        parts, order = [], []
        for path, (rows, chunk_keys) in rows_of.items():
            arrays = fresh.get(path) or self._read(path, fingerprint)
            if arrays is None:
                return None, {}, path
            parts.append(unpack_rows(arrays, np.array(rows, dtype=np.int64)))
            order.extend(chunk_keys)
        return concat(parts), {k: j for j, k in enumerate(order)}, None

def embed(encoder: Encoder, texts: Sequence[str], side: str, cache: EmbeddingCache | None = None,
          batch_size: int = 32, heads: Sequence[str] | None = None, show_progress: bool = True,
          task: str | None = None) -> Embeddings:
    """`texts` embedded by `encoder` on `side` ("query" or "document"), through `cache` when given: the one
    way evaluation, mining and dedup encode.  The cache is keyed by that side's fingerprint only, so a
    document cache survives a new query tower.  `heads` None: the encoder's `default_heads` (its first)."""
    heads = encoder.default_heads if heads is None else tuple(heads)
    encode_side = encoder.encode_queries if side == "query" else encoder.encode_documents

    def encode(todo: list[str]) -> Embeddings:
        start = time.perf_counter()
        out = encode_side(todo, batch_size=batch_size, heads=tuple(heads), show_progress=show_progress, task=task)
        if cache is not None:
            cache.encoded[side] += len(todo)
            cache.encode_seconds[side] += time.perf_counter() - start
        return out

    if cache is None:
        return encode(list(texts))
    return cache.get(encoder.side_fingerprint(side, task), side, tuple(heads), list(texts), encode)
