"""The dedup recipe (data_pipeline/dedup/) as datatrove pipeline steps: `dedup.engine=datatrove`.

Each step is a datatrove PipelineStep run by an executor (executors.py) as tasks; dedup_engine.py chains them.
A text is known everywhere by its position in the stage's input (the rows the role/source filters keep, in
file order), so "earliest" means "smallest position" whatever the number of tasks, and every output is the
native engine's (tests/test_dedup_datatrove.py).  Why not datatrove's own dedup steps (measured on the import
store): its MinHash shingles word 5-grams of a text stripped of punctuation and digits (a Chinese text is one
"word" unless a segmenter is loaded, and `language="zh"` silently loads spaCy's multilingual one), hashes in
64-bit arithmetic instead of datasketch's 32-bit one, writes only consecutive pairs of a bucket, unverified, and
keeps the largest cluster's root, not the earliest text; its exact dedup hashes 64 bits of xxhash where the
recipe compares whole MD5 digests.  What is datatrove's here: the executors and their per-task resume, the
PipelineStep stats and timing, DataFolder IO (a local folder or any fsspec URL), the reader base class, and
the signature files' layout (`bucket_BBB/RRRRR.minhash.sig`: rows x uint32 band values then a uint32
document number, as its MinhashDedupSignature writes them, here sorted by first value and position).  The arithmetic is the native engine's
own numpy code (minhash_numpy.py), run on a task's texts at once, not one text at a time.

The work folder (one per input, config and task count; dedup_engine.py):
  store/offsets.bin                 uint64 byte offset in the input of each position's line
  store/manifest.json               the input, the rows, the task ranges (`starts`)
  exact/sigs/BBB/RRRRR.bin          (md5 high, md5 low, position) of task R's texts whose digest falls in
                                    finder bucket B, sorted
  exact/clusters/BBB.bin            (kept, removed) positions of bucket B's duplicates, sorted
  minhash/sigs/bucket_BBB/RRRRR.minhash.sig   band B's values and position of task R's texts, sorted by
                                    first value and position
  minhash/candidates/BBB_HHH.bin    band B, hash range H: every pair in a bucket, as i << 32 | j (i < j), sorted
  minhash/verified/RRRRR.bin        (i, j, exact Jaccard) of task R's candidates at or above the threshold
  minhash/verified/RRRRR.json       how many distinct candidates task R checked
  minhash/clusters.bin              (kept, removed) positions, sorted; clusters_edges.bin: (kept, weakest edge)
A stage's removals are (kept, removed) files; a later stage's signature step skips the removed positions.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import resource
import time
from collections.abc import Iterator, Sequence

import numpy as np
import orjson
from datatrove.data import Document, DocumentsPipeline
from datatrove.io import DataFolderLike, get_datafolder, open_file
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.readers.base import BaseReader

from data_pipeline.dedup.clusters import clusters_from_edges
from data_pipeline.dedup.minhash_numpy import band_groups, exact_jaccard, group_pairs, signature_matrix
from data_pipeline.dedup.normalize import Normalizer
from data_pipeline.dedup.shingle_ids import ShingleIds, shingle_ids_of_texts, sorted_unique

PAIRS = np.dtype([("kept", "<u8"), ("removed", "<u8")])
EXACT = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("pos", "<u8")])
EDGES = np.dtype([("i", "<u8"), ("j", "<u8"), ("sim", "<f8")])
MAX_POSITIONS = 1 << 32          # positions are uint32 in datatrove's signature layout and in pair codes
VERIFY_CHUNK = 1 << 21           # candidate pairs checked at once by a verify task (memory stays bounded)


# --- binary files in a DataFolder --------------------------------------------------------------------------

def write_array(folder, path: str, array: np.ndarray) -> None:
    with folder.open(path, "wb") as fh:
        fh.write(np.ascontiguousarray(array).tobytes())


def read_array(folder, path: str, dtype) -> np.ndarray:
    with folder.open(path, "rb") as fh:
        return np.frombuffer(fh.read(), dtype=dtype)


def sorted_slice(folder, path: str, dtype, lo: int, hi: int, width: int | None = None) -> np.ndarray:
    """The records of a sorted file whose key is in [lo, hi): the record itself, or with `width` the first
    of each row of `width` values.  A memory map on a local folder, so a task reads its slice only;
    elsewhere the whole file."""
    if folder.is_local():
        full = np.memmap(folder.resolve_paths(path), dtype=dtype, mode="r") if folder.size(path) else \
            np.zeros(0, dtype=dtype)
    else:
        full = read_array(folder, path, dtype)
    if width is not None:
        full = full.reshape(-1, width)
    keys = full[:, 0] if width is not None else full
    top = int(np.iinfo(keys.dtype).max)
    a = np.searchsorted(keys, lo, side="left") if lo <= top else len(keys)
    b = np.searchsorted(keys, hi, side="left") if hi <= top else len(keys)
    return np.array(full[a:b])


def removed_positions(work, stages: Sequence[str], lo: int, hi: int) -> np.ndarray:
    """Positions in [lo, hi) that the earlier stages removed, sorted."""
    parts = []
    for stage in stages:
        for path in work.list_files(f"{stage}/removed"):
            parts.append(sorted_slice(work, path, "<u8", lo, hi))
    return sorted_unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)


# --- the input by position -----------------------------------------------------------------------------------

def _loads(line: bytes) -> dict:
    """A row as json parses it: orjson (several times faster) gives the same strings where it accepts the
    line; what it refuses and json accepts (a lone surrogate escape, NaN) goes through json."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line.decode("utf-8"))


