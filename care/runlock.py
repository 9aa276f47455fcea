"""One run per folder: an exclusive lock on a training run folder (output_dir) or an evaluation out_dir.

    <folder>/.run.lock        the lock itself: filelock's FileLock, flock(2) on Linux.  The OS drops it when
                              the holding process dies (kill -9, OOM, a node reboot), so a crash never leaves
                              the folder locked on a filesystem where flock works (local disks, NFSv4).
    <folder>/.run.lock.json   who holds it: pid, host, Slurm job (SLURM_JOB_ID), process start time, since
                              when, the command.  Written once the flock is held, removed on release.

A second run into a held folder is refused with one line naming the holder (RunLocked, a ValueError so
train.py and evaluate.py report it as bad input: exit 1, no traceback).

A sidecar left behind (its process died without releasing: the flock is free, the record is not) is judged:
  - this host, that process no longer running (pid gone, or reused: its start time differs): taken over,
    with a message naming the dead holder;
  - this host, that process still running: refused (the flock is not effective on this filesystem);
  - another host: its process cannot be checked from here, and flock across hosts is not coherent on every
    shared filesystem (NFSv3 with local locks, Lustre without -o flock): taken over only by the same Slurm
    job (a requeue runs the job again, on any node), or with `lock_force=true` (say so in the message).
Where flock is not supported at all filelock falls back to a soft (file-exists) lock; the sidecar rules are
the same.  Under accelerate only the main process takes the lock and holds it for all ranks; the decision
(held, or refused with the message) is broadcast so that every rank stops on a refusal.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import sys
import time
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_NAME = ".run.lock"
FORCE_KEY = "lock_force"  # the config key that overrides a holder on another host


class RunLocked(ValueError):
    """The folder is held by another run (the message names it)."""


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _alive(pid: int, started: int | None) -> bool:
    if Path("/proc").is_dir() and Path("/proc/self/stat").exists():
        now = _start_ticks(pid)
        return now is not None and (started is None or now == started)
    try:  # no /proc: the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(holder: dict | None) -> str:
    if not holder:
        return "another process (no holder record yet)"
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}, since {holder.get('since')}"


class RunLock:
    """`RunLock(folder, kind).acquire()` ... `.release()`; also a context manager.  `kind` (training,
    evaluation) only words the messages."""

    def __init__(self, folder: str | Path, kind: str = "run", force: bool = False,
                 elsewhere: str = "another run_name= or output folder"):
        self.folder, self.kind, self.force = Path(folder), kind, bool(force)
        self.elsewhere = elsewhere  # how the refusal says to pick another folder in this kind of app
        self.path = self.folder / LOCK_NAME
        self.info = self.folder / f"{LOCK_NAME}.json"
        self._lock: FileLock | None = None
        self.notice = ""  # what acquire() said, if anything (a takeover)

    @property
    def held(self) -> bool:
        return self._lock is not None

    def read_holder(self) -> dict | None:
        try:
            return json.loads(self.info.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def _refuse(self, holder: dict | None, why: str = "") -> RunLocked:
        return RunLocked(f"{self.folder} is in use by another {self.kind} ({describe(holder)}){why}: wait for it "
                         f"to finish, or write elsewhere ({self.elsewhere})")

    def acquire(self) -> RunLock:
        if self._lock is not None:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.path, timeout=0, thread_local=False)
        try:
            lock.acquire()
        except Timeout:
            raise self._refuse(self.read_holder()) from None
        try:
            self.notice = self._judge_leftover(self.read_holder())
            me = {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                  "started": _start_ticks(os.getpid()), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "kind": self.kind, "command": " ".join(sys.argv)[:500]}
            tmp = self.info.with_name(f"{self.info.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(me, indent=1), encoding="utf-8")
            os.replace(tmp, self.info)
        except BaseException:
            lock.release()
            raise
        self._lock = lock
        if self.notice:
            print(self.notice, file=sys.stderr)
        return self

    def _judge_leftover(self, holder: dict | None) -> str:
        """The flock is ours; a record still there is a holder that never released.  '' = no record."""
        if not holder:
            return ""
        here = socket.gethostname()
        who = describe(holder)
        if holder.get("host") == here:
            if holder.get("pid") == os.getpid():  # an earlier lock of this process, dropped unreleased
                return ""
            if _alive(int(holder.get("pid", -1)), holder.get("started")):
                if not self.force:
                    raise self._refuse(holder, f", still running although its file lock is free (a filesystem "
                                               f"without working locks?); pass {FORCE_KEY}=true if it is not")
                return f"warning: {self.folder}: {FORCE_KEY}=true: took over the lock of the running {who}"
            return (f"note: {self.folder}: took over a stale lock of {who}: that process is no longer running "
                    f"(it did not release the lock; its outputs may be partial)")
        job = os.environ.get("SLURM_JOB_ID")
        if job and holder.get("slurm_job_id") == job:
            return (f"note: {self.folder}: took over the lock of {who}: the same Slurm job {job}, requeued on "
                    f"{here}")
        if self.force:
            return (f"warning: {self.folder}: {FORCE_KEY}=true: took over the lock of {who} (another host: "
                    f"make sure that run is dead)")
        raise self._refuse(holder, f"; its host cannot be checked from {here}: if that run is dead (its node "
                                   f"failed), pass {FORCE_KEY}=true")

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is None:
            return
        try:
            holder = self.read_holder()
            if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                self.info.unlink(missing_ok=True)
        finally:
            lock.release()

    def __enter__(self) -> RunLock:  # noqa: PYI034 (Python 3.10 has no typing.Self)
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class _NotHeld:
    """What a non-main process holds: nothing (the main process holds the lock for every rank)."""
    held = False
    notice = ""

    def release(self) -> None:
        pass


def lock_run_folder(folder: str | Path, kind: str, accelerator=None, force: bool = False) -> RunLock | _NotHeld:
    """The lock of `folder`, taken by the main process of `accelerator` (or this process without one); every
    process raises RunLocked when the main process was refused."""
    lock, error = None, None
    if accelerator is None or accelerator.is_main_process:
        try:
            lock = RunLock(folder, kind, force).acquire()
        except RunLocked as e:
            error = str(e)
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error])[0]
    if error:
        raise RunLocked(error)
    return lock if lock is not None else _NotHeld()


def release_lock_on_error(method):
    """For __init__: a failure after the lock was taken (self.run_lock) releases it before propagating."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            if getattr(self, "run_lock", None) is not None:
                self.run_lock.release()
            raise
    return wrapper


