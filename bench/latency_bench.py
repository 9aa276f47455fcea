"""Query latency at batch 1, the number CARE exists for: `run() -> dict`.

A CARE model's query tower (`CARE_MODEL`, care_me5 by default: its 4-layer me5 query tower is cut on first use
from the offline me5 folder, care.encoders.builders.towers; when it cannot be built here, care_tiny, and the JSON says
so under `care_fallback`) against the symmetric model (`SYMMETRIC_MODEL`, me5_small), measured in the same run,
both as evaluation builds them (care.evaluation.corpora.evaluation_model, evaluate.yaml's token limit).

Queries: the first `QUERIES` queries of the task evaluate.py times (evaluate.yaml `efficiency.task` of the
main benchmark, else its first retrieval task: care/evaluation/efficiency.py), one at a time, each with its
model's query prompt for retrieval.  The first `WARMUP` queries run once on every path first and are not
counted.

Paths (`<model>/<backend>@<threads>t`): the CARE query tower with backend torch and onnx
(care/encoders/care.py, `model.query.backend`), the symmetric model with torch and onnx (care/encoders/dense.py,
`model.backend`), each at one torch thread and at the machine's thread count (an ONNX Runtime session takes
torch's thread count when it is built, so each count has its own).  For every query and path:

- tokenize_ms: prompt + tokenizer -> tensors;
- model_ms:    tensors -> the query vector (backbone by the backend, pooling, normalisation, cut);
- encode_ms:   `Encoder.encode_queries([query], batch_size=1)`, what evaluate.py's efficiency column times
               (care/retrieval/scorer.py time_query), in a separate call.  The dense encoder sorts a batch by
               token count before encoding (care/encoders/dense.py token_lengths), so its encode_ms holds a
               second tokenizer pass that tokenize_ms + model_ms do not.

Reported: p50 / p95 of each, the ratios CARE / symmetric of those percentiles at the same thread count
(`ratios`), onnx / torch within a model, and the agreement of each onnx path's query vectors with torch's
(max |difference|).  The paths run interleaved, query by query (the starting path rotating), so a change of
load hits them alike; the load average before and after is recorded: on a shared machine compare the ratios of
one run, not milliseconds across runs.

    python -m bench latency                                   # bench/results/latency.json, the defaults
    python -m bench.latency_bench --queries 20 --out /tmp/latency.json   # a quick check
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import torch
from omegaconf import OmegaConf

from bench.encode_bench import at_threads
from care.config import load_config, model_config
from care.encoders import build_encoder
from care.evaluation.corpora import evaluation_model, load_benchmarks
from care.families import family_of
from care.models.pooling import pool
from data_pipeline.benchmarks import build

QUERIES, WARMUP = 200, 10
CARE_MODEL, CARE_FALLBACK, SYMMETRIC_MODEL = "care_me5", "care_tiny", "me5_small"
TASK = "retrieval"  # the task type whose query prompt the queries take


def load() -> float:
    return round(os.getloadavg()[0], 2)


def timing_queries(app: dict, n: int) -> tuple[str, list[str]]:
    """The first `n` queries of the task evaluate.py times (evaluate.py efficiency_texts): the main
    benchmark's `efficiency.task`, else its first retrieval task."""
    loaded = load_benchmarks({**app, "extra_benchmark": None}, build, show_progress=False)
    bench, tasks = loaded[0]
    spec, data = next(((s, d) for s, d in tasks if s.key == app["efficiency"]["task"]), None) \
        or next((s, d) for s, d in tasks if d.type == "retrieval")
    return f"{bench.name}/{spec.key}", list(data.queries.values())[:n]


class QueryPath:
    """One encoder on one backend: the two halves of encoding a query, and the whole call."""

    def __init__(self, name: str, threads: int, encoder, tokenize: Callable, model: Callable):
        self.name, self.threads, self.encoder = name, threads, encoder
        self.tokenize, self.model = tokenize, model
        self.times: dict[str, list[float]] = {"tokenize_ms": [], "model_ms": [], "encode_ms": []}
        self.vectors: list[np.ndarray] = []
        self.tokens: list[int] = []

    def once(self, query: str, record: bool) -> None:
        start = time.perf_counter()
        inputs = self.tokenize(query)
        tokenized = time.perf_counter()
        vec = self.model(inputs)
        done = time.perf_counter()
        self.encoder.encode_queries([query], batch_size=1, task=TASK)
        encoded = time.perf_counter()
        if record:
            self.times["tokenize_ms"].append((tokenized - start) * 1000)
            self.times["model_ms"].append((done - tokenized) * 1000)
            self.times["encode_ms"].append((encoded - done) * 1000)
            self.vectors.append(vec.float().numpy()[0])
            self.tokens.append(int(inputs["attention_mask"].sum()))


