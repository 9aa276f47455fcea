"""Stage `benchmarks`: build the open stand-in evaluation sets from the shared data, in the layouts a
user's own C-MTEB / CMedTEB copy has (so evaluate.py reads both the same way):

    {data_dir}/benchmarks/cmedteb_open/
        cmed_v1/test.jsonl      CMed v1 <- cEpilepsyQA test: 490 questions x 95-100 candidates (repeated
                                candidate rows collapsed by the reader), reranking JSON Lines
        cmed_v2/test.jsonl      CMed v2 <- ChineseBLUE cMedQA2 test grouped by question; only the trusted
                                questions (1-2 positives, the data README's known defect)
        retrieval/              Retrieval <- KUAKE-QTR dev queries against ALL KUAKE-QTR titles (train + dev
                                + test, identical titles merged), BEIR folder, graded qrels/dev.tsv
        rerank/test.jsonl       Rerank <- cMedIR test grouped by query
        sts/dev.jsonl           STS <- KUAKE-QQR dev without the disputed pair s9
    {data_dir}/benchmarks/cmedqa2_retrieval/
        cmedqa2_test/           the trusted ChineseBLUE cMedQA2 test questions against ALL its answers (BEIR)

How relevance comes from graded labels (the same choice the field makes for each set):
- KUAKE-QTR (0-3): qrels keep the label as the nDCG gain; label >= 1 counts as relevant (trec_eval's
  default level), since 1 already means "partly answers the query".  Dev queries with no title labelled
  >= 1 (379 of 2,369) are dropped and counted: nDCG is 0 for them whatever the model does.
- cMedIR (0-4): a title labelled >= 2 is a positive (the data README's usable-query criterion), 0-1 a
  negative; positives keep their label as "positive_grades" (nDCG gain), so MAP@10 is binary and nDCG
  graded.  Queries with no positive or no negative are dropped and counted (they rank nothing).
- cEpilepsyQA / cMedQA2 are binary already.
A text judged twice for one query under two ids (identical answers, one cMedIR title at two urls) becomes
one candidate with its best label, and is counted.

Every file is written atomically and stats.json last, with a fingerprint of the source files, the data
config and this code: an unchanged re-run is skipped, an interrupted one is redone.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from care.data.io import atomic_open, write_jsonl
from care.data.records import Pair, QueryCandidates, Text, native_id
from care.data.sources import code_files, read_source, source_files
from care.data.stage_cache import fingerprint
from care.data.stage_start import stage_start

OPEN_STAND_IN = ("open stand-in built from public data (data README); not the real CMedTEB / cMedQA2 sets, "
                 "scores are not comparable with published ones")
CODE = [Path(__file__), *code_files()]


def read_shared_source(data: dict, name: str, **overrides) -> tuple[list, dict[str, Text], dict]:
    """Source `name` of the resolved data config (conf/data/shared.yaml), its options updated by `overrides`:
    its records, its texts by id and the reader's report (as a dict).  Also the Nano stage's reader of the
    same sets (data_pipeline/nano/shared_data.py)."""
    records, report = read_source(name, {**data["sources"][name], **overrides}, data["root"],
                                  data.get("on_error", "stop"))
    texts: dict[str, Text] = {}
    for r in records:
        if isinstance(r, Text):
            texts.setdefault(r.id, r)  # readers yield a shared text once per use; the first copy is its place
    return records, texts, report.as_dict()


def _reranking_rows(lists: Iterable[tuple[str, dict[str, int]]], positive, counts: dict) -> list[dict]:
    """(query, {candidate text: label}) -> C-MTEB reranking rows; `positive(label)` decides the side."""
    rows = []
    for query, judged in lists:
        pos = {t: label for t, label in judged.items() if positive(label)}
        neg = [t for t, label in judged.items() if not positive(label)]
        if not pos or not neg:
            counts["dropped_no_positive" if not pos else "dropped_no_negative"] += 1
            continue
        row = {"query": query, "positive": list(pos), "negative": neg}
        if any(label > 1 for label in pos.values()):
            row["positive_grades"] = list(pos.values())
        rows.append(row)
    return rows


def _candidate_lists(records, texts: dict[str, Text], split: str,
                     counts: dict) -> list[tuple[str, dict[str, int]]]:
    """QueryCandidates of a split -> (query text, {candidate text: label}).  A text judged twice for one
    query (two ids, e.g. two cMedIR urls with one title) is one candidate with its best label: counted."""
    out: dict[str, dict[str, int]] = {}
    for qc in records:
        if isinstance(qc, QueryCandidates) and qc.split == split:
            judged = out.setdefault(texts[qc.query_id].text, {})
            for doc, label in qc.candidates:
                text = texts[doc].text
                if text in judged:
                    counts["identical_texts_merged"] += 1
                judged[text] = max(judged.get(text, label), label)
    return list(out.items())


def _write_reranking(path: Path, rows: list[dict], counts: dict) -> dict:
    write_jsonl(path, rows)
    return {"file": str(path), "queries": len(rows), "positives": sum(len(r["positive"]) for r in rows),
            "candidates": sum(len(r["positive"]) + len(r["negative"]) for r in rows), **counts}


def _write_beir(folder: Path, split: str, corpus: dict[str, str], queries: dict[str, str],
                qrels: dict[str, dict[str, int]]) -> dict:
    write_jsonl(folder / "corpus.jsonl", ({"_id": i, "text": t} for i, t in corpus.items()))
    write_jsonl(folder / "queries.jsonl", ({"_id": i, "text": t} for i, t in queries.items()))
    lines = ["query-id\tcorpus-id\tscore\n"] + [f"{q}\t{d}\t{g}\n" for q, judged in qrels.items() for d, g in judged.items()]
    with atomic_open(folder / "qrels" / f"{split}.tsv") as fh:
        fh.writelines(lines)
    return {"folder": str(folder), "corpus": len(corpus), "queries": len(queries),
            "judgements": sum(len(j) for j in qrels.values()),
            "relevant": sum(g >= 1 for j in qrels.values() for g in j.values())}


def _zero(*names: str) -> dict:
    return dict.fromkeys(names, 0)


def build_cmedteb_open(data: dict, out: Path) -> dict:
    def reranking_slot(source: str, min_label: int, file: Path, description: str, **read_options) -> dict:
        """A test split's candidate lists as a C-MTEB reranking file; positive = label >= min_label."""
        records, texts, report = read_shared_source(data, source, **read_options)
        counts = _zero("identical_texts_merged", "dropped_no_positive", "dropped_no_negative")
        rows = _reranking_rows(_candidate_lists(records, texts, "test", counts), lambda label: label >= min_label,
                               counts)
        return {"source": description, **_write_reranking(file, rows, counts), "reader": report}

    slots = {}
    slots["cmed_v1"] = reranking_slot(
        "cepilepsyqa", 1, out / "cmed_v1" / "test.jsonl",
        "cEpilepsyQA test (cMedQA2 release format), 100 candidates a question, repeated rows collapsed", splits=["test"])
    slots["cmed_v2"] = reranking_slot(
        "cmedqa2_pairs", 1, out / "cmed_v2" / "test.jsonl",
        "ChineseBLUE cMedQA2 test grouped by question, trusted questions only (1-2 positives)",
        files={"test": data["sources"]["cmedqa2_pairs"]["files"]["test"]})

    records, texts, report = read_shared_source(data, "kuake_qtr")
    titles = {native_id(r.id): r.text for r in records if isinstance(r, Text) and r.role == "title"}
    queries, qrels, conflicts = {}, {}, 0
    for p in records:
        if isinstance(p, Pair) and p.split == "dev":
            q, d = native_id(p.text1_id), native_id(p.text2_id)
            queries[q] = texts[p.text1_id].text
            judged = qrels.setdefault(q, {})
            conflicts += d in judged and judged[d] != p.label
            judged[d] = max(judged.get(d, p.label), int(p.label))
    no_relevant = [q for q, judged in qrels.items() if max(judged.values()) < 1]
    for q in no_relevant:
        del qrels[q], queries[q]
    slots["retrieval"] = {"source": "KUAKE-QTR dev queries vs all KUAKE-QTR titles (train+dev+test, deduplicated); "
                                    "graded qrels 0-3, relevant = label >= 1, nDCG gain = label",
                          **_write_beir(out / "retrieval", "dev", titles, queries, qrels),
                          "dropped_no_relevant": len(no_relevant), "conflicting_labels": int(conflicts),
                          "reader": report}

    slots["rerank"] = reranking_slot(
        "cmedir", 2, out / "rerank" / "test.jsonl",
        "cMedIR test grouped by query; positive = label >= 2 (nDCG gain = label), negative = label 0-1",
        files={"test": data["sources"]["cmedir"]["files"]["test"]})

    records, texts, report = read_shared_source(data, "kuake_qqr")
    pairs = [{"sentence1": texts[p.text1_id].text, "sentence2": texts[p.text2_id].text, "score": p.label}
             for p in records if isinstance(p, Pair) and p.split == "dev"]
    write_jsonl(out / "sts" / "dev.jsonl", pairs)
    slots["sts"] = {"source": "KUAKE-QQR dev (labels 0/1/2), disputed id s9 dropped",
                    "file": str(out / "sts" / "dev.jsonl"), "pairs": len(pairs), "reader": report}
    return slots


