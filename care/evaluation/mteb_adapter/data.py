"""mteb's data as the project reads it (care.data.tasks.TaskData), for the project's side of compare().

    retrieval_data(kind, ...)          mteb's retrieval/reranking split as a TaskData, the project's rules
    read_parquet_copy(folder, ...)     a local copy in mteb's (the hub's) parquet layout
    load_local_copy(path, kind, split) that, or the project's layouts (BEIR folder, JSON Lines)
    load_hub_task(task)                an mteb task's data loaded as mteb does, or a plain reason why not
    task_data(task)                    any mteb task's data as a TaskData (a local task's own)
    care_spec(task)                    the TaskSpec the project's runners score a task with
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from care.data.nano import config_files, read_rows
from care.data.tasks import TaskData, load_task
from care.evaluation.mteb_adapter.scores import DATA_TYPES, default_spec

#: the local layouts a C-MTEB task copy may come in (tasks=<name>=<path>)
LOCAL_LAYOUTS = ("mteb's parquet layout (a hub download: corpus, queries, default|qrels, top_ranked configs; "
                 "an STS set's default config), or the project's: a BEIR folder (retrieval), a JSON Lines file "
                 '{"query", "positive", "negative"} (reranking) or {"sentence1", "sentence2", "score"} (STS)')


def mteb_document_text(row: Mapping) -> str:
    """A corpus row as mteb embeds it (mteb._create_dataloaders._corpus_to_dict): title and text joined by a
    space, outer whitespace stripped."""
    title, text = row.get("title") or "", row.get("text") or ""
    return f"{title} {text}".strip() if title else text.strip()


def retrieval_data(kind: str, path: str, corpus: Mapping[str, str], queries: Mapping[str, str],
                   qrels: Mapping[str, Mapping[str, int]], top_ranked: Mapping[str, Sequence[str]] | None = None,
                   reader: str = "mteb") -> TaskData:
    """mteb's view of a retrieval or reranking split (corpus, queries, relevant_docs, top_ranked) as the project
    reads such a task (care.data.tasks): only queries with qrels; for reranking, each query's qrels become its
    candidate list (top_ranked, else its judged documents), unlisted documents graded 0; a list with no
    positive or no negative is dropped and counted (care.data.tasks' rule), as are positives missing from it."""
    from care.data.io import DataError

    data = TaskData(kind, str(path), counts={"reader": reader})
    qrels = {str(q): {str(d): int(g) for d, g in j.items()} for q, j in qrels.items() if str(q) in queries}
    if kind == "retrieval":
        data.queries = {q: t for q, t in queries.items() if q in qrels}
        data.docs, data.qrels = dict(corpus), {q: qrels[q] for q in data.queries}
    else:
        lists = top_ranked if top_ranked is not None else {q: list(j) for q, j in qrels.items()}
        one_sided = outside = 0
        for q, text in queries.items():
            if q not in qrels or q not in lists:
                continue
            judged = {str(d): qrels[q].get(str(d), 0) for d in lists[q]}
            outside += sum(1 for d, g in qrels[q].items() if g > 0 and d not in judged)
            if len({g > 0 for g in judged.values()}) < 2:
                one_sided += 1
                continue
            data.queries[q], data.qrels[q] = text, judged
        if bad := next((d for j in data.qrels.values() for d in j if d not in corpus), None):
            raise DataError(path, None, "corpus-ids", f"candidate {bad} is not in the corpus")
        data.docs = {d: corpus[d] for j in data.qrels.values() for d in j}
        data.counts.update(skipped_one_sided_lists=one_sided, positives_outside_candidates=outside)
    if not data.queries:
        raise DataError(path, None, None, "no judged query" + (" with both a positive and a negative candidate"
                                                               if kind != "retrieval" else ""))
    data.counts.update(queries=len(data.queries), docs=len(data.docs),
                       judgements=sum(len(j) for j in data.qrels.values()))
    return data


def read_parquet_copy(folder: str | Path, kind: str, split: str) -> TaskData:
    """A local copy of a C-MTEB task in mteb's (the hub's) parquet layout, read with care.data.nano's pyarrow
    reader (no datasets cache): retrieval and reranking from the corpus, queries, default (or qrels) and
    top_ranked configs, STS from the default config (sentence1, sentence2, score).  The split is `split`, or a
    config's only split (mteb's loader's rule)."""
    from care.data.io import DataError

    folder = Path(folder)
    files = config_files(folder)

    def rows(config: str) -> list[dict]:
        splits = list(files[config])
        chosen = split if split in splits else splits[0] if len(splits) == 1 else None
        if chosen is None:
            raise ValueError(f"{folder}: config {config!r} has no split {split!r} (it has {', '.join(splits)})")
        return read_rows(folder, config, chosen, files=files)

    def pick(*names: str) -> str | None:
        return next((n for n in names if n in files), None)

    if kind == "sts":
        config = pick("default") or (next(iter(files)) if len(files) == 1 else None)
        if config is None:
            raise FileNotFoundError(f"{folder}: no default config of STS pairs (configs: {', '.join(files)})")
        pairs = rows(config)
        if bad := next((c for c in ("sentence1", "sentence2", "score") if pairs and c not in pairs[0]), None):
            raise DataError(folder / config, None, bad, f"config {config!r} lacks column {bad!r}")
        data = TaskData("sts", str(folder), pairs=[(r["sentence1"], r["sentence2"]) for r in pairs],
                        gold=[float(r["score"]) for r in pairs], counts={"reader": "mteb parquet", "pairs": len(pairs)})
        if len(data.pairs) < 2:
            raise DataError(folder / config, None, "sentence1", f"{len(data.pairs)} pairs; STS needs >= 2")
        return data
    corpus_c, queries_c, qrels_c = pick("corpus"), pick("queries", "query"), pick("default", "qrels")
    if not (corpus_c and queries_c and qrels_c):
        raise FileNotFoundError(f"{folder}: not in mteb's retrieval layout (needs corpus, queries and default or "
                                f"qrels configs; found {', '.join(sorted(files)) or 'none'})")

    def rid(r: dict) -> str:
        return str(r["id"] if "id" in r else r["_id"])

    corpus = {rid(r): mteb_document_text(r) for r in rows(corpus_c)}
    queries = {rid(r): r["text"] for r in rows(queries_c)}
    qrels: dict[str, dict[str, int]] = {}
    for r in rows(qrels_c):
        for d in r["corpus-id"] if isinstance(r["corpus-id"], list) else [r["corpus-id"]]:
            qrels.setdefault(str(r["query-id"]), {})[str(d)] = int(r.get("score", 1))
    top = pick("top_ranked") if kind == "reranking" else None
    top_ranked = {str(r["query-id"]): [str(d) for d in r["corpus-ids"]] for r in rows(top)} if top else None
    return retrieval_data(kind, str(folder), corpus, queries, qrels, top_ranked, reader="mteb parquet")


def load_local_copy(path: str | Path, kind: str, split: str) -> TaskData:
    """A local copy of a task: mteb's parquet layout (a folder of parquet configs), else the project's layouts
    through care.data.tasks.load_task (a BEIR folder, reranking or STS JSON Lines)."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder (a local task copy: {LOCAL_LAYOUTS})")
    if path.is_dir() and config_files(path):
        return read_parquet_copy(path, kind, split)
    if path.is_dir():  # qrels/<split>.tsv or <split>.jsonl: the only split when `split` is absent (mteb's rule)
        found = sorted(f.stem for f in (path.glob("qrels/*.tsv") if kind == "retrieval" else path.glob("*.jsonl")))
        if split not in found and len(found) == 1:
            split = found[0]
    return load_task(kind, path, split)


def load_hub_task(task):
    """Load an mteb task's data as mteb does (the hub, or the datasets cache), or say clearly why it cannot."""
    from care.evaluation.benchmarks import FORMATS, hub_reachable

    if task.data_loaded or hasattr(task, "care_data"):
        return task
    meta = task.metadata
    try:
        task.load_data()
    except (ConnectionError, OSError) as e:
        why = ("the hub is unreachable: HF_HUB_OFFLINE=1 (or HF_DATASETS_OFFLINE=1) is set"
               if not hub_reachable() else f"the hub could not be reached ({type(e).__name__}: {e})")
        kind = DATA_TYPES.get(meta.type)
        layouts = LOCAL_LAYOUTS if kind is None else f"{LOCAL_LAYOUTS}; here {FORMATS[kind]}"
        raise FileNotFoundError(
            f"mteb task {meta.name}: its data ({meta.dataset.get('path')} on the Hugging Face hub) could not be "
            f"loaded and no cached copy was found: {why}.  Unset HF_HUB_OFFLINE where the hub is reachable, or "
            f"pass a local copy: tasks={meta.name}=<path>, in {layouts}") from None
    return task


def task_data(task) -> TaskData:
    """The data of an mteb task as the project's TaskData: a local task's own; an mteb task's (loaded first,
    load_hub_task) converted (retrieval_data; STS pairs from its column_names)."""
    if hasattr(task, "care_data"):
        return task.care_data
    load_hub_task(task)
    meta, split = task.metadata, task.eval_splits[0]
    kind = DATA_TYPES.get(meta.type)
    if kind is None:
        raise ValueError(f"mteb task {meta.name}: a {meta.type} task has no project counterpart")
    part = task.dataset["default"][split] if "default" in task.dataset else task.dataset[split]
    path = str(meta.dataset.get("path"))
    if kind == "sts":
        first, second = task.column_names
        return TaskData("sts", path, pairs=list(zip(part[first], part[second])),
                        gold=[float(s) for s in part["score"]], counts={"reader": "mteb", "pairs": len(part)})
    corpus = {str(r["id"]): mteb_document_text(r) for r in part["corpus"]}
    queries = dict(zip(map(str, part["queries"]["id"]), part["queries"]["text"]))
    return retrieval_data(kind, path, corpus, queries, part["relevant_docs"], part["top_ranked"])


def care_spec(task):
    """The TaskSpec the project's runners score a task with: a local task's own, else default_spec."""
    if getattr(task, "care_spec", None) is not None:
        return task.care_spec
    return default_spec(task_data(task), task.metadata.name, task.eval_splits[0], task.metadata.main_score)