class TextStore:
    """The stage's input rows by position: the input file itself, read at the byte offsets the engine
    recorded (store/offsets.bin), so no copy of the texts is made and any task can read any text."""

    def __init__(self, work: DataFolderLike):
        self.work = get_datafolder(work)
        self._manifest = None
        self._offsets = None

    @property
    def manifest(self) -> dict:
        if self._manifest is None:
            with self.work.open("store/manifest.json", "rt") as fh:
                self._manifest = json.load(fh)
        return self._manifest

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            self._offsets = read_array(self.work, "store/offsets.bin", "<u8")
        return self._offsets

    def task_range(self, rank: int) -> tuple[int, int]:
        starts = self.manifest["starts"]
        return (starts[rank], starts[rank + 1]) if rank + 1 < len(starts) else (0, 0)

    def rows(self, positions: np.ndarray) -> list[dict]:
        """The rows at these positions (in the given order)."""
        out = []
        with open_file(self.manifest["input"], "rb") as fh:
            for offset in self.offsets[np.asarray(positions, dtype=np.int64)].tolist():
                fh.seek(offset)
                out.append(_loads(fh.readline()))
        return out

    def range_lines(self, lo: int, hi: int) -> Iterator[tuple[int, bytes]]:
        """(position, the row's line as bytes) for positions lo..hi-1, read as one span of the input."""
        if hi <= lo:
            return
        offsets = self.offsets[lo:hi]
        with open_file(self.manifest["input"], "rb") as fh:
            fh.seek(int(offsets[0]))
            span = fh.read(int(offsets[-1] - offsets[0]))
            span += fh.readline()
        base = int(offsets[0])
        for k, offset in enumerate(offsets.tolist()):
            start = offset - base
            end = span.find(b"\n", start)
            yield lo + k, span[start:end if end >= 0 else len(span)]

    def range_rows(self, lo: int, hi: int) -> Iterator[tuple[int, dict]]:
        """(position, row) for positions lo..hi-1."""
        for pos, line in self.range_lines(lo, hi):
            yield pos, _loads(line)


class StoreReader(BaseReader):
    """datatrove's reader for the stage's input: task r gets positions starts[r]..starts[r+1]-1 (contiguous, so
    the earliest text of a task is its first), each a Document with its position in metadata["pos"]."""

    name = "🗂 dedup input by position"

    def __init__(self, work: DataFolderLike):
        super().__init__()
        self.store = TextStore(work)

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        lo, hi = self.store.task_range(rank)
        for pos, row in self.store.range_rows(lo, hi):
            yield Document(text=row["text"], id=str(row["id"]), metadata={"pos": pos})
        self.stat_update("documents", value=hi - lo)   # once: per-document stats cost ~20% of a step


