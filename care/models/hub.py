"""Where a model lives: a local folder or a hub id, resolved with messages that say what to do, the digest
of a folder's weights (embedding caches, stage fingerprints and training runs are keyed by it; whole files,
memoised), and the one loader of a plain Hugging Face encoder that every model family shares."""
from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel

from care.data.io import DataError, file_digest, read_json, write_json
from care.paths import cache_dir

# Families whose AutoModel adds a BERT pooler: no pooling mode here uses it, and a folder without one
# (multilingual-e5-small, our M3 checkpoints) would otherwise get a random pooler, a warning and phantom
# online parameters.
POOLER_FAMILIES = ("bert", "xlm-roberta", "roberta")


def resolve_model_path(name_or_path: str, build_hint: str = "") -> str:
    """Accept a local folder or a hub id.  A local-looking path that is missing gets a message that says
    what to do, instead of transformers' HFValidationError; a hub id with the hub offline likewise."""
    path = Path(os.path.expanduser(str(name_or_path)))
    looks_local = path.is_absolute() or str(name_or_path).startswith((".", "~")) or path.exists()
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path} is not a Hugging Face model folder (no config.json). {build_hint}".strip())
        return str(path)
    if looks_local:
        raise FileNotFoundError(f"model folder {path} does not exist. {build_hint}".strip())
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        from huggingface_hub import try_to_load_from_cache

        if try_to_load_from_cache(str(name_or_path), "config.json") is None:
            raise FileNotFoundError(
                f"model '{name_or_path}' is a hub id, the hub is offline (HF_HUB_OFFLINE=1) and it is not in "
                f"the local hub cache. Download it where the hub is reachable and pass its folder as the "
                f"model path. {build_hint}".strip())
    return str(name_or_path)


def local_folder(name_or_path: str | Path, build_hint: str = "") -> Path:
    """A local folder as is; a hub id (BAAI/bge-m3) through the hub cache, which also holds extra files
    such as M3's head weights."""
    resolved = resolve_model_path(str(name_or_path), build_hint)
    if Path(resolved).is_dir():
        return Path(resolved)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(resolved, ignore_patterns=["onnx/*", "*.onnx", "flax_model.msgpack",
                                                             "rust_model.ot", "tf_model.h5", "imgs/*"]))


def read_torch(path: str | Path):
    """torch.load(weights_only=True) on the CPU; a file that cannot be read (truncated, corrupt, missing) is a
    DataError naming it, so the app's one-line error says which file (care/errors.py)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (truncated zip, bad pickle, missing file: all say which file)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(path, None, None, f"cannot be read, corrupt or truncated ({type(e).__name__}: {first})") from None


def load_encoder_model(folder: str | Path, dtype: torch.dtype | None = None) -> nn.Module:
    """The plain Hugging Face encoder of a folder (an HF model folder or an M3 checkpoint), no pooler."""
    model_type = AutoConfig.from_pretrained(folder).model_type
    extra = {"add_pooling_layer": False} if model_type in POOLER_FAMILIES else {}
    return AutoModel.from_pretrained(folder, dtype=dtype, **extra)


#: Files of a model folder that are no part of its weights: build notes, the model card, the
#: sentence-transformers files (care.encoders.st_folder).  Adding or rewriting one never re-keys an embedding cache.
NOT_WEIGHTS = frozenset({"manifest.json", "README.md", "modules.json", "config_sentence_transformers.json",
                         "sentence_bert_config.json", "router_config.json"})


def weights_digest(folder: str | Path) -> str:
    """A digest of a model folder's weights: the name, size and whole-content xxh3_128 of each weight file,
    so folders that differ anywhere in their weights never share an embedding cache.  Each file's digest is
    memoised by its identity (`_file_identity`), in this process and under the cache root, so a second look
    at an unchanged 8 GB tower (a cached evaluation run again) reads none of it."""
    folder = Path(folder)
    if not folder.is_dir():
        return str(folder)
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.name in NOT_WEIGHTS:
            continue
        if f.suffix in {".safetensors", ".bin", ".pt", ".json", ".txt", ".model"} and f.is_file():
            h.update(f"{f.name}\0{f.stat().st_size}\0{memoised_digest(f)}\n".encode())
    return h.hexdigest()[:16]


# ---- the memo of each weight file's digest --------------------------------------------------------------
# path -> (identity, digest) in this process; on disk one small JSON per file under <cache root>/weights-digests
# (care.paths.cache_dir: the app's cache_root, conf/roots.yaml), so another process (the next evaluate.py) skips
# the read too.
_MEMO: dict[str, tuple[list[int], str]] = {}
MEMO_FOLDER = "weights-digests"
MEMO_ENTRIES = 2000  # past this many on disk, entries of files that no longer exist (temporary folders) go


def _file_identity(path: Path) -> list[int]:
    """What changes when a file's bytes may have: size, mtime, inode (a file replaced by a rename, as every
    writer here does), device, and ctime, which the kernel sets on every write and no tool can set back
    (`cp -p` over an existing file or `rsync --inplace -t` restore the mtime, not the ctime).  A new hard link
    also sets the ctime: that file is hashed once more."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns]


def memoised_digest(path: Path) -> str:
    """A file's whole-content xxh3_128, memoised by its identity (`_file_identity`) in this process and under
    the cache root: the weights of a model folder (weights_digest) and the files of a cached ONNX export
    (care/encoders/onnx_backend.py, checked before every session) are read once while unchanged."""
    path = path.resolve()
    identity = _file_identity(path)
    key = str(path)
    known = _MEMO.get(key)
    if known is not None and known[0] == identity:
        return known[1]
    entry = cache_dir() / MEMO_FOLDER / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        stored = read_json(entry)
        digest = stored["xxh3_128"] if stored["path"] == key and stored["identity"] == identity else None
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or torn: hash the file
        digest = None
    if digest is None:
        digest = file_digest(path, "xxh3_128", chars=None)
        with contextlib.suppress(OSError):  # a cache root that cannot be written: only slower next time
            write_json(entry, {"path": key, "identity": identity, "xxh3_128": digest})
            _prune(entry.parent)
    _MEMO[key] = (identity, digest)
    return digest


def _prune(memo: Path) -> None:
    entries = list(memo.glob("*.json"))
    if len(entries) <= MEMO_ENTRIES:
        return
    for entry in entries:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if not Path(read_json(entry)["path"]).exists():
                entry.unlink(missing_ok=True)
