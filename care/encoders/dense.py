"""A dense encoder over any Hugging Face backbone: pooling, optional prefixes, L2 normalisation,
optional Matryoshka truncation.  multilingual-e5-small and the tiny test models use it.

`backend` picks what runs the forward pass (the tokeniser, pooling and normalisation stay the same):

torch        the Hugging Face model in PyTorch (the class's default; the only one that trains, and the only one
             on a GPU)
onnx         the model exported to ONNX and run by ONNX Runtime (care/encoders/onnx_backend.py, which M3's
             backbone and a CARE query tower share), fp32: CPU only, needs `onnxruntime` and `onnx`.  The same
             network: vectors within ~1e-7 of torch's, every score of `evaluate.py` equal to the printed digit
             (tests/test_inference_backend.py); at 2 threads 1.05-2.1x the documents/s of the torch path, by the
             day's machine (bench/results/encode.json: 1.64-1.86x; docs/models.md "Faster CPU encoding").
             The export (10-20 s) is made once per model folder and cached under the cache root.
             What an app builds for inference is `auto` (care/encoders/registry.py build_encoder): this one on
             the CPU when onnxruntime is installed, else torch.
onnx_int8    that export dynamically quantised to int8 by ONNX Runtime (per-channel weights)
torch_int8   the torch model with every nn.Linear dynamically quantised to int8 (torch.ao, per-channel)

The int8 backends are faster still (2.3-3.7x) but not offered for scores: on me5_small they move benchmark slots
by up to 1.1 (onnx_int8, CMed v2) and 2.3 points (torch_int8, CMed v1), against a budget of 0.1; and they
quantise activations with one scale per batch, so a text's vector depends on the texts batched with it
(cosine down to 0.996 / 0.990 between a text alone and in a batch), which no cache key can capture.  They
stay for speed-only work (smoke runs, profiling).

Every backend but torch enters the side identity (`identity`), so the embedding cache never hands vectors of
one backend to another; torch adds nothing, so the vectors cached before backends existed stay valid.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers import AutoTokenizer

from care.encoders.base import Embeddings, Encoder, config_args
from care.encoders.onnx_backend import OnnxForward, export_identity, padded_example
from care.encoders.prompts import Prompts
from care.models.hub import load_encoder_model, resolve_model_path, weights_digest
from care.models.pooling import pool
from care.progress import progress


def pick_device(device: str | None = None) -> torch.device:
    if device and device != "auto":
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def batched_forward(texts: Sequence[str], batch_size: int, show_progress: bool, desc: str,
                    step: Callable[[list[str]], list], lengths: Sequence[int] | None = None) -> list:
    """Run `step(batch_texts)` over texts sorted by length, longest first (less padding), return results in
    input order.  `lengths`: each text's token count (token_lengths); characters when not given."""
    key = lengths if lengths is not None else [len(t) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: -key[i])
    out: list = [None] * len(texts)
    starts = range(0, len(order), batch_size)
    for s in progress(starts, desc=desc, enabled=show_progress, unit="batch"):
        idx = order[s:s + batch_size]
        for i, r in zip(idx, step([texts[i] for i in idx])):
            out[i] = r
    return out


def token_lengths(tokenizer, texts: Sequence[str], max_length: int) -> list[int]:
    """Each text's token count after truncation: the sort key that pads least.  Characters are a loose proxy
    (a Latin word is one to a few tokens, a Chinese character one): on the evaluation's document texts, batches
    of 64 sorted by characters carry 1.29 tokens per real token, sorted by tokens 1.14 (bench/encode_bench.py,
    `padding`).  One extra pass of the fast tokenizer costs little beside the forward."""
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]]


BACKENDS = ("torch", "torch_int8", "onnx", "onnx_int8")


def check_backend(backend: str, device: torch.device) -> None:
    """An unknown backend, or a CPU-only one asked to run on a GPU, stops before any weights load."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown dense encoder backend {backend!r} (choose one of {', '.join(BACKENDS)})")
    if backend != "torch" and device.type != "cpu":
        raise ValueError(f"backend {backend!r} runs on the CPU only, the encoder was given device {device}; "
                         f"use device=cpu or backend=torch")


def quantize_linear_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Every nn.Linear of `model` replaced, in place, by torch's dynamic int8 one: int8 weights with one scale
    per output channel (one per tensor doubles the error: mean cosine to fp32 on me5_small 0.981 against
    0.989), activations quantised with one scale per batch as they come."""
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():  # torch.ao announces its move to torchao; the API still works in this torch
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, inplace=True)


def progress_label(name: str, side: str) -> str:
    return f"{name} {'queries' if side == 'query' else 'documents'}"


