"""Stage `nano`: one Nano dataset, one split per retrieval task (docs/nano.md; conf/nano/default.yaml).

    python -m data_pipeline stage=nano                     the open splits from the shared data
    python -m data_pipeline stage=nano input=DIR out=OUT   any task folder (BEIR or mteb / HAKARI parquet);
                                                           without out=, ${data_dir}/nano/Nano<DIR's name>

Per split: the selection (select.py), then (split.py) BM25 top-500 (bm25s robertson over HAKARI's jieba
tokens), dense top-500 with the configured encoder through the embedding cache (the corpus is encoded
shard by shard, each shard a cache chunk, so an interrupted build resumes where it stopped), reciprocal
rank fusion with the safeguard, the audit (any failure stops the build) and the candidate-quality table.
The splits come from an input= folder (sources.py) or the shared data (shared_data.py).  With the open
splits, the build stage's training data is checked against every Nano query and (query, positive) pair
with the leakage rule (data_pipeline/leakage.py).

The dataset folder is built beside its destination and swapped in whole when every split has passed
its audit, so a failed or interrupted build never leaves half a dataset and never touches the previous
one.  The swap would delete whatever else the folder holds, so anything there this stage did not write (a
user's out= folder, the folder holding other Nano datasets, a file added to one) is refused, force or not;
files of its own names that another stage or person wrote are refused unless force=true; a folder built from
another input= folder of the same name is refused unless force=true (care/data/stage_start.py).  An
unchanged re-run (same sources, config, code and encoder weights, files as written) is skipped.
"""
from __future__ import annotations

import datetime
import hashlib
import re
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from care.data.io import DataError, read_text_store, write_json
from care.data.nano import METADATA
from care.data.sources import source_files
from care.data.stage_cache import ForeignOutputError, fingerprint
from care.data.stage_start import stage_start
from care.encoders.prompts import legacy_keyed
from care.paths import relative_name
from data_pipeline.nano import candidates, layout
from data_pipeline.nano.select import Selection, select
from data_pipeline.nano.shared_data import shared_tasks
from data_pipeline.nano.sources import SourceTask, read_task
from data_pipeline.nano.split import build_split

HERE = Path(__file__).parent
# benchmarks.py: shared_data.py reads the default splits through its read_shared_source
CODE = [*sorted(HERE.glob("*.py")), HERE.parent / "leakage.py", HERE.parent / "benchmarks.py",
        HERE.parents[1] / "care" / "retrieval" / "bm25.py"]
# What the stage writes into its folder (layout.py), the dense list's folder (dense_name) besides
OUTPUTS = ("README.md", "reranking_hybrid_metadata.json", "corpus", "queries", "qrels", "metadata", "bm25",
           "reranking_hybrid", "mteb_qrels")
SHARED_SOURCES = ("kuake_qtr", "cmedir", "cepilepsyqa", "cmedqa2_pairs")


def dense_name(opts: dict, model: dict) -> str:
    """The dense list's config name: the model actually used (docs/nano.md s.6), as a slug."""
    return re.sub(r"[^A-Za-z0-9]+", "_", opts["dense"]["config_name"] or model["name"]).strip("_").lower()


# ---- the leakage check ---------------------------------------------------------------------------------------

def leakage_check(selections: dict[str, Selection], build_dir: Path, opts: dict) -> dict:
    """Every Nano query and (query, positive) pair against the build stage's training texts (examples and
    unlabelled texts), by the build stage's own rule.  Returns per split the counts; a leak is an error."""
    from care.data.examples import read_example_rows
    from care.data.records import Example
    from data_pipeline.leakage import EvalSet, LeakageDetector

    examples_file = build_dir / "examples.jsonl"
    if not examples_file.is_file():
        raise FileNotFoundError(f"nano.leakage: {examples_file} does not exist: run the build stage first "
                                "(`python -m data_pipeline`, every stage), or pass nano.leakage.check=false")
    texts = read_text_store(build_dir / "texts.jsonl")
    examples = [Example(r["query_id"], r["pos_ids"], r.get("rule", ""), r.get("pool", ""))
                for _, r in read_example_rows(examples_file, texts, store=build_dir / "texts.jsonl")]
    unlabelled = build_dir / "unlabelled_texts.jsonl"
    if unlabelled.is_file():  # trained on as (text, text) pairs (CARE's stage I)
        extra = read_text_store(unlabelled)
        texts.update(extra)
        examples += [Example(t, [t], "unlabelled", "") for t in extra]
    sets = []
    for split, sel in selections.items():
        key = f"nano:{split}:"
        texts.update({key + "q:" + q: t for q, t in sel.queries.items()})
        texts.update({key + "d:" + d: t for d, t in sel.corpus.items()})
        sets.append(EvalSet(f"nano/{split}", {key + "q:" + q for q in sel.queries},
                            {(key + "q:" + q, key + "d:" + d) for q, docs in sel.qrels.items() for d in docs}))
    counts, shown, _ = LeakageDetector(sets, texts, opts).report(examples)
    found = {name: dict(c) for name, c in counts.items() if sum(c.values())}
    if found:
        raise DataError(examples_file, None, "query_id", f"Nano queries are in the training data: {found}; "
                        f"e.g. {dict(shown)}. Add the split's source to build.eval_sets and rebuild.")
    return {"build_dir": str(build_dir), "training_examples": len(examples), "leaks": 0,
            "rule": "build.leakage (exact after normalisation + MinHash near duplicates), as queries and as texts"}