def care_path(name: str, threads: int, enc) -> QueryPath:
    """The CARE query side as CAREEncoder.encode runs it: tokenize, then `vectors` by the query backend."""
    return QueryPath(name, threads, enc, lambda q: enc.tokenize(enc.prompts.apply([q], "query", TASK), "query"),
                lambda inputs: enc.vectors(inputs, "query"))


def dense_path(name: str, threads: int, enc) -> QueryPath:
    """The dense query side as HFDenseEncoder.embed runs it, split after the tokenizer."""
    def tokenize(q: str) -> dict:
        return enc.tokenizer(enc.prompts.apply([q], "query", TASK), padding=True, truncation=True,
                             max_length=enc.max_length, return_tensors="pt")

    @torch.inference_mode()
    def model(inputs: dict) -> torch.Tensor:
        vec = pool(enc.hidden_states(inputs), inputs["attention_mask"], enc.pooling)
        if enc.normalize:
            vec = torch.nn.functional.normalize(vec.float(), dim=-1)
        return vec[:, : enc.truncate_dim] if enc.truncate_dim else vec

    return QueryPath(name, threads, enc, tokenize, model)


def percentiles(ms: list[float]) -> dict:
    return {"p50": round(float(np.percentile(ms, 50)), 3), "p95": round(float(np.percentile(ms, 95)), 3)}


def models(app: dict, care_name: str, symmetric_name: str) -> tuple[dict, dict, dict | None]:
    """The CARE and symmetric model configs as evaluation builds them; CARE's towers built here when its config
    says how.  A CARE model that cannot be had falls back to care_tiny (`fallback` says why)."""
    from care.encoders.registry import ensure_towers

    def config(name: str) -> dict:
        return evaluation_model(model_config(name, app), app["max_length"])

    care, fallback = config(care_name), None
    try:
        ensure_towers(care)
    except (FileNotFoundError, OSError, ValueError, RuntimeError) as e:
        if care_name == CARE_FALLBACK:
            raise
        fallback = {"wanted": care_name, "used": CARE_FALLBACK, "reason": f"{type(e).__name__}: {e}"[:500]}
        care = config(CARE_FALLBACK)
        ensure_towers(care)
    return care, config(symmetric_name), fallback


def with_backend(model: dict, backend: str) -> dict:
    """The model config with `backend` where its family reads it (care.families: CARE's query tower)."""
    if side := family_of(model).backend:
        return {**model, side: {**model[side], "backend": backend}}
    return {**model, "backend": backend}


