"""Checkpoints and resume: what a run folder holds, and how a run picks up exactly where it stopped.

    checkpoints/step-NNNNNNN/   state.pt (model, optimizer, schedule, position, early stopping, config hash)
                                + rng-<rank>.pt per process; everything loads with torch.load(weights_only=True)
                                + model/ (the same weights as a model folder with care_training.json, so
                                evaluate.py ckpt=<run> checkpoints=all scores every checkpoint)

Resume is exact: the same weights as an uninterrupted run, bit for bit on CPU in fp32.  That needs the model,
AdamW's moments, the schedule, every RNG (dropout) and the data position; the data position is just
(epoch, batches done) because every group is a pure function of (seed, epoch, example index)
(care.training.data).  A checkpoint of another config (another hash) is refused, as is replacing the final
model of another run.  Checkpoints hold full (unsharded) states: DDP, the tested multi-process setting;
several nodes need the run folder on a shared filesystem.

Every checkpoint holds manifest.json, written inside the atomic folder before it is swapped in:
    {"format": 1, "algorithm": "xxh3_128", "files": {"state.pt": {"size": N, "xxh3_128": "<32 hex>"}, ...,
     "model/model.safetensors": {...}}}   every file of the folder (model/ too), but the manifest itself.
Resume verifies it (sizes, then digests) before loading anything.  `trainer.resume=auto` takes the newest
checkpoint that verifies; newer ones that fail are named (checkpoint and file) and moved aside to
checkpoints/.corrupt-step-N (so they never shadow the checkpoints the resumed run writes; delete them once
looked at), and the run says which one it used instead.  None verifies: a ResumeError naming each folder and
file.  An explicit `trainer.resume=PATH` that fails is refused (ResumeError).  A checkpoint without manifest.json
(written before manifests existed, or its manifest lost) cannot be verified and is refused, in one line that
names it and `trainer.resume_unverified=true`, which accepts it with a notice; a file of it that cannot be read
is a ResumeError naming the file.  A resumed run prints "resumed from <folder> at step N".

What a run killed inside an atomic write left (`checkpoints/.step-N.<random>`, a checkpoint's size) is removed,
with a note of its size, by the run's next start, which holds the folder's lock (RunFolder.clean_stale).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import broadcast_object_list, gather_object
from omegaconf import DictConfig, OmegaConf

from care.config import recipe
from care.data.io import (
    DataError,
    atomic_folder,
    file_digest,
    json_digest,
    leftovers,
    read_json,
    remove_leftovers,
)
from care.encoders.registry import CHECKPOINT_MODEL, TRAINING_RECORD
from care.families import tower_configs
from care.models.hub import read_torch, weights_digest

# What a run folder holds besides its checkpoints (overwrite=true removes all of it).
RUN_OUTPUTS = ("checkpoints", "best", "tuned", "final", "metrics.jsonl", "curves.png")
MANIFEST = "manifest.json"
DIGEST = "xxh3_128"  # ~10 GB/s: verifying a multi-GB state.pt costs about its read from disk


class ResumeError(RuntimeError):
    """A checkpoint that does not belong to this config, or a final model of another run in the way."""


class CheckpointInvalid(ResumeError):
    """A checkpoint whose files do not match its manifest (or cannot be read); the message names the file."""


class AlreadyFinished(ResumeError):
    """output_dir holds the final model of this very config: nothing to train (train.py reports and skips,
    as the data pipeline skips an unchanged stage).  `summary` holds what that run recorded."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


def _hashed(cfg: DictConfig, digest=None) -> dict:
    """What config_hash hashes; `digest`: how a starting-weights folder is digested (None: weights_digest,
    looked up when called, not bound when this module was imported)."""
    digest = digest or weights_digest
    c = recipe(OmegaConf.to_container(cfg, resolve=True), ignore=())
    c["data_digest"] = [file_digest(cfg.data.texts), file_digest(cfg.data.examples)]
    paths = [tower["path"] for tower in tower_configs(cfg.model)]
    c["start_weights"] = [digest(p) for p in paths] if len(paths) > 1 else digest(paths[0])
    return c


