"""Source readers: one small module per real format, each knowing its own quirks, all yielding the record
types of care.data.records.  A source is configured by a dict (conf/data/*.yaml, `sources.<name>`):
`reader` (a key of READERS), `path` (a file or folder under data.root) and the reader's own options.

Every reader is `read(opts, root, report) -> Iterator[Text | Pair | QueryCandidates]`; `report` counts
rows read, kept, rejected and filtered, and applies the on_error policy (see common.py).
"""
from __future__ import annotations

from pathlib import Path

from care.data.records import Pair, QueryCandidates, Text
from care.data.sources import beir, cblue, chineseblue, chip2019, cmedir, cmedqa_release, cmteb, ncov
from care.data.sources.common import Report

READERS = {
    "cmedqa_release": cmedqa_release.read,  # cMedQA / cMedQA2 / cEpilepsyQA release folders
    "chineseblue_qa": chineseblue.read_qa,  # ChineseBLUE cMedQA TSV: label, question, answer
    "chineseblue_pairs": chineseblue.read_pairs,  # ChineseBLUE cMedQQ TSV: label, text1, text2
    "cblue": cblue.read,  # CBLUE JSON arrays: KUAKE-QTR, KUAKE-QQR, CHIP-STS
    "chip2019": chip2019.read,  # CHIP 2019 task 2 CSV
    "ncov": ncov.read,  # nCoV-2019 similar-question TSV
    "cmedir": cmedir.read,  # ChineseBLUE cMedIR JSON Lines
    "beir": beir.read,  # BEIR retrieval folder
    "cmteb_reranking": cmteb.read_reranking,  # C-MTEB reranking JSON Lines
    "sts_jsonl": cmteb.read_sts,  # STS JSON Lines
}


def read_source(name: str, opts: dict, root: str | Path, on_error: str = "stop"
                ) -> tuple[list[Text | Pair | QueryCandidates], Report]:
    """All records of one configured source, and the report of what was read, kept and left out."""
    if opts.get("reader") not in READERS:
        raise ValueError(f"source '{name}': unknown reader {opts.get('reader')!r} (choose one of {', '.join(READERS)})")
    root = Path(root)
    if not (root / opts["path"]).exists():
        raise FileNotFoundError(f"source '{name}': {root / opts['path']} does not exist (check data.root and path)")
    report = Report(name, root / opts["path"], opts.get("on_error", on_error))
    return list(READERS[opts["reader"]](opts, root, report)), report


def source_files(opts: dict, root: str | Path) -> list[Path]:
    """The files a source reads from (for the stage fingerprint): its path, or every file under it."""
    path = Path(root) / opts["path"]
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def code_files() -> list[Path]:
    """The readers' own source files: a stage fingerprint includes them, so a fixed reader re-runs."""
    return sorted(Path(__file__).parent.glob("*.py"))
