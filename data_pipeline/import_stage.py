"""Stage `import`: read every configured source (cfg.data.sources) into three files every later stage uses.

    {data_dir}/import/texts.jsonl       {"id", "text", "source", "role"}            every text once
    {data_dir}/import/pairs.jsonl       {"id", "source", "split", "text1_id", "text2_id", "label"[, "category"]}
    {data_dir}/import/candidates.jsonl  {"id", "source", "split", "query_id", "candidates": [{"id", "label"}]}
    {data_dir}/import/stats.json        per source and file: rows read, kept, rejected (each with file, line,
                                        field, reason), filters applied with counts; input digests and the
                                        stage fingerprint

Labels are numbers, or null in unlabelled splits.  An unchanged re-run (same input files, same data
config, same reader code) is skipped; force=true re-runs it.
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import care.data.records
import care.data.sources
from care.data.io import file_digest, write_jsonl
from care.data.records import Pair, QueryCandidates, Text, to_json
from care.data.sources import read_source, source_files
from care.data.stage_cache import fingerprint
from care.data.stage_start import stage_start

# The reader code is an input too: a fixed reader must not be skipped as "unchanged".
CODE = [*care.data.sources.code_files(), Path(care.data.records.__file__), Path(__file__)]
OUTPUTS = ("texts.jsonl", "pairs.jsonl", "candidates.jsonl")


def run(cfg: DictConfig) -> dict:
    data = OmegaConf.to_container(cfg.data, resolve=True)
    root, out = Path(data["root"]), Path(cfg.data_dir) / "import"
    files = [f for opts in data["sources"].values() for f in source_files(opts, root)]
    fp = fingerprint(files + CODE, data)
    with stage_start(cfg, "import", out, fp, OUTPUTS) as start:
        if start.done:
            return start.skip(f"import: inputs, config and code unchanged (fingerprint {fp}): skipped; "
                              "force=true re-runs it")
        stats = _import(data, root, files, fp, start)
    print(_table(stats, out))
    return stats


def _import(data: dict, root: Path, files: list[Path], fp: str, start) -> dict:
    """Read every source, write the three files and stats.json (last) into the stage's folder."""
    out = start.out
    t0 = time.perf_counter()
    texts: dict[str, Text] = {}
    pairs: list[Pair] = []
    candidates: list[QueryCandidates] = []
    per_source = {}
    for name, opts in tqdm(data["sources"].items(), desc="import", unit="source"):
        t0 = time.perf_counter()
        records, report = read_source(name, opts, root, data.get("on_error", "stop"))
        n_texts, n_pairs, n_unlabelled, n_lists, n_judged = set(), Counter(), Counter(), Counter(), 0
        for r in records:
            if isinstance(r, Text):
                if texts.setdefault(r.id, r).text != r.text:
                    raise ValueError(f"source '{name}': text id {r.id!r} names two different texts")
                n_texts.add(r.id)
            elif isinstance(r, Pair):
                pairs.append(r)
                (n_unlabelled if r.label is None else n_pairs)[r.split] += 1
            else:
                candidates.append(r)
                n_lists[r.split] += 1
                n_judged += len(r.candidates)
        per_source[name] = {
            "reader": opts["reader"], "path": str(root / opts["path"]), "seconds": round(time.perf_counter() - t0, 2),
            "records": {"texts": len(n_texts), "pairs": dict(n_pairs), "unlabelled_pairs": dict(n_unlabelled),
                        "candidate_lists": dict(n_lists), "candidates": n_judged},
            **report.as_dict(),
        }

    start.writing()
    write_jsonl(out / "texts.jsonl", (to_json(t) for t in texts.values()))
    write_jsonl(out / "pairs.jsonl", (to_json(p) for p in pairs))
    write_jsonl(out / "candidates.jsonl", (to_json(c) for c in candidates))
    stats = {
        "stage": "import", "fingerprint": fp, "on_error": data.get("on_error", "stop"), "root": str(root),
        "seconds": round(time.perf_counter() - t0, 2),
        "inputs": {str(f): file_digest(f) for f in files if f.is_file()},
        "outputs": {"texts": len(texts), "pairs": len(pairs), "candidate_lists": len(candidates)},
        "sources": per_source,
    }
    return start.finish(stats)  # stats.json last: a crash before this point leaves no fresh fingerprint


def _table(stats: dict, out: Path) -> str:
    head = f"{'source':<16}{'rows':>9}{'rejected':>10}{'filtered':>10}{'texts':>9}{'pairs':>9}{'unlab.':>8}{'lists':>8}"
    lines = [head, "-" * len(head)]
    for name, s in stats["sources"].items():
        files, rec = s["files"].values(), s["records"]
        lines.append(f"{name:<16}{sum(f['rows'] for f in files):>9,}{sum(f['rejected'] for f in files):>10,}"
                     f"{sum(f['filtered'] for f in files):>10,}{rec['texts']:>9,}{sum(rec['pairs'].values()):>9,}"
                     f"{sum(rec['unlabelled_pairs'].values()):>8,}{sum(rec['candidate_lists'].values()):>8,}")
    o = stats["outputs"]
    lines.append(f"import: {o['texts']:,} texts, {o['pairs']:,} pairs, {o['candidate_lists']:,} candidate lists "
                 f"in {stats['seconds']} s -> {out}")
    return "\n".join(lines)


def summary(stats: dict) -> str:
    o = stats.get("outputs", {})
    return f"{o.get('texts', 0):,} texts, {o.get('pairs', 0):,} pairs, {o.get('candidate_lists', 0):,} candidate lists"
