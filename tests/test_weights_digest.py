"""A model folder's weights digest (care.models.hub.weights_digest), which keys embedding caches, stage
fingerprints and training runs: it covers every byte of every weight file, so two folders that differ in the
middle of model.safetensors never share cached vectors; and it is memoised by each file's identity (path,
size, mtime, inode, ctime), so a second call, in this process or the next, reads no weight file again.
References: the vectors of a direct, uncached encoding of the changed folder; the number of files hashed,
counted by wrapping the one hashing call."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from care.encoders import build_encoder
from care.encoders.cache import EmbeddingCache, embed
from care.models import hub

TEXTS = ["头痛怎么办", "发烧吃什么药", "糖尿病饮食"]


@pytest.fixture(autouse=True)
def _memo_in_tmp(tmp_path, monkeypatch):
    """The on-disk memo under this test's folder (it lives under the cache root: CARE_CACHE moves it), and an
    empty memo in this process."""
    monkeypatch.setenv("CARE_CACHE", str(tmp_path / "care-cache"))
    monkeypatch.setattr(hub, "_MEMO", {}, raising=False)


def flip_two_middle_bytes(path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid] ^= 0xFF
    data[mid + 1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_two_bytes_in_the_middle_change_the_digest_and_the_cached_vectors(tiny_bert_dir, tmp_path):
    first = shutil.copytree(tiny_bert_dir, tmp_path / "first")
    second = shutil.copytree(tiny_bert_dir, tmp_path / "second")
    weights = second / "model.safetensors"
    assert weights.stat().st_size > 4 << 20  # the middle is outside the first and last MiB
    flip_two_middle_bytes(weights)
    assert hub.weights_digest(first) != hub.weights_digest(second)

    cache = EmbeddingCache(tmp_path / "embeddings")
    for folder in (first, second):
        encoder = build_encoder({"kind": "dense", "path": str(folder), "max_length": 16}, device="cpu")
        before = cache.misses
        cached = embed(encoder, TEXTS, "document", cache, show_progress=False)
        assert cache.misses - before == len(TEXTS), f"{folder.name}: served another folder's vectors"
        np.testing.assert_array_equal(cached.dense, embed(encoder, TEXTS, "document", None, show_progress=False).dense)


def test_memo_reads_no_file_twice_and_a_changed_file_is_hashed_again(tiny_bert_dir, tmp_path, monkeypatch):
    folder = shutil.copytree(tiny_bert_dir, tmp_path / "model")
    hashed = []
    real = hub.file_digest
    monkeypatch.setattr(hub, "file_digest", lambda path, *a, **k: hashed.append(path.name) or real(path, *a, **k))

    digest = hub.weights_digest(folder)
    weight_files = sorted(hashed)
    assert "model.safetensors" in weight_files and "README.md" not in weight_files
    hashed.clear()
    assert hub.weights_digest(folder) == digest and hashed == []  # memoised in this process
    monkeypatch.setattr(hub, "_MEMO", {})  # as a new process (a cached evaluation run again)
    assert hub.weights_digest(folder) == digest and hashed == []  # memoised on disk
    assert list((tmp_path / "care-cache").rglob("*.json")), "no memo under the cache root"

    weights = folder / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert hub.weights_digest(folder) == digest and hashed == ["model.safetensors"]  # same bytes, re-read
    hashed.clear()
    # rewritten in place (same inode and size) with its mtime put back, as `cp -p` over it would: the
    # change of ctime, which no tool can set back, still re-hashes it
    stat = weights.stat()
    flip_two_middle_bytes(weights)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns and weights.stat().st_ino == stat.st_ino
    assert hub.weights_digest(folder) != digest and hashed == ["model.safetensors"]


def test_a_damaged_or_unwritable_memo_is_only_a_slower_digest(tiny_bert_dir, tmp_path, monkeypatch):
    folder = shutil.copytree(tiny_bert_dir, tmp_path / "model")
    digest = hub.weights_digest(folder)
    entries = list((tmp_path / "care-cache").rglob("*.json"))
    assert entries, "no memo under the cache root"
    for entry in entries:
        entry.write_text('{"size": 1, "xxh3', encoding="utf-8")  # torn
    monkeypatch.setattr(hub, "_MEMO", {})
    assert hub.weights_digest(folder) == digest
    # a cache root that cannot be written (a read-only share): hashed, nothing memoised on disk, no error
    monkeypatch.setenv("CARE_CACHE", "/proc/care-cache")
    monkeypatch.setattr(hub, "_MEMO", {})
    assert hub.weights_digest(folder) == digest