def build_cmedqa2_retrieval(data: dict, out: Path) -> dict:
    test = {"test": data["sources"]["cmedqa2_pairs"]["files"]["test"]}
    # The corpus is every answer of the test file, the untrusted questions' answers included.
    every, _, _ = read_shared_source(data, "cmedqa2_pairs", files=test, min_positives=0, max_positives=None)
    corpus = {native_id(r.id): r.text for r in every if isinstance(r, Text) and r.role == "answer"}
    records, texts, report = read_shared_source(data, "cmedqa2_pairs", files=test)
    queries, qrels = {}, {}
    for qc in records:
        if isinstance(qc, QueryCandidates):
            queries[native_id(qc.query_id)] = texts[qc.query_id].text
            qrels[native_id(qc.query_id)] = {native_id(d): 1 for d, label in qc.candidates if label >= 1}
    return {"cmedqa2_test": {"source": "ChineseBLUE cMedQA2 test: trusted questions (1-2 positives) against all "
                                       "answers of the test file", **_write_beir(out / "cmedqa2_test", "test", corpus, queries, qrels),
                             "reader": report}}


# name -> the files its builder writes into data_dir/benchmarks/<name> (checked by claim_outputs)
OUTPUTS = {"cmedteb_open": ("cmed_v1/test.jsonl", "cmed_v2/test.jsonl", "retrieval/corpus.jsonl",
                            "retrieval/queries.jsonl", "retrieval/qrels/dev.tsv", "rerank/test.jsonl",
                            "sts/dev.jsonl"),
           "cmedqa2_retrieval": ("cmedqa2_test/corpus.jsonl", "cmedqa2_test/queries.jsonl",
                                 "cmedqa2_test/qrels/test.tsv")}
