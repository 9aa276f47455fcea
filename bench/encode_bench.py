"""Encoding benchmark on real data: `run() -> dict`.

Encoding is what dominates a first evaluation (every benchmark text through the model once).  On `TEXTS`
document texts drawn (seed 0) from everything evaluation embeds on the document side (the open CMedTEB
stand-in + cMedQA2, care.evaluation.corpora), with the configured model (evaluate.yaml's, me5_small by
default) at evaluate.yaml's token limit (256), documents/s of:

- project: `Encoder.encode_documents` at evaluate.yaml's batch size, as evaluation calls it (fp32 torch);
- limit: a plain `torch.inference_mode()` forward of the same Hugging Face model (pooling included,
  tokenisation excluded), texts sorted by token length, at the best of `LIMIT_BATCHES` (chosen on the first
  `SWEEP_TEXTS` texts, per thread count): what torch allows the model on this CPU without changing its
  numerics;
- each backend of care/encoders/dense.py (BACKENDS) through the same encode_documents, with its setup time
  (quantising, exporting) and its agreement with the project's fp32 vectors (cosine mean / min, max
  |difference|).  ONNX Runtime ones are skipped when it is not installed.

Every path runs at torch's thread count and at one thread (`name@Nt`): on a shared machine one thread can
beat two, and paths are only compared fairly at the same count.  The paths run interleaved, `ROUNDS` times,
and each round's ratios (over the project path at torch's threads, and over project and limit at the same
threads) are reported:
the machine may be shared, so compare ratios of one round (and the load before / after each timing), not
documents/s across runs.  Also: padded / real tokens of the project's batches (sorted by characters) and of
token-sorted ones.
"""
from __future__ import annotations

import os
import random
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from care.config import load_config
from care.encoders import build_encoder
from care.encoders.dense import BACKENDS, HFDenseEncoder
from care.evaluation.corpora import document_texts, evaluation_model, load_benchmarks
from care.families import family_of
from care.models.pooling import pool
from data_pipeline.benchmarks import build

TEXTS, SWEEP_TEXTS, ROUNDS = 2000, 1000, 3
LIMIT_BATCHES = (16, 32, 64, 128)


def sample_texts(cfg, n: int = TEXTS, seed: int = 0) -> list[str]:
    """`n` distinct document texts of the evaluation, drawn uniformly: the mix of lengths evaluation encodes."""
    loaded = load_benchmarks(OmegaConf.to_container(cfg, resolve=True), build, show_progress=False)
    texts = list(dict.fromkeys(t for group in document_texts(loaded).values() for t in group))
    return random.Random(seed).sample(texts, min(n, len(texts)))


def load() -> float:
    return round(os.getloadavg()[0], 2)


def timed(fn) -> tuple[object, float, list[float]]:
    before = load()
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start, [before, load()]


def token_batches(tokenizer, texts: list[str], batch_size: int, max_length: int) -> tuple[list[int], list[dict]]:
    """Texts sorted by token count (longest first), tokenised per batch: the least padding there can be."""
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: -lengths[i])
    batches = [tokenizer([texts[i] for i in order[s:s + batch_size]], padding=True, truncation=True,
                         max_length=max_length, return_tensors="pt") for s in range(0, len(order), batch_size)]
    return order, batches


def padding_ratio(tokenizer, texts: list[str], order: list[int], batch_size: int, max_length: int) -> float:
    """Padded tokens / real tokens when `texts` are batched in `order`."""
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]
    padded = sum(max(lengths[i] for i in order[s:s + batch_size]) * len(order[s:s + batch_size])
                 for s in range(0, len(order), batch_size))
    return round(padded / sum(lengths), 3)


def plain_forward(encoder, texts: list[str], batch_size: int) -> tuple[np.ndarray, float]:
    """The limit: the encoder's own HF model and pooling, nothing else, over token-sorted batches."""
    order, batches = token_batches(encoder.tokenizer, texts, batch_size, encoder.max_length)
    out = np.zeros((len(texts), encoder.model.config.hidden_size), np.float32)
    start = time.perf_counter()
    with torch.inference_mode():
        rows = []
        for batch in batches:
            vec = pool(encoder.model(**batch).last_hidden_state, batch["attention_mask"], encoder.pooling)
            rows.append(torch.nn.functional.normalize(vec.float(), dim=-1).numpy())
    seconds = time.perf_counter() - start
    out[order] = np.concatenate(rows)
    return out, seconds


def dense_encoder(model: dict, backend: str) -> HFDenseEncoder:
    """The dense encoder of a model config, as care/encoders/registry.py builds it, with `backend`."""
    if family_of(model).backend != "":  # the family whose own config picks the backend (care.families)
        raise ValueError(f"backends are an option of dense encoders; model {model['name']} is {model['kind']}")
    return build_encoder({**model, "backend": backend}, device="cpu")


def agreement(ref: np.ndarray, vec: np.ndarray) -> dict:
    cos = (ref * vec).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(vec, axis=1))
    return {"cosine_mean": round(float(cos.mean()), 6), "cosine_min": round(float(cos.min()), 6),
            "max_abs_diff": float(np.abs(ref - vec).max())}