def config_hash(cfg: DictConfig, digest=None) -> str:
    """What determines the trained weights: the config's recipe with its seed (care.config.recipe: without the
    run settings a run may resume with other values of, newer keys at their neutral value left out, prompts
    under their older keys), plus the content of the training files and the starting weights (not their paths,
    which may move)."""
    return json_digest(_hashed(cfg, digest), 16, sort_keys=True)


# The parts of the hash a checkpoint records beside it (state.pt `config_parts`), so a refused resume can say
# which of them changed.
PARTS = {"recipe": "the recipe (the config's settings that shape the weights)", "data_digest": "the training "
         "files' content", "start_weights": "the starting weights (model.path's content)"}


def config_parts(cfg: DictConfig) -> dict:
    c = _hashed(cfg)
    return {"recipe": json_digest({k: v for k, v in c.items() if k not in PARTS}, 16, sort_keys=True),
            "data_digest": c["data_digest"], "start_weights": c["start_weights"]}


# The older digest's own choice of files (care/models/hub.py before #33.3), frozen here
LEGACY_SKIPPED = frozenset({"manifest.json", "README.md", "modules.json", "config_sentence_transformers.json",
                            "sentence_bert_config.json", "router_config.json"})
LEGACY_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".json", ".txt", ".model"})


def legacy_weights_digest(folder: str | Path) -> str:
    """The starting weights' digest before whole-file digests (care/models/hub.py weights_digest, #33.3): names,
    sizes and the first and last MiB of each weight file.  Only to recognise a run hashed with it."""
    folder = Path(folder)
    if not folder.is_dir():
        return str(folder)
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.name not in LEGACY_SKIPPED and f.suffix in LEGACY_SUFFIXES and f.is_file():
            size = f.stat().st_size
            h.update(f.name.encode() + str(size).encode())
            with f.open("rb") as fh:
                h.update(fh.read(1 << 20))
                if size > 2 << 20:
                    fh.seek(-(1 << 20), 2)
                    h.update(fh.read())
    return h.hexdigest()[:16]


def what_changed(cfg: DictConfig | None, theirs: str, parts: dict | None) -> str:
    """Why a recorded config hash `theirs` is not this config's: the parts that differ (when the record has
    them), or that only the starting weights' digest changed (the run was hashed with the older digest), else
    the three things the hash covers."""
    if cfg is not None and parts:
        mine = config_parts(cfg)
        changed = [PARTS[k] for k in PARTS if parts.get(k) != mine[k]]
        if changed:
            return "what differs: " + "; ".join(changed)
    if cfg is not None:
        with contextlib.suppress(Exception):  # a folder or file that cannot be read now: say the general thing
            if config_hash(cfg, legacy_weights_digest) == theirs:
                return ("the config, the training files and the starting weights are the same: only the digest of "
                        "the starting weights changed (whole weight files since #33.3; it was hashed with their "
                        "first and last MiB), so this run cannot prove it is the same run")
    return "the recipe, the training files' content or the starting weights differ"


# ---- the manifest: every file's size and digest --------------------------------------------------------
def write_manifest(folder: Path) -> Path:
    """manifest.json of every file under `folder` (sub-folders too), by relative POSIX path."""
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, DIGEST: file_digest(p, DIGEST, chars=None)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST}
    path = folder / MANIFEST
    path.write_text(json.dumps({"format": 1, "algorithm": DIGEST, "files": files}, indent=1), encoding="utf-8")
    return path