def _rss_mb() -> float:
    """This process's resident memory now (Linux; 0 elsewhere): a task's peak above it is the task's own."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return 0.0


class _DedupStep(PipelineStep):
    type = "🫂 - DEDUP"

    def __init__(self, work: DataFolderLike, normalize: dict, skip_stages: Sequence[str] = ()):
        super().__init__()
        self.work = get_datafolder(work)
        self.normalize = dict(normalize)
        self.skip_stages = list(skip_stages)

    @contextlib.contextmanager
    def measured(self):
        """datatrove's timing, plus the task's CPU seconds and its process's peak memory in the step's stats
        (summed and maxed over tasks in <logs>/<step>/stats.json: bench/scaleout_bench.py reads them)."""
        cpu, start = time.process_time(), _rss_mb()
        with self.track_time():
            yield
        self.stat_update("cpu_seconds", value=time.process_time() - cpu, unit="task")
        self.stat_update("start_rss_mb", value=start, unit="task")
        self.stat_update("peak_rss_mb", value=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, unit="task")

    def _texts(self, data: DocumentsPipeline, rank: int) -> tuple[np.ndarray, list[str]]:
        """The task's positions and normalised texts, less those an earlier stage removed."""
        docs = list(data or ())
        pos = np.fromiter((d.metadata["pos"] for d in docs), dtype=np.uint64, count=len(docs))
        if len(pos) and self.skip_stages:
            gone = removed_positions(self.work, self.skip_stages, int(pos[0]), int(pos[-1]) + 1)
            keep = ~np.isin(pos, gone)
            self.stat_update("skipped_removed_earlier", value=int((~keep).sum()))
            docs = [d for d, k in zip(docs, keep.tolist()) if k]
            pos = pos[keep]
        normalise = Normalizer(**self.normalize)
        self.stat_update("texts", value=len(docs))
        return pos, [normalise(d.text) for d in docs]


# --- exact: MD5 of the normalised text ---------------------------------------------------------------------

class ExactSignature(_DedupStep):
    """The MD5 digest of each normalised text (exact.py's key: the whole 128 bits), written per finder bucket."""

    name = "🎯 exact: digests"

    def __init__(self, work, normalize: dict, finders: int, skip_stages: Sequence[str] = ()):
        super().__init__(work, normalize, skip_stages)
        self.finders = finders

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with self.measured():
            pos, texts = self._texts(data, rank)
            digests = b"".join(hashlib.md5(t.encode("utf-8")).digest() for t in texts)
            halves = np.frombuffer(digests, dtype=">u8").reshape(-1, 2).astype("<u8")
            records = np.zeros(len(pos), dtype=EXACT)
            records["hi"], records["lo"], records["pos"] = halves[:, 0], halves[:, 1], pos
            bucket = records["hi"] % np.uint64(self.finders)
            for b in range(self.finders):
                part = records[bucket == b]
                part = part[np.lexsort((part["pos"], part["lo"], part["hi"]))]
                write_array(self.work, f"exact/sigs/{b:03d}/{rank:05d}.bin", part)
        return iter(())


class ExactFind(_DedupStep):
    """Finder bucket `rank`: every group of equal digests keeps its smallest position (exact.py's rule)."""

    name = "🎯 exact: groups"

    def __init__(self, work):
        super().__init__(work, {})

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with self.measured():
            files = self.work.list_files(f"exact/sigs/{rank:03d}")
            recs = np.concatenate([read_array(self.work, f, EXACT) for f in files]) if files else \
                np.zeros(0, dtype=EXACT)
            recs = recs[np.lexsort((recs["pos"], recs["lo"], recs["hi"]))]
            same = (recs["hi"][1:] == recs["hi"][:-1]) & (recs["lo"][1:] == recs["lo"][:-1])
            dup = np.concatenate([[False], same])
            first = np.maximum.accumulate(np.where(~dup, np.arange(len(recs)), 0)) if len(recs) else \
                np.zeros(0, dtype=np.int64)
            pairs = np.zeros(int(dup.sum()), dtype=PAIRS)
            pairs["kept"], pairs["removed"] = recs["pos"][first[dup]], recs["pos"][dup]
            pairs = pairs[np.lexsort((pairs["removed"], pairs["kept"]))]
            write_array(self.work, f"exact/clusters/{rank:03d}.bin", pairs)
            write_array(self.work, f"exact/removed/{rank:03d}.bin", np.sort(pairs["removed"]))
            self.stat_update("removed", value=len(pairs))
        return iter(())


