"""Where a model lives: a local folder or a hub id, resolved with messages that say what to do, a cheap
digest of a folder's weights (embedding caches and training runs are keyed by it), and the one loader of a
plain Hugging Face encoder that every model family shares."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel

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
    """A cheap, stable digest of a model folder: names, sizes and the first/last MiB of each weight file."""
    folder = Path(folder)
    if not folder.is_dir():
        return str(folder)
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.name in NOT_WEIGHTS:
            continue
        if f.suffix in {".safetensors", ".bin", ".pt", ".json", ".txt", ".model"} and f.is_file():
            size = f.stat().st_size
            h.update(f.name.encode() + str(size).encode())
            with f.open("rb") as fh:
                h.update(fh.read(1 << 20))
                if size > 2 << 20:
                    fh.seek(-(1 << 20), 2)
                    h.update(fh.read())
    return h.hexdigest()[:16]
