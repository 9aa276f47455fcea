"""Three-stage deduplication (docs/design.md, "Layers"; `python -m data_pipeline stage=dedup`).

normalize.py  what counts as the same text (NFKC, case, whitespace, optional punctuation)
exact.py      stage 1: MD5 of the normalised text
minhash.py    stage 2: character n-gram MinHash LSH, every candidate verified by exact Jaccard
semantic.py   stage 3: encoder cosine >= the encoder's own threshold, FAISS search, embedding cache
clusters.py   pairs -> connected components -> the earliest member is kept
stage.py      the pipeline stage: files in, files + stats.json out
calibrate.py  per-encoder thresholds: interval sampler, labels, LLM judge, human-labelled pairs
"""
