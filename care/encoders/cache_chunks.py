"""One chunk file of the embedding cache (care.encoders.cache): the arrays it holds, their digests, and how it
is written, read back with checks, or moved aside.

A chunk is one numpy .npz: `keys` (one 16-byte text key per row), the arrays of the heads it holds (`dense`,
sparse in CSR, ColBERT; the heads are in its folder's name, care.encoders.cache), `fingerprint` (the side fingerprint it was written under) and `digests`.  It is written to a
temporary file and renamed into place, so an interrupted run never leaves a half chunk.

Every chunk carries the xxh3_128 digest of each of its arrays (dtype, shape and raw bytes), in the `digests`
array (JSON text) written in the same atomic write; every read checks the arrays it reads against it.  A chunk
that cannot be parsed or whose arrays do not match their digests (keys intact, vectors damaged) is
DamagedChunkError; the cache reports it and encodes its texts again.  Chunks written before digests existed
(no `digests` array) are verified once by the zip's own CRC-32 of each member when first read whole, then
rewritten (same arrays) with their digests; one that fails the CRC is damaged as above.

A chunk whose recorded fingerprint is not its folder's (copied or synced into the wrong folder: another
document tower's vectors) is refused with ForeignChunkError, naming the file and both fingerprints; its
vectors are never used.  Chunks written before the array existed carry none and stay readable.
"""
from __future__ import annotations

import json
import logging
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from care.data.io import atomic_open
from care.encoders.base import Embeddings

log = logging.getLogger(__name__)
FINGERPRINT = "fingerprint"  # the array in every chunk naming the side fingerprint it was written under
DIGESTS = "digests"  # the array (JSON text) in every chunk holding {"xxh3_128": {array name: hex digest}}
DIGEST_ALGO = "xxh3_128"


class ForeignChunkError(ValueError):
    """A chunk that records another side fingerprint than its folder's: another encoder's vectors."""


class DamagedChunkError(Exception):
    """A chunk that cannot be read, or whose arrays do not match their digests; the message says what failed."""


def array_digest(a: np.ndarray) -> str:
    """xxh3_128 of an array's dtype, shape and raw bytes (~2 ms for 20,000 x 384 float32)."""
    a = np.ascontiguousarray(a)
    h = xxhash.xxh3_128(f"{a.dtype.str}{a.shape}".encode())
    h.update(a)
    return h.hexdigest()


