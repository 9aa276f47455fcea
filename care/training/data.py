"""Training examples over the id-referencing training files (docs/design.md, "Files between stages").

`texts.jsonl` holds every text once ({"id","text"}); `train.jsonl` refers to them by id:
{"query_id", "pos_ids": [...], "neg_ids": [...], "neg_scores": [...], "pool" (optional)}.  Each step an example becomes one
group: its query, 1 positive and (group_size - 1) negatives, laid out as the losses expect (for each query
its positive first, then its negatives).

Teacher scores.  A row may also carry `teacher_pos_scores` (aligned with pos_ids) and `teacher_neg_scores`
(aligned with neg_ids): raw scores of a teacher (a cross-encoder's logits or a bi-encoder's similarities),
written by `python -m data_pipeline stage=score teacher=...`.  `neg_scores` / `pos_scores` are the miner's
similarities and are never used as teacher scores.  A group then carries the teacher scores of the very
passages drawn (the draws themselves do not depend on whether the file has teacher scores), and
collate_groups stacks them into a (batch, group_size) tensor for the loss's distillation.

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
are drawn: plain in-batch negatives.  A repeated negative repeats its teacher score; a borrowed random
passage has none, so such a group's row of teacher scores is NaN in the batch and the distillation term
leaves it out (care/training/loss_terms.py TeacherDistillation); InfoNCE trains it as without distillation.

Which examples each batch holds (`trainer.batching`: mixed, or each global batch from one build rule) is
the samplers' part: care.training.samplers.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from care.data.examples import read_example_rows
from care.data.io import DataError, read_text_store

# What writes the training files when they are missing (the usual cause: the data pipeline has not run).
WRITTEN_BY = "python -m data_pipeline (stage mine writes outputs/data/train/)"
# The teacher scores of a training file: field -> the id field its scores are aligned with.
TEACHER_FIELDS = {"teacher_pos_scores": "pos_ids", "teacher_neg_scores": "neg_ids"}
# What writes the teacher scores into the training file (named when a distilling run finds none).
TEACHER_WRITTEN_BY = "`python -m data_pipeline stage=score teacher=...`"
# Tags of the random streams the by_rule order adds (care.training.samplers: a rule's shuffle, the batches'
# order; here: a repeated example's draw), as numpy SeedSequence spawn keys on (seed, epoch), so they never
# coincide with the (seed, epoch) epoch order or a group's (seed, epoch, index) draw.  Kept together: distinct.
RULE_STREAM, ORDER_STREAM, REPEAT_STREAM = 1, 2, 3


def require_training_files(texts_path: str | Path, train_path: str | Path) -> None:
    """A missing training file is named together with the command that writes it (call this before
    anything else opens them, e.g. a digest for the run's config hash)."""
    for what, path in (("the training text store", Path(texts_path)),
                       ("the training examples file", Path(train_path))):
        if not path.exists():
            raise FileNotFoundError(f"{what} {path} does not exist: it is written by {WRITTEN_BY}; run that "
                                    "first, or point data.texts / data.examples at your own files")


class TrainingGroups(Dataset):
    """Item (epoch, i) -> {"query", "passages": [positive, negative...], "pool", "teacher_scores": [one per
    passage] or None} for example i in that epoch."""

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
        with_teacher = sum(e["teacher"] is not None for e in self.examples)
        if with_teacher:  # said only for files that carry teacher scores
            self.stats["with_teacher_scores"] = with_teacher

    def _read_examples(self, max_examples: int | None) -> list[dict]:
        """The examples as groups are drawn from them; every row checked by the one reader of the format
        (care.data.examples), its ids against the text store."""
        rows = []
        for line, row in read_example_rows(self.train_path, self.texts, limit=max_examples, store=self.texts_path):
            teacher = None  # (positives' scores, negatives' scores) when the file has them
            if TEACHER_FIELDS.keys() <= row.keys():
                teacher = tuple([float(x) for x in row[f]] for f in TEACHER_FIELDS)
            rows.append({"query_id": row["query_id"], "pos_ids": row["pos_ids"], "neg_ids": row.get("neg_ids", []),
                         "pool": row.get("pool"), "teacher": teacher, "rule": row.get("rule"), "line": line})
        return rows

    def require_teacher_scores(self, key: str) -> None:
        """Refuse (one line, naming the file and what writes the scores) a file a distilling loss cannot use:
        one without teacher scores (the reader, care.data.examples, holds a file to them on every line or
        on none).  (An example without negatives is trained on borrowed random passages, which have no
        teacher score: its group gets no distillation term, counted in `stats` as without_negatives.)
        `key`: the config key that asked for distillation."""
        if all(e["teacher"] is None for e in self.examples):
            raise DataError(self.train_path, None, None,
                            f"{key} > 0 distils teacher scores, and this training file has none "
                            f"(teacher_pos_scores, teacher_neg_scores): they are written by {TEACHER_WRITTEN_BY} "
                            f"into its score.out_dir (default <data_dir>/scored); run it and train on that folder "
                            f"(data.dir=...), or set {key}=0")

    def __len__(self) -> int:
        return len(self.examples)

    def draw(self, epoch: int, index: int, repeat: int = 0) -> tuple[int, list[int], list[str]]:
        """(positive's index in pos_ids, negatives' indices in neg_ids, borrowed passage ids) drawn for example
        `index` in `epoch`: the one place the group's randomness is spent.  `repeat` > 0: the example's
        repeat-th return in the epoch (a by_rule weight above its share), drawn afresh."""
        ex = self.examples[index]
        need = self.group_size - 1
        if need == 0 and len(ex["pos_ids"]) == 1:  # nothing to draw (CARE stage I): what the generator would give
            return 0, [], []
        entropy = [self.seed, epoch, index]
        rng = np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=(REPEAT_STREAM, repeat))
                                    if repeat else entropy)
        pos = int(rng.integers(len(ex["pos_ids"])))
        n_negs = len(ex["neg_ids"])
        if need == 0:
            return pos, [], []
        if n_negs >= need:
            return pos, [int(j) for j in rng.choice(n_negs, need, replace=False)], []
        if n_negs:  # too few: all of them, the rest drawn again from them (see the module docstring)
            return pos, [*range(n_negs), *(int(j) for j in rng.integers(n_negs, size=need - n_negs))], []
        return pos, [], self._random_passages(rng, need, set(ex["pos_ids"]))

    def group(self, epoch: int, index: int, repeat: int = 0) -> tuple[str, list[str], list[float] | None]:
        """(query id, [positive id, negative ids...], their teacher scores) drawn for example `index` in
        `epoch`; the scores are None when the example has none or its group borrowed random passages."""
        ex = self.examples[index]
        pos, negs, borrowed = self.draw(epoch, index, repeat)
        ids = [ex["pos_ids"][pos], *(ex["neg_ids"][j] for j in negs), *borrowed]
        if ex["teacher"] is None or borrowed:
            return ex["query_id"], ids, None
        pos_scores, neg_scores = ex["teacher"]
        return ex["query_id"], ids, [pos_scores[pos], *(neg_scores[j] for j in negs)]

    def group_ids(self, epoch: int, index: int) -> tuple[str, list[str]]:
        """(query id, [positive id, negative ids...]) drawn for example `index` in `epoch`."""
        qid, ids, _ = self.group(epoch, index)
        return qid, ids

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

    def example_rules(self, key: str = "trainer.batching") -> list[str]:
        """The build rule of every example, in file order; an example without one is refused (one line)."""
        bare = [e for e in self.examples if not isinstance(e["rule"], str) or not e["rule"]]
        if bare:
            raise DataError(self.train_path, bare[0]["line"], "rule",
                            f"{key}=by_rule batches by each example's build rule, and {len(bare)} of "
                            f"{len(self.examples)} examples name none (this is the first): a file of the build "
                            f"and mine stages ({WRITTEN_BY}) names them; CARE's stage I (same-text pairs) has "
                            f"none: set it for stage II only (++model.stages.stage2.trainer.batching=by_rule), "
                            f"or use {key}=mixed")
        return [e["rule"] for e in self.examples]

    def __getitem__(self, item: tuple[int, int] | tuple[int, int, int]) -> dict:
        epoch, index, *repeat = item
        qid, pids, teacher = self.group(epoch, index, *repeat)
        return {"query": self.texts[qid], "passages": [self.texts[p] for p in pids],
                "pool": self.examples[index]["pool"], "teacher_scores": teacher}


def collate_groups(items: list[dict]) -> dict:
    """Batch of groups -> {"queries": [B texts], "passages": [B * group_size texts]} in pool layout,
    "passage_pools": the pool (build.rules' `pool`, None when the file has none) of each passage's group,
    and, when any group has them, "teacher_scores": a (B, group_size) float32 tensor (row i: group i's
    scores, positive first, in pool order; NaN for a group without, which distillation leaves out)."""
    batch = {"queries": [it["query"] for it in items], "passages": [p for it in items for p in it["passages"]],
             "passage_pools": [it.get("pool") for it in items for _ in it["passages"]]}
    teacher = [it.get("teacher_scores") for it in items]
    if any(t is not None for t in teacher):
        width = len(items[0]["passages"])
        batch["teacher_scores"] = torch.tensor([t if t is not None else [math.nan] * width for t in teacher],
                                               dtype=torch.float32)
    return batch
