"""The start and the end of every pipeline stage, written once (the stages of data_pipeline/__main__.py):

    with stage_start(cfg, "import", out, fp, OUTPUTS) as start:
        if start.done:                       # inputs, config and outputs as they were: nothing to do
            return start.skip("import: unchanged, skipped")
        ...                                  # the work
        start.writing()                      # just before the first file is written into `out`
        ...                                  # the outputs
        return start.finish(stats)           # stats.json last, with every output's size and digest

What it does, in order, holding the run lock of `out` (care/runlock.py) from the first step to the last, so a
second run into the same folder is refused in one line naming the holder instead of mixing its files in:
  1. the skip check (stage_cache.up_to_date): the fingerprint in stats.json, and every output it records
     re-read at its recorded size and digest; a changed output is named and the stage runs again;
  2. the claim (stage_cache.claim_outputs): files the stage did not write are refused, naming them;
  3. `force` (cfg.force) is read here and nowhere else: re-run an unchanged stage, overwrite files of the
     stage's names that it did not write.  cfg.lock_force takes over a dead holder's lock (care/runlock.py).
Before these, what a killed run's atomic writes left beside the stage's outputs (`.NAME.<random>.tmp`,
care.data.io.leftovers) is removed with a note, as training's start does (care/training/checkpoint.py).
A stage that replaces its whole folder (nano) builds in `start.folder()` (care.data.io.atomic_folder) and
passes whole_folder=True: anything in `out` it did not write would be deleted by the swap, so it is refused
before any work (force or not), and the lock's files are carried into the new folder.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from care.data.io import atomic_folder, leftovers, remove_leftovers, write_json
from care.data.stage_cache import (
    LOCK_FILES,
    RECORD,
    ForeignOutputError,
    claim_outputs,
    mark_in_progress,
    read_stats,
    record_outputs,
    strays,
    up_to_date,
    written_by,
)
from care.paths import portable
from care.runlock import FORCE_KEY, locked_folder


def forced(cfg: Mapping | None) -> bool:
    """The one reading of the pipeline's `force` option."""
    return bool((cfg or {}).get("force", False))


class StageStart:
    """What `stage_start` yields: `done` (the previous stats when the stage is up to date, else None), `own`
    (out's stats.json when this stage wrote it, else None), `force`, and the steps of a run."""

    def __init__(self, stage: str, out: Path, outputs: tuple[str, ...], force: bool, whole_folder: bool,
                 legacy_keys: tuple[str, ...], legacy_entry):
        self.stage, self.out, self.outputs, self.force = stage, out, outputs, force
        self.whole_folder, self.legacy_entry = whole_folder, legacy_entry
        self.own = read_stats(out)[0] if written_by(out, stage, legacy_keys) else None
        self.done: dict | None = None
        self.started = time.perf_counter()  # the stage's wall time, for a stats.json that gives none of its own

    def skip(self, message: str = "") -> dict:
        """The previous stats marked skipped, `message` printed."""
        if message:
            print(message)
        return {**self.done, "skipped": True}

    def writing(self) -> None:
        """Just before the first output is written: a provisional stats.json names the stage, so an
        interrupted run is redone next time rather than refused (stage_cache.mark_in_progress)."""
        mark_in_progress(self.out, self.stage)

    @contextlib.contextmanager
    def folder(self):
        """A whole-folder stage's new folder, swapped in when the block succeeds; the lock's files, and anything
        put in `out` during the run that the stage does not write, are kept."""
        def keep(old: Path) -> list[str]:
            return [*LOCK_FILES, *(s.rstrip("/") for s in strays(old, self.outputs, self.own, self.legacy_entry)
                                   if "/" not in s.rstrip("/"))]

        with atomic_folder(self.out, keep=keep) as tmp:
            yield tmp

    def finish(self, stats: dict, folder: str | Path | None = None) -> dict:
        """Write stats.json last, into `folder` (a whole-folder stage's new one) or `out`, with every output
        recorded (RECORD: size and digest as written); returns the stats written."""
        where = Path(folder) if folder is not None else self.out
        names = ([p.name for p in where.iterdir() if p.name not in (*LOCK_FILES, "stats.json")]
                 if self.whole_folder else [n for n in self.outputs if n != "stats.json"])
        # every path in it named relative to the data folder (or the roots): no machine path (care.paths.portable)
        # every stage's stats.json says its seconds (bench/timeline.py reads them); a stage's own figure wins
        stats = {"seconds": round(time.perf_counter() - self.started, 2), **stats}
        stats = portable({**stats, RECORD: record_outputs(where, names)}, base=self.out.parent)
        write_json(where / "stats.json", stats)
        return stats


@contextlib.contextmanager
def stage_start(cfg: Mapping | None, stage: str, out_dir: str | Path, fp: str, outputs: Iterable[str],
                legacy_keys: tuple[str, ...] = (), whole_folder: bool = False, legacy_entry=None):
    """Hold `out_dir` for stage `stage` whose fingerprint is `fp` and whose outputs (names relative to
    out_dir: files, or folders for a whole-folder stage) are `outputs`; yields a StageStart (module
    docstring).  legacy_keys / legacy_entry: how stats.json and folders written by older code are known
    as the stage's own (stage_cache.written_by, stage_cache.strays)."""
    out, force, outputs = Path(out_dir), forced(cfg), tuple(outputs)
    if out.exists() and not out.is_dir():
        raise ForeignOutputError(f"stage {stage}: output folder {out} is a file, not a folder")
    with locked_folder(out, f"{stage} stage run", force=bool((cfg or {}).get(FORCE_KEY, False)), elsewhere="out=DIR"):
        remove_leftovers(interrupted_writes(out, outputs, whole_folder), out)
        start = StageStart(stage, out, tuple(outputs), force, whole_folder, legacy_keys, legacy_entry)
        start.done = None if force else up_to_date(out, fp)
        if start.done is None:
            claim_outputs(out, stage, start.outputs, force, legacy_keys, whole_folder, legacy_entry)
        yield start


def interrupted_writes(out: Path, outputs: Iterable[str], whole_folder: bool) -> list[Path]:
    """What atomic writes of the stage's own files (its outputs, stats.json, the lock's record), killed midway,
    left in `out` and its outputs' folders; a whole-folder stage's new folder beside `out` too.  Only with
    `out`'s lock held: no live writer of these names."""
    by_folder: dict[Path, list[str]] = {}
    for name in (*outputs, "stats.json", *LOCK_FILES):
        path = out / name.rstrip("/")
        by_folder.setdefault(path.parent, []).append(path.name)
    if whole_folder:
        by_folder.setdefault(out.parent, []).append(out.name)
    return [p for folder, names in by_folder.items() for p in leftovers(folder, names)]
