"""The model card: a README.md the Hugging Face hub renders, for every model folder a training run writes.

    data_lineage(texts, examples) -> dict          the data pipeline's stats behind a pair of training files
    base_models(model_cfg) -> list[str]            the start model(s): hub ids where known, else folder names
    write_model_card(folder, record, evaluation)   folder/README.md from its training record (care_training.json)
    refresh_card(folder, summary, row_name)        the same with evaluate.py's summary.json row (the table and
                                                   the front matter's model-index)

The YAML front matter comes from huggingface_hub's ModelCardData (never a hand-built YAML string); the
body is Markdown assembled here.  A card holds no absolute local path: paths become names relative to the
project's outputs/, .cache/ or shared data folders, or the folder's own name.

Choices the card makes (README "Model cards"):
- license: `other` (license_name `non-commercial-research`), because every shared training set is for
  non-commercial research (../shared/data/README.md); the base models' own licences (a model config's
  `license` key, per tower for CARE) are listed in the body.  A record's `license` key overrides it.
- base_model: a model config's `hub_id` key where present, else its `path` when that is a hub id, else the
  start folder's name; a start that is itself a folder this project trained (a CARE stage I tower, an
  earlier run's final/) is followed back to its own start.
- datasets: the front matter lists only real hub dataset ids (a lineage's `hub_datasets`); the shared
  sources have none, so the field is left out and the body names the sources.
- model-index: one entry per task column of summary.json (a slot, or a task's metric), values exactly as
  stored there (0-100 scale), filed under the open stand-in's own name ("cmedteb_open open stand-in:
  CMed v1"), never under the real CMedTEB / C-MTEB / cMedQA2 dataset ids; mean columns (Avg) appear in
  the table only.
"""
from __future__ import annotations

import json
import platform
import re
from importlib import metadata
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from omegaconf import OmegaConf

from care.config import CONF_DIR, load_config
from care.data.io import atomic_open, file_digest
from care.encoders.registry import TRAINING_RECORD
from care.paths import PROJECT_ROOT, cache_dir, outputs_dir, shared_data

CARD = "README.md"
STAGES = ("import", "dedup", "build", "mine")
DEDUP_STEPS = ("exact", "minhash", "semantic")
LICENSE_NAME = "non-commercial-research"
KIND_TAGS = {"m3": "bge-m3", "care": "care", "dense": "dense"}
# summary.json task types -> (model-index task type, task name)
TASK_TYPES = {"retrieval": ("information-retrieval", "Retrieval"), "reranking": ("reranking", "Reranking"),
              "sts": ("semantic-similarity", "Semantic Similarity")}
ST_POOLING = {"cls": "cls", "mean": "mean", "last_token": "lasttoken"}
FRAMEWORKS = ("torch", "transformers", "sentence-transformers", "huggingface_hub", "care-medical")
# Settings never shown as "differs from the default": where files go and what the run is called (the
# data files are in the lineage section).
NOT_SETTINGS = ("output_dir", "run_name", "experiment_name", "data.dir", "data.texts", "data.examples",
                "wandb.", "hydra.", "model.build_hint", "model.thresholds.how", "overwrite")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
ABSOLUTE = re.compile(r"(?<![\w.:/~-])(?:~/|/)(?:[\w.@+-]+/)*[\w.@+-]+")

CITATIONS = {
    "bge-m3": ("BGE-M3 (the M3 heads, the self-knowledge-distillation loss this recipe sums)", """\
@misc{chen2024bgem3,
  title         = {BGE M3-Embedding: Multi-Lingual, Multi-Functionality, Multi-Granularity Text Embeddings Through Self-Knowledge Distillation},
  author        = {Jianlv Chen and Shitao Xiao and Peitian Zhang and Kun Luo and Defu Lian and Zheng Liu},
  year          = {2024},
  eprint        = {2402.03216},
  archivePrefix = {arXiv},
  primaryClass  = {cs.CL}
}"""),
    "care": ("CMedTEB and CARE (the two-tower recipe, its two stages and the CMedTEB slots)", """\
@misc{care2026,
  title         = {CMedTEB and CARE},
  note          = {ACL 2026; see arXiv:2604.10937 for the full title and author list},
  year          = {2026},
  eprint        = {2604.10937},
  archivePrefix = {arXiv}
}"""),
    "e5": ("multilingual-e5 (the start model)", """\
@article{wang2024multilingual,
  title   = {Multilingual E5 Text Embeddings: A Technical Report},
  author  = {Liang Wang and Nan Yang and Xiaolong Huang and Linjun Yang and Rangan Majumder and Furu Wei},
  journal = {arXiv preprint arXiv:2402.05672},
  year    = {2024}
}"""),
}


