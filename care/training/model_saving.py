"""What the trainer (care.training.trainer) saves of its model: a checkpoint's weights, and the model folders.

A checkpoint's weights are the trained ones only (trained_state; load_trained reads them back on resume): the
frozen parameters never leave the start weights.  The model folders are checkpoints/step-N/model/, best/ (each
new best validation score), final/ at the end of the run, and tuned/ beside a merged final/
(trainer.merge_with_start).  Each is a model folder of the family, built beside its place and swapped in
whole, with the sentence-transformers files (care.encoders.st_folder) and care_training.json (what evaluate.py
detects and scores; every path in it relative to the folder or the project, none absolute); final/ and
tuned/ also get a model card (care.export.card).  The functions below take the trainer whose model they save
(a care.training.trainer.Trainer, not imported here: the trainer imports this module).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import OmegaConf

from care.data.io import atomic_folder, link_or_copy_tree, write_json
from care.encoders.registry import TRAINING_RECORD, best_weights, holds_starting_weights, read_record
from care.encoders.st_folder import write_st_files
from care.export.card import write_model_card
from care.export.provenance import base_models, data_lineage, portable
from care.training.checkpoint import ResumeError

log = logging.getLogger(__name__)


def frozen_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint's weights of `model`: its state_dict less the frozen parameters (trainer.freeze, CARE
    stage II's LoRA base), which never leave the start weights a resumed run loads again (the config hash
    covers both the start weights and what is frozen).  For care_me5's query tower the frozen vocabulary is
    93% of the weights: its weights in state.pt shrink from 395 to 28 MB (bench/results/care_step.json: the
    whole state.pt of care_me5's stage I, AdamW's moments included, is now 84 MB)."""
    frozen = frozen_names(model)
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def load_trained(model: torch.nn.Module, state: dict, what: str) -> None:
    """Load trained_state's weights (or a whole state_dict, as checkpoints held before): every key the
    model has but the frozen ones must be there, and no other."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    lacking = sorted(set(missing) - frozen_names(model))
    if lacking or unexpected:
        raise ResumeError(f"{what} weights do not fit this model: {len(lacking)} missing (e.g. {lacking[:3]}), "
                          f"{len(unexpected)} unexpected (e.g. {sorted(unexpected)[:3]})")


def save_model(trainer, models: list[torch.nn.Module], folder: Path, weights: str | None = None) -> Path:
    """`models` (the trainer's unwrapped towers) as a model folder of the family at `folder`; `weights` says
    which weights they are in care_training.json (default: the trainer's current step)."""
    with atomic_folder(folder) as tmp:
        trainer.family.save(models, tmp)
        finish_folder(tmp, training_record(trainer, weights or f"step {trainer.step}"))
    return folder


def finish_folder(folder: Path, record: dict) -> None:
    write_st_files(folder, record["model"])
    write_json(folder / TRAINING_RECORD, record)


def training_record(trainer, weights: str, merge: dict | None = None) -> dict:
    """care_training.json of a model folder the trainer writes now."""
    c = trainer.cfg
    if trainer.provenance is None:  # once a run: the pipeline's stats files are read, not the training files
        trainer.provenance = {"base_models": base_models(OmegaConf.to_container(c.model, resolve=True)),
                              "lineage": data_lineage(c.data.texts, c.data.examples)}
    return {"config_hash": trainer.hash, "steps": trainer.step, "stop_reason": trainer.stop_reason,
            "data": portable(trainer.data.stats), "validation": trainer.validation_summary(), "weights": weights,
            "merge": merge, "model": trainer.family.model_config(), **trainer.provenance,
            "config": portable(OmegaConf.to_container(c, resolve=True))}


def save_final(trainer) -> Path:
    """final/ (+ tuned/ with a merge), written by the main process; every process waits for it."""
    acc, out, stopper = trainer.accelerator, trainer.out, trainer.stopper
    final = out / "final"
    merge_weight = trainer.cfg.trainer.get("merge_with_start")
    if acc.is_main_process:
        best = out / "best"
        use_best = bool(stopper and best.exists())  # the early-stopping choice, not the last weights
        weights = best_weights(stopper.best_step) if use_best else "last"
        if holds_starting_weights({"weights": weights, "steps": trainer.step}):
            warn_untrained_final(trainer)
        # With a merge the fine-tuned weights are kept in tuned/ and final/ is the merged model.
        tuned = final if merge_weight is None else out / "tuned"
        with atomic_folder(tuned) as tmp:
            if use_best:
                link_or_copy_tree(best, tmp)
            else:
                trainer.family.save(trainer.unwrapped(), tmp)
            finish_folder(tmp, training_record(trainer, weights))
        if merge_weight is not None:
            merge = {"weight": merge_weight, "start": portable(str(trainer.cfg.model.path)), "tuned": "../tuned"}
            with atomic_folder(final) as tmp:
                trainer.family.merge_with_start(tuned, tmp, merge_weight)
                finish_folder(tmp, training_record(trainer, weights, merge))
            write_model_card(tuned, read_record(tuned))
        write_model_card(final, read_record(final))
    acc.wait_for_everyone()
    return final


def warn_untrained_final(trainer) -> None:
    """Say so when final/ is the starting point: no later validation scored above step 0's (a tie keeps the
    start), so the best-of choice throws every trained step away.  On a small validation set (the CPU default's
    12 queries) a tie is no rare event, and a row scored as "trained N steps" would be the untrained model."""
    v, stopper = trainer.cfg.validation, trainer.stopper
    log.warning("%s: no validation after step 0 scored above the start (%s %.4f at step 0); final/ holds the "
                "starting weights, not those of the %d trained steps (care_training.json: weights '%s'). "
                "For a fixed budget's last weights train with validation.task=null; more validation queries "
                "(validation.max_queries) make a tie less likely.", trainer.out, v.metric, stopper.best, trainer.step,
                best_weights(0))