def _seal(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays` plus the digests array covering every one of them."""
    digests = {k: array_digest(v) for k, v in arrays.items() if k != DIGESTS}
    return {**{k: v for k, v in arrays.items() if k != DIGESTS},
            DIGESTS: np.array(json.dumps({DIGEST_ALGO: digests}, sort_keys=True))}


def _mismatch(arrays: dict[str, np.ndarray], stored: np.ndarray, complete: bool) -> str | None:
    """What fails when `arrays` (read from a chunk) are checked against its stored digests; None if nothing.
    `complete`: `arrays` are all of the chunk's arrays, so each digested array must be among them."""
    try:
        digests = json.loads(str(stored))[DIGEST_ALGO]
        assert isinstance(digests, dict)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        return f"its digests array cannot be parsed ({e!r})"
    for name, a in arrays.items():
        if name not in digests:
            return f"array {name!r} has no digest"
        if array_digest(a) != digests[name]:
            return f"array {name!r} does not match its {DIGEST_ALGO} digest"
    if complete and (lost := sorted(set(digests) - set(arrays))):
        return f"arrays {lost} are digested but absent"
    return None


def _pack(keys: list[bytes], emb: Embeddings, fingerprint: str) -> dict[str, np.ndarray]:
    arrays = {"keys": np.array(keys, dtype="V16")}
    if emb.dense is not None:
        arrays["dense"] = np.asarray(emb.dense, np.float32)
    arrays[FINGERPRINT] = np.array(fingerprint)
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


def unpack_rows(arrays, rows: np.ndarray) -> Embeddings:
    """Embeddings for the given row numbers of one chunk."""
    dense = arrays["dense"][rows] if "dense" in arrays else None
    sparse = colbert = None
    if "sparse_indptr" in arrays:
        ptr, idx, val = arrays["sparse_indptr"], arrays["sparse_indices"], arrays["sparse_values"]
        sparse = [dict(zip(idx[ptr[r]:ptr[r + 1]].tolist(), val[ptr[r]:ptr[r + 1]].tolist())) for r in rows]
    if "colbert_offsets" in arrays:
        off, vec = arrays["colbert_offsets"], arrays["colbert"]
        colbert = [vec[off[r]:off[r + 1]] for r in rows]
    return Embeddings(dense=dense, sparse=sparse, colbert=colbert)


def concat(parts: list[Embeddings]) -> Embeddings:
    dense = np.concatenate([p.dense for p in parts]) if parts[0].dense is not None else None
    sparse = [d for p in parts for d in p.sparse] if parts[0].sparse is not None else None
    colbert = [c for p in parts for c in p.colbert] if parts[0].colbert is not None else None
    return Embeddings(dense=dense, sparse=sparse, colbert=colbert)


def write_chunk(path: Path, keys: list[bytes], emb: Embeddings, fingerprint: str) -> dict[str, np.ndarray]:
    """Store `emb` (one row per key) as the chunk `path`, atomically, with its digests; the arrays written."""
    if len(emb) != len(keys):
        raise RuntimeError(f"encoder returned {len(emb)} embeddings for {len(keys)} texts")
    arrays = _seal(_pack(keys, emb, fingerprint))
    with atomic_open(path, "wb") as fh:
        np.savez(fh, **arrays)
    return arrays


def read_chunk(path: Path, fingerprint: str, names: Sequence[str] | None = None,
               upgrade_legacy: bool = True) -> dict[str, np.ndarray]:
    """A chunk's arrays (only `names` when given), each checked against the chunk's digests.
    DamagedChunkError when the file cannot be read or an array does not match; ForeignChunkError when the chunk
    records another fingerprint than `fingerprint` (its folder's).  A chunk written before digests (none
    stored) read whole has just passed the zip's CRC-32 of every member: with `upgrade_legacy` it is
    rewritten with its digests."""
    try:
        with np.load(path) as z:
            stored = z[DIGESTS] if DIGESTS in z.files else None  # None: written before digests
            wanted = [k for k in (z.files if names is None else names) if k != DIGESTS]
            arrays = {k: z[k] for k in wanted}
            recorded = (arrays[FINGERPRINT] if FINGERPRINT in arrays
                        else z[FINGERPRINT] if FINGERPRINT in z.files else None)  # None: written before the array
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
        raise DamagedChunkError(f"cannot be read ({type(e).__name__}: {e})") from e
    if stored is not None:
        checked = arrays if recorded is None or FINGERPRINT in arrays else {**arrays, FINGERPRINT: recorded}
        if (what := _mismatch(checked, stored, complete=names is None)) is not None:
            raise DamagedChunkError(what)
    if recorded is not None and str(recorded) != fingerprint:
        raise ForeignChunkError(
            f"embedding chunk {path} was written by another encoder side (fingerprint {recorded}) but lies in "
            f"the folder of fingerprint {fingerprint}: its vectors are not this encoder's and are never used. "
            f"Delete it (or move it to {path.parents[2] / str(recorded) / path.parent.name}) and rerun.")
    if stored is None and names is None and upgrade_legacy:
        try:
            with atomic_open(path, "wb") as fh:
                np.savez(fh, **_seal(arrays))
            log.info("embedding chunk %s (written before digests) passed its CRC-32 check: digests added", path)
        except OSError as e:  # a read-only cache stays readable, without digests
            log.info("could not add digests to embedding chunk %s (%s)", path, e)
    return arrays


def quarantine(path: Path) -> None:
    """Move a damaged chunk out of every later lookup (kept beside, as `<name>.npz.damaged`)."""
    try:
        path.replace(path.with_name(path.name + ".damaged"))
        log.warning("moved damaged embedding chunk %s to %s.damaged", path, path.name)
    except OSError as e:
        log.warning("could not move damaged embedding chunk %s aside (%s)", path, e)
