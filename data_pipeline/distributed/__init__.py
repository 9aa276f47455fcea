"""Data stages past one machine, on datatrove (docs/scale.md, "Past one machine"; docs/cluster.md).

executors.py      the executor factory: `dedup.executor=local|slurm|ray` (any config section with the same
                  keys) -> a datatrove executor, and `run_steps`, which runs a stage's steps in order and
                  checks every task finished
dedup_steps.py    the dedup recipe (data_pipeline/dedup/) as datatrove pipeline steps: exact (normalised
                  MD5) and MinHash LSH with every bucket pair checked by exact Jaccard, the earliest text kept
dedup_engine.py   `dedup.engine=datatrove`: shards the stage's input, runs the steps, hands the clusters back
                  to the stage, which writes the same folder the native engine writes
"""
