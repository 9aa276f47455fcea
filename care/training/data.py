"""Training examples over the id-referencing training files (docs/design.md, "Files between stages").

`texts.jsonl` holds every text once ({"id","text"}); `train.jsonl` refers to them by id:
{"query_id", "pos_ids": [...], "neg_ids": [...], "neg_scores": [...], "pool" (optional)}.  Each step an example becomes one
group: its query, 1 positive and (group_size - 1) negatives, laid out as the losses expect (for each query
its positive first, then its negatives).

Determinism.  Every random draw is made by a numpy Generator seeded with (seed, epoch, example index), and
the epoch order by one seeded with (seed, epoch).  Which worker or which process builds a group therefore
never changes it: the same run gives the same groups on 1 CPU, with 4 data-loader workers, or on 8 GPUs
(accelerate shards the batches of one global order), and a resumed run sees exactly the groups it would
have seen.

Too few hard negatives.  An example with fewer than (group_size - 1) negatives keeps all of its own and
fills the rest by drawing again from them with replacement (FlagEmbedding's own rule), so every group has
the same shape (GradCache and the pool layout need that).  An example with no negatives at all gets random
passages of the training set (any id used as a positive or negative, never one of its own positives).
Both cases are counted in `stats` so a run says how often it happened.  With group_size = 1 no negatives
are drawn: plain in-batch negatives.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset, Sampler

from care.data.io import DataError, read_jsonl_numbered, read_text_store

# What writes the training files when they are missing (the usual cause: the data pipeline has not run).
WRITTEN_BY = "python -m data_pipeline (stage mine writes outputs/data/train/)"


def require_training_files(texts_path: str | Path, train_path: str | Path) -> None:
    """A missing training file is named together with the command that writes it (call this before
    anything else opens them, e.g. a digest for the run's config hash)."""
    for what, path in (("the training text store", Path(texts_path)),
                       ("the training examples file", Path(train_path))):
        if not path.exists():
            raise FileNotFoundError(f"{what} {path} does not exist: it is written by {WRITTEN_BY}; run that "
                                    "first, or point data.texts / data.examples at your own files")


class TrainingGroups(Dataset):
    """Item (epoch, i) -> {"query", "passages": [positive, negative...]} for example i in that epoch."""

    def __init__(self, texts_path: str | Path, train_path: str | Path, group_size: int = 10, seed: int = 0,
                 max_examples: int | None = None):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1 (1 positive + negatives), got {group_size}")
        self.texts_path, self.train_path = Path(texts_path), Path(train_path)
        self.group_size, self.seed = group_size, seed
        require_training_files(self.texts_path, self.train_path)
        self.texts = read_text_store(self.texts_path)
        self.examples = self._read_examples(max_examples)
        # Ids a "no negatives" example may borrow from: every passage the training set uses, sorted so the
        # pool (and therefore every draw) does not depend on file or dict order.
        self.passage_pool = sorted({p for e in self.examples for p in (*e["pos_ids"], *e["neg_ids"])})
        need = group_size - 1
        self.stats = {
            "examples": len(self.examples),
            "group_size": group_size,
            "short_of_negatives": sum(0 < len(e["neg_ids"]) < need for e in self.examples),
            "without_negatives": sum(len(e["neg_ids"]) == 0 for e in self.examples) if need else 0,
        }

    def _read_examples(self, max_examples: int | None) -> list[dict]:
        rows = []
        for line, row in read_jsonl_numbered(self.train_path, required=("query_id", "pos_ids")):
            if max_examples is not None and len(rows) >= max_examples:
                break
            problem = self._check(row)
            if problem:
                raise DataError(self.train_path, line, *problem)
            rows.append({"query_id": str(row["query_id"]), "pos_ids": [str(p) for p in row["pos_ids"]],
                         "neg_ids": [str(n) for n in row.get("neg_ids") or []], "pool": row.get("pool")})
        if not rows:
            raise DataError(self.train_path, None, None, "no training examples")
        return rows

    def _check(self, row: dict) -> tuple[str, str] | None:
        """(field, problem) for a bad row, else None."""
        for field in ("pos_ids", "neg_ids"):
            if field in row and not isinstance(row[field], list):
                return field, f"expected a list of ids, got {type(row[field]).__name__}"
        if not row["pos_ids"]:
            return "pos_ids", "no positive"
        unknown = f"not in the text store {self.texts_path}"
        if str(row["query_id"]) not in self.texts:
            return "query_id", f"unknown id {row['query_id']!r}: {unknown}"
        for field in ("pos_ids", "neg_ids"):
            for i in row.get(field) or []:
                if str(i) not in self.texts:
                    return field, f"unknown id {i!r}: {unknown}"
        scores = row.get("neg_scores")
        if scores is not None and len(scores) != len(row.get("neg_ids") or []):
            return "neg_scores", f"{len(scores)} scores for {len(row.get('neg_ids') or [])} neg_ids"
        return None

    def __len__(self) -> int:
        return len(self.examples)

    def group_ids(self, epoch: int, index: int) -> tuple[str, list[str]]:
        """(query id, [positive id, negative ids...]) drawn for example `index` in `epoch`."""
        ex = self.examples[index]
        rng = np.random.default_rng([self.seed, epoch, index])
        pos = ex["pos_ids"][rng.integers(len(ex["pos_ids"]))]
        need, negs = self.group_size - 1, ex["neg_ids"]
        if need == 0:
            return ex["query_id"], [pos]
        if len(negs) >= need:
            chosen = [negs[j] for j in rng.choice(len(negs), need, replace=False)]
        elif negs:  # too few: all of them, the rest drawn again from them (see the module docstring)
            chosen = list(negs) + [negs[j] for j in rng.integers(len(negs), size=need - len(negs))]
        else:
            chosen = self._random_passages(rng, need, set(ex["pos_ids"]))
        return ex["query_id"], [pos, *chosen]

    def _random_passages(self, rng: np.random.Generator, need: int, exclude: set[str]) -> list[str]:
        """`need` passages of the training set, drawn with replacement, none of them in `exclude`."""
        if len(self.passage_pool) <= len(exclude) and set(self.passage_pool) <= exclude:
            raise DataError(self.train_path, None, "neg_ids",
                            "an example has no negatives and the training set has no other passage to borrow")
        picked: list[str] = []
        while len(picked) < need:  # rejection: `exclude` (one example's positives) is a tiny share of the pool
            candidate = self.passage_pool[rng.integers(len(self.passage_pool))]
            if candidate not in exclude:
                picked.append(candidate)
        return picked

    def __getitem__(self, item: tuple[int, int]) -> dict:
        epoch, index = item
        qid, pids = self.group_ids(epoch, index)
        return {"query": self.texts[qid], "passages": [self.texts[p] for p in pids],
                "pool": self.examples[index]["pool"]}


class EpochSampler(Sampler):
    """Yields (epoch, example index) in an order shuffled by (seed, epoch).  The trainer calls set_epoch
    before each epoch; the epoch travels with every index so data-loader workers need no shared state."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        return iter([(self.epoch, int(i)) for i in order])


def collate_groups(items: list[dict]) -> dict:
    """Batch of groups -> {"queries": [B texts], "passages": [B * group_size texts]} in pool layout, and
    "passage_pools": the pool (build.rules' `pool`, None when the file has none) of each passage's group."""
    return {"queries": [it["query"] for it in items], "passages": [p for it in items for p in it["passages"]],
            "passage_pools": [it.get("pool") for it in items for _ in it["passages"]]}
