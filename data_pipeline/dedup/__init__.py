"""Three-stage deduplication (docs/design.md, "Layers"; `python -m data_pipeline stage=dedup`).

normalize.py  what counts as the same text (NFKC, case, whitespace, optional punctuation)
exact.py      stage 1: MD5 of the normalised text
minhash.py    stage 2: character n-gram MinHash LSH, every candidate verified by exact Jaccard (the entry
              point: band choice, `minhash_pairs`, `similar_pairs`)
  minhash_reference.py  the recipe's definitions (shingles, hash, Jaccard), the datasketch reference
  minhash_numpy.py      the fast backend (the default): every text at once, in numpy
  shingle_ids.py        its input: shingle sets as integer ids, built vectorised
semantic.py   stage 3: encoder cosine >= the encoder's own threshold, FAISS search, embedding cache
clusters.py   pairs -> connected components -> the earliest member is kept
stage.py      the pipeline stage: files in, files + stats.json out; `dedup.engine=datatrove` runs the exact
              and MinHash stages as datatrove tasks with the same outputs (data_pipeline/distributed/)
calibrate.py  per-encoder thresholds: the CLI and its modes (interval sampler, LLM judge, labelled pairs)
  calibrate_labels.py   where the labels come from: pairs to label, label files, the judge, labelled sources
  calibrate_rates.py    the maths: cosine intervals, positive rate per interval, the suggested thresholds
"""
