"""Skip a stage whose inputs and config are unchanged.  Each stage writes `stats.json` holding a
fingerprint of (input file digests, stage config); a re-run with the same fingerprint is skipped.

`stats.json` also carries the stage's name ("stage"), which is how a stage knows an output folder as its
own: `claim_outputs` (called before any work) refuses to overwrite files in a folder whose stats.json was
not written by the same stage (a user's own `kept.jsonl`, another stage's outputs) unless force=true, and
`mark_in_progress` (called just before the first file is written) names the stage in a provisional
stats.json, so that an interrupted first run is redone next time rather than refused."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from care.data.io import file_digest, write_json


def fingerprint(inputs: Iterable[str | Path], config: dict) -> str:
    h = hashlib.sha256()
    for p in sorted(str(x) for x in inputs):
        h.update(p.encode())
        h.update(file_digest(p).encode() if Path(p).is_file() else b"<missing>")
    h.update(json.dumps(config, sort_keys=True, ensure_ascii=False, default=str).encode())
    return h.hexdigest()[:16]


def up_to_date(out_dir: str | Path, fp: str) -> dict | None:
    """The previous stats if `out_dir/stats.json` carries this fingerprint, else None."""
    stats = Path(out_dir) / "stats.json"
    if not stats.exists():
        return None
    try:
        old = json.loads(stats.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    return old if old.get("fingerprint") == fp else None


class ForeignOutputError(FileExistsError, ValueError):
    """A stage would overwrite a file it did not write.  A ValueError too, so the pipeline's CLI reports it
    as one line like any other bad input."""


def written_by(out_dir: str | Path, stage: str, legacy_keys: tuple[str, ...] = ()) -> bool:
    """Whether `out_dir/stats.json` was written by `stage`: its "stage" names it, or (stats written before
    they carried the name) it has no "stage" but every one of `legacy_keys`."""
    try:
        old = json.loads((Path(out_dir) / "stats.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(old, dict):
        return False
    if "stage" in old:
        return old["stage"] == stage
    return bool(legacy_keys) and all(k in old for k in legacy_keys)


def _named(stats: Path) -> str:
    """' (it names stage X)' for a stats.json that names another stage, else ''."""
    try:
        other = json.loads(stats.read_text(encoding="utf-8")).get("stage")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return ""
    return f" (it names stage {other!r})" if other else ""


def claim_outputs(out_dir: str | Path, stage: str, filenames: Iterable[str], force: bool = False,
                  legacy_keys: tuple[str, ...] = ()) -> None:
    """Call before a stage does any work for `out_dir` (it writes nothing).  `filenames` (relative to
    out_dir; stats.json is always included) are what the stage may write or delete there.  When out_dir's
    stats.json was not written by `stage` and one of those files exists, it is someone else's: refused,
    naming it, unless `force`."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ForeignOutputError(f"stage {stage}: output folder {out} is a file, not a folder")
    if written_by(out, stage, legacy_keys):
        return
    names = list(dict.fromkeys([*filenames, "stats.json"]))
    foreign = [name for name in names if (out / name).exists()]
    if foreign and not force:
        stats = out / "stats.json"
        why = (f"{stats} was not written by stage {stage}{_named(stats)}" if stats.exists()
               else f"{out} has no stats.json written by stage {stage}")
        raise ForeignOutputError(
            f"stage {stage}: refusing to overwrite {out / foreign[0]}"
            + (f" (and {len(foreign) - 1} more: {', '.join(foreign[1:])})" if foreign[1:] else "")
            + f": {why}, so {'they are' if foreign[1:] else 'it is'} not the output of an earlier {stage} "
            f"run. Move {'them' if foreign[1:] else 'it'} away, choose another output folder, or pass "
            "force=true to overwrite.")


def mark_in_progress(out_dir: str | Path, stage: str) -> None:
    """Call after `claim_outputs`, just before the stage writes its first file: unless out_dir's stats.json
    is already this stage's, write a provisional one naming the stage (no fingerprint, so never "up to
    date"; the stage's real stats.json replaces it last).  A run interrupted after that point left files
    that the next run knows as its own."""
    if not written_by(out_dir, stage):
        write_json(Path(out_dir) / "stats.json",
                   {"stage": stage, "fingerprint": None, "complete": False,
                    "note": "outputs being written; the real stats.json comes last"})
