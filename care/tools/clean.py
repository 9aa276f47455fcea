"""`make clean`: remove what the project wrote under the outputs root, and nothing else.

    python care/tools/clean.py --out-root DIR [--project DIR] [--dry-run]

The outputs root may be a folder of the user's own (`make clean OUT_ROOT=~/thesis`, or CARE_OUTPUTS pointing
at it), so the root itself is never removed with what it holds: only the sub-folders the project writes there
(OUT_ROOT_FOLDERS, each named in conf/ or the Makefile; tests/test_clean.py checks that none is missing), and
the project's own `multirun/` and `.pytest_cache/` beside the Makefile.  A sub-folder that is a link is
unlinked, never followed.  The root is removed only when it is the project's default `outputs/` and nothing
else is left in it.  Each removed path is printed, and so is what was left.

Standard library only, run by its path: `make clean` works before `make setup` made the virtualenv.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

# What the project writes directly under the outputs root, and where each comes from:
OUT_ROOT_FOLDERS = (
    "data",         # the pipeline's stages (conf/roots.yaml data_dir)
    "train",        # training runs (conf/train.yaml output_dir)
    "eval",         # evaluations (conf/evaluate.yaml out_dir)
    "mteb",         # the mteb adapter's results (care/evaluation/mteb_adapter/results.py)
    "compare",      # care.evaluation.compare and care.training.study tables, and the Makefile's COMPARE
    "hydra",        # Hydra's run logs (conf/hydra/default.yaml run.dir)
    "multirun",     # Hydra's sweep logs (conf/hydra/default.yaml sweep.dir)
    "care_table",   # make care-experiment's table of links (Makefile CARE_TABLE)
    "care_stage2",  # make care-stage2's table of links (Makefile CARE_S2)
    "care_claim",   # make care-claim's table of links (Makefile CARE_CLAIM)
)
# Beside the Makefile: Hydra's sweep folder of a config without conf/hydra, and pytest's cache.
PROJECT_FOLDERS = ("multirun", ".pytest_cache")
DEFAULT_OUT_ROOT = "outputs"


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(folder) / name).lstat().st_size
            except OSError:
                pass
    return total


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def targets(out_root: Path, project: Path) -> list[Path]:
    """What clean removes: the project's sub-folders of the outputs root and of the project, as they exist."""
    found = [out_root / name for name in OUT_ROOT_FOLDERS] + [project / name for name in PROJECT_FOLDERS]
    seen, result = set(), []
    for path in found:
        key = os.path.abspath(path)
        if key not in seen and (path.exists() or path.is_symlink()):
            seen.add(key)
            result.append(path)
    return result


def clean(out_root: Path, project: Path, dry_run: bool = False, say=print) -> list[Path]:
    """Remove (or, dry_run, only name) `targets`; returns them."""
    out_root, project = Path(out_root).expanduser(), Path(project).expanduser()
    removed = targets(out_root, project)
    verb = "would remove" if dry_run else "removed"
    for path in removed:
        kind = "a link" if path.is_symlink() else f"{_size(path) / 1e6:.1f} MB"
        if not dry_run:
            _remove(path)
        say(f"clean: {verb} {path} ({kind})")
    if not removed:
        say(f"clean: nothing the project wrote under {out_root}")
    if out_root.is_dir() and not dry_run:
        left = sorted(p.name for p in out_root.iterdir())
        if not left and os.path.abspath(out_root) == os.path.abspath(project / DEFAULT_OUT_ROOT):
            out_root.rmdir()
            say(f"clean: removed {out_root} (empty)")
        elif left:
            shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
            say(f"clean: kept {out_root} and what the project did not write there: {shown}")
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-root", type=Path, required=True, help="the outputs root (make's OUT_ROOT / CARE_OUTPUTS)")
    ap.add_argument("--project", type=Path, default=Path(__file__).resolve().parents[2],
                    help="the project folder (default: the one holding this file)")
    ap.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    args = ap.parse_args(argv)
    try:
        clean(args.out_root, args.project, args.dry_run)
    except OSError as e:  # a folder that cannot be removed: one line naming it
        print(f"clean: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
