"""Stage "build": training examples from the import stage's files, with the leakage rule applied.

Reads `{build.input_dir}` (the import stage's texts.jsonl, pairs.jsonl, candidates.jsonl) and writes
`{build.out_dir}`:
    examples.jsonl  {"query_id", "pos_ids": [...], "rule", "pool"}   one line per training query
    texts.jsonl     {"id", "text"}                                   every text the examples refer to
    leakage.json    per evaluation set: what the rule found before and after (after is always 0)
    stats.json      counts per rule, timings, the stage fingerprint (an unchanged re-run is skipped)

Examples come from the configured rules (`build.rules`): (source, split) of the import files, which
labels count as positive, and the pool a rule's negatives are later mined from (stage "mine").

The leakage rule (`build.eval_sets`, `build.leakage`; data_pipeline/leakage.py): no query of an
evaluation set may appear in the training data, as a query or as a positive, by exact match of the
normalised text or as a near duplicate (the dedup stage's MinHash recipe, verified by exact Jaccard); and
no (query, relevant document) pair of an evaluation set may be a training (query, positive) pair.  Texts
an evaluation set only uses as candidates or corpus entries may stay.  An example whose query leaks is
dropped; a leaking positive is dropped from its example (and the example with it when no positive is
left).  The counts "after" are recomputed from scratch on what is kept, not assumed.

`export_flag` writes the id-based training files as FlagEmbedding's {"query", "pos", "neg"}, plus
"pos_scores" / "neg_scores" from teacher scores only (its docstring).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from care.data.examples import read_example_rows, write_examples
from care.data.io import DataError, read_jsonl, read_jsonl_numbered, read_text_store, write_json, write_jsonl
from care.data.records import Example
from care.data.stage_cache import fingerprint
from care.data.stage_start import stage_start
from data_pipeline.leakage import EvalSet, admitted_texts, apply_leakage_rule

FROM = {"pairs": "pairs.jsonl", "candidates": "candidates.jsonl"}
OUTPUTS = ("examples.jsonl", "texts.jsonl", "leakage.json", "unlabelled_texts.jsonl")


# ---- reading the import files ------------------------------------------------------------------------

def _rows(input_dir: Path, specs: list[dict], texts: dict[str, str]):
    """(spec, path, line, row) for every pairs/candidates row a spec selects by (source, split).
    Every id a selected row names must be in the text store."""
    for kind, name in FROM.items():
        wanted = [s for s in specs if s["from"] == kind]
        if not wanted:
            continue
        path = input_dir / name
        required = ("source", "split", "text1_id", "text2_id", "label") if kind == "pairs" else (
            "source", "split", "query_id", "candidates")
        for line, row in read_jsonl_numbered(path, required):
            for spec in wanted:
                if row["source"] == spec["source"] and row["split"] == spec["split"]:
                    ids = ([("text1_id", row["text1_id"]), ("text2_id", row["text2_id"])] if kind == "pairs"
                           else [("query_id", row["query_id"])] + [("candidates", c.get("id"))
                                                                   for c in row["candidates"]])
                    for fld, tid in ids:
                        if tid not in texts:
                            raise DataError(path, line, fld, f"unknown text id {tid!r} (not in texts.jsonl)")
                    yield spec, path, line, row


def _positive(label, min_label, path, line) -> bool:
    """label >= min_label; min_label None takes every row, labelled or not."""
    if min_label is None:
        return True
    if label is None:
        raise DataError(path, line, "label", "unlabelled row in a split a rule or evaluation set uses")
    return label >= min_label


def collect_examples(input_dir: Path, rules: list[dict], texts: dict[str, str]) -> dict[str, list[Example]]:
    """rule name -> its examples, one per query (positives in file order, no repeats)."""
    grouped: dict[str, dict[str, list[str]]] = {r["name"]: {} for r in rules}
    for rule, path, line, row in _rows(input_dir, rules, texts):
        groups = grouped[rule["name"]]
        if rule["from"] == "pairs":
            if _positive(row["label"], rule["min_label"], path, line):
                groups.setdefault(row["text1_id"], []).append(row["text2_id"])
        else:
            pos = [c["id"] for c in row["candidates"]
                   if _positive(c.get("label"), rule["min_label"], path, line)]
            if pos:
                groups.setdefault(row["query_id"], []).extend(pos)
    pools = {r["name"]: r["pool"] for r in rules}
    examples = {name: [Example(q, list(dict.fromkeys(p for p in pos if p != q)), name, pools[name])
                       for q, pos in groups.items()] for name, groups in grouped.items()}
    # A query whose only "paraphrase" is itself teaches nothing.
    return {name: [ex for ex in exs if ex.pos_ids] for name, exs in examples.items()}


def collect_eval_sets(input_dir: Path, specs: list[dict], texts: dict[str, str]) -> list[EvalSet]:
    sets = {s["name"]: EvalSet(s["name"]) for s in specs}
    for spec, path, line, row in _rows(input_dir, specs, texts):
        es, threshold = sets[spec["name"]], spec.get("relevant_min_label")
        if spec["from"] == "candidates":
            es.queries.add(row["query_id"])
            es.relevant.update((row["query_id"], c["id"]) for c in row["candidates"]
                               if _positive(c.get("label"), threshold, path, line))
        else:
            first, second = spec["roles"]
            for role, tid in ((first, row["text1_id"]), (second, row["text2_id"])):
                if role == "query":
                    es.queries.add(tid)
            if _positive(row["label"], threshold, path, line):
                es.relevant.add((row["text1_id"], row["text2_id"]))
    for es in sets.values():
        if not es.queries:
            raise ValueError(f"evaluation set '{es.name}' has no queries in {input_dir}: check its "
                             "source/split in build.eval_sets against the import stage's files")
    return list(sets.values())


# ---- FlagEmbedding export ----------------------------------------------------------------------------

# FlagEmbedding's score fields, from the training file's teacher fields (never from the miner's own)
TEACHER = {"teacher_pos_scores": "pos_scores", "teacher_neg_scores": "neg_scores"}


def export_flag(train_path: str | Path, texts_path: str | Path, out_path: str | Path) -> int:
    """The id-based training file as FlagEmbedding's JSON Lines {"query", "pos", "neg"}, texts inlined (what
    FlagEmbedding reads, so this file is ~50x the id-based one).

    FlagEmbedding reads "pos_scores" / "neg_scores" as TEACHER scores when distillation is on
    (knowledge_distillation=True: its AbsEmbedderTrainDataset then needs both).  So they are written only
    from the training file's teacher fields, "teacher_pos_scores" / "teacher_neg_scores" (aligned with
    pos_ids / neg_ids; written by the teacher-scoring stage, data_pipeline/score.py), and never from the
    miner's similarities (the training file's own pos_scores / neg_scores, data_pipeline/mining.py).  A file
    without teacher fields exports no score field at all.  Teacher fields go on every line or on none, one
    score per id: anything else is a DataError naming file, line and field."""
    texts = read_text_store(texts_path)
    # The reader checks every id and the teacher fields (one number per id, every line or none).
    examples = read_example_rows(train_path, texts, need=("neg_ids",), store=texts_path)
    rows = ({"query": texts[ex["query_id"]], "pos": [texts[i] for i in ex["pos_ids"]],
             "neg": [texts[i] for i in ex["neg_ids"]], **{flag: ex[f] for f, flag in TEACHER.items() if f in ex}}
            for _, ex in examples)
    return write_jsonl(out_path, rows)


# ---- the stage ---------------------------------------------------------------------------------------

def _sample(examples: list[Example], cap: int | None, seed: int) -> list[Example]:
    if cap is None or len(examples) <= cap:
        return examples
    picked = sorted(random.Random(seed).sample(range(len(examples)), cap))  # input order kept
    return [examples[i] for i in picked]


def _unlabelled(opts: dict, eval_sets, texts: dict[str, str], used: dict, leakage: dict, input_dir: Path):
    """Ids of every other imported text the leakage rule admits to training on its own (CARE's stage I
    aligns same-text pairs and needs no labels), optionally of some roles only; None when disabled."""
    if not opts.get("enabled"):
        return None
    roles = set(opts.get("roles") or ())
    ids = [t for t in texts if t not in used]
    if roles:
        role_of = {r["id"]: r.get("role") for r in read_jsonl(input_dir / "texts.jsonl")}
        ids = [t for t in ids if role_of.get(t) in roles]
    return admitted_texts(eval_sets, texts, ids, leakage)


def run(cfg: DictConfig) -> dict:
    c = OmegaConf.to_container(cfg.build, resolve=True)
    input_dir, out_dir = Path(c["input_dir"]), Path(c["out_dir"])
    inputs = [input_dir / "texts.jsonl", *(input_dir / name for name in FROM.values())]
    fp = fingerprint(inputs, c)
    for spec in c["rules"] + c["eval_sets"]:
        if spec.get("from") not in FROM:
            raise ValueError(f"build config entry {spec.get('name')!r}: `from` must be one of {list(FROM)}, "
                             f"not {spec.get('from')!r}")
    with stage_start(cfg, "build", out_dir, fp, OUTPUTS) as start:
        if start.done:
            return start.skip(f"build: inputs and config unchanged, skipped ({out_dir})")
        stats, leakage = _build(c, input_dir, fp, start)
    _print_table(stats["rules"], leakage)
    return stats


def _build(c: dict, input_dir: Path, fp: str, start) -> tuple[dict, dict]:
    """The examples, the leakage rule, the outputs and stats.json (last); (stats, the leakage report)."""
    out_dir = start.out
    t0 = time.perf_counter()
    texts = read_text_store(input_dir / "texts.jsonl")
    by_rule = collect_examples(input_dir, c["rules"], texts)
    eval_sets = collect_eval_sets(input_dir, c["eval_sets"], texts)
    t_read = time.perf_counter() - t0
    examples = [ex for rule in c["rules"] for ex in by_rule[rule["name"]]]
    if not examples:
        raise ValueError(f"no training examples: no rule in build.rules selected a positive from {input_dir}")
    clean, leakage = apply_leakage_rule(examples, eval_sets, texts, c["leakage"])
    t_leak = time.perf_counter() - t0 - t_read
    final, per_rule = [], {}
    for rule in c["rules"]:
        name = rule["name"]
        kept = [ex for ex in clean if ex.rule == name]
        capped = _sample(kept, rule.get("max_examples"), c["seed"])
        final += capped
        per_rule[name] = {"examples": len(by_rule[name]), "pairs": sum(len(e.pos_ids) for e in by_rule[name]),
                          "after_leakage": len(kept), "kept": len(capped),
                          "max_examples": rule.get("max_examples"),
                          "pool": rule["pool"]}
    used = dict.fromkeys(tid for ex in final for tid in [ex.query_id, *ex.pos_ids])
    unlabelled = _unlabelled(c.get("unlabelled") or {}, eval_sets, texts, used, c["leakage"], input_dir)
    t_unlabelled = time.perf_counter() - t0 - t_read - t_leak
    start.writing()
    write_examples(out_dir / "examples.jsonl", (ex.row() for ex in final))
    write_jsonl(out_dir / "texts.jsonl", ({"id": tid, "text": texts[tid]} for tid in used))
    write_json(out_dir / "leakage.json", leakage)
    if unlabelled is not None:
        write_jsonl(out_dir / "unlabelled_texts.jsonl", ({"id": tid, "text": texts[tid]} for tid in unlabelled))
    stats = {"stage": "build", "fingerprint": fp, "examples": len(final), "texts": len(used),
             "unlabelled_texts": None if unlabelled is None else len(unlabelled),
             "training_pairs": sum(len(e.pos_ids) for e in final), "rules": per_rule,
             "leakage_removed": leakage["removed"],
             "seconds": {"read": round(t_read, 2), "leakage": round(t_leak, 2), "unlabelled": round(t_unlabelled, 2),
                         "total": round(time.perf_counter() - t0, 2)}}
    return start.finish(stats), leakage


def _print_table(per_rule: dict, leakage: dict) -> None:
    print(f"{'rule':<14}{'examples':>10}{'after leakage':>15}{'kept':>8}")
    for name, r in per_rule.items():
        print(f"{name:<14}{r['examples']:>10}{r['after_leakage']:>15}{r['kept']:>8}")
    print(f"{'eval set':<34}{'queries':>9}{'leaks before':>14}{'after':>7}")
    for name, s in leakage["eval_sets"].items():
        before = s["before"]["as_query"] + s["before"]["as_text"] + s["before"]["relevant_pairs"]
        after = sum(s["after"].values())
        print(f"{name:<34}{s['queries']:>9}{before:>14}{after:>7}")
    print(f"leakage rule removed {leakage['removed']['training_pairs']} training pairs")


def summary(stats: dict) -> str:
    removed = stats.get("leakage_removed", {}).get("training_pairs", 0)
    return f"{stats.get('examples', 0):,} examples, {stats.get('texts', 0):,} texts; leakage rule removed {removed:,} pairs"
