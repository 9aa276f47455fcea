"""Evaluation: metrics with trec_eval's conventions (`metrics`), the TREC-file scoring CLI (`trec`).

Kept import-free so `python -m care.evaluation.trec` loads only what it needs.
"""
