"""The training loop, on accelerate: one code path for one CPU, one GPU, many GPUs and many nodes.

Each step takes `batch_size` queries per process, each with 1 positive and (group_size - 1) negatives
(care.training.data), runs the pool through GradCache (care.training.gradcache; `chunk_size` texts per
forward; `chunk_size: null` = the plain step, whole pool in one pass), clips the gradient and steps AdamW
and the schedule (linear warmup, then cosine decay: transformers' get_cosine_schedule_with_warmup).  Under
several processes accelerate shards the batches and wraps the model in DDP; negatives are gathered from
every process (care.training.distributed).  Validation (early stopping, the best model) runs on the main
process only.  The loop knows no model family: it drives care.training.model's protocol.  A loss that
distils teacher scores (`loss.teacher_weight > 0`; CARE: `model.stages.stage2.loss.teacher_weight`) gets each
batch's (batch, group_size) scores of the drawn groups (care.training.data), gathered like the negatives.
`trainer.batching: by_rule` draws each global batch from one build rule (care.training.samplers).

The run folder (`output_dir`) is described in the README ("Training"); checkpoints and resume in
care.training.checkpoint, what is saved of the model (a checkpoint's trained weights, the model folders
best/ and final/) in care.training.model_saving, the log and curves in care.training.runlog.  `train(cfg)`,
at the end, is what train.py runs: the recipe the model's family names (CARE's two stages), else one Trainer.
"""
from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from care.encoders.registry import best_weights
from care.families import family_of, hook
from care.runlock import FORCE_KEY, lock_run_folder, release_lock_after, release_lock_on_error
from care.training.checkpoint import AlreadyFinished, ResumeError, RunFolder, config_hash
from care.training.data import TrainingGroups, collate_groups, require_training_files
from care.training.distributed import all_gather_with_grad, gather_reps, world_size
from care.training.gradcache import GradCache
from care.training.model import build_family
from care.training.model_saving import load_trained, save_final, save_model, trained_state
from care.training.runlog import RunLog, memory_mb, wandb_mode
from care.training.samplers import build_sampler
from care.training.validation import EarlyStopping, Validator

__all__ = ["AlreadyFinished", "Diverged", "ResumeError", "Trainer", "train"]


class Diverged(FloatingPointError):
    """A step's loss or gradient norm, or the weights to be saved, are NaN or infinite: the run stops there
    without a final model (train.py: one line, exit status 1), its last checkpoint before the step kept."""


def first_non_finite(models: Sequence[torch.nn.Module]) -> str | None:
    """The name of the first weight holding a NaN or an infinity, None when every weight is finite."""
    for model in models:
        for name, weight in model.named_parameters():
            if not bool(torch.isfinite(weight).all()):
                return name
    return None


def build_loss(loss_cfg: DictConfig, group_size: int):
    """conf/loss/*.yaml names its class in `_target_`; the group size checks the pool layout."""
    return instantiate(loss_cfg, group_size=group_size, _convert_="all")


def loss_key(cfg: DictConfig) -> str:
    """Where the run's loss is configured, for messages: `loss`, or a CARE stage's
    `model.stages.<stage>.loss` (care.training.care_recipe copies it to `loss`)."""
    stage = cfg.model.get("current_stage")
    return f"model.stages.{stage}.loss" if stage else "loss"