# ---- the stage -------------------------------------------------------------------------------------------

def _tasks(cfg: DictConfig, opts: dict) -> tuple[dict[str, SourceTask], list[Path], dict]:
    if cfg.get("input"):
        path = Path(cfg.input).expanduser().resolve()
        task = read_task(path, opts["input_split"])
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        return {task.name: task}, files, {"input": str(path), "split": opts["input_split"]}
    data = OmegaConf.to_container(cfg.data, resolve=True)
    tasks = shared_tasks(data)
    if opts["splits"]:
        unknown = [s for s in opts["splits"] if s not in tasks]
        if unknown:
            raise ValueError(f"nano.splits: no default split {unknown} (choose from {', '.join(tasks)})")
        tasks = {s: tasks[s] for s in opts["splits"]}
    root = Path(data["root"])
    files = [f for s in SHARED_SOURCES for f in source_files(data["sources"][s], root)]
    return tasks, files, {"data_root": str(root), "sources": {s: data["sources"][s] for s in SHARED_SOURCES}}


def output_folder(cfg: DictConfig, opts: dict) -> tuple[str, Path]:
    """The dataset's name (the card's title) and folder.  The open splits: nano.name or the open dataset's
    name (nano.open_name), in out= / nano.out_dir or ${nano.root}/<name>.  An input= task: nano.name or
    Nano<input folder name> (as is when it already starts with "Nano"), in out= / nano.out_dir or
    ${nano.root}/<name>; never the open dataset's name or folder, which `evaluate.py benchmark=nano` would
    score as the open stand-in (a ValueError says so)."""
    open_name, root = opts["open_name"], Path(opts["root"]).expanduser()
    explicit = cfg.get("out") or opts.get("out_dir")
    if not cfg.get("input"):
        name = opts["name"] or open_name
        return name, (Path(explicit) if explicit else root / name).expanduser().resolve()
    folder = Path(cfg.input).expanduser().resolve().name
    name = opts["name"] or (folder if folder.startswith("Nano") else f"Nano{folder}")
    out = (Path(explicit) if explicit else root / name).expanduser().resolve()
    open_dir = (root / open_name).resolve()
    if name == open_name or out == open_dir:
        raise ValueError(f"nano: input={cfg.input} would be written as the open dataset "
                         f"({open_name}, {open_dir}), which `evaluate.py benchmark=nano` scores as the open "
                         f"stand-in; name it otherwise (nano.name=...) or write it elsewhere (out=DIR)")
    return name, out


def _selection_options(opts: dict) -> dict:
    keys = ("query_limit", "doc_limit", "query_selection", "seed", "corpus_order", "dedupe_query_texts",
            "dedupe_doc_texts", "qrels_cap")
    return {k: opts[k] for k in keys}