# ---- paths ----------------------------------------------------------------------------------------------

def portable(value):
    """`value` (nested dicts and lists too) with every absolute local path made relative: under the
    project's outputs/, .cache/ or shared data folder it is named from there, elsewhere by its last part."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    if isinstance(value, str) and value.startswith(("/", "~/")) and "\n" not in value and " " not in value:
        return _relative(value)
    return value


def _relative(path: str) -> str:
    p = Path(path).expanduser()
    for root, label in ((outputs_dir(), "outputs"), (cache_dir(), ".cache"), (shared_data(), "shared/data"),
                        (PROJECT_ROOT, "")):
        try:
            rel = p.resolve().relative_to(root)
        except (ValueError, OSError):
            continue
        return str(Path(label) / rel) if label else str(rel)
    return p.name or "."


def _scrub(text: str) -> str:
    """The safety net over the rendered body: any absolute path left in prose becomes relative."""
    return ABSOLUTE.sub(lambda m: _relative(m.group(0)), text)


def model_id(folder: str | Path) -> str:
    """How the card names its own folder: "<run>/final" for a training run's final/, best/ or tuned/."""
    folder = Path(folder).resolve()
    return f"{folder.parent.name}/{folder.name}" if folder.name in ("final", "best", "tuned") else folder.name


# ---- lineage --------------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _stage_stats(folder: Path) -> dict | None:
    stats = _read_json(folder / "stats.json")
    return stats if stats and stats.get("stage") in STAGES else None


def _compact_stage(name: str, s: dict, folder: Path) -> dict:
    out = {"folder": folder.name, "fingerprint": s.get("fingerprint")}
    if s.get("complete") is False:
        out["complete"] = False
    if name == "import":
        out["outputs"] = s.get("outputs")
        out["sources"] = sorted(s.get("sources") or {})
    elif name == "dedup":
        steps = s.get("stages") or {}
        out["filters"] = {"roles": s.get("roles"), "sources": s.get("sources")}
        out["texts_in"] = s.get("texts_in")
        out["after"] = {k: steps[k].get("out") for k in s.get("stage_order") or steps if k in steps}
        out["texts_out"] = s.get("texts_out")
        th = s.get("thresholds") or {}
        if th:
            out["semantic_cosine"] = th.get("dedup_cosine", th.get("cosine"))
    elif name == "build":
        out.update({k: s.get(k) for k in ("examples", "texts", "training_pairs", "unlabelled_texts")})
        out["rules"] = {r: v.get("kept") for r, v in (s.get("rules") or {}).items()}
        out["leakage_removed"] = s.get("leakage_removed")
    elif name == "mine":
        out.update({k: s.get(k) for k in ("examples", "texts", "similarity", "examples_with_fallback")})
        enc, window = s.get("encoder") or {}, s.get("window") or {}
        out["encoder"] = enc.get("name")
        out["window"] = {k: window.get(k) for k in ("lo", "hi", "source") if k in window}
        out["negatives_per_example"] = (s.get("negatives") or {}).get("per_example_mean")
        out["dedup_texts_removed"] = s.get("dedup_texts_removed")
    return portable(out)


def _compact_leakage(report: dict) -> dict:
    sets = {}
    for name, v in (report.get("eval_sets") or {}).items():
        before, after = v.get("before") or {}, v.get("after") or {}
        sets[name] = {"queries": v.get("queries"),
                      "before": {k: before.get(k, 0) for k in ("as_query", "as_text", "relevant_pairs")},
                      "after": sum(after.values())}
    return {"eval_sets": sets, "removed": report.get("removed") or {}}


def _lines(path: Path) -> int | None:
    try:
        with open(path, "rb") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return None


