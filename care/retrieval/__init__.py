"""Ranking, shared by evaluation, mining, dedup and benchmark builders.

index   one exact FAISS inner-product index (moved to every GPU when faiss-gpu sees one), unit rows, top-k
scorer  the scorer protocol the task runners call, for any Encoder (`EncoderScorer`)
bm25    the same protocol for the lexical baseline (bm25s over jieba words)

A scorer's `prepare(queries, docs)` returns an object with `search(depth) -> {method: (indices, scores)}`
(every query against every document) and `score(method, query_index, doc_indices) -> scores`.
"""
