"""The training loop, on accelerate: one code path for one CPU, one GPU, many GPUs and many nodes.

Each step takes `batch_size` queries per process, each with 1 positive and (group_size - 1) negatives
(care.training.data), runs the pool through GradCache (care.training.gradcache; `chunk_size` texts per
forward, so the pool may be far larger than what fits in memory at once; `chunk_size: null` = the plain step,
whole pool in one pass), clips the gradient and steps AdamW and the schedule (linear warmup, then cosine
decay: transformers' get_cosine_schedule_with_warmup).  Under several processes accelerate shards the
batches and wraps the model in DDP; negatives are gathered from every process (care.training.distributed).
Validation (early stopping, the best model) runs on the main process only.

Run folder `output_dir` (outputs/train/<run name>/):
    checkpoints/step-NNNNNNN/   state.pt (model, optimizer, schedule, position, early stopping, config hash)
                                + rng-<rank>.pt per process; everything loads with torch.load(weights_only=True)
    best/                       the best model so far by the validation metric (FlagEmbedding's M3 format)
    final/                      the model to use: `best` when validating, else the last weights (M3 format)
                                + care_training.json (config, hash, steps, why it stopped); with
                                trainer.merge_with_start = w, those weights merged with the start
                                (care.training.merge: w * tuned + (1 - w) * start, backbone only)
    tuned/                      with a merge only: the fine-tuned weights before it (M3 format)
    metrics.jsonl, curves.png   one row per logged step / validation; the curves drawn from them

Resume is exact: the same weights as an uninterrupted run, bit for bit on CPU in fp32.  That needs the model,
AdamW's moments, the schedule, every RNG (dropout) and the data position; the data position is just
(epoch, batches done) because every group is a pure function of (seed, epoch, example index).  A checkpoint
of another config (another hash) is refused, as is replacing the final model of another run.
Checkpoints hold full (unsharded) states: DDP, the tested multi-process setting; several nodes need the run
folder on a shared filesystem.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import psutil
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from care.encoders.base import Embeddings, weights_digest
from care.models.m3 import M3Encoder, M3Model, load_backbone
from care.training.data import EpochSampler, TrainingGroups, collate_groups
from care.training.distributed import gather_reps, world_size
from care.training.gradcache import GradCache
from care.training.losses import M3Loss
from care.training.merge import merge_with_start
from data_pipeline.io import atomic_open, file_digest, read_jsonl, write_json, write_jsonl

# Settings that do not change the trained weights: a run may resume with other values for these.
RESUME_SAFE = ("trainer.resume", "trainer.max_steps_this_session", "trainer.num_workers", "trainer.log_every",
               "trainer.checkpoint_every", "trainer.keep_checkpoints", "validation.batch_size", "wandb",
               "overwrite", "output_dir", "run_name", "experiment_name", "hydra", "data.dir", "data.texts",
               "data.examples")


class ResumeError(RuntimeError):
    """A checkpoint that does not belong to this config, or a final model of another run in the way."""


class AlreadyFinished(ResumeError):
    """output_dir holds the final model of this very config: nothing to train (train.py reports and skips,
    as the data pipeline skips an unchanged stage)."""


def config_hash(cfg: DictConfig) -> str:
    """What determines the trained weights: the resolved config without RESUME_SAFE keys, plus the content
    of the training files and the starting weights (not their paths, which may move)."""
    c = OmegaConf.to_container(cfg, resolve=True)
    for key in RESUME_SAFE:
        *parents, leaf = key.split(".")
        node = c
        for p in parents:
            node = node.get(p, {})
        node.pop(leaf, None)
    c["data_digest"] = [file_digest(cfg.data.texts), file_digest(cfg.data.examples)]
    c["start_weights"] = weights_digest(cfg.model.path)
    return hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest()[:16]


# ---- RNG state as tensors and lists (torch.load(weights_only=True) refuses numpy objects; facts.md s.6)
def rng_state() -> dict:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def build_model(model_cfg: DictConfig, seed: int) -> M3Model:
    """`kind: m3` folders carry trained heads; a plain encoder (`kind: dense`, e.g. multilingual-e5-small)
    becomes the backbone of an M3 model with fresh, seeded sparse and ColBERT heads."""
    pooling = model_cfg.get("pooling", "cls")
    if model_cfg.get("kind", "dense") == "m3":
        return M3Model.load(model_cfg.path, pooling, build_hint=model_cfg.get("build_hint", ""))
    return M3Model.from_backbone(model_cfg.path, pooling, seed=seed)


def freeze(model: torch.nn.Module, patterns: Sequence[str]) -> None:
    """Stop training every parameter whose name contains one of `patterns` (e.g. the 96M-parameter
    vocabulary matrix of multilingual-e5-small, which dominates a CPU optimizer step and which a short
    run barely moves)."""
    for pattern in patterns:
        hits = [p for name, p in model.named_parameters() if pattern in name]
        if not hits:
            raise ValueError(f"trainer.freeze: no parameter name contains {pattern!r}")
        for p in hits:
            p.requires_grad_(False)


def build_loss(loss_cfg: DictConfig, group_size: int) -> M3Loss:
    """conf/loss/*.yaml: M3Loss's arguments (`_target_` optional); the group size checks the pool layout."""
    kwargs = OmegaConf.to_container(loss_cfg, resolve=True)
    kwargs.pop("_target_", None)
    kwargs.pop("name", None)
    return M3Loss(**kwargs, group_size=group_size)


class EarlyStopping:
    """Stop after `patience` validations without an improvement of more than `min_delta`."""

    def __init__(self, patience: int, min_delta: float = 0.0):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.best_step, self.bad = -math.inf, -1, 0

    def update(self, value: float, step: int) -> bool:
        """Record a validation; True when it is the best so far."""
        if value > self.best + self.min_delta:
            self.best, self.best_step, self.bad = value, step, 0
            return True
        self.bad += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.bad >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load_state_dict(self, d: dict) -> None:
        self.best, self.best_step, self.bad = d["best"], d["best_step"], d["bad"]


class Trainer:
    """`Trainer(cfg).fit()` trains and returns a summary; `callbacks` run after every step with the trainer
    (tests use one to simulate a crash)."""

    def __init__(self, cfg: DictConfig, callbacks: Sequence[Callable[[Trainer], None]] = ()):
        self.cfg, self.callbacks = cfg, list(callbacks)
        t = cfg.trainer
        self.out = Path(cfg.output_dir)
        wandb_mode = os.environ.get("WANDB_MODE") or cfg.wandb.mode
        self.accelerator = Accelerator(cpu=t.cpu, mixed_precision=t.mixed_precision,
                                       log_with=None if wandb_mode == "disabled" else "wandb")
        acc = self.accelerator
        self.hash = config_hash(cfg)
        self._check_run_folder()
        set_seed(cfg.seed)

        self.data = TrainingGroups(cfg.data.texts, cfg.data.examples, t.group_size, cfg.seed,
                                   cfg.data.max_examples)
        self.query_side_pools = set(t.get("query_side_pools") or ())
        if self.query_side_pools and not any(e["pool"] for e in self.data.examples):
            # A file of your own may lack pools (every passage then gets the document prefix); one from an
            # older mine stage should be re-mined.
            warnings.warn(f"trainer.query_side_pools={sorted(self.query_side_pools)} but {cfg.data.examples} names no "
                          "pool, so every passage gets the document prefix; a file from an older mine stage: "
                          "re-run `python -m data_pipeline stage=mine force=true`", stacklevel=2)
        model = build_model(cfg.model, cfg.seed)
        freeze(model, t.freeze)
        model.set_backbone_heads(list(t.backbone_heads))
        if t.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.tokenizer = model.tokenizer
        self.sampler = EpochSampler(len(self.data), cfg.seed)
        # The loader draws its worker seeds from its own generator, never from the global RNG, so building
        # an iterator (every epoch, and on resume) leaves dropout's random stream untouched.
        loader = DataLoader(self.data, batch_size=t.batch_size, sampler=self.sampler, collate_fn=collate_groups,
                            drop_last=True, num_workers=t.num_workers,
                            generator=torch.Generator().manual_seed(cfg.seed))
        params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]  # no weight decay on biases and norms
        rest = [p for p in params if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                       {"params": rest, "weight_decay": 0.0}], lr=t.lr)
        self.model, self.optimizer, self.loader = acc.prepare(model, optimizer, loader)
        if len(self.loader) == 0:
            raise ValueError(f"{len(self.data)} examples make no full batch of {t.batch_size} queries x "
                             f"{acc.num_processes} processes: lower trainer.batch_size")
        self.total_steps = min(t.max_steps or math.inf, t.epochs * len(self.loader))
        # Not passed to prepare(): accelerate would step it once per process per step.
        self.scheduler = get_cosine_schedule_with_warmup(
            self.optimizer, math.ceil(t.warmup_ratio * self.total_steps), self.total_steps)
        self.loss = build_loss(cfg.loss, t.group_size)
        self.gradcache = GradCache(self.loss, t.chunk_size, acc, autocast=acc.autocast) if t.chunk_size else None
        v = cfg.validation
        self.stopper = EarlyStopping(v.patience, v.min_delta) if v.task else None
        self.step = self.epoch = self.batch_in_epoch = 0
        self.stop_reason = ""
        start = self._resume_from()
        if start is not None:
            self.resume(start)
        elif acc.is_main_process and (self.out / "metrics.jsonl").exists():
            self._write_metrics([])  # rows of an attempt that never reached a checkpoint

    # ---- run folder ------------------------------------------------------------------------------------
    def _check_run_folder(self) -> None:
        info = self.out / "final" / "care_training.json"
        if info.exists() and not self.cfg.overwrite:
            theirs = json.loads(info.read_text(encoding="utf-8")).get("config_hash")
            if theirs == self.hash:
                raise AlreadyFinished(f"{info.parent} already holds the final model of this run, already "
                                      f"finished (config {self.hash}): skipped. Pass overwrite=true to train again.")
            raise ResumeError(f"{info.parent} already holds the final model of another run (config {theirs}); "
                              f"this config is {self.hash}. Choose another run_name= or pass overwrite=true to replace it.")
        if self.cfg.overwrite and self.accelerator.is_main_process:
            for name in ("checkpoints", "best", "tuned", "final", "metrics.jsonl", "curves.png"):
                path = self.out / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        self.accelerator.wait_for_everyone()

    def _checkpoints(self) -> list[Path]:
        return sorted((self.out / "checkpoints").glob("step-[0-9]*[0-9]"))

    # ---- checkpoints -------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        acc = self.accelerator
        final = self.out / "checkpoints" / f"step-{self.step:07d}"
        tmp = final.with_name(final.name + ".tmp")
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            torch.save({"model": acc.unwrap_model(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(), "step": self.step, "epoch": self.epoch,
                        "batch_in_epoch": self.batch_in_epoch, "config_hash": self.hash,
                        "num_processes": acc.num_processes,
                        "early_stopping": self.stopper.state_dict() if self.stopper else None},
                       tmp / "state.pt")
        acc.wait_for_everyone()
        torch.save(rng_state(), tmp / f"rng-{acc.process_index}.pt")
        acc.wait_for_everyone()
        if acc.is_main_process:  # the folder appears complete or not at all
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in self._checkpoints()[:-self.cfg.trainer.keep_checkpoints]:
                shutil.rmtree(old)
        acc.wait_for_everyone()
        return final

    def _resume_from(self) -> Path | None:
        r = self.cfg.trainer.resume
        if not r:
            return None
        if r == "auto":
            found = self._checkpoints()
            return found[-1] if found else None
        return Path(r)

    def resume(self, folder: Path) -> None:
        acc = self.accelerator
        if not (folder / "state.pt").exists():
            raise ResumeError(f"{folder} is not a checkpoint (no state.pt)")
        state = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
        if state["config_hash"] != self.hash:
            raise ResumeError(
                f"checkpoint {folder} belongs to another config (hash {state['config_hash']}, this run's is "
                f"{self.hash}): resuming would mix two runs. Use the config it was trained with, another "
                f"run_name= (a new output folder), trainer.resume=null, or overwrite=true to start over.")
        if state["num_processes"] != acc.num_processes:
            raise ResumeError(f"checkpoint {folder} was written by {state['num_processes']} processes, this run "
                              f"has {acc.num_processes}: the data position and RNG streams would not match")
        acc.unwrap_model(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        if self.stopper:
            self.stopper.load_state_dict(state["early_stopping"])
        set_rng_state(torch.load(folder / f"rng-{acc.process_index}.pt", weights_only=True))
        if acc.is_main_process:  # drop log rows past the checkpoint: they will be recomputed
            rows = self._read_metrics()
            self._write_metrics([r for r in rows if r["step"] <= self.step])

    # ---- the loop ----------------------------------------------------------------------------------------
    def _tokenize(self, texts: list[str], prefixes: list[str], max_length: int) -> dict:
        batch = self.tokenizer([p + t for p, t in zip(prefixes, texts)], padding=True, truncation=True,
                               max_length=max_length, return_tensors="pt")
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}

    def train_step(self, batch: dict) -> dict[str, float]:
        t, m = self.cfg.trainer, self.cfg.model
        qp, dp = m.get("query_prefix", ""), m.get("doc_prefix", "")
        # Passages of a symmetric pool (a question's paraphrase) are queries too: E5-style models embed both
        # sides of a symmetric pair with the query prefix, as STS and paraphrase search will ask them.
        queries = self._tokenize(batch["queries"], [qp] * len(batch["queries"]), t.query_max_length)
        passages = self._tokenize(batch["passages"],
                                  [qp if pool in self.query_side_pools else dp for pool in batch["passage_pools"]],
                                  t.passage_max_length)
        self.model.train()
        if self.gradcache:
            losses = self.gradcache.step(self.model, queries, passages)
        else:  # the whole pool in one forward: no extra no-grad pass, memory grows with the pool
            with self.accelerator.autocast():
                out = self.loss(gather_reps(self.model(**queries)), gather_reps(self.model(**passages)))
            self.accelerator.backward(out["loss"] * world_size())  # x world size: see distributed.py
            losses = {k: v.detach() for k, v in out.items()}
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**{f"loss/{k}": float(v) for k, v in losses.items()}, "grad_norm": float(grad_norm), "lr": lr}

    def fit(self) -> dict:
        acc, t = self.accelerator, self.cfg.trainer
        self._init_tracker()
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
                elapsed, tick = time.perf_counter() - tick, time.perf_counter()
                if self.step % t.log_every == 0 or self.step == self.total_steps:
                    self.log({**row, "epoch": self.epoch, "step_seconds": elapsed,
                              "examples_per_s": t.batch_size * acc.num_processes / elapsed,
                              "memory_mb": memory_mb()})
                bar.update(1)
                if self.stopper and self.step % self.cfg.validation.every_steps == 0:
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
            summary["final"] = str(self.save_final())
            if acc.is_main_process:
                self.plot()
        acc.end_training()
        return summary

    # ---- validation and early stopping -------------------------------------------------------------------
    def validate(self) -> None:
        """Score the dev task on the main process; every process learns whether to stop."""
        acc, v = self.accelerator, self.cfg.validation
        decision = [None]
        if acc.is_main_process:
            model = acc.unwrap_model(self.model)
            start = time.perf_counter()
            value = dev_metric(model, self.cfg)  # leaves the model in eval mode; train_step sets train
            seconds = time.perf_counter() - start
            if self.stopper.update(value, self.step):
                model.save(self.out / "best")
            self.log({f"val/{v.metric}": value, "val/best": self.stopper.best, "val/seconds": seconds})
            decision = ["early_stopping" if self.stopper.should_stop else ""]
        acc.wait_for_everyone()
        self.stop_reason = self.stop_reason or broadcast_object_list(decision)[0]

    # ---- outputs -----------------------------------------------------------------------------------------
    def save_final(self) -> Path:
        """FlagEmbedding's M3 folder (loadable by evaluate.py ckpt=... and BGEM3FlagModel) + care_training.json."""
        acc = self.accelerator
        final = self.out / "final"
        merge_weight = self.cfg.trainer.get("merge_with_start")
        if acc.is_main_process:
            best = self.out / "best"
            use_best = bool(self.stopper and best.exists())  # the early-stopping choice, not the last weights
            # With a merge the fine-tuned weights are kept in tuned/ and final/ is the merged model.
            tuned = final if merge_weight is None else self.out / "tuned"
            if use_best:
                tmp = tuned.with_name(f".{tuned.name}.tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.copytree(best, tmp)
                shutil.rmtree(tuned, ignore_errors=True)
                os.replace(tmp, tuned)
            else:
                acc.unwrap_model(self.model).save(tuned)
            if merge_weight is not None:
                merged = M3Model.load(tuned, self.cfg.model.get("pooling", "cls"))
                merge_with_start(merged, load_backbone(self.cfg.model.path, self.cfg.model.get("build_hint", "")),
                                 merge_weight)
                merged.save(final)
            model_cfg = {**OmegaConf.to_container(self.cfg.model, resolve=True), "kind": "m3", "path": str(final)}
            info = {"config_hash": self.hash, "steps": self.step, "stop_reason": self.stop_reason,
                    "data": self.data.stats, "weights": f"best (step {self.stopper.best_step})" if use_best else "last",
                    "merge": None if merge_weight is None else {
                        "weight": merge_weight, "start": str(self.cfg.model.path), "tuned": str(tuned)},
                    "model": model_cfg, "config": OmegaConf.to_container(self.cfg, resolve=True)}
            write_json(final / "care_training.json", info)
            if merge_weight is not None:  # tuned/ is a model of its own: evaluate.py ckpt=<run> scores both
                write_json(tuned / "care_training.json", {**info, "merge": None, "model": {**model_cfg, "path": str(tuned)}})
        acc.wait_for_everyone()
        return final

    def _init_tracker(self) -> None:
        if self.accelerator.log_with:
            mode = os.environ.get("WANDB_MODE") or self.cfg.wandb.mode
            self.accelerator.init_trackers(
                self.cfg.wandb.project, config=OmegaConf.to_container(self.cfg, resolve=True),
                init_kwargs={"wandb": {"name": self.cfg.run_name, "mode": mode, "dir": str(self.out),
                                       "id": f"{self.cfg.run_name}-{self.hash}", "resume": "allow"}})

    def log(self, row: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        row = {"step": self.step, **row}
        self.accelerator.log({k: v for k, v in row.items() if k != "step"}, step=self.step)
        self.out.mkdir(parents=True, exist_ok=True)
        # Appended row by row (one small write each); a resume rewrites the file up to its checkpoint.
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")

    def _read_metrics(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        return list(read_jsonl(path)) if path.exists() else []

    def _write_metrics(self, rows: list[dict]) -> None:
        with atomic_open(self.out / "metrics.jsonl") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)

    def plot(self) -> Path:
        """curves.png: each head's loss, the learning rate and the validation metric against the step."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self._read_metrics()
        keys = sorted({k for r in rows for k in r})
        panels = {"loss": [k for k in keys if k.startswith("loss/")], "learning rate": ["lr"],
                  "validation": [f"val/{self.cfg.validation.metric}"] if self.stopper else []}
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, (title, names) in zip(axes, panels.items()):
            for name in names:
                points = [(r["step"], r[name]) for r in rows if name in r]
                if points:
                    ax.plot(*zip(*points), marker="o" if title == "validation" else None, label=name)
                    ax.legend(fontsize=8)
            ax.set_title(title)
            ax.set_xlabel("step")
        fig.suptitle(f"{self.cfg.run_name} ({self.hash})")
        fig.tight_layout()
        with atomic_open(self.out / "curves.png", "wb") as fh:
            fig.savefig(fh, format="png", dpi=100)
        plt.close(fig)
        return self.out / "curves.png"


def memory_mb() -> float:
    """Peak accelerator memory on a GPU; the process's resident memory on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return psutil.Process().memory_info().rss / 2**20


def dev_metric(model: M3Model, cfg: DictConfig) -> float:
    """The validation metric of the model as it is now: rerank each dev query's candidates with the summed
    scores of `validation.heads` and score the ranking with care.evaluation.metrics (trec conventions)."""
    from care.evaluation.metrics import evaluate
    from care.models.m3 import score_matrix

    v, m = cfg.validation, cfg.model
    rows = list(read_jsonl(ensure_dev_task(v), required=("query", "positive", "negative")))[: v.max_queries]
    docs = sorted({d for r in rows for d in (*r["positive"], *r["negative"])})
    encoder = M3Encoder(m.path, name=m.name, pooling=m.get("pooling", "cls"),
                        query_prefix=m.get("query_prefix", ""), doc_prefix=m.get("doc_prefix", ""),
                        max_length=cfg.trainer.passage_max_length, device=str(next(model.parameters()).device),
                        model=model)
    heads = list(v.heads)
    q = encoder.encode_queries([r["query"] for r in rows], v.batch_size, heads)
    d = encoder.encode_documents(docs, v.batch_size, heads)
    at = {text: i for i, text in enumerate(docs)}
    run, qrels = {}, {}
    for i, r in enumerate(rows):
        cand = [at[t] for t in dict.fromkeys((*r["positive"], *r["negative"]))]
        scores = sum(score_matrix(subset(q, [i]), subset(d, cand), h)[0] for h in heads)
        run[str(i)] = {str(j): float(s) for j, s in zip(cand, scores)}
        qrels[str(i)] = {str(at[t]): 1 for t in r["positive"]}
    return evaluate(run, qrels, [v.metric])[v.metric]


def subset(e: Embeddings, idx: list[int]) -> Embeddings:
    return Embeddings(dense=e.dense[idx], sparse=[e.sparse[i] for i in idx] if e.sparse else None,
                      colbert=[e.colbert[i] for i in idx] if e.colbert else None)


def ensure_dev_task(v: DictConfig) -> Path:
    """The dev reranking file; the default (cEpilepsyQA dev, 490 questions x ~100 candidates, repeated rows
    collapsed by the reader) is built from the shared data on first use."""
    path = Path(v.task)
    if path.exists() or not v.get("build_from"):
        return path
    from care.paths import shared_data
    from data_pipeline.records import QueryCandidates, Text
    from data_pipeline.sources import cmedqa_release
    from data_pipeline.sources.common import Report

    texts, lists = {}, []
    report = Report(source=v.build_from.source, root=shared_data())
    for rec in cmedqa_release.read({"path": v.build_from.path, "splits": [v.build_from.split]}, shared_data(), report):
        if isinstance(rec, Text):
            texts[rec.id] = rec.text
        elif isinstance(rec, QueryCandidates) and rec.split == v.build_from.split:
            lists.append(rec)
    write_jsonl(path, ({"query": texts[c.query_id],
                        "positive": [texts[d] for d, label in c.candidates if label == 1],
                        "negative": [texts[d] for d, label in c.candidates if label == 0]} for c in lists))
    return path
