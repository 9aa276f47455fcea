"""The one way an app (train.py, evaluate.py, encode.py, python -m data_pipeline, the care.* command lines)
turns an exception into a one-line error at its edge:

    with app_errors("evaluate.py", cfg, writes_to=cfg.out_dir):
        ...

- what the user can fix (a bad input file or setting: DataError and the other ValueErrors, KeyError,
  FileNotFoundError, FloatingPointError, MissingPackage; an OSError naming its file; a full disk; a corrupt
  parquet, JSON, pickle or torch file) ends the app with `<app>: error: <message>` on one line of stderr and
  exit status 1;
- Ctrl-C (KeyboardInterrupt) ends it with `<app>: interrupted; the same command resumes where it stopped`
  and exit status 130 (the shell's for SIGINT);
- anything else (a bug) keeps its traceback.

`HYDRA_FULL_ERROR=1` in the environment, or `debug` set in the app's config (`+debug=true` on a Hydra
command line), shows the full traceback of every error instead.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import shutil
import sys
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path


class MissingPackage(ImportError):
    """An optional package a setting needs is not installed (onnxruntime for backend=onnx): the user's to fix,
    by installing it or choosing another setting, which the message says."""


# What a user's input can get wrong (a DataError is a ValueError): one line on stderr, exit status 1.
BAD_INPUT = (FileNotFoundError, ValueError, KeyError, FloatingPointError, MissingPackage)

INTERRUPTED = "interrupted; the same command resumes where it stopped"
FULL_DISK_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# what a full disk says when it reaches us through a library that does not raise OSError(ENOSPC)
FULL_DISK_TEXTS = ("no space left on device", "storagefull", "disk quota exceeded")
# torch.save / PytorchStreamWriter on a full disk never mentions space
TORCH_WRITE_FAILED = ("PytorchStreamWriter failed", "file write failed")
CORRUPT_TORCH = ("PytorchStreamReader failed", "invalid load key", "failed finding central directory",
                 "not a zip file", "Ran out of input", "unexpected EOF", "Weights only load failed")


def wants_traceback(cfg: Mapping | None = None) -> bool:
    """HYDRA_FULL_ERROR=1, or a truthy `debug` in the app's config."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return True
    if cfg is None:
        return False
    try:
        value = cfg.get("debug", False)
    except Exception:  # noqa: BLE001 (a config that cannot answer: no debug)
        return False
    return str(value).lower() in ("1", "true", "yes", "on")


def mount_of(path: str | Path) -> str:
    """The mount point (the disk) holding `path`, found from its nearest existing folder."""
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def _free(path: str) -> str:
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if free < 1024 or unit == "TiB":
            return f", {free:.0f} {unit} free now" if unit == "B" else f", {free:.1f} {unit} free now"
        free /= 1024
    return ""


def full_disk(path: str | Path | None, writes_to: str | Path | None = None) -> str:
    """`no space left on MOUNT writing PATH` (the file when known, else the folder the app writes under)."""
    target = path or writes_to
    if target is None:
        return "no space left on the device (the error names no file); free some space and run the same command again"
    mount = mount_of(target)
    what = f"writing {target}" if path else f"writing under {target}"
    return f"no space left on {mount} {what}{_free(mount)}; free some space and run the same command again"


def is_full_disk(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in FULL_DISK_ERRNOS:
        return True
    text = str(e).lower()
    return any(t in text for t in FULL_DISK_TEXTS)


def _arrow_exception() -> tuple[type, ...]:
    mod = sys.modules.get("pyarrow.lib")  # only when the app has loaded pyarrow: never import it for this
    return (mod.ArrowException,) if mod is not None and hasattr(mod, "ArrowException") else ()


def describe(e: BaseException, writes_to: str | Path | None = None,
             extra: tuple[type, ...] = ()) -> str | None:
    """The one line for an error the user can fix, or None for one that should keep its traceback."""
    if is_full_disk(e):
        return full_disk(getattr(e, "filename", None), writes_to)
    if isinstance(e, RuntimeError) and any(t in str(e) for t in TORCH_WRITE_FAILED):
        return (f"writing a torch file failed ({_first_line(e)}): is the disk full? "
                + (full_disk(None, writes_to) if writes_to else "check the free space where the app writes"))
    if isinstance(e, json.JSONDecodeError):
        # a reader that knows the file wraps it in a DataError; this one names only the place in the text
        return f"invalid JSON (line {e.lineno}, column {e.colno}): {e.msg}"
    if isinstance(e, OSError) and e.filename is not None:
        where = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")
        return f"{where}: {e.strerror or _first_line(e)}"
    if isinstance(e, (pickle.UnpicklingError, zipfile.BadZipFile, EOFError)) or (
            isinstance(e, RuntimeError) and any(t in str(e) for t in CORRUPT_TORCH)):
        return f"a corrupt or truncated file (pickle / torch archive): {type(e).__name__}: {_first_line(e)}"
    arrow = _arrow_exception()
    if arrow and isinstance(e, arrow):
        return f"a corrupt or unreadable parquet / arrow file: {_first_line(e)}"
    if isinstance(e, KeyError):
        return f"missing key {e}"
    if isinstance(e, (*BAD_INPUT, *extra)):
        return _first_line(e) if str(e) else type(e).__name__
    return None


def _first_line(e: BaseException) -> str:
    """The message on one line (a multi-line message has its lines joined)."""
    return " | ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())


@contextlib.contextmanager
def app_errors(app: str, cfg: Mapping | None = None, *, writes_to: str | Path | None = None,
               where: str = "", extra: tuple[type, ...] = (), resumes: bool = True,
               status: int = 1) -> Iterator[None]:
    """Run the block as an app's body: a user-fixable error becomes `<app>: error[ where]: <message>` and exit
    status 1, Ctrl-C `<app>: interrupted; ...` and 130; see the module docstring.  `writes_to`: the folder
    the app writes under (named when a full disk's error names no file); `extra`: more exception types that
    are the user's to fix (train.py's ResumeError); `resumes=False`: an app with nothing to resume; `status`:
    the exit status of an error (2 for a tool whose errors are argparse-style bad arguments)."""
    try:
        yield
    except KeyboardInterrupt:
        if wants_traceback(cfg):
            raise
        print(f"{app}: {INTERRUPTED if resumes else 'interrupted'}", file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as e:
        message = describe(e, writes_to=writes_to, extra=extra)
        if message is None or wants_traceback(cfg):
            raise
        print(f"{app}: error{' ' + where if where else ''}: {message}", file=sys.stderr, flush=True)
        sys.exit(status)
