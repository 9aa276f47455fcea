"""Efficiency beside quality: what a model costs online and offline, measured on this machine.

- online parameters: the parameters that run at query time (an asymmetric model's query tower only),
  and the same without the token-embedding matrix (a lookup, not compute: with small towers it dominates
  the count and hides the saving);
- query latency: one query at a time (batch 1), p50 and p95 over a fixed set of real queries, after a
  few warm-up queries; for an encoder this is query encoding (search excluded: it is the same FAISS
  flat search for every model of a given width), for BM25 segmentation plus a top-10 search;
- documents per second: encoding (BM25: segmenting and indexing) a fixed set of real documents,
  bypassing the embedding cache.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from care.evaluation.tasks import shows_progress
from care.progress import progress


def measure(scorer, queries: Sequence[str], docs: Sequence[str], warmup: int = 3) -> dict:
    if not queries or not docs:
        raise ValueError("efficiency needs at least one query and one document")
    doc_seconds = scorer.time_documents(list(docs))
    for q in queries[:warmup]:
        scorer.time_query(q)
    latency = np.array([scorer.time_query(q) for q in progress(queries, desc=f"{scorer.name} latency", leave=False,
                                                               enabled=shows_progress(scorer))])
    return {
        "online_parameters": int(scorer.online_parameters),
        "online_parameters_without_embeddings": int(scorer.online_parameters - scorer.online_embedding_parameters),
        "query_latency_ms_p50": float(np.percentile(latency, 50) * 1000),
        "query_latency_ms_p95": float(np.percentile(latency, 95) * 1000),
        "docs_per_second": float(len(docs) / doc_seconds),
        "latency_queries": len(queries),
        "throughput_docs": len(docs),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "cuda": torch.cuda.is_available()},
    }
