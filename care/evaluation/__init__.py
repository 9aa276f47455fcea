"""Evaluation: metrics with trec_eval's conventions (`metrics`) and the TREC-file scoring CLI (`trec`); the
task runners (`tasks`), benchmarks as configs (`benchmarks`, `corpora`), the rows evaluate.py scores (`entries`), efficiency, the report, paired-bootstrap
gains (`significance`), runs compared over seeds (`compare`), Nano datasets (`nano`) and the mteb adapter.

Kept import-free so `python -m care.evaluation.trec` loads only what it needs.
"""
