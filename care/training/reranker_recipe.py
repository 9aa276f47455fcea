"""What `python train.py model=me5_reranker` runs (the `reranker` family's recipe, care.families): one Trainer
run whose step scores (query, passage) pairs instead of embedding two sides.

Everything else is the Trainer's own, unchanged: the same training files and groups, checkpoints, resume
(bit-identical: tests/test_reranker_family.py), the run lock, best/ and final/ with care_training.json and a
model card, and validation by the evaluation's reranking runner (care.training.validation, through
care.retrieval.rerank's pair scorer).  The loss is the model config's own (`model.loss`, RerankerLoss of
care.training.reranker_family), copied to `loss` as CARE's stages copy theirs, so the run's config hash
covers it.
"""
from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from care.training.checkpoint import AlreadyFinished
from care.training.trainer import Trainer

#: the reranker's loss when a model config names none (FlagEmbedding's reranker: softmax over the group)
DEFAULT_LOSS = {"_target_": "care.training.reranker_family.RerankerLoss", "objective": "softmax", "temperature": 1.0}


class RerankerTrainer(Trainer):
    def train_step(self, batch: dict) -> dict[str, float]:
        """Each group's loss is its own (a softmax over its own passages), so the batch's mean loss is the
        weighted sum of chunks of whole groups: `trainer.chunk_size` pairs a forward (rounded down to whole
        groups, at least one; null = the batch at once) bound the memory, and the gradient is the same."""
        n = len(batch["queries"])
        group = len(batch["passages"]) // n
        chunk = n if not self.cfg.trainer.chunk_size else max(1, int(self.cfg.trainer.chunk_size) // group)
        model = self.towers[0]
        model.train()
        totals: dict[str, torch.Tensor] = {}
        for s in range(0, n, chunk):
            queries = [q for q in batch["queries"][s:s + chunk] for _ in range(group)]  # each beside its passages
            pairs = self.family.tokenize_pairs(queries, batch["passages"][s * group:(s + chunk) * group])
            share = len(queries) / group / n
            # gradients are synchronised across processes once, after the last chunk; each process's groups
            # are whole, so DDP's gradient mean is the mean over every process's groups
            last = s + chunk >= n
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model), self.accelerator.autocast():
                out = self.loss(model(**{k: v.to(self.accelerator.device) for k, v in pairs.items()}).logits[:, 0])
                self.accelerator.backward(out["loss"] * share)
            for k, v in out.items():
                totals[k] = totals.get(k, 0.0) + v.detach() * share
        return self.optimizer_step(totals)


def reranker_config(cfg: DictConfig) -> DictConfig:
    """The run's config: the model's loss as `loss`; an encoder recipe's merge with the start (cpu_default's
    LM-Cocktail 0.5) dropped with a note, as a fresh head has nothing to merge with."""
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(c):
        c.loss = c.model.get("loss") or DEFAULT_LOSS
        if c.trainer.get("merge_with_start") is not None:
            print(f"train: trainer.merge_with_start={c.trainer.merge_with_start} does not apply to a reranker "
                  "(a fresh head has no start to merge with): not merged")
            c.trainer.merge_with_start = None
        c.trainer.query_side_pools = []  # a pair carries no prompt, so no pool changes how it is tokenized
    return c


def run_reranker(cfg: DictConfig) -> dict:
    try:
        trainer = RerankerTrainer(reranker_config(cfg))
    except AlreadyFinished as done:
        print(done)
        return done.summary
    return trainer.fit()