# name -> (builder, the data sources it reads: only their files enter the fingerprint)
BUILDERS = {"cmedteb_open": (build_cmedteb_open, ["cepilepsyqa", "cmedqa2_pairs", "kuake_qtr", "cmedir", "kuake_qqr"]),
            "cmedqa2_retrieval": (build_cmedqa2_retrieval, ["cmedqa2_pairs"])}


def build(name: str, data: dict, data_dir: str | Path, cfg=None) -> dict:
    """Build one stand-in benchmark into data_dir/benchmarks/<name> unless it is up to date (`cfg`: the
    pipeline config, for force= and lock_force=; none: neither)."""
    if name not in BUILDERS:
        raise ValueError(f"no stand-in builder '{name}' (choose one of {', '.join(BUILDERS)})")
    builder, sources = BUILDERS[name]
    missing = [s for s in sources if s not in data["sources"]]
    if missing:
        raise KeyError(f"benchmark {name} is built from data sources {missing}, absent from the data config")
    out, root = Path(data_dir) / "benchmarks" / name, Path(data["root"])
    used = {s: data["sources"][s] for s in sources}
    inputs = [f for opts in used.values() for f in source_files(opts, root)] + CODE
    fp = fingerprint(inputs, {"name": name, "root": str(root), "sources": used})
    with stage_start(cfg, "benchmarks", out, fp, OUTPUTS[name]) as start:
        if start.done:
            return start.skip()
        t0 = time.perf_counter()
        start.writing()  # the builder writes slot by slot
        slots = builder(data, out)
        stats = {"stage": "benchmarks", "benchmark": name, "fingerprint": fp, "note": OPEN_STAND_IN,
                 "seconds": round(time.perf_counter() - t0, 2), "slots": slots}
        return start.finish(stats)  # stats.json last: an interrupted build leaves no fresh fingerprint


def run(cfg: DictConfig) -> dict:
    data = OmegaConf.to_container(cfg.data, resolve=True)
    stats = {}
    for name in BUILDERS:
        stats[name] = build(name, data, cfg.data_dir, cfg)
        state = "unchanged, skipped" if stats[name].get("skipped") else f"built in {stats[name]['seconds']} s"
        print(f"benchmarks/{name}: {state} ({OPEN_STAND_IN})")
        for slot, s in stats[name]["slots"].items():
            sizes = {k: v for k, v in s.items() if isinstance(v, int)}
            print(f"  {slot:13s} {s['source']}\n  {'':13s} {sizes}")
    return stats


def summary(stats: dict) -> str:
    return ", ".join(f"{b}: {len(s.get('slots', {}))} tasks" for b, s in stats.items())
