"""Skip a stage whose inputs and config are unchanged.  Each stage writes `stats.json` holding a
fingerprint of (input file digests, stage config); a re-run with the same fingerprint is skipped."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from care.data.io import file_digest


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