class OneBackboneEncoder(Encoder):
    """What an encoder of one backbone for both sides says it is (HFDenseEncoder, care.encoders.m3.M3Encoder):
    its `model` encodes queries and documents, texts up to `max_length` tokens, dense vectors of the hidden
    size or cut to `truncate_dim`, unit length when normalised and not cut."""

    model: torch.nn.Module
    max_length: int
    truncate_dim: int | None
    normalize: bool = True  #: L2-normalised at full width (an M3 model always is)

    @property
    def networks(self) -> dict:
        return {"query": self.model, "document": self.model}

    @property
    def dense_width(self) -> int:
        return int(self.truncate_dim or self.model.config.hidden_size)

    @property
    def max_tokens(self) -> int:
        return self.max_length

    @property
    def unit_vectors(self) -> bool:
        return bool(self.normalize) and not self.truncate_dim  # a cut unit vector is shorter than 1


class HFDenseEncoder(OneBackboneEncoder):
    """One backbone for queries and documents (symmetric).  `backend`: what runs the forward pass (BACKENDS,
    the module docstring); any but torch is CPU only and inference only (`embed` is then not differentiable)."""

    @classmethod
    def from_config(cls, c: dict, device: str | None = None) -> HFDenseEncoder:
        """A `kind: dense` model config's encoder (care.families)."""
        return cls(str(c["path"]), normalize=c.get("normalize", True), truncate_dim=c.get("truncate_dim"),
                   padding_side=c.get("padding_side", "right"), backend=c.get("backend", "torch"),
                   **config_args(c, device))

    def __init__(self, path: str, name: str = "dense", pooling: str = "cls", prompts: Prompts | None = None,
                 max_length: int = 512, normalize: bool = True,
                 truncate_dim: int | None = None, device: str | None = None, padding_side: str = "right",
                 build_hint: str = "", backend: str = "torch"):
        self.path = str(path)
        self.name = name
        self.pooling = pooling
        self.prompts = prompts or Prompts()
        self.max_length = max_length
        self.normalize = normalize
        self.truncate_dim = truncate_dim
        self.backend = backend
        self.device = torch.device("cpu") if device in (None, "auto") and backend != "torch" else pick_device(device)
        check_backend(backend, self.device)
        local = resolve_model_path(path, build_hint)
        # The model first: its config check names a folder that is not a model ("Unrecognized model in
        # PATH"); transformers 5's AutoTokenizer no longer reads the config first and would fail with a
        # generic "Couldn't instantiate the backend tokenizer" instead.
        self.model = load_encoder_model(local).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(local)
        self.tokenizer.padding_side = padding_side
        # Counted before quantising: torch's int8 Linear keeps its weights out of parameters(), and the network
        # that runs is the same size whatever runs it.
        self._parameters = sum(p.numel() for p in self.model.parameters())
        self._onnx: OnnxForward | None = None
        if backend == "torch_int8":
            quantize_linear_int8(self.model)
        elif backend in ("onnx", "onnx_int8"):
            example = padded_example(lambda t: self.tokenizer(t, padding=True, return_tensors="pt"))
            self._onnx = OnnxForward(self.model, example, int8=backend == "onnx_int8", weights=weights_digest(local))

    def identity(self, side: str) -> dict:
        ident = {"class": type(self).__name__, "weights": weights_digest(self.path),
                 "pooling": self.pooling, "qp": self.prompts.query, "dp": self.prompts.document,
                 "max_length": self.max_length, "normalize": self.normalize, "dim": self.truncate_dim}
        # Only a non-default backend is recorded, so the fingerprints of torch encoders (and their caches) are
        # the ones they had before backends existed.
        # an ONNX side adds the digest of the export it runs (care/encoders/onnx_backend.py export_identity)
        return ident if self.backend == "torch" else {**ident, "backend": self.backend, **export_identity(self._onnx)}

    @property
    def online_parameters(self) -> int:
        return self._parameters

    @property
    def online_embedding_parameters(self) -> int:
        return self.model.get_input_embeddings().weight.numel()

    def hidden_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The last hidden states of a tokenised batch, by the encoder's backend."""
        if self._onnx is not None:
            return self._onnx(**batch)
        return self.model(**batch).last_hidden_state

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Dense vectors for already-prompted texts (differentiable with the torch backend)."""
        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="pt").to(self.device)
        hidden = self.hidden_states(batch)
        vec = pool(hidden, batch["attention_mask"], self.pooling)
        if self.normalize:
            vec = torch.nn.functional.normalize(vec.float(), dim=-1)
        if self.truncate_dim:
            vec = vec[:, : self.truncate_dim]  # after normalising, not re-normalised (CARE, docs/facts.md s.1)
        return vec

    @torch.inference_mode()
    def encode(self, texts, side, batch_size, heads, show_progress) -> Embeddings:
        rows = batched_forward(texts, batch_size, show_progress, progress_label(self.name, side),
                               lambda b: self.embed(b).float().cpu().numpy(),
                               lengths=token_lengths(self.tokenizer, texts, self.max_length))
        dim = self.truncate_dim or self.model.config.hidden_size
        return Embeddings(dense=np.stack(rows).astype(np.float32) if rows else np.zeros((0, dim), np.float32))
