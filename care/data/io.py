"""Files between stages: JSON Lines read with errors that name file, line and field; every output written
atomically (to a temporary file renamed into place), so a crash never leaves half a file behind."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import xxhash


class DataError(ValueError):
    """A bad input row.  The message always names the file, the line and the field."""

    def __init__(self, path: str | Path, line: int | None, field: str | None, problem: str):
        self.path, self.line, self.field, self.problem = str(path), line, field, problem
        where = f"{path}" + (f", line {line}" if line is not None else "") + (f", field '{field}'" if field else "")
        super().__init__(f"{where}: {problem}")


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8"):
    """Write to a temporary file beside `path`, then rename it over `path` only if the block succeeded."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as fh:
            yield fh
        mask = os.umask(0)  # mkstemp makes 0600 files; give outputs the user's usual permissions
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_folder(path: str | Path, keep=None):
    """Build a folder beside `path` (the block writes into the yielded temporary folder), then swap it in
    whole, so a crash never leaves half a model or checkpoint.  An existing `path` is replaced; `keep(path)`
    names entries of it the new folder keeps, carried over just before the swap: a file as a hard link (the
    same file, so a run lock held on it, care/runlock.py, stays held across the swap), a folder moved."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is meant to be shared
    try:
        yield tmp
        for name in keep(out) if keep is not None and out.is_dir() else ():
            src, dst = out / name, tmp / name
            if src.is_file() and not dst.exists():
                try:
                    os.link(src, dst)
                except OSError:  # no hard links here: moved (a lock taken in this instant may be lost)
                    os.replace(src, dst)
            elif src.exists() and not dst.exists():
                os.replace(src, dst)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# What the writers above leave beside NAME when killed mid-write: atomic_open's `.NAME.<8 random>.tmp` (mkstemp),
# link_or_copy's `.NAME.<pid>.tmp`, atomic_folder's `.NAME.<8 random>` (mkdtemp) and `.NAME.old-<pid>` mid-swap.
LEFTOVER = r"\.(?:{names})\.(?:[a-z0-9_]{{8}}(?:\.tmp)?|\d+\.tmp|old-\d+)"


def leftovers(folder: str | Path, names: Iterable[str] = (), pattern: str | None = None) -> list[Path]:
    """The entries of `folder` an interrupted atomic write of one of `names` (or of a name matching the regex
    `pattern`) left; nothing else, so a user's own file is never taken for one.  Removing them is safe only
    while no writer is live in `folder` (its lock held: care/runlock.py)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    alternatives = [re.escape(n) for n in names] + ([pattern] if pattern else [])
    if not alternatives:
        return []
    match = re.compile(LEFTOVER.format(names="|".join(alternatives))).fullmatch
    return sorted(p for p in folder.iterdir() if match(p.name))


def remove_leftovers(paths: Iterable[Path], where: str | Path) -> list[Path]:
    """Remove `leftovers` (files or folders), saying how many and how much, as one note on stderr."""
    paths = list(paths)
    if not paths:
        return paths
    size = sum(f.stat().st_size for p in paths for f in ([p] if not p.is_dir() else p.rglob("*")) if f.is_file())
    for path in paths:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    print(f"note: removed what {len(paths)} interrupted write{'s' if len(paths) > 1 else ''} left in {where} "
          f"({size / 1e6:.1f} MB): {', '.join(p.name for p in paths)}", file=sys.stderr, flush=True)
    return paths


def link_or_copy(src: str | Path, dst: str | Path) -> Path:
    """`dst` as a hard link to the file `src` (no extra disk), a copy where a link cannot be made (another
    filesystem), swapped in by a rename (an existing `dst` is replaced whole).  Safe because nothing here
    rewrites a file in place: every writer replaces files by renaming (atomic_open), which unlinks rather than
    modifies a shared inode."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)
    return dst


def link_or_copy_tree(src: str | Path, dst: str | Path, skip: frozenset[str] = frozenset()) -> Path:
    """`src`'s files under `dst`, each by link_or_copy (no extra disk: a 4B-parameter tower costs its 8 GB once).
    Top-level names in `skip` are left out."""
    src, dst = Path(src), Path(dst)
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if rel.parts[0] in skip:
            continue
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(path, target)
    return dst


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """A matplotlib figure as a PNG, written atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=dpi)
    plt.close(fig)
    return Path(path)