def data_lineage(texts_path: str | Path, examples_path: str | Path) -> dict:
    """What the training files came from: the stats.json of each `python -m data_pipeline` stage found
    beside them (the stage that wrote them, and its sibling stage folders under the same out_root:
    import/, dedup/, build/, train/), compacted to fingerprints and counts, plus the build stage's leakage
    report.  Files of your own, with no stage stats beside them, give {"pipeline": False, "note": ...}.
    JSON-able; stored by the trainer in care_training.json under "lineage"."""
    texts, examples = Path(texts_path), Path(examples_path)
    files = {"texts": _relative(str(texts.resolve())), "examples": _relative(str(examples.resolve()))}
    for key, path in (("texts", texts), ("examples", examples)):
        if path.is_file():
            files[f"{key}_digest"] = file_digest(path)
    n_examples = _lines(examples)
    own = _stage_stats(examples.parent)
    if own is None:
        return {"pipeline": False, "training_files": files, "training_examples": n_examples,
                "note": "training files not written by `python -m data_pipeline` (no stage stats.json beside "
                        "them): no pipeline lineage"}
    found: dict[str, tuple[Path, dict]] = {own["stage"]: (examples.parent, own)}
    root = examples.parent.parent
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and p != examples.parent):
        s = _stage_stats(sub)
        if s is not None and s["stage"] not in found:
            found[s["stage"]] = (sub, s)
    stages = {name: _compact_stage(name, found[name][1], found[name][0]) for name in STAGES if name in found}
    leakage = None
    for name in (own["stage"], "build"):  # mine copies build's leakage.json beside the training files
        if name in found and (report := _read_json(found[name][0] / "leakage.json")) and report.get("eval_sets"):
            leakage = _compact_leakage(report)
            break
    lineage = {"pipeline": True, "training_files": files, "written_by": own["stage"], "stages": stages,
               "leakage": leakage, "training_examples": n_examples}
    missing = [s for s in STAGES if s not in found and STAGES.index(s) < STAGES.index(own["stage"])]
    if missing:
        lineage["note"] = f"no stats.json found for the earlier stage(s) {', '.join(missing)} under {root.name}/"
    if own.get("examples") is not None and n_examples is not None and own["examples"] != n_examples:
        lineage["note"] = (f"{examples.name} has {n_examples} examples but its stage's stats.json says "
                           f"{own['examples']}: the file was changed after the pipeline wrote it")
    return lineage


# ---- base models ----------------------------------------------------------------------------------------

def _is_hub_id(path: str) -> bool:
    return bool(path) and path[0] not in "/.~" and not Path(path).exists() and bool(HUB_ID.match(path))


def _read_record(folder: Path) -> dict | None:
    return _read_json(folder / TRAINING_RECORD) if folder.is_dir() else None


def _base_of(c: dict, depth: int = 0) -> str:
    if c.get("hub_id"):
        return str(c["hub_id"])
    path = str(c.get("path") or "")
    if not path:
        return str(c.get("name") or "unknown")
    if _is_hub_id(path):
        return path
    folder = Path(path).expanduser()
    if depth < 4:  # a folder this project trained: its own start (CARE stage II's query tower is stage I's)
        record, part = _read_record(folder), None
        if record is None and folder.name in ("query", "document"):
            record, part = _read_record(folder.parent), folder.name
        start = ((record or {}).get("config") or {}).get("model") or {}
        if part:
            start = start.get(part) or {}
        elif start.get("kind") == "care":
            start = {}  # a whole CARE model as a one-backbone start: name the folder itself
        if start and Path(str(start.get("path", ""))).expanduser().resolve() != folder.resolve():
            return _base_of(start, depth + 1)
    return folder.name or path


def base_models(model_cfg: dict) -> list[str]:
    """The start model(s) of a model config (the training config's `model`): one for M3 / dense, the query
    and the document tower's for CARE, each as `_base_of` names it (hub_id, a hub path, else the folder's
    name)."""
    if model_cfg.get("kind") == "care" or ("query" in model_cfg and "document" in model_cfg):
        names = [_base_of(model_cfg.get("query") or {}), _base_of(model_cfg.get("document") or {})]
    else:
        names = [_base_of(model_cfg)]
    return list(dict.fromkeys(names))


# ---- settings -------------------------------------------------------------------------------------------

def _flatten(d, prefix: str = "") -> dict:
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v:
                out.update(_flatten(v, key + "."))
            else:
                out[key] = v
    return out


def _defaults(config: dict) -> dict:
    """The resolved conf/train.yaml with the run's model config file, as `python train.py model=NAME` gives."""
    name = (config.get("model") or {}).get("name")
    overrides = [f"model={name}"] if name and (CONF_DIR / "model" / f"{name}.yaml").is_file() else []
    try:
        return OmegaConf.to_container(load_config("train", overrides), resolve=True)
    except Exception:  # noqa: BLE001 (a config the current conf/ no longer composes: no comparison)
        return {}