def onnxruntime_missing() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return True
    return False


def at_threads(n: int, fn):
    """`fn()` with torch (and so the ORT sessions built inside it) at `n` intra-op threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def run(n_texts: int = TEXTS, rounds: int = ROUNDS) -> dict:
    cfg = load_config("evaluate")
    texts = sample_texts(cfg, n_texts)
    model = evaluation_model(OmegaConf.to_container(cfg.model, resolve=True), cfg.max_length)
    model.pop("backend", None)  # the project path: torch (apps default to `auto`, ONNX on the CPU: a backend here)
    encoder = build_encoder(model, device="cpu", backend="torch")
    bs = int(cfg.batch_size)
    prompted = encoder.prompts.apply(texts, "document", None)
    default = torch.get_num_threads()
    thread_counts = sorted({1, default}, reverse=True)
    result = {"model": model["name"], "max_length": encoder.max_length, "batch_size": bs, "texts": len(texts),
              "mean_chars": round(float(np.mean([len(t) for t in texts])), 1), "torch_threads": default,
              "rounds": rounds, "load_start": load()}

    char_order = sorted(range(len(prompted)), key=lambda i: -len(prompted[i]))
    token_order, _ = token_batches(encoder.tokenizer, prompted, bs, encoder.max_length)
    result["padding"] = {name: padding_ratio(encoder.tokenizer, prompted, order, bs, encoder.max_length)
                         for name, order in [("char_sorted", char_order), ("token_sorted", token_order),
                                             ("unsorted", list(range(len(prompted))))]}

    # The limit at each thread count: the fastest batch size of a plain forward on the first SWEEP_TEXTS texts.
    sweep, limit_bs = {}, {}
    for t in thread_counts:
        for b in LIMIT_BATCHES:
            _, s = at_threads(t, lambda b=b: plain_forward(encoder, prompted[:SWEEP_TEXTS], b))
            sweep[f"{t}t_b{b}"] = round(min(SWEEP_TEXTS, len(prompted)) / s, 2)
        limit_bs[t] = max(LIMIT_BATCHES, key=lambda b, t=t: sweep[f"{t}t_b{b}"])

    def encode(e):
        return lambda: e.encode_documents(texts, batch_size=bs).dense

    # Every path at every thread count: `name@Nt`.  An ORT session takes its thread count when it is built.
    paths, setup, warm = {}, {}, []
    for t in thread_counts:
        paths[f"project@{t}t"] = (t, encode(encoder))
        warm.append((t, encoder))
        for backend in BACKENDS[1:]:
            if backend.startswith("onnx") and onnxruntime_missing():
                continue
            other, setup[f"{backend}@{t}t"], _ = timed(
                lambda b=backend, t=t: at_threads(t, lambda: dense_encoder(model, b)))
            paths[f"{backend}@{t}t"] = (t, encode(other))
            warm.append((t, other))
    for t in thread_counts:
        paths[f"limit@{t}t"] = (t, lambda b=limit_bs[t]: plain_forward(encoder, prompted, b)[0])
    for t, e in warm:  # first-call allocations, ORT's first run
        at_threads(t, lambda e=e: e.encode_documents(texts[:bs], batch_size=bs))

    seconds: dict[str, list[float]] = {name: [] for name in paths}
    loads: dict[str, list[list[float]]] = {name: [] for name in paths}
    vectors = {}
    for _ in range(rounds):  # interleaved, so a change of load hits every path alike
        for name, (t, fn) in paths.items():
            vectors[name], s, during = timed(lambda t=t, fn=fn: at_threads(t, fn))
            seconds[name].append(s)
            loads[name].append(during)

    project = f"project@{default}t"
    ref = vectors[project]
    per_s = {name: [len(texts) / s for s in ss] for name, ss in seconds.items()}

    def ratios(name: str, over: str) -> list[float]:
        return [round(a / b, 3) for a, b in zip(per_s[name], per_s[over])]

    out = {}
    for name, (t, _) in paths.items():
        same = f"project@{t}t"
        out[name] = {"threads": t, "docs_per_s": round(float(np.median(per_s[name])), 2),
                     "docs_per_s_rounds": [round(x, 2) for x in per_s[name]], "load_rounds": loads[name],
                     "over_project_rounds": ratios(name, project),
                     "over_project_same_threads_rounds": ratios(name, same),
                     "over_limit_same_threads_rounds": ratios(name, f"limit@{t}t"),
                     "agreement": agreement(ref, vectors[name])}
        if name in setup:
            out[name]["setup_s"] = round(setup[name], 1)
    result["project"] = project
    result["limit"] = {"batch_size": {f"{t}t": b for t, b in limit_bs.items()}, "sweep_docs_per_s": sweep}
    result["paths"] = out
    result["skipped"] = {b: "onnxruntime is not installed" for b in BACKENDS[1:]
                         if b.startswith("onnx") and onnxruntime_missing()}
    result["load_end"] = load()
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