# --- MinHash LSH, every bucket pair verified by exact Jaccard ------------------------------------------------

class MinhashSignature(_DedupStep):
    """Character n-gram shingles and the recipe's 32-bit datasketch signature of the task's texts at once
    (shingle_ids_of_texts, signature_matrix), then each band's values and positions, sorted, in datatrove's
    signature layout."""

    name = "🎯 MinHash: signatures"

    def __init__(self, work, normalize: dict, ngram: int, num_perm: int, seed: int, bands: int, rows: int,
                 skip_stages: Sequence[str] = ()):
        super().__init__(work, normalize, skip_stages)
        self.ngram, self.num_perm, self.seed, self.bands, self.rows = ngram, num_perm, seed, bands, rows

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with self.measured():
            pos, texts = self._texts(data, rank)
            sig = signature_matrix(shingle_ids_of_texts(texts, self.ngram), self.num_perm, self.seed,
                                   self.bands * self.rows)
            for b in range(self.bands):
                records = np.empty((len(pos), self.rows + 1), dtype="<u4")
                records[:, :self.rows] = sig[b * self.rows:(b + 1) * self.rows].T
                records[:, self.rows] = pos
                # sorted by the first value (the bucket step's hash ranges), then position
                key = (records[:, 0].astype(np.uint64) << np.uint64(32)) | records[:, self.rows]
                records = records[np.argsort(key, kind="stable")]
                write_array(self.work, f"minhash/sigs/bucket_{b:03d}/{rank:05d}.minhash.sig", records)
        return iter(())