def run(n_queries: int = QUERIES, warmup: int = WARMUP, care_name: str = CARE_MODEL,
        symmetric_name: str = SYMMETRIC_MODEL, threads: list[int] | None = None) -> dict:
    app = OmegaConf.to_container(load_config("evaluate"), resolve=True)
    source, queries = timing_queries(app, n_queries)
    care, symmetric, fallback = models(app, care_name, symmetric_name)
    default = torch.get_num_threads()
    thread_counts = sorted(set(threads or {1, default, os.cpu_count() or 1}))
    result = {"care_model": care["name"], "care_fallback": fallback, "symmetric_model": symmetric["name"],
              "queries": {"source": source, "n": len(queries), "warmup": min(warmup, len(queries)),
                          "mean_chars": round(float(np.mean([len(q) for q in queries])), 1)},
              "query_max_length": {care["name"]: care["query"]["max_length"],
                                   symmetric["name"]: symmetric["max_length"]},
              "torch_default_threads": default, "threads": thread_counts, "load_start": load()}

    paths, setup, built = [], {}, {}
    for kind, model, make in (("care", care, care_path), ("symmetric", symmetric, dense_path)):
        for backend in ("torch", "onnx"):
            # a torch encoder runs at whatever count torch is set to; an ORT session keeps the one it was built at
            for t in thread_counts if backend == "onnx" else thread_counts[:1]:
                start = time.perf_counter()
                enc = at_threads(t, lambda m=model, b=backend: build_encoder(with_backend(m, b), device="cpu"))
                setup[f"{model['name']}/{backend}@{t}t" if backend == "onnx" else f"{model['name']}/{backend}"] = \
                    round(time.perf_counter() - start, 1)
                built[kind] = enc
                for count in thread_counts if backend == "torch" else [t]:
                    paths.append(make(f"{model['name']}/{backend}@{count}t", count, enc))
    result["online_parameters"] = {
        m["name"]: {"all": int(built[k].online_parameters),
                    "without_embeddings": int(built[k].online_parameters - built[k].online_embedding_parameters)}
        for k, m in (("care", care), ("symmetric", symmetric))}
    result["setup_s"] = setup

    loads = {}
    for t in thread_counts:  # one thread count at a time: switching torch's pool per call would be timed too
        group = [p for p in paths if p.threads == t]

        def go(group=group):
            for q in queries[:warmup]:
                for p in group:
                    p.once(q, record=False)
            before = load()
            for i, q in enumerate(queries):
                for p in group[i % len(group):] + group[: i % len(group)]:
                    p.once(q, record=True)
            return [before, load()]

        loads[f"{t}t"] = at_threads(t, go)

    out = {}
    for p in paths:
        out[p.name] = {"threads": p.threads, **{k: percentiles(v) for k, v in p.times.items()},
                       "tokens_mean": round(float(np.mean(p.tokens)), 1)}
    result["paths"] = out
    result["load_during"] = loads

    by_name = {p.name: p for p in paths}
    result["agreement"] = {
        f"{m['name']}@{t}t": {"max_abs_diff_onnx_vs_torch": float(np.abs(
            np.stack(by_name[f"{m['name']}/onnx@{t}t"].vectors) - np.stack(by_name[f"{m['name']}/torch@{t}t"].vectors)).max())}
        for m in (care, symmetric) for t in thread_counts}

    def ratio(a: str, b: str) -> dict:
        return {f"{k}_{q}": round(out[a][k][q] / out[b][k][q], 3)
                for k in ("model_ms", "tokenize_ms", "encode_ms") for q in ("p50", "p95")}

    c, s = care["name"], symmetric["name"]
    result["ratios"] = {f"{t}t": {
        "care_torch/symmetric_torch": ratio(f"{c}/torch@{t}t", f"{s}/torch@{t}t"),
        "care_onnx/symmetric_torch": ratio(f"{c}/onnx@{t}t", f"{s}/torch@{t}t"),
        "care_onnx/symmetric_onnx": ratio(f"{c}/onnx@{t}t", f"{s}/onnx@{t}t"),
        "care_onnx/care_torch": ratio(f"{c}/onnx@{t}t", f"{c}/torch@{t}t"),
        "symmetric_onnx/symmetric_torch": ratio(f"{s}/onnx@{t}t", f"{s}/torch@{t}t"),
    } for t in thread_counts}
    result["load_end"] = load()
    return result


def main(argv: list[str] | None = None) -> None:
    """Like `python -m bench latency`, with the sizes and the output file as options (a quick check must not
    overwrite bench/results/latency.json)."""
    import json

    from bench.__main__ import machine
    from care.data.io import write_json
    from care.paths import PROJECT_ROOT

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=QUERIES)
    ap.add_argument("--warmup", type=int, default=WARMUP)
    ap.add_argument("--care", default=CARE_MODEL, help="a CARE model config (conf/model/<name>.yaml)")
    ap.add_argument("--symmetric", default=SYMMETRIC_MODEL, help="a dense model config")
    ap.add_argument("--threads", type=int, nargs="*", help="torch thread counts (default: 1, torch's, the CPUs')")
    ap.add_argument("--out", default=str(PROJECT_ROOT / "bench" / "results" / "latency.json"))
    args = ap.parse_args(argv)
    start = time.perf_counter()
    result = run(args.queries, args.warmup, args.care, args.symmetric, args.threads)
    result = {"benchmark": "latency", "wall_s": round(time.perf_counter() - start, 2),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **result}
    write_json(args.out, result)
    print(json.dumps(result, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
