"""The encoder interface and the pieces every implementation shares."""
from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEADS = ("dense", "sparse", "colbert")


@dataclass
class Embeddings:
    """What an encoder returns for n texts.

    dense:   float32 [n, d]; L2-normalised unless the model says otherwise (CARE truncates after
             normalising, so its document vectors are not unit length).
    sparse:  one {token_id: weight} dict per text, when the model has a sparse head.
    colbert: one float32 [tokens, d'] array per text, when the model has a ColBERT head.
    """

    dense: np.ndarray
    sparse: list[dict[int, float]] | None = None
    colbert: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.dense)


class Encoder(ABC):
    """Encode queries and documents.  Symmetric models use one network for both; asymmetric ones
    (CARE) use a small query network online and a large document network offline."""

    #: heads this encoder can produce, a subset of HEADS; "dense" always first.
    heads: tuple[str, ...] = ("dense",)
    #: a short human-readable name for tables ("me5_small", "bge-m3 (ft step 60)").
    name: str = "encoder"

    @abstractmethod
    def encode_queries(
        self, texts: Sequence[str], batch_size: int = 32, heads: Sequence[str] = ("dense",),
        show_progress: bool = False,
    ) -> Embeddings: ...

    @abstractmethod
    def encode_documents(
        self, texts: Sequence[str], batch_size: int = 32, heads: Sequence[str] = ("dense",),
        show_progress: bool = False,
    ) -> Embeddings: ...

    @abstractmethod
    def identity(self) -> dict:
        """Everything that changes the vectors (weights hash, pooling, prefixes, max length).
        `fingerprint` hashes it; embedding caches are keyed by it."""

    @property
    def fingerprint(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, ensure_ascii=False).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    @abstractmethod
    def online_parameters(self) -> int:
        """Parameters that run at query time (the query tower of an asymmetric model)."""

    def check_heads(self, heads: Sequence[str]) -> None:
        missing = [h for h in heads if h not in self.heads]
        if missing:
            raise ValueError(f"{self.name} has no {missing} head(s); it has {list(self.heads)}")


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


def weights_digest(folder: str | Path) -> str:
    """A cheap, stable digest of a model folder: names, sizes and the first/last MiB of each weight file."""
    folder = Path(folder)
    if not folder.is_dir():
        return str(folder)
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.name in {"manifest.json", "README.md"}:  # build notes, not weights: rebuilding must not re-key caches
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