class Trainer:
    """`Trainer(cfg).fit()` trains and returns a summary; `callbacks` run after every step with the trainer
    (tests use one to simulate a crash)."""

    @release_lock_on_error
    def __init__(self, cfg: DictConfig, callbacks: Sequence[Callable[[Trainer], None]] = ()):
        self.cfg, self.callbacks = cfg, list(callbacks)
        self.out = Path(cfg.output_dir)
        self.accelerator = Accelerator(cpu=cfg.trainer.cpu, mixed_precision=cfg.trainer.mixed_precision,
                                       log_with=None if wandb_mode(cfg) == "disabled" else "wandb")
        # Cheapest first: a bad folder, file or loss setting is refused in seconds, before the model loads.
        self._claim_run_folder()
        set_seed(cfg.seed)
        self._read_data()
        self._build_loss()
        self._pick_query_side_pools()
        self._load_model()
        self._prepare_training()
        self._build_validation()
        self.step = self.epoch = self.batch_in_epoch = 0
        self.stop_reason = ""
        self.non_finite = ""  # what a diverged step found non-finite (optimizer_step)
        self.provenance: dict | None = None  # base models and data lineage, read once (model_saving.training_record)
        start = self.folder.resume_point(cfg.trainer.resume, cfg.trainer.get("resume_unverified", False))
        if start is not None:
            self.resume(start)
        else:
            self.log_rows.keep_until(None)  # rows of an attempt that never reached a checkpoint

    def _claim_run_folder(self) -> None:
        """The run's config hash, its folder (checked against what it holds: resume, refuse or overwrite),
        the folder's lock and the log.  The training files are checked first, since the hash reads them."""
        cfg, acc = self.cfg, self.accelerator
        require_training_files(cfg.data.texts, cfg.data.examples)  # say what writes a missing one
        self.hash = config_hash(cfg)
        self.folder = RunFolder(self.out, self.hash, acc, cfg)
        self.run_lock = lock_run_folder(self.out, "training", acc, force=cfg.get(FORCE_KEY, False))
        self.folder.check(cfg.overwrite)
        self.log_rows = RunLog(self.out, acc, cfg, self.hash)

    def _read_data(self) -> None:
        """The training groups and the epoch order."""
        cfg, t = self.cfg, self.cfg.trainer
        self.data = TrainingGroups(cfg.data.texts, cfg.data.examples, t.group_size, cfg.seed,
                                   cfg.data.max_examples)
        self.sampler = build_sampler(t, self.data, cfg.seed, self.accelerator.num_processes)

    def _build_loss(self) -> None:
        """The loss; a distilling one refuses a training file without teacher scores."""
        self.loss = build_loss(self.cfg.loss, self.cfg.trainer.group_size)
        self.distils = bool(getattr(self.loss, "distils_teacher", False))
        if self.distils:
            self.data.require_teacher_scores(f"{loss_key(self.cfg)}.teacher_weight")

    def _pick_query_side_pools(self) -> None:
        """The passage pools that get the query prompt (trainer.query_side_pools; see train_step)."""
        cfg = self.cfg
        self.query_side_pools = set(cfg.trainer.get("query_side_pools") or ())
        if self.query_side_pools and not any(e["pool"] for e in self.data.examples):
            # A file of your own may lack pools (every passage then gets the document prompt); one from an
            # older mine stage should be re-mined.  stacklevel 4: the line that built the Trainer.
            warnings.warn(f"trainer.query_side_pools={sorted(self.query_side_pools)} but {cfg.data.examples} names no "
                          "pool, so every passage gets the document prefix; a file from an older mine stage: "
                          "re-run `python -m data_pipeline stage=mine force=true`", stacklevel=4)

    def _load_model(self) -> None:
        """The family's modules (one backbone, or a tower per side) and which of them train."""
        self.family = build_family(self.cfg)
        if hasattr(self.loss, "check_width"):  # Matryoshka widths the model's vectors cannot give
            self.loss.check_width(self.family.dense_width, loss_key(self.cfg))
        self.towers = [m for m in (self.family.query_module, self.family.document_module) if m is not None]
        # A frozen tower (CARE stage I's cached document vectors) has nothing to train.
        self.trainable = [any(p.requires_grad for p in m.parameters()) for m in self.towers]

    def _prepare_training(self) -> None:
        """The loader, AdamW and the schedule, through accelerate (devices, DDP, sharded batches)."""
        t, acc = self.cfg.trainer, self.accelerator
        # The loader draws its worker seeds from its own generator, never from the global RNG, so building
        # an iterator (every epoch, and on resume) leaves dropout's random stream untouched.
        loader = DataLoader(self.data, batch_size=t.batch_size, sampler=self.sampler, collate_fn=collate_groups,
                            drop_last=True, num_workers=t.num_workers,
                            generator=torch.Generator().manual_seed(self.cfg.seed))
        params = [p for m in self.towers for p in m.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]  # no weight decay on biases and norms
        rest = [p for p in params if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                       {"params": rest, "weight_decay": 0.0}], lr=t.lr)
        # Only modules with trainable weights are prepared (DDP refuses a module with nothing to train); a
        # frozen one just moves to the device.
        *prepared, self.optimizer, self.loader = acc.prepare(
            *[m for m, k in zip(self.towers, self.trainable) if k], optimizer, loader)
        prepared = iter(prepared)
        self.towers = [next(prepared) if k else m.to(acc.device) for m, k in zip(self.towers, self.trainable)]
        if len(self.loader) == 0:
            raise ValueError(f"{len(self.data)} examples make no full batch of {t.batch_size} queries x "
                             f"{acc.num_processes} processes: lower trainer.batch_size")
        self.total_steps = min(t.max_steps or math.inf, t.epochs * len(self.loader))
        # Not passed to prepare(): accelerate would step it once per process per step.
        self.scheduler = get_cosine_schedule_with_warmup(
            self.optimizer, math.ceil(t.warmup_ratio * self.total_steps), self.total_steps)
        self.gradcache = GradCache(self.loss, t.chunk_size, acc, autocast=acc.autocast) if t.chunk_size else None

    def _build_validation(self) -> None:
        """The dev-set scorer and early stopping, when validation.task names a task (else both None)."""
        v = self.cfg.validation
        self.validator = Validator(v, getattr(self.family, "cache", None), family_of(self.cfg.model)) if v.task else None
        self.stopper = EarlyStopping(v.patience, v.min_delta) if v.task else None

    @property
    def model(self) -> torch.nn.Module:
        """The (prepared) module that encodes queries, and documents too for a one-backbone family."""
        return self.towers[0]

    def unwrapped(self) -> list[torch.nn.Module]:
        return [self.accelerator.unwrap_model(m) for m in self.towers]

    # ---- checkpoints -------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        models = self.unwrapped()
        self.check_finite(models, "checkpoint")
        state = {"model": trained_state(models[0]), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "epoch": self.epoch,
                 "batch_in_epoch": self.batch_in_epoch,
                 "early_stopping": self.stopper.state_dict() if self.stopper else None}
        if len(models) > 1:
            state["document_model"] = trained_state(models[1])
        return self.folder.save(self.step, state, self.cfg.trainer.keep_checkpoints,
                                write_model=lambda folder: save_model(self, models, folder))

    def resume(self, folder: Path) -> None:
        state = self.folder.load(folder)
        models = self.unwrapped()
        load_trained(models[0], state["model"], f"checkpoint {folder}: the model")
        if len(models) > 1:
            load_trained(models[1], state["document_model"], f"checkpoint {folder}: the document model")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        if self.stopper:
            self.stopper.load_state_dict(state["early_stopping"])
        self.log_rows.keep_until(self.step)  # rows past the checkpoint will be recomputed
        self.check_finite(models, f"resumed checkpoint {folder.name}")

    # ---- divergence ----------------------------------------------------------------------------------------
    def check_finite(self, models: list[torch.nn.Module], what: str) -> None:
        """Weights about to be saved or trained on hold no NaN or infinity (a state no finite step leads to,
        e.g. a checkpoint resumed with trainer.resume_unverified=true), else the run stops as diverged."""
        name = first_non_finite(models)
        if name is not None:
            self.diverge(f"the weights of the {what} hold NaN or infinite values ({name})")

    def diverge(self, found: str) -> None:
        """Record the stop (stop_reason 'diverged' in metrics.jsonl, where the run logs) and end the run
        without a final model: nothing non-finite is saved, so the checkpoints written so far stay."""
        self.stop_reason = "diverged"
        self.log_rows.log(self.step, {"stop_reason": self.stop_reason, "non_finite": found})
        kept = self.folder.checkpoints()
        last = (f"the last checkpoint, {kept[-1]}, is kept" if kept
                else "no checkpoint was written before it")
        raise Diverged(f"training diverged at step {self.step}: {found}; stopped without a final model and "
                       f"{last}. Lower trainer.lr (or raise trainer.warmup_ratio, lower trainer.max_grad_norm) "
                       f"and train again with overwrite=true or another run_name=")

    # ---- the loop ----------------------------------------------------------------------------------------
    def _tokenize(self, texts: list[str], sides: list[str], max_length: int) -> dict:
        batch = self.family.tokenize(texts, sides, max_length)
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}

    def train_step(self, batch: dict) -> dict[str, float]:
        t = self.cfg.trainer
        queries = self._tokenize(batch["queries"], ["query"] * len(batch["queries"]), t.query_max_length)
        # Passages of a symmetric pool (a question's paraphrase) are queries too: E5-style models embed both
        # sides of a symmetric pair with the query prompt, as STS and paraphrase search will ask them.
        sides = ["query" if pool in self.query_side_pools else "document" for pool in batch["passage_pools"]]
        passages = self._tokenize(batch["passages"], sides, t.passage_max_length)
        # (batch, group_size) teacher scores of the drawn groups, for a distilling loss only (no gradient)
        teacher = batch["teacher_scores"].to(self.accelerator.device) if self.distils else None
        query_model, passage_model = self.towers[0], self.towers[-1]
        for m, k in zip(self.towers, self.trainable):
            m.train(k)
        if self.gradcache:
            losses = self.gradcache.step(query_model, queries, passages, passage_model=passage_model,
                                         teacher_scores=teacher)
        else:  # the whole pool in one forward: no extra no-grad pass, memory grows with the pool
            extra = {} if teacher is None else {"teacher_scores": all_gather_with_grad(teacher)}
            with self.accelerator.autocast():
                out = self.loss(gather_reps(query_model(**queries)), gather_reps(passage_model(**passages)), **extra)
            self.accelerator.backward(out["loss"] * world_size())  # x world size: see distributed.py
            losses = {k: v.detach() for k, v in out.items()}
        return self.optimizer_step(losses)

    def optimizer_step(self, losses: dict) -> dict[str, float]:
        """Clip, step and schedule after a step's backward; the step's log row."""
        t = self.cfg.trainer
        grad_norm = self.accelerator.clip_grad_norm_([p for m in self.towers for p in m.parameters()],
                                                     t.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
        row = {**{f"loss/{k}": float(v) for k, v in losses.items()}, "grad_norm": float(grad_norm), "lr": lr}
        self.non_finite = self.non_finite_in(row)
        if self.non_finite:  # a NaN step would make every weight NaN: not taken (fit stops the run)
            self.optimizer.zero_grad(set_to_none=True)
            return row
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return row

    def non_finite_in(self, row: dict) -> str:
        """The step's non-finite losses and gradient norm ('' when finite), agreed by every process.  Under
        fp16 an infinite gradient is the GradScaler's to skip (it lowers the scale), so only the losses count
        there; a NaN that reaches the weights is still caught before they are saved (check_finite)."""
        names = [k for k in row if k.startswith("loss/")]
        if self.cfg.trainer.mixed_precision != "fp16":
            names.append("grad_norm")
        bad = [k for k in names if not math.isfinite(row[k])]
        if "loss/loss" in bad:  # the total: its terms add nothing to the message
            bad = [k for k in bad if k == "loss/loss" or not k.startswith("loss/")]
        found = ", ".join(f"{k.removeprefix('loss/')} = {row[k]}" for k in bad)
        if self.accelerator.num_processes > 1:  # one process's NaN stops them all at the same step
            flag = torch.tensor(float(bool(found)), device=self.accelerator.device)
            if float(self.accelerator.reduce(flag, reduction="sum")) > 0:
                found = found or "a non-finite loss or gradient on another process"
        return found

    @release_lock_after
    def fit(self, end_training: bool = True) -> dict:
        """`end_training=False` keeps the process group for another Trainer in this process (CARE's stage II
        after stage I: accelerate's end_training destroys it, and a later Accelerator does not re-create it)."""
        acc, t = self.accelerator, self.cfg.trainer
        self.log_rows.start()
        if self.stopper and self.step == 0:
            self.validate()  # the starting point, so the curve shows what training gained
        session_end = self.step + (t.max_steps_this_session or math.inf)
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=not acc.is_main_process)
        while self.step < self.total_steps and not self.stop_reason:
            loader = acc.skip_first_batches(self.loader, self.batch_in_epoch) if self.batch_in_epoch else self.loader
            loader.set_epoch(self.epoch)  # accelerate re-sets the sampler's epoch from this on every pass
            tick = time.perf_counter()
            for batch in loader:
                row = self.train_step(batch)
                self.step += 1
                self.batch_in_epoch += 1
                if self.non_finite:
                    bar.close()
                    self.log_rows.log(self.step, row)
                    self.diverge(self.non_finite)
                elapsed, tick = time.perf_counter() - tick, time.perf_counter()
                if self.step % t.log_every == 0 or self.step == self.total_steps:
                    self.log_rows.log(self.step, {**row, "epoch": self.epoch, "step_seconds": elapsed,
                                                  "examples_per_s": t.batch_size * acc.num_processes / elapsed,
                                                  "memory_mb": memory_mb()})
                bar.update(1)
                # the last step too: the best-of choice must see the last weights (every_steps may not divide it)
                if self.stopper and (self.step % self.cfg.validation.every_steps == 0 or self.step == self.total_steps):
                    self.validate()
                if self.step >= self.total_steps:
                    self.stop_reason = self.stop_reason or "completed"
                elif self.step >= session_end:
                    self.stop_reason = "max_steps_this_session"
                if self.stop_reason or self.step % t.checkpoint_every == 0:
                    self.save_checkpoint()
                for callback in self.callbacks:
                    callback(self)
                if self.stop_reason:
                    break
                tick = time.perf_counter()
            else:
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        bar.close()
        self.stop_reason = self.stop_reason or "completed"  # also: resumed from the last step's checkpoint
        summary = {"step": self.step, "epoch": self.epoch, "stop_reason": self.stop_reason,
                   "config_hash": self.hash, "output_dir": str(self.out), "data": self.data.stats}
        if self.stopper:
            summary.update(best_metric=self.stopper.best, best_step=self.stopper.best_step)
        if self.stop_reason != "max_steps_this_session":  # a paused run has no final model yet
            self.check_finite(self.unwrapped(), "final model")
            summary["final"] = str(save_final(self))
            if acc.is_main_process:
                self.log_rows.plot(self.cfg.validation.metric if self.stopper else None)
        if end_training:
            acc.end_training()
        else:
            for tracker in acc.trackers:  # what end_training does, less destroying the process group
                tracker.finish()
        return summary

    # ---- validation and early stopping -------------------------------------------------------------------
    def validate(self) -> None:
        """Score the dev task on the main process; every process learns whether to stop."""
        acc, v = self.accelerator, self.cfg.validation
        decision = [None]
        if acc.is_main_process:
            models = self.unwrapped()
            start = time.perf_counter()
            # leaves the model in eval mode; train_step sets train
            value = self.validator(self.family.encoder(models, self.cfg.trainer.passage_max_length))
            seconds = time.perf_counter() - start
            if self.stopper.update(value, self.step):
                save_model(self, models, self.out / "best", best_weights(self.step))
            self.log_rows.log(self.step, {f"val/{v.metric}": value, "val/best": self.stopper.best,
                                          "val/seconds": seconds})
            decision = ["early_stopping" if self.stopper.should_stop else ""]
        acc.wait_for_everyone()
        self.stop_reason = self.stop_reason or broadcast_object_list(decision)[0]

    def validation_summary(self) -> dict | None:
        if not self.stopper:
            return None
        return {"metric": self.cfg.validation.metric, "best": self.stopper.best, "best_step": self.stopper.best_step}


def train(cfg: DictConfig) -> dict:
    """What `python train.py` runs: the whole recipe the model config's family names (its `recipe` hook,
    care.families: CARE's stages in order, the reranker's run), else one Trainer run.  Returns the run's summary
    (`best_metric` among it).  A run that finished before with the same config is not trained again: its
    summary is returned (make run re-runs)."""
    recipe = hook(family_of(cfg.model), "recipe")
    if recipe is not None:
        return recipe(cfg)
    try:
        trainer = Trainer(cfg)
    except AlreadyFinished as done:
        print(done)
        return done.summary
    return trainer.fit()