def run(cfg: DictConfig) -> dict:
    from care.models.hub import weights_digest

    opts = OmegaConf.to_container(cfg.nano, resolve=True)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    name, out = output_folder(cfg, opts)
    opts["name"] = name
    tasks, files, source = _tasks(cfg, opts)
    dense = dense_name(opts, model)
    check = opts["leakage"]["check"] and (not cfg.get("input")
                                          or (Path(opts["leakage"]["build_dir"]) / "examples.jsonl").is_file())
    build_dir = Path(opts["leakage"]["build_dir"])
    leak_inputs = [build_dir / n for n in ("examples.jsonl", "texts.jsonl", "unlabelled_texts.jsonl")] if check else []
    fp = fingerprint([*files, *CODE, *leak_inputs],
                     {"nano": opts, "source": source, "model": legacy_keyed(model),
                      "weights": weights_digest(model["path"]),
                      "leakage": OmegaConf.to_container(cfg.build.leakage, resolve=True) if check else None})
    with stage_start(cfg, "nano", out, fp, (*OUTPUTS, dense), whole_folder=True, legacy_entry=_data_folder) as start:
        if start.done:
            return start.skip(f"nano: {out} unchanged, skipped")
        _refuse_another_input(start, source.get("input"))
        t_start = time.perf_counter()
        selections = {name: select(task, **_selection_options(opts)) for name, task in tasks.items()}
        leakage = (leakage_check(selections, build_dir, OmegaConf.to_container(cfg.build.leakage, resolve=True))
                   if check else {"checked": False, "why": "no build stage outputs for an input= task"})
        from care.encoders import build_encoder
        from care.encoders.cache import EmbeddingCache
        from care.evaluation.corpora import evaluation_model

        d = opts["dense"]
        encoder = build_encoder(evaluation_model(model, d["max_length"]), device=d["device"])
        cache = EmbeddingCache(d["cache"], enabled=d["cache"] is not None)
        built = {}
        with start.folder() as tmp:
            for name, task in tasks.items():
                t0 = time.perf_counter()
                built[name] = build_split(task, selections[name], encoder, cache, opts, dense, tmp)
                print(f"nano/{name}: {built[name]['card']['queries']} queries, {built[name]['card']['corpus']:,} docs, "
                      f"{built[name]['quality_row']['safeguards']} safeguards, {time.perf_counter() - t0:.1f} s")
            table = _write_dataset_files(tmp, opts, model, dense, built, encoder, bool(cfg.get("input")))
            audit_folder(tmp, opts["hybrid"]["top_k"])  # the files as written, read back (HAKARI audits its upload)
            stats = {"stage": "nano", "fingerprint": fp, "name": opts["name"], "out_dir": str(out), "dense": dense,
                     "input": source.get("input"), "input_key": input_key(source.get("input")),
                     "leakage": leakage, "seconds": round(time.perf_counter() - t_start, 1),
                     "embeddings_encoded": cache.misses, "embeddings_from_cache": cache.hits,
                     "splits": {n: {**b["card"], "seconds": b["metadata"]["seconds"],
                                    "safeguards": b["quality_row"]["safeguards"],
                                    "candidate_quality": b["metadata"]["candidate_quality"]} for n, b in built.items()}}
            stats = start.finish(stats, tmp)
    print(f"nano: {out} (candidate quality, 0-100; README.md holds the card)\n" + "\n".join(table))
    return stats


def _data_folder(entry: Path) -> bool:
    """A folder of parquet / JSON files only: a config (or metadata) of a Nano folder written before its
    stats.json recorded its files (stage_cache.strays), e.g. the dense list of an earlier model."""
    return entry.is_dir() and all(f.suffix in (".parquet", ".json") for f in entry.rglob("*") if f.is_file())


def input_key(source: str | None) -> str | None:
    """Which input folder a Nano folder was built from, as stats.json records it: a digest of its absolute
    path (the file names no machine path: the "input" beside it is relative, so /a/retrieval and
    /b/retrieval both read "retrieval" there); None for the open splits."""
    return hashlib.sha256(source.encode()).hexdigest()[:16] if source else None


def _refuse_another_input(start, source: str | None) -> None:
    """Two input= folders with one last name (/a/retrieval, /b/retrieval) make one Nano<name>: the folder's
    stats.json records the input it was built from, and another one does not replace it unless forced."""
    own = start.own or {}
    if "input_key" in own:
        same = own["input_key"] == input_key(source)
    else:  # written before input_key: its "input" was the absolute path (or None for the open splits)
        old = own.get("input", source)
        same = old == source or (old is not None and not Path(old).is_absolute())
    if not same and not start.force:
        what = f"another input folder (recorded as {own['input']})" if own.get("input") else "the open splits"
        raise ForeignOutputError(
            f"nano: refusing to replace {start.out}: it was built from {what}, not "
            f"{f'input={source}' if source else 'the open splits'} (two task folders with one name make one "
            f"{start.out.name}). Write this one elsewhere (out=DIR or nano.name=NAME), or pass force=true to "
            "replace it.")


