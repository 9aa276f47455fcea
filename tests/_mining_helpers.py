"""Shared by the mining tests: the top-K, a CSV reader, the real config composed once, a JSON Lines reader."""

from __future__ import annotations

import csv
import functools
import json
from pathlib import Path

from omegaconf import OmegaConf

from care.config import load_config

TOP_K = 30


def read_csv(path: Path, header: bool = True, **kw) -> list:
    """Rows of a CSV/TSV file: dicts by the header, or lists without one."""
    with open(path, encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh, **kw) if header else csv.reader(fh, **kw))


@functools.cache
def base_config(build_dir: Path, model_dir: Path):
    return load_config("data_pipeline", [
        "model=tiny_bert", f"model.path={model_dir}", "model.max_length=64", f"mine.input_dir={build_dir}",
        f"mine.dedup_clusters={build_dir}/clusters.jsonl", f"mine.top_k={TOP_K}",
        f"mine.cache={build_dir}/embedding-cache"])


def compose(build_dir: Path, out: Path, model_dir: Path, *extra: str):
    """The real config (composed once: Hydra takes ~1 s a call here) with `key=value` overrides."""
    return OmegaConf.merge(base_config(build_dir, model_dir), OmegaConf.from_dotlist([f"data_dir={out}", *extra]))


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