def changed_settings(config: dict) -> list[tuple[str, object, object]]:
    """(key, this run's value, the default) for every setting of the run that differs from the default
    composition of conf/train.yaml with its model (paths made portable; file locations left out)."""
    if not config:
        return []
    ours, base = _flatten(portable(config)), _flatten(portable(_defaults(config)))
    missing = object()
    rows = []
    for key, value in ours.items():
        if any(key == n or key.startswith(n if n.endswith(".") else n + ".") for n in NOT_SETTINGS):
            continue
        default = base.get(key, missing)
        if default is missing:
            rows.append((key, value, "(not set)"))
        elif default != value:
            rows.append((key, value, default))
    return rows


# ---- evaluation -----------------------------------------------------------------------------------------

def _row(summary: dict, name: str) -> dict:
    row = next((r for r in summary.get("models", []) if r.get("name") == name), None)
    if row is None:
        raise ValueError(f"summary.json of run {summary.get('run')!r} has no model row {name!r} "
                         f"(rows: {', '.join(r.get('name', '?') for r in summary.get('models', []))})")
    return row


def dataset_name(bench: dict, task_key: str) -> str:
    """The open stand-in's own name (never the real set's): "cmedteb_open open stand-in: CMed v1"."""
    task = (bench.get("tasks") or {}).get(task_key) or {}
    kind = "open stand-in" if bench.get("open_stand_in") else "local copy"
    return f"{bench['name']} {kind}: {task.get('slot') or task_key}"


def eval_results(summary: dict, row_name: str) -> list[EvalResult]:
    """model-index entries for one row of summary.json: each task column (a slot, or a metric of a task
    without a slot) with the value exactly as summary.json stores it (0-100 scale)."""
    row = _row(summary, row_name)
    benches = {b["name"]: b for b in summary.get("benchmarks", [])}
    results = []
    for col in summary.get("columns", []):
        value = row.get("scores", {}).get(col["key"])
        bench = benches.get(col.get("benchmark"))
        parts = col["key"].split("/")
        if value is None or bench is None or len(parts) < 2:
            continue
        task = (bench.get("tasks") or {}).get(parts[1])
        if task is None:  # a mean column (Avg): the table shows it
            continue
        task_type, task_name = TASK_TYPES.get(task.get("type"), (task.get("type") or "other", None))
        results.append(EvalResult(
            task_type=task_type, task_name=task_name, dataset_type=f"{bench['name']}-{parts[1]}",
            dataset_name=dataset_name(bench, parts[1]), dataset_config=parts[1],
            metric_type=parts[2] if len(parts) > 2 else task["primary"], metric_name=col.get("title"),
            metric_value=value))
    return results


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}" if digits else f"{value:,.0f}"


def _interval(iv: dict | None) -> str:
    if not iv:
        return ""
    mark = "*" if iv["low"] > 0 or iv["high"] < 0 else ""
    return f"[{iv['low']:+.2f}, {iv['high']:+.2f}]{mark}"


EFFICIENCY = [("online_parameters", "Online params (M)", 1e-6, 1),
              ("online_parameters_without_embeddings", "w/o token embeddings (M)", 1e-6, 1),
              ("query_latency_ms_p50", "Query ms p50", 1, 1), ("query_latency_ms_p95", "Query ms p95", 1, 1),
              ("docs_per_second", "Docs/s", 1, 0)]