def release_lock_after(method):
    """For fit(): the lock (self.run_lock) is released when the method returns or raises."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            if getattr(self, "run_lock", None) is not None:
                self.run_lock.release()
    return wrapper


@contextlib.contextmanager
def locked_folder(folder: str | Path, kind: str, force: bool = False, **lock_args):
    """Hold the lock of `folder` for the block (RunLock), released when it ends or raises.  A block that
    fails having written nothing leaves the folder as it found it: the lock file it added is unlinked while
    still held (a process opening the path after that creates a new file; none can share the old one), and a
    folder it created is removed, so a failed run leaves no folder holding only `.run.lock`."""
    folder = Path(folder)
    before = set(os.listdir(folder)) if folder.is_dir() else None
    lock = RunLock(folder, kind, force=force, **lock_args).acquire()
    try:
        yield lock
    except BaseException:
        added = set(os.listdir(folder)) - (before or set()) if folder.is_dir() else set()
        if added <= {LOCK_NAME, lock.info.name}:
            if LOCK_NAME in added:
                lock.path.unlink(missing_ok=True)
            lock.release()
            if before is None:
                with contextlib.suppress(OSError):  # not empty: another run has just taken the folder
                    folder.rmdir()
        raise
    finally:
        lock.release()


def locked_out_dir(run, key: str = "out_dir", kind: str = "evaluation"):
    """`run(cfg)` holding the lock of cfg[key] (evaluate.py's main) for its whole run (locked_folder)."""
    @functools.wraps(run)
    def wrapper(cfg):
        with locked_folder(Path(cfg[key]), kind, force=bool(cfg.get(FORCE_KEY, False))):
            return run(cfg)
    return wrapper