def hash_bounds(work, band: int, rows: int, ranges: int) -> np.ndarray:
    """Split points of a band's first value into `ranges` parts of about equal size, read from the band's
    first non-empty signature file (as datatrove's MinhashDedupBuckets does), the same for every task.
    Minimum hashes crowd towards 0, so equal-width ranges would not balance."""
    edges = np.array([0, 1 << 32], dtype=np.uint64)
    if ranges <= 1:
        return edges
    for path in work.list_files(f"minhash/sigs/bucket_{band:03d}"):
        first = read_array(work, path, "<u4").reshape(-1, rows + 1)[:, 0]
        if len(first):
            inner = first[(np.arange(1, ranges) * len(first)) // ranges].astype(np.uint64)
            return np.concatenate([[0], inner, [1 << 32]]).astype(np.uint64)
    return edges


class MinhashBuckets(_DedupStep):
    """The units (band, hash range) rank, rank + tasks, ...: the texts whose band values are all equal, every
    pair of them (minhash_numpy's grouping and pairing, not only neighbours), written as sorted pair codes.
    A unit holds about BUCKET_RECORDS records whatever the corpus size (dedup_engine.py sets `ranges`)."""

    name = "🎯 MinHash: buckets"

    def __init__(self, work, bands: int, rows: int, ranges: int):
        super().__init__(work, {})
        self.bands, self.rows, self.ranges = bands, rows, ranges

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with self.measured():
            for unit in range(rank, self.bands * self.ranges, world_size):
                self._unit(*divmod(unit, self.ranges))
        return iter(())

    def _unit(self, band: int, h: int) -> None:
        bounds = hash_bounds(self.work, band, self.rows, self.ranges)
        parts = [sorted_slice(self.work, path, "<u4", int(bounds[h]), int(bounds[h + 1]), width=self.rows + 1)
                 for path in self.work.list_files(f"minhash/sigs/bucket_{band:03d}")]
        records = np.concatenate(parts) if parts else np.zeros((0, self.rows + 1), dtype="<u4")
        order, starts, sizes = band_groups(np.ascontiguousarray(records[:, :self.rows].T))
        a, b = group_pairs(order, starts, sizes)
        pa, pb = records[a, self.rows].astype(np.uint64), records[b, self.rows].astype(np.uint64)
        codes = sorted_unique((np.minimum(pa, pb) << np.uint64(32)) | np.maximum(pa, pb))
        write_array(self.work, f"minhash/candidates/{band:03d}_{h:03d}.bin", codes)
        self.stat_update("pairs", value=len(codes))


def pair_jaccard(store: TextStore, normalize: dict, ngram: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Exact Jaccard of the shingle sets of the texts at positions i[k], j[k] (minhash_numpy.exact_jaccard
    on the texts read by position)."""
    if not len(i):
        return np.zeros(0, dtype=np.float64)
    needed = sorted_unique(np.concatenate([i, j]).astype(np.int64))
    normalise = Normalizer(**normalize)
    sh: ShingleIds = shingle_ids_of_texts([normalise(r["text"]) for r in store.rows(needed)], ngram)
    return exact_jaccard(sh, np.searchsorted(needed, i.astype(np.int64)), np.searchsorted(needed, j.astype(np.int64)))


class MinhashVerify(_DedupStep):
    """Task r: the candidate pairs whose first text is in task r's range, each once, kept when their exact
    Jaccard reaches the threshold."""

    name = "🎯 MinHash: exact Jaccard"

    def __init__(self, work, normalize: dict, ngram: int, threshold: float):
        super().__init__(work, normalize)
        self.ngram, self.threshold = ngram, threshold

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        store = TextStore(self.work)
        lo, hi = store.task_range(rank)
        with self.measured():
            parts = [sorted_slice(self.work, path, "<u8", lo << 32, hi << 32)
                     for path in self.work.list_files("minhash/candidates")]
            codes = sorted_unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)
            kept = []
            for c0 in range(0, len(codes), VERIFY_CHUNK):
                chunk = codes[c0:c0 + VERIFY_CHUNK]
                i, j = chunk >> np.uint64(32), chunk & np.uint64(0xFFFFFFFF)
                sims = pair_jaccard(store, self.normalize, self.ngram, i, j)
                ok = sims >= self.threshold
                edges = np.zeros(int(ok.sum()), dtype=EDGES)
                edges["i"], edges["j"], edges["sim"] = i[ok], j[ok], sims[ok]
                kept.append(edges)
            edges = np.concatenate(kept) if kept else np.zeros(0, dtype=EDGES)
            write_array(self.work, f"minhash/verified/{rank:05d}.bin", edges)
            with self.work.open(f"minhash/verified/{rank:05d}.json", "wt") as fh:
                json.dump({"candidates": len(codes), "verified": len(edges)}, fh)
            self.stat_update("candidates", value=len(codes))
            self.stat_update("verified", value=len(edges))
        return iter(())


class MinhashCluster(_DedupStep):
    """One task: the verified pairs' connected components (clusters.py), each kept at its smallest position."""

    name = "🎯 MinHash: clusters"

    def __init__(self, work):
        super().__init__(work, {})

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with self.measured():
            files = [f for f in self.work.list_files("minhash/verified") if f.endswith(".bin")]
            edges = np.concatenate([read_array(self.work, f, EDGES) for f in files]) if files else \
                np.zeros(0, dtype=EDGES)
            # only the texts that have an edge: memory follows the duplicates, not the corpus
            nodes = sorted_unique(np.concatenate([edges["i"], edges["j"]]))
            clusters = clusters_from_edges(len(nodes), np.searchsorted(nodes, edges["i"]),
                                           np.searchsorted(nodes, edges["j"]), edges["sim"])
            kept = nodes[np.array([c.kept for c in clusters], dtype=np.int64)]
            sizes = np.array([len(c.removed) for c in clusters], dtype=np.int64)
            pairs = np.zeros(int(sizes.sum()), dtype=PAIRS)
            pairs["kept"] = np.repeat(kept, sizes)
            pairs["removed"] = nodes[np.concatenate([np.array(c.removed, dtype=np.int64) for c in clusters] or
                                                    [np.zeros(0, dtype=np.int64)])]
            weakest = np.zeros(len(clusters), dtype=[("kept", "<u8"), ("min_edge", "<f8")])
            weakest["kept"], weakest["min_edge"] = kept, [c.min_edge for c in clusters]
            write_array(self.work, "minhash/clusters.bin", pairs)
            write_array(self.work, "minhash/clusters_edges.bin", weakest)
            write_array(self.work, "minhash/removed/000.bin", np.sort(pairs["removed"]))
            self.stat_update("clusters", value=len(clusters))
        return iter(())