def audit_folder(folder: str | Path, top_k: int = candidates.HYBRID_TOP_K) -> list[str]:
    """Read a Nano folder back (care/data/nano.py) and audit every split's `reranking_hybrid` rows
    (docs/nano.md s.9); raises on the first split that fails, returns the splits checked."""
    from care.data.nano import HYBRID, load_split, splits

    names = splits(folder)
    for split in names:
        s = load_split(folder, split)
        if HYBRID not in s.candidates:
            raise FileNotFoundError(f"{folder}: split {split} has no {HYBRID} config to audit")
        candidates.audit(split, list(s.queries), s.corpus, s.qrels, s.candidates[HYBRID], top_k=top_k)
    return names


def _write_dataset_files(out: Path, opts: dict, model: dict, dense: str, built: dict, encoder,
                         from_input: bool = False) -> list[str]:
    """reranking_hybrid_metadata.json in HAKARI's schema (docs/nano.md s.10) and the README card; returns the
    card's Candidate Quality table."""
    prompts = encoder.prompts
    configs = {"bm25": {"top_k": opts["bm25"]["top_k"], "tokenizer": opts["bm25"]["tokenizer"],
                        "method": opts["bm25"]["method"], "k1": opts["bm25"]["k1"], "b": opts["bm25"]["b"]},
               dense: {"model": model.get("label", model["name"]), "model_path": relative_name(model["path"]),
                       "top_k": opts["dense"]["top_k"], "query_prompt_name": None,
                       "query_prompt": prompts.apply([""], "query", "retrieval")[0],
                       "document_prompt_name": None, "document_prompt": prompts.apply([""], "document", "retrieval")[0],
                       "max_seq_length": opts["dense"]["max_length"], "dtype": "float32",
                       "side_fingerprints": {s: encoder.side_fingerprint(s, "retrieval") for s in ("query", "document")}},
               "reranking_hybrid": {"rrf_top_k": opts["hybrid"]["top_k"],
                                    "max_candidates_per_query": opts["hybrid"]["top_k"] + 1,
                                    "method": "reciprocal_rank_fusion", "rrf_k": opts["hybrid"]["rrf_k"],
                                    "random_seed": opts["seed"], "construction_policy": candidates.CONSTRUCTION_POLICY}}
    write_json(out / METADATA, {
        "generated_at_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source_dataset": opts["name"], "configs": configs, "splits": {n: b["meta"] for n, b in built.items()}})
    dense_model = f"`{dense}` ({model.get('label', model['name'])}), not harrier-oss-v1-270m"
    if from_input:  # a user's task: named as such, never described as the open dataset
        tasks = ", ".join(f"`{n}` ({b['metadata']['source'].get('description', n)})" for n, b in built.items())
        first = (f"A Nano-style retrieval dataset built from the task {tasks} by this project's `nano` stage "
                 f"(data_pipeline/nano, `input=`) with HAKARI-bench's NanoCMTEB recipe (docs/nano.md). "
                 f"**It is not NanoCMTEB, nor the open {opts['open_name']}**: its split comes from that task, and "
                 f"its dense list is {dense_model}.")
    else:
        first = (f"An open, Nano-style Chinese medical retrieval dataset built by this project's `nano` stage "
                 f"(data_pipeline/nano) with HAKARI-bench's NanoCMTEB recipe (docs/nano.md). **It is not NanoCMTEB**: "
                 f"its splits come from public medical sets, and its dense list is {dense_model}.")
    score = ("`python evaluate.py benchmark=nano benchmark.nano.path=<this folder>`" if from_input
             else "`python evaluate.py benchmark=nano`")
    intro = [first, "",
             ("Load a config with `datasets.load_dataset(\"<this folder>\", \"queries\", split=\"<split>\")`; "
              f"score a model with {score} (README of the project)."), "",
             "Splits and sources:"]
    intro += [f"- `{n}`: {b['metadata']['source'].get('description', b['metadata']['source'])}" for n, b in built.items()]
    rows = {n: b["quality_row"] for n, b in built.items()}
    layout.write_card(out, opts["name"], intro, list(built), dense, {n: b["card"] for n, b in built.items()}, rows,
                      sum(r["safeguards"] for r in rows.values()),
                      sum(b["meta"]["reranking_hybrid"]["limited_by_corpus_size_count"] for b in built.values()))
    return layout.quality_table(rows, dense)


def summary(stats: dict) -> str:
    splits = stats.get("splits", {})
    return (f"{stats.get('name')}: {len(splits)} splits ("
            + ", ".join(f"{n} {s['queries']}q/{s['corpus']:,}d" for n, s in splits.items())
            + f"), {sum(s['safeguards'] for s in splits.values())} safeguards")
