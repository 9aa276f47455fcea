"""The one way a model folder is built here (care.encoders.builders.me5, care.encoders.builders.towers): under a file
lock beside OUT (concurrent callers: one builds, the others then skip), into a temporary folder swapped in whole
(care.data.io.atomic_folder: a crash or a failed check never leaves half a model), skipped when OUT's
manifest.json records the same build key and every file it lists is there at its size, and never over a folder
this project did not build.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from care.data.io import atomic_folder, write_json

MANIFEST = "manifest.json"


def say(tool: str, msg: str) -> None:
    print(f"[{tool}] {msg}", flush=True)


def manifest_if_up_to_date(out: Path, key: dict, key_field: str = "key") -> dict | None:
    """OUT's manifest if OUT was built with this key (stored under `key_field`) and every file it lists is there,
    at its size."""
    try:
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    if manifest.get(key_field) != key or not manifest.get("files"):
        return None
    ok = all((out / f).is_file() and (out / f).stat().st_size == size for f, size in manifest["files"].items())
    return manifest if ok else None


def _built_here(out: Path, key_field: str) -> bool:
    try:
        return isinstance(json.loads((out / MANIFEST).read_text(encoding="utf-8"))[key_field], dict)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _publish(tmp: Path, manifest: dict) -> dict:
    """Write tmp/manifest.json (`manifest` + every file with its size) and make the folder readable by all."""
    files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {**manifest, "size_bytes": sum(files.values()), "files": files}
    write_json(tmp / MANIFEST, manifest)
    for p in [tmp, *tmp.rglob("*")]:  # mkstemp/mkdtemp make them private; model folders are for everyone to read
        p.chmod(0o755 if p.is_dir() else 0o644)
    return manifest


def locked_build(tool: str, out: Path, key: dict, force: bool, write: Callable[[Path], dict],
                 key_field: str = "key") -> dict:
    """Skip when OUT is up to date with `key`; else `write(tmp) -> info` into a temporary folder swapped in, its
    manifest holding {key_field: key, **info, built_at, build_seconds, size_bytes, files}.  Returns the manifest
    with `skipped` added.  `key_field` is the name the builder's manifests have always used, so folders built
    before this module existed stay up to date."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        manifest = None if force else manifest_if_up_to_date(out, key, key_field)
        if manifest:
            say(tool, f"{out} is up to date: skipped")
            return {**manifest, "skipped": True}
        if not force and out.exists() and any(out.iterdir()) and not _built_here(out, key_field):
            raise FileExistsError(f"{out} exists and was not built by {tool} (no manifest.json of ours): "
                                  "refusing to replace it; pass --force (force=True) to replace it")
        t0 = time.perf_counter()
        with atomic_folder(out) as tmp:
            info = write(tmp)
            # `info` may carry its own built_at (a README written inside the folder quotes it)
            manifest = _publish(tmp, {key_field: key, "built_at": time.strftime("%Y-%m-%d %H:%M:%S"), **info,
                                      "build_seconds": round(time.perf_counter() - t0, 2)})
    say(tool, f"wrote {out} ({manifest['size_bytes'] / 2**20:.1f} MiB) in {manifest['build_seconds']} s")
    return {**manifest, "skipped": False}