def evaluation_section(summary: dict, row_name: str) -> list[str]:
    """The evaluation table: this model, the baseline rows it was scored beside, its gain row with the
    paired-bootstrap 95% intervals, and the efficiency columns; then the benchmarks' sources."""
    row = _row(summary, row_name)
    cols = summary.get("columns", [])
    benches = {b["name"]: b for b in summary.get("benchmarks", [])}
    stand_in = {c["key"]: benches.get(c.get("benchmark"), {}).get("open_stand_in") for c in cols}
    rows = [row] + [r for r in summary.get("models", []) if r.get("baseline") and r is not row]
    head = ["Model"] + [c["title"] + (" (stand-in)" if stand_in[c["key"]] else "") for c in cols] \
        + [t for _, t, _, _ in EFFICIENCY]
    lines = [(f"Scored by `python evaluate.py ckpt=...` (run `{summary.get('run')}`); scores on a 0-100 scale "
             "(Pearson x 100 for STS), trec_eval conventions; table method "
             f"`{(summary.get('settings') or {}).get('table_method')}`."), ""]
    for b in summary.get("benchmarks", []):
        tag = (" (**open stand-in**, built from public data: not the real sets, not comparable with published "
               "scores)") if b.get("open_stand_in") else ""
        lines.append(f"- `{b['name']}`: {b.get('label')}{tag}")
    lines += ["", "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        eff = r.get("efficiency") or {}
        cells = [("**" + r["label"] + "**") if r is row else r["label"]]
        cells += [_fmt((r.get("scores") or {}).get(c["key"])) for c in cols]
        cells += [_fmt(eff[k] * scale if eff.get(k) is not None else None, d) for k, _, scale, d in EFFICIENCY]
        lines.append("| " + " | ".join(cells) + " |")
    gain = row.get("gain") or {}
    ref = next((r for r in summary.get("models", []) if r.get("name") == gain.get("over")), None)
    if ref is not None:
        cells = [f"gain over {ref['label']}"]
        for c in cols:
            a, b = row["scores"].get(c["key"]), ref["scores"].get(c["key"])
            cells.append("n/a" if a is None or b is None else f"{a - b:+.2f}")
        lines.append("| " + " | ".join(cells + [""] * len(EFFICIENCY)) + " |")
        intervals = gain.get("intervals") or {}
        if any(intervals.values()):
            cells = ["95% interval of that gain"] + [_interval(intervals.get(c["key"])) for c in cols]
            lines.append("| " + " | ".join(cells + [""] * len(EFFICIENCY)) + " |")
            lines += ["", ("Gain intervals: paired bootstrap over the task's queries (STS: its pairs); * = the "
                          "interval excludes 0.  A training run's seed adds noise of its own.")]
    lines.append("")
    for b in summary.get("benchmarks", []):
        lines.append(f"Sources of `{b['name']}`" + (" (open stand-in)" if b.get("open_stand_in") else "") + ":")
        for key, t in (b.get("tasks") or {}).items():
            lines.append(f"- {t.get('slot') or key}: {t.get('source') or portable(t.get('path'))}")
        lines.append("")
    s = summary.get("settings") or {}
    lines.append("Efficiency: online parameters = the weights a query passes through; latency = one query at "
                 f"a time (batch 1) on the evaluating machine ({s.get('cpus')} CPUs, 1-minute load average "
                 f"{s.get('load_average_1m')}), so compare rows of one run only.")
    return lines


# ---- the card -------------------------------------------------------------------------------------------

def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in FRAMEWORKS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _start_config(record: dict) -> dict:
    return (record.get("config") or {}).get("model") or record.get("model") or {}


def _tower(c: dict, key: str) -> dict:
    return c.get(key) or {}


ST_SNIPPET = ["```python", "from sentence_transformers import SentenceTransformer", "",
              'model = SentenceTransformer("{name}")  # this folder (or its hub id once uploaded)',
              'q = model.encode_query(["头痛发烧怎么办"])',
              'd = model.encode_document(["发烧头痛可以先物理降温，多喝水"])',
              "print(model.similarity(q, d))", "```", ""]


def _load_section(record: dict, name: str, kind: str, folder: Path | None = None) -> list[str]:
    m = record.get("model") or {}
    lines = []
    if folder is not None and (folder / "modules.json").is_file():  # sentence-transformers files (st_folder)
        lines += ["**sentence-transformers** (the folder carries its modules, prompts and pooling"
                  + ("; a Router sends queries to the query tower and documents to the document tower" if kind == "care"
                     else "") + "):", ""]
        lines += [line.replace("{name}", name) for line in ST_SNIPPET]
        if kind == "m3":
            lines += _flag_snippet(name, m.get("pooling", "cls"))
        return lines + ["**This project**:", ""] + _project_snippet(name)
    if kind == "care":
        q, d = _tower(m, "query"), _tower(m, "document")
        qpath, dpath = (portable(str(t.get("path", ""))) for t in (q, d))
        lines += [(f"A CARE model is two towers: the query tower `{qpath}` and the document tower `{dpath}` "
                  "(paths as the training run wrote them, relative to the project's outputs). This folder holds "
                  "the record that names them."), "",
                  ("**This project** (queries get the instruction prompt, documents none; the document vector is "
                  "cut Matryoshka-style to the query width):"), ""] + _project_snippet(name)
        for key, t, path in (("query", q, qpath), ("document", d, dpath)):
            prompt = t.get("prompt") or ""
            lines += [(f"**sentence-transformers**, the {key} tower alone (its pooling "
                      f"`{t.get('pooling')}`; prompt `{prompt!r}` with the task instruction filled in):"), "",
                      "```python", "from sentence_transformers import SentenceTransformer, models", "",
                      f'word = models.Transformer("{path}", max_seq_length={t.get("max_length", 512)})',
                      (f'pool = models.Pooling(word.get_word_embedding_dimension(), pooling_mode="'
                      f'{ST_POOLING.get(t.get("pooling"), "cls")}")'),
                      "tower = SentenceTransformer(modules=[word, pool, models.Normalize()])", "```", ""]
        return lines
    pooling = m.get("pooling", "cls")
    qp, dp = m.get("query_prefix") or "", m.get("doc_prefix") or ""
    prompts = f", prompts={{'query': {qp!r}, 'document': {dp!r}}}" if qp or dp else ""
    lines += [("**sentence-transformers** (the folder holds no sentence-transformers module files, so name the "
              f"pooling: a bare `SentenceTransformer(path)` would mean-pool; this model pools `{pooling}`):"), "",
              "```python", "from sentence_transformers import SentenceTransformer, models", "",
              f'path = "{name}"  # this folder (or its hub id once uploaded)',
              f"word = models.Transformer(path, max_seq_length={m.get('max_length', 512)})",
              f'pool = models.Pooling(word.get_word_embedding_dimension(), pooling_mode="{ST_POOLING.get(pooling, "cls")}")',
              f"model = SentenceTransformer(modules=[word, pool, models.Normalize()]{prompts})",
              'q = model.encode_query(["头痛发烧怎么办"])',
              'd = model.encode_document(["发烧头痛可以先物理降温，多喝水"])',
              "print(model.similarity(q, d))", "```", ""]
    if kind == "m3":
        lines += _flag_snippet(name, pooling)
    lines += ["**This project**:", ""] + _project_snippet(name)
    return lines


def _flag_snippet(name: str, pooling: str) -> list[str]:
    return ["**FlagEmbedding** (dense, sparse and ColBERT heads: `colbert_linear.pt`, `sparse_linear.pt`):", "",
            "```python", "from FlagEmbedding import BGEM3FlagModel", "",
            f'model = BGEM3FlagModel("{name}", pooling_method="{pooling}", use_fp16=False)',
            'out = model.encode(["头痛发烧怎么办"], return_dense=True, return_sparse=True, return_colbert_vecs=True)',
            "```", ""]


def _project_snippet(name: str) -> list[str]:
    return ["```bash", f"python evaluate.py ckpt=outputs/train/{name}", "```", "",
            "```python", "from care.encoders import build_encoder", "from care.encoders.registry import detect", "",
            f'encoder = build_encoder(detect("outputs/train/{name}", {{}}))',
            'q = encoder.encode_queries(["头痛发烧怎么办"]).dense',
            'd = encoder.encode_documents(["发烧头痛可以先物理降温，多喝水"]).dense',
            "print(q @ d.T)", "```", ""]


def _lineage_section(record: dict) -> list[str]:
    lineage = record.get("lineage")
    data = record.get("data") or {}
    lines = []
    if lineage and lineage.get("read_at") == "card":
        lines.append("The training run stored no lineage: this one was read from the training files its config "
                     "names when this card was written; compare the digests if they may have changed since.")
        lines.append("")
    if not lineage:
        lines.append("No data lineage was recorded with this model (its care_training.json has no `lineage`).")
    elif not lineage.get("pipeline"):
        files = lineage.get("training_files") or {}
        lines.append(f"{lineage.get('note')}. Files: `{files.get('examples')}` (sha256/16 "
                     f"`{files.get('examples_digest')}`), `{files.get('texts')}` (`{files.get('texts_digest')}`).")
    else:
        files = lineage.get("training_files") or {}
        lines += [(f"Training files `{files.get('examples')}` (sha256/16 `{files.get('examples_digest')}`) and "
                  f"`{files.get('texts')}` (`{files.get('texts_digest')}`), written by the `{lineage.get('written_by')}` "
                  "stage of `python -m data_pipeline`:"), "",
                  "| stage | fingerprint | result |", "|---|---|---|"]
        for name, s in (lineage.get("stages") or {}).items():
            lines.append(f"| {name} | `{s.get('fingerprint')}` | {_stage_result(name, s)} |")
        if lineage.get("note"):
            lines += ["", f"Note: {lineage['note']}."]
        leak = lineage.get("leakage")
        if leak:
            removed = leak.get("removed") or {}
            lines += ["", ("Leakage rule (no evaluation query in training, exact after normalisation or a MinHash "
                          "near duplicate; no evaluation (query, relevant document) pair as a training pair): "
                          f"removed {removed.get('training_pairs', 0):,} training pairs "
                          f"({removed.get('examples_query_leaked', 0):,} examples whose query leaked, "
                          f"{removed.get('examples_no_positive_left', 0):,} left without a positive)."), "",
                      "| evaluation set | queries | leaks as query | as text | relevant pairs | after |",
                      "|---|---:|---:|---:|---:|---:|"]
            for name, v in leak["eval_sets"].items():
                b = v.get("before") or {}
                lines.append(f"| {name} | {_fmt(v.get('queries'), 0)} | {b.get('as_query', 0)} | {b.get('as_text', 0)} "
                             f"| {b.get('relevant_pairs', 0)} | {v.get('after', 0)} |")
        sources = ((lineage.get("stages") or {}).get("import") or {}).get("sources")
        if sources:
            lines += ["", "Public sources read by the import stage (../shared/data; non-commercial research use): "
                      + ", ".join(f"`{s}`" for s in sources) + "."]
    n = data.get("examples", (lineage or {}).get("training_examples"))
    lines += ["", (f"Training examples used: {_fmt(n, 0)} (group size {data.get('group_size')}; "
                  f"{data.get('short_of_negatives', 0)} short of negatives, {data.get('without_negatives', 0)} "
                  "without any).")]
    return lines


def _stage_result(name: str, s: dict) -> str:
    if name == "import":
        o = s.get("outputs") or {}
        return f"{_fmt(o.get('texts'), 0)} texts, {_fmt(o.get('pairs'), 0)} pairs, {_fmt(o.get('candidate_lists'), 0)} candidate lists"
    if name == "dedup":
        steps = " -> ".join(f"{k} {_fmt(v, 0)}" for k, v in (s.get("after") or {}).items())
        cos = f" (semantic cut cosine {s['semantic_cosine']})" if s.get("semantic_cosine") is not None else ""
        return f"texts in {_fmt(s.get('texts_in'), 0)}; after {steps}{cos}"
    if name == "build":
        return (f"{_fmt(s.get('examples'), 0)} examples, {_fmt(s.get('training_pairs'), 0)} training pairs, "
                f"{_fmt(s.get('texts'), 0)} texts")
    if name == "mine":
        w = s.get("window") or {}
        return (f"{_fmt(s.get('examples'), 0)} examples, {s.get('negatives_per_example')} negatives each, window "
                f"[{w.get('lo')}, {w.get('hi')}) by `{s.get('encoder')}`")
    return ""


def _training_section(record: dict) -> list[str]:
    v = record.get("validation") or {}
    lines = [(f"{record.get('steps')} optimizer steps (stop reason: {record.get('stop_reason')}); weights: "
             f"{record.get('weights')}; config hash `{record.get('config_hash')}`.")]
    if v:
        lines.append(f"Validation {v.get('metric')}: best {v.get('best')} at step {v.get('best_step')}.")
    if record.get("merge"):
        lines.append(f"Merged with its start (LM-Cocktail style), weight {record['merge'].get('weight')}.")
    if record.get("stages"):
        lines.append("CARE stages: " + ", ".join(f"{k} (`{portable(p)}`)" for k, p in record["stages"].items()) + ".")
    rows = changed_settings(record.get("config") or {})
    if rows:
        lines += ["", "Settings that differ from the defaults (`conf/train.yaml` with this model's config):", "",
                  "| setting | this run | default |", "|---|---|---|"]
        lines += [f"| `{k}` | `{_short(v)}` | `{_short(d)}` |" for k, v, d in rows]
    return lines


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def card_data(folder: Path, record: dict, evaluation: dict | None = None) -> ModelCardData:
    kind = (record.get("model") or {}).get("kind", "dense")
    bases = record.get("base_models") or base_models(_start_config(record))
    lineage = record.get("lineage") or {}
    hub_datasets = list(lineage.get("hub_datasets") or [])
    tags = ["sentence-transformers", "feature-extraction", "sentence-similarity", "medical", "chinese",
            KIND_TAGS.get(kind, kind), "care-medical"]
    license_ = record.get("license") or "other"
    results = eval_results(evaluation["summary"], evaluation["row"]) if evaluation else None
    return ModelCardData(
        language=["zh"], license=license_, license_name=LICENSE_NAME if license_ == "other" else None,
        library_name="sentence-transformers", pipeline_tag="sentence-similarity", tags=list(dict.fromkeys(tags)),
        base_model=bases[0] if len(bases) == 1 else bases, datasets=hub_datasets or None,
        model_name=model_id(folder), eval_results=results)


def card_body(folder: Path, record: dict, evaluation: dict | None = None) -> str:
    name = model_id(folder)
    model = record.get("model") or {}
    kind = model.get("kind", "dense")
    start = _start_config(record)
    bases = record.get("base_models") or base_models(start)
    what = {"m3": "a BGE-M3-style encoder (one backbone; dense, sparse and ColBERT heads)",
            "care": "a CARE two-tower encoder (a small query tower, a large document tower; asymmetric retrieval)",
            "dense": "a dense sentence encoder"}.get(kind, f"a `{kind}` encoder")
    lines = [f"# {name}", "",
             (f"{model.get('label') or name}: {what} for Chinese medical text, fine-tuned by the care-medical "
             f"project from {', '.join(f'`{b}`' for b in bases)} on public Chinese medical question-answer and "
             "paraphrase data. It embeds queries and documents for retrieval, reranking and semantic similarity."),
             "", "## How to load", ""]
    lines += _load_section(record, name, kind, folder)
    lines += ["## Data lineage", ""] + _lineage_section(record) + [""]
    lines += ["## Training", ""] + _training_section(record) + [""]
    lines += ["## Evaluation", ""]
    if evaluation:
        lines += evaluation_section(evaluation["summary"], evaluation["row"])
    else:
        lines.append(f"Not evaluated yet: `python evaluate.py ckpt=outputs/train/{name}` scores it and writes the "
                     "table here (and the model-index in the front matter).")
    lines += ["", "## Framework versions", ""] + [f"- {k}: {v}" for k, v in _versions().items()]
    lines += ["", "## License", "",
              ("`other` (`non-commercial-research`): every training set is for non-commercial research (see the "
              "shared data's PROVENANCE.md files). The base model licences still apply:")]
    towers = [start.get("query") or {}, start.get("document") or {}] if kind == "care" or "query" in start else [start]
    for base, t in zip(bases if len(bases) == len(towers) else [bases[0]] * len(towers), towers):
        lines.append(f"- `{base}`: {t.get('license') or start.get('license') or 'see its own model card'}")
    lines += ["", "## Citation", ""]
    for key in _citations(kind, bases):
        title, bib = CITATIONS[key]
        lines += [f"{title}:", "", "```bibtex", bib, "```", ""]
    return _scrub("\n".join(portable(lines)))


def _citations(kind: str, bases: list[str]) -> list[str]:
    keys = []
    if kind == "m3" or any("bge-m3" in b.lower() for b in bases):
        keys.append("bge-m3")
    if kind == "care":
        keys.append("care")
    if any("e5" in b.lower() for b in bases):
        keys.append("e5")
    return keys


TEMPLATE = "---\n{{ card_data }}\n---\n\n{{ body }}\n"


def write_model_card(folder: str | Path, record: dict, evaluation: dict | None = None) -> Path:
    """folder/README.md from the training record (care_training.json's content, with its `lineage` when the
    trainer stored one) and, when given, an evaluation {"summary": summary.json's content, "row": the row
    name}; written atomically.  Returns the card's path."""
    folder = Path(folder)
    if not record.get("lineage"):
        data = (record.get("config") or {}).get("data") or {}
        if data.get("texts") and data.get("examples") and Path(data["examples"]).is_file():
            # no lineage stored at training time: read it now from the files the config names, and say so
            record = {**record, "lineage": {**data_lineage(data["texts"], data["examples"]), "read_at": "card"}}
    card = ModelCard.from_template(card_data(folder, record, evaluation), template_str=TEMPLATE,
                                   body=card_body(folder, record, evaluation))
    path = folder / CARD
    with atomic_open(path) as fh:
        fh.write(str(card))
    return path


def refresh_card(folder: str | Path, summary: dict, row_name: str) -> Path | None:
    """Rewrite folder/README.md with the evaluation of row `row_name` of `summary` (summary.json's
    content).  Only a folder that holds care_training.json (a model this project trained) is written;
    anything else (a baseline's folder, a hub cache) is left alone and None returned."""
    folder = Path(folder)
    record = _read_record(folder)
    if record is None:
        return None
    return write_model_card(folder, record, {"summary": summary, "row": row_name})