def verify_checkpoint(folder: Path) -> bool:
    """True: every file of the manifest is there with its size and digest; False: no manifest (a checkpoint
    from before manifests, which cannot be verified).  Raises CheckpointInvalid naming the first bad file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointInvalid(f"checkpoint {folder} does not exist")
    path = folder / MANIFEST
    if not path.exists():
        return False
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        algorithm, files = manifest["algorithm"], manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointInvalid(f"checkpoint {folder}: {MANIFEST} is unreadable ({type(e).__name__}: {e})") from None
    for name, want in files.items():  # sizes first: a truncated file is found without hashing the rest
        file = folder / name
        if not file.is_file():
            raise CheckpointInvalid(f"checkpoint {folder}: {name} is missing")
        if file.stat().st_size != want["size"]:
            raise CheckpointInvalid(f"checkpoint {folder}: {name} has {file.stat().st_size} bytes, the manifest "
                                    f"says {want['size']} (truncated or overwritten)")
    for name, want in files.items():
        if file_digest(folder / name, algorithm, chars=None) != want[algorithm]:
            raise CheckpointInvalid(f"checkpoint {folder}: {name} does not match its {algorithm} digest in "
                                    f"{MANIFEST} (corrupted)")
    return True


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- RNG state as tensors and lists (torch.load(weights_only=True) refuses numpy objects; docs/facts.md s.6)
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


class RunFolder:
    """output_dir of one run, seen by every process (`accelerator`): checks, checkpoints, resume."""

    def __init__(self, out: Path, config_hash: str, accelerator, cfg: DictConfig | None = None):
        self.out, self.hash, self.accelerator, self.cfg = Path(out), config_hash, accelerator, cfg

    def check(self, overwrite: bool) -> None:
        """Refuse a folder holding another run's final model; skip this run's own; clear it on overwrite.
        Called with the run folder's lock held: what interrupted writes left is removed first."""
        if self.accelerator.is_main_process:
            self.clean_stale()
        info = self.out / "final" / TRAINING_RECORD
        if info.exists() and not overwrite:
            record = read_json(info)  # a corrupt record: a DataError naming the file and the line
            theirs = record.get("config_hash")
            if theirs == self.hash:
                validation = record.get("validation") or {}
                raise AlreadyFinished(f"{info.parent} already holds the final model of this run, already "
                                      f"finished (config {self.hash}): skipped. Pass overwrite=true to train again.",
                                      {"best_metric": validation.get("best"), "final": str(info.parent)})
            raise ResumeError(f"{info.parent} already holds the final model of another run (config {theirs}); "
                              f"this config is {self.hash}: {what_changed(self.cfg, theirs, None)}. Move the folder "
                              f"away or choose another run_name= to keep it, or pass overwrite=true to replace it.")
        if overwrite and self.accelerator.is_main_process:
            for name in RUN_OUTPUTS:
                path = self.out / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        self.accelerator.wait_for_everyone()

    def clean_stale(self) -> None:
        """What interrupted atomic writes left beside each output and checkpoint (care.data.io.leftovers:
        `.NAME.<random>`, `.NAME.old-<pid>` mid-swap, `.NAME.<random>.tmp`), removed with a note, as a pipeline
        stage's start does.  Only with the lock held (no live writer); `.corrupt-step-N` is kept."""
        stale = leftovers(self.out, RUN_OUTPUTS) + leftovers(self.out / "checkpoints", pattern=r"step-\d+")
        remove_leftovers(stale, self.out)

    def checkpoints(self) -> list[Path]:
        return sorted((self.out / "checkpoints").glob("step-[0-9]*[0-9]"))

    def save(self, step: int, state: dict, keep: int, write_model=None) -> Path:
        """state.pt and every process's RNG state, written by the main process into a folder that appears
        complete or not at all; only the newest `keep` checkpoints stay.  `write_model(folder)` (main
        process) adds `model/`, the weights as a model folder evaluate.py scores (CHECKPOINT_MODEL)."""
        acc = self.accelerator
        rng = gather_object([rng_state()])  # one per process, in rank order
        final = self.out / "checkpoints" / f"step-{step:07d}"
        if acc.is_main_process:
            with atomic_folder(final) as tmp:
                parts = config_parts(self.cfg) if self.cfg is not None else None
                torch.save({**state, "step": step, "config_hash": self.hash, "config_parts": parts,
                            "num_processes": acc.num_processes}, tmp / "state.pt")
                for rank, r in enumerate(rng):
                    torch.save(r, tmp / f"rng-{rank}.pt")
                if write_model is not None:
                    write_model(tmp / CHECKPOINT_MODEL)
                write_manifest(tmp)  # last: it covers every file above
            for old in self.checkpoints()[:-keep]:
                shutil.rmtree(old)
        acc.wait_for_everyone()
        return final

    def resume_point(self, resume, unverified: bool = False) -> Path | None:
        """`trainer.resume`: auto = the newest checkpoint that verifies, if any; a path (verified, or refused);
        null = never; one without a manifest only if `unverified`.  The main process decides for all."""
        if not resume:
            return None
        acc = self.accelerator
        choice = [None, None]  # folder, error message
        if acc.is_main_process:
            try:
                found = self._choose(resume, unverified) if resume != "auto" or self.checkpoints() else None
                choice[0] = str(found) if found else None
            except ResumeError as e:
                choice[1] = str(e)
        if acc.num_processes > 1:
            choice = broadcast_object_list(choice)
        if choice[1]:
            raise ResumeError(choice[1])
        return Path(choice[0]) if choice[0] else None

    def _choose(self, resume, unverified: bool) -> Path:
        if resume != "auto":
            folder = Path(resume)
            try:
                verified = verify_checkpoint(folder)
            except CheckpointInvalid as e:
                raise CheckpointInvalid(f"trainer.resume={resume}: {e}; refusing to resume from it") from None
            if not verified:
                _unverifiable(folder, unverified)
            return folder
        failed = []
        for folder in reversed(self.checkpoints()):
            try:
                verified = verify_checkpoint(folder)
            except CheckpointInvalid as e:
                failed.append((folder, str(e)))
                _say(f"warning: {e}")
                continue
            if not verified:
                _unverifiable(folder, unverified)
            for bad, _ in failed:  # newer than the one used: the resumed run rewrites those steps
                aside = bad.with_name(f".corrupt-{bad.name}")
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(bad, aside)
                _say(f"warning: {bad.name} failed verification (moved aside to {aside}); resuming from the "
                     f"newest checkpoint that verifies instead: {folder}")
            return folder
        raise CheckpointInvalid(f"no checkpoint in {self.out / 'checkpoints'} verifies: "
                                + "; ".join(message for _, message in failed)
                                + ". Pass trainer.resume=null or overwrite=true to start over")

    def load(self, folder: Path) -> dict:
        """The checkpoint's state (checked against this run) with this process's RNG state restored."""
        acc = self.accelerator
        if not (folder / "state.pt").exists():
            raise ResumeError(f"{folder} is not a checkpoint (no state.pt)")
        state = _read(folder / "state.pt")
        if state["config_hash"] != self.hash:
            theirs = state["config_hash"]
            raise ResumeError(
                f"checkpoint {folder} belongs to another config (hash {theirs}, this run's is {self.hash}; "
                f"{what_changed(self.cfg, theirs, state.get('config_parts'))}): resuming would mix two runs. Move "
                f"{self.out} away or choose another run_name= to keep it and start anew, or pass overwrite=true "
                f"(or trainer.resume=null) to start over in it.")
        if state["num_processes"] != acc.num_processes:
            raise ResumeError(f"checkpoint {folder} was written by {state['num_processes']} processes, this run "
                              f"has {acc.num_processes}: the data position and RNG streams would not match")
        set_rng_state(_read(folder / f"rng-{acc.process_index}.pt"))
        if acc.is_main_process:
            print(f"resumed from {folder} at step {state['step']}", flush=True)
        return state


def _unverifiable(folder: Path, accept: bool) -> None:
    """A checkpoint without a manifest: refused, or (trainer.resume_unverified=true) taken with a notice."""
    why = f"checkpoint {folder} has no {MANIFEST} (written before manifests, or it was lost): it cannot be verified"
    if not accept:
        raise ResumeError(f"{why}, so it is not resumed. Pass trainer.resume_unverified=true to resume from it "
                          f"anyway, or trainer.resume=null or overwrite=true to start over")
    _say(f"note: {why}; resuming from it as trainer.resume_unverified=true asks")


def _read(path: Path):
    """care.models.hub.read_torch: a file that cannot be read is named in one line."""
    try:
        return read_torch(path)
    except DataError as e:
        raise CheckpointInvalid(f"checkpoint file {e}") from None
