"""Skip a stage whose inputs and config are unchanged.  Each stage writes `stats.json` holding a
fingerprint of (input file digests, stage config) and, under "output_files", the size and xxh3_128 digest
of every file it wrote, taken as it wrote them; a re-run with the same fingerprint is skipped only while
every recorded file is still there as written (a stats.json from before outputs were recorded is trusted
on its fingerprint alone, as it always was).  care/data/stage_start.py is how a stage uses all of this.

`stats.json` also carries the stage's name ("stage"), which is how a stage knows an output folder as its
own: `claim_outputs` (called before any work) refuses to overwrite files in a folder whose stats.json was
not written by the same stage (a user's own `kept.jsonl`, another stage's outputs) unless force=true (and, for a
stage that swaps its whole folder in, refuses anything there it did not write, force or not), and
`mark_in_progress` (called just before the first file is written) names the stage in a provisional
stats.json, so that an interrupted first run is redone next time rather than refused."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from care.data.io import DataError, file_digest, read_json, write_json
from care.runlock import LOCK_NAME

RECORD = "output_files"  # stats.json: {path relative to the folder: {"bytes", DIGEST}} of every output
DIGEST = "xxh3_128"      # about 10 GB/s (care/data/io.py file_digest): the skip check re-reads every output
LOCK_FILES = (LOCK_NAME, f"{LOCK_NAME}.json")  # the run lock's files (care/runlock.py): never an output


def fingerprint(inputs: Iterable[str | Path], config: dict) -> str:
    h = hashlib.sha256()
    for p in sorted(str(x) for x in inputs):
        h.update(p.encode())
        h.update(file_digest(p).encode() if Path(p).is_file() else b"<missing>")
    h.update(json.dumps(config, sort_keys=True, ensure_ascii=False, default=str).encode())
    return h.hexdigest()[:16]


def read_stats(out_dir: str | Path) -> tuple[dict | None, str]:
    """(out_dir/stats.json's object or None, '' or why it cannot be read: corrupt, unreadable)."""
    path = Path(out_dir) / "stats.json"
    if not path.is_file():
        return None, ""
    try:
        stats = read_json(path)
    except (DataError, OSError) as e:
        return None, f"{path} is corrupt or unreadable ({e.problem if isinstance(e, DataError) else e})"
    if not isinstance(stats, dict):
        return None, f"{path} is corrupt (a JSON {type(stats).__name__}, not an object)"
    return stats, ""


def record_outputs(folder: str | Path, names: Iterable[str]) -> dict:
    """stats.json's RECORD of the outputs `names` (files, or folders: every file under them but hidden ones)
    that exist in `folder`: size and digest, read back as written."""
    folder, record = Path(folder), {}
    for name in names:
        path = folder / name
        files = [path] if path.is_file() else sorted(
            f for f in path.rglob("*") if f.is_file() and not f.name.startswith(".")) if path.is_dir() else []
        for f in files:
            record[f.relative_to(folder).as_posix()] = {"bytes": f.stat().st_size, DIGEST: file_digest(f, DIGEST, None)}
    return record


def changed_output(out_dir: str | Path, stats: dict) -> str:
    """'' while every output `stats` records is in out_dir at its recorded size and digest, else which is
    not (a second run that wrote into the folder, a truncated copy, an edit)."""
    for rel, want in (stats.get(RECORD) or {}).items():
        path = Path(out_dir) / rel
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want.get("bytes"):
            return f"{path} has {size:,} bytes, not the {want.get('bytes'):,} its run wrote"
        if file_digest(path, DIGEST, None) != want.get(DIGEST):
            return f"{path} is not the file its run wrote (its {DIGEST} digest differs)"
    return ""


def up_to_date(out_dir: str | Path, fp: str, say=print) -> dict | None:
    """The previous stats if `out_dir/stats.json` carries this fingerprint and every output it records is
    as written, else None; `say` is told which output changed."""
    old, _ = read_stats(out_dir)
    if old is None or old.get("fingerprint") != fp:
        return None
    changed = changed_output(out_dir, old)
    if changed:
        say(f"{old.get('stage', 'stage')}: {changed}: inputs and config are unchanged, but its outputs are "
            "not: running it again")
        return None
    return old


class ForeignOutputError(FileExistsError, ValueError):
    """A stage would overwrite a file it did not write.  A ValueError too, so the pipeline's CLI reports it
    as one line like any other bad input."""


def written_by(out_dir: str | Path, stage: str, legacy_keys: tuple[str, ...] = ()) -> bool:
    """Whether `out_dir/stats.json` was written by `stage`: its "stage" names it, or (stats written before
    they carried the name) it has no "stage" but every one of `legacy_keys`."""
    old, _ = read_stats(out_dir)
    if old is None:
        return False
    if "stage" in old:
        return old["stage"] == stage
    return bool(legacy_keys) and all(k in old for k in legacy_keys)


def _why_not_own(out: Path, stage: str) -> str:
    """Why out's files are not `stage`'s: no stats.json, a corrupt one, or one naming another stage."""
    stats = out / "stats.json"
    old, broken = read_stats(out)
    if broken:
        return f"{broken}, so it cannot say which stage wrote them"
    if old is None:
        return f"{out} has no stats.json written by stage {stage}"
    other = old.get("stage")
    return f"{stats} was not written by stage {stage}" + (f" (it names stage {other!r})" if other else "")


def strays(out_dir: str | Path, names: Iterable[str], own: dict | None, legacy_entry=None) -> list[str]:
    """What a stage that swaps its whole folder in would delete without having written it: every entry of
    out_dir but its outputs `names`, stats.json and the run lock, and inside those, files its last run did
    not record (`own`: its own stats.json, None when the folder is not its own).  `legacy_entry(path)`:
    whether an entry of a folder it wrote before outputs were recorded is its own."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    record = (own or {}).get(RECORD)
    mine = {*names, "stats.json", *(rel.split("/")[0] for rel in record or ())}
    found = []
    for entry in sorted(out.iterdir()):
        if entry.name in LOCK_FILES:
            continue
        if entry.name not in mine and not (own and record is None and legacy_entry and legacy_entry(entry)):
            found.append(entry.name + ("/" if entry.is_dir() else ""))
        elif record is not None and entry.is_dir():
            found += [f.relative_to(out).as_posix() for f in sorted(entry.rglob("*"))
                      if f.is_file() and f.relative_to(out).as_posix() not in record]
    return found


def claim_outputs(out_dir: str | Path, stage: str, filenames: Iterable[str], force: bool = False,
                  legacy_keys: tuple[str, ...] = (), whole_folder: bool = False, legacy_entry=None) -> None:
    """Call before a stage does any work for `out_dir` (it writes nothing).  `filenames` (relative to
    out_dir; stats.json is always included) are what the stage may write or delete there.  When out_dir's
    stats.json was not written by `stage` and one of those files exists, it is someone else's: refused,
    naming it, unless `force`.  A `whole_folder` stage (the folder is replaced by a new one) would delete
    everything else there too: anything it did not write (`strays`) is refused, force or not."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ForeignOutputError(f"stage {stage}: output folder {out} is a file, not a folder")
    own = written_by(out, stage, legacy_keys)
    if whole_folder and (found := strays(out, filenames, read_stats(out)[0] if own else None, legacy_entry)):
        raise ForeignOutputError(
            f"stage {stage}: refusing to write into {out}: it holds {found[0]}"
            + (f" (and {len(found) - 1} more: {', '.join(found[1:4])}{', ...' if found[4:] else ''})"
               if found[1:] else "")
            + f", which stage {stage} did not write, and the stage replaces the whole folder, which would "
            f"delete {'them' if found[1:] else 'it'}. Move {'them' if found[1:] else 'it'} away or choose "
            "another output folder (out=DIR); force=true does not delete files a stage did not write.")
    if own:
        return
    names = list(dict.fromkeys([*filenames, "stats.json"]))
    foreign = [name for name in names if (out / name).exists()]
    if foreign and not force:
        raise ForeignOutputError(
            f"stage {stage}: refusing to overwrite {out / foreign[0]}"
            + (f" (and {len(foreign) - 1} more: {', '.join(foreign[1:])})" if foreign[1:] else "")
            + f": {_why_not_own(out, stage)}, so {'they are' if foreign[1:] else 'it is'} not the output of an "
            f"earlier {stage} run. Move {'them' if foreign[1:] else 'it'} away, choose another output folder, "
            "or pass force=true to overwrite.")


def mark_in_progress(out_dir: str | Path, stage: str) -> None:
    """Call after `claim_outputs`, just before the stage writes its first file: unless out_dir's stats.json
    is already this stage's, write a provisional one naming the stage (no fingerprint, so never "up to
    date"; the stage's real stats.json replaces it last).  A run interrupted after that point left files
    that the next run knows as its own."""
    if not written_by(out_dir, stage):
        write_json(Path(out_dir) / "stats.json",
                   {"stage": stage, "fingerprint": None, "complete": False,
                    "note": "outputs being written; the real stats.json comes last"})
