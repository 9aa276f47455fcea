"""Stage `nano`: HAKARI-compatible Nano splits (docs/nano.md) from any retrieval task.

    sources.py      read a retrieval task (BEIR folder, mteb / HAKARI parquet layout) into a SourceTask:
                    rows in source order, HAKARI's normalisation
    shared_data.py  the shared data's four retrieval-shaped sets as SourceTasks (the default splits)
    select.py       200 queries and a 10,000-document corpus (docs/nano.md s.3-4), with its counters
    candidates.py   BM25 / dense lists -> reciprocal rank fusion + safeguard (s.7-8), the audit (s.9), the
                    candidate-quality metrics (s.11)
    split.py        one split: its BM25 and dense lists, their fusion and audit, its files and metadata
    layout.py       the files: parquet configs, reranking_hybrid_metadata.json, metadata/<split>.json,
                    the README with its tables (s.10-11)
    stage.py        `python -m data_pipeline stage=nano`: run(cfg), summary(stats)
"""