def save_histogram(fig, ax, path: str | Path, title: str, xlabel: str, ylabel: str) -> Path:
    """A stage's histogram finished in the stages' one style (axis labels, a small title and legend at the upper
    left, fixed margins) and saved as save_figure does (the mine and score stages' plots)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.subplots_adjust(left=0.09, right=0.98, top=0.88, bottom=0.12)
    return save_figure(fig, path, dpi=110)


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    n = 0
    encoder = json.JSONEncoder(ensure_ascii=False)  # one encoder: json.dumps builds a new one per call
    with atomic_open(path) as fh:
        for row in rows:
            fh.write(encoder.encode(row) + "\n")
            n += 1
    return n


def write_json(path: str | Path, obj) -> None:
    with atomic_open(path) as fh:
        json.dump(obj, fh, ensure_ascii=False, indent=2)
        fh.write("\n")


def read_json(path: str | Path):
    """One JSON file (a record, a summary); broken JSON is a DataError naming the file and the line."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(path, e.lineno, None, f"not valid JSON ({e.msg}, column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise DataError(path, None, None, f"not UTF-8 text ({e.reason})") from None


def read_jsonl(path: str | Path, required: Iterable[str] = ()) -> Iterator[dict]:
    """Yield one dict per non-blank line; a bad line raises DataError with its number (1-based)."""
    for _, row in read_jsonl_numbered(path, required):
        yield row


def validation_metric(row: dict) -> str | None:
    """In a row of a training run's metrics.jsonl (care/training/runlog.py), the key of the validation task's
    metric (val/<metric>), None in other rows: the trainer logs it beside val/best and val/seconds, and the
    held-out alignment slice logs val/align_* in rows of their own."""
    return next((k for k in row if k.startswith("val/") and k not in ("val/best", "val/seconds")
                 and not k.startswith("val/align")), None)


def text_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """Yield (line number, decoded line) per non-blank line of a UTF-8 file; a missing file or a line that
    is not UTF-8 is an error naming it."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; a UTF-8 text file (one record a line) is expected here")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(path, lineno, None, f"undecodable bytes (not UTF-8) at byte {e.start}") from None
            if line.strip():
                yield lineno, line


def read_jsonl_numbered(path: str | Path, required: Iterable[str] = ()) -> Iterator[tuple[int, dict]]:
    """Yield (line number, dict) per non-blank line, so callers can name the line of a bad value."""
    required = tuple(required)
    for lineno, line in text_lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(path, lineno, None, f"not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(path, lineno, None, "expected a JSON object")
        for f in required:
            if f not in row:
                raise DataError(path, lineno, f, "missing")
        yield lineno, row


def read_text_rows(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield (line number, row) per row of a text store (`{"id","text",...}` per line), each checked: an id
    and a non-empty text, and no id twice (a store whose ids repeat cannot say which text an id means).
    The one check of a text store: `read_text_store` and the stages that keep whole rows both use it."""
    seen: set[str] = set()
    for lineno, row in read_jsonl_numbered(path, required=("id", "text")):
        if not isinstance(row["text"], str) or not row["text"].strip():
            raise DataError(path, lineno, "text", f"empty text for id {row['id']!r}")
        key = str(row["id"])  # the id as read_text_store keys it, so no text silently replaces another
        if key in seen:
            raise DataError(path, lineno, "id", f"duplicate id {row['id']!r}")
        seen.add(key)
        yield lineno, row


def read_text_store(path: str | Path) -> dict[str, str]:
    """A text store `{"id","text"}` per line -> {id: text}; duplicate ids and empty texts are errors
    (`read_text_rows`)."""
    return {str(row["id"]): row["text"] for _, row in read_text_rows(path)}


def file_digest(path: str | Path, algorithm: str = "sha256", chars: int | None = 16) -> str:
    """A file's content digest, read in blocks: sha256's first 16 hex characters by default (fingerprints);
    "xxh3_128" (about 10 GB/s: verifying a multi-GB checkpoint costs about its read from disk) or any hashlib
    name, `chars=None` for the whole hex digest."""
    h = xxhash.xxh3_128() if algorithm == "xxh3_128" else hashlib.new(algorithm)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()[:chars]


def json_digest(value, chars: int, *, sort_keys: bool = False, ensure_ascii: bool = True, default=None) -> str:
    """sha256 of `value`'s JSON text, its first `chars` hex characters: the key of a cache entry, a stage's or
    an encoder's fingerprint, a run's config hash.  The options are json.dumps's, with its defaults; each key
    keeps the options and length it was first stored with (any change gives every stored key another value:
    tests/test_json_digest.py holds each site to its old expression)."""
    text = json.dumps(value, sort_keys=sort_keys, ensure_ascii=ensure_ascii, default=default)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:chars]
