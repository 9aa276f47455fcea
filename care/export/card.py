"""The model card: a README.md the Hugging Face hub renders, for every model folder a training run writes.

    write_model_card(folder, record, evaluation)   folder/README.md from its training record (care_training.json)
    refresh_card(folder, summary, row_name)        the same with evaluate.py's summary.json row (the table and
                                                   the front matter's model-index)
    (the generated part sits between markers; the user's text around it is kept: care.export.card_file)
    card_data(...) / card_body(...)                the front matter and the Markdown body of one card
    eval_results(summary, row_name)                the model-index entries of one summary.json row

This module assembles the card; its parts live beside it: care.export.provenance (where the model came
from: data lineage, base models, changed settings, portable paths) and care.export.card_sections (the
Markdown sections of the body).  The YAML front matter comes from huggingface_hub's ModelCardData (never a
hand-built YAML string).  A card holds no absolute local path (provenance.portable / scrub).

Choices the card makes (docs/export.md, "Model cards"):
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

import platform
from importlib import metadata
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from care.data.io import atomic_open
from care.export.card_file import compose
from care.export.card_sections import (
    citation_section,
    evaluation_section,
    lineage_section,
    load_section,
    summary_row,
    training_section,
)
from care.export.provenance import base_models, data_lineage, model_id, portable, scrub, training_record
from care.families import family_of, tower_configs

CARD = "README.md"
LICENSE_NAME = "non-commercial-research"
# summary.json task types -> (model-index task type, task name)
TASK_TYPES = {"retrieval": ("information-retrieval", "Retrieval"), "reranking": ("reranking", "Reranking"),
              "sts": ("semantic-similarity", "Semantic Similarity")}
FRAMEWORKS = ("torch", "transformers", "sentence-transformers", "huggingface_hub", "care-medical")


# ---- the model-index ------------------------------------------------------------------------------------

def dataset_name(bench: dict, task_key: str) -> str:
    """The open stand-in's own name (never the real set's): "cmedteb_open open stand-in: CMed v1"."""
    task = (bench.get("tasks") or {}).get(task_key) or {}
    kind = "open stand-in" if bench.get("open_stand_in") else "local copy"
    return f"{bench['name']} {kind}: {task.get('slot') or task_key}"


def eval_results(summary: dict, row_name: str) -> list[EvalResult]:
    """model-index entries for one row of summary.json: each task column (a slot, or a metric of a task
    without a slot) with the value exactly as summary.json stores it (0-100 scale)."""
    row = summary_row(summary, row_name)
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


def card_data(folder: Path, record: dict, evaluation: dict | None = None) -> ModelCardData:
    family = family_of(record.get("model") or {})
    bases = record.get("base_models") or base_models(_start_config(record))
    lineage = record.get("lineage") or {}
    hub_datasets = list(lineage.get("hub_datasets") or [])
    tags = ["sentence-transformers", "feature-extraction", "sentence-similarity", "medical", "chinese",
            family.tag, "care-medical"]
    license_ = record.get("license") or "other"
    results = eval_results(evaluation["summary"], evaluation["row"]) if evaluation else None
    return ModelCardData(
        language=["zh"], license=license_, license_name=LICENSE_NAME if license_ == "other" else None,
        library_name="sentence-transformers", tags=list(dict.fromkeys(tags)),
        pipeline_tag="text-ranking" if family.cross_encoder else "sentence-similarity",
        base_model=bases[0] if len(bases) == 1 else bases, datasets=hub_datasets or None,
        model_name=model_id(folder), eval_results=results)


def card_body(folder: Path, record: dict, evaluation: dict | None = None) -> str:
    name = model_id(folder)
    model = record.get("model") or {}
    family = family_of(model)
    start = _start_config(record)
    bases = record.get("base_models") or base_models(start)
    what = family.description
    lines = [f"# {name}", "",
             (f"{model.get('label') or name}: {what} for Chinese medical text, fine-tuned by the care-medical "
             f"project from {', '.join(f'`{b}`' for b in bases)} on public Chinese medical question-answer and "
             "paraphrase data. "
             + ("It scores a (query, passage) pair for reranking." if family.cross_encoder else
                "It embeds queries and documents for retrieval, reranking and semantic similarity.")),
             "", "## How to load", ""]
    lines += load_section(record, name, family, folder)
    lines += ["## Data lineage", ""] + lineage_section(record) + [""]
    lines += ["## Training", ""] + training_section(record) + [""]
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
    towers = tower_configs(start)
    for base, t in zip(bases if len(bases) == len(towers) else [bases[0]] * len(towers), towers):
        lines.append(f"- `{base}`: {t.get('license') or start.get('license') or 'see its own model card'}")
    lines += ["", "## Citation", ""] + citation_section(family, bases)
    return scrub("\n".join(portable(lines)))


TEMPLATE = "---\n{{ card_data }}\n---\n\n{{ body }}\n"


def write_model_card(folder: str | Path, record: dict, evaluation: dict | None = None) -> Path:
    """folder/README.md from the training record (care_training.json's content, with its `lineage` when the
    trainer stored one) and, when given, an evaluation {"summary": summary.json's content, "row": the row
    name}; written atomically, the user's own text around the generated part kept (care.export.card_file;
    CardKept when the README is not the project's own card).  Returns the card's path."""
    folder = Path(folder)
    if not record.get("lineage"):
        data = (record.get("config") or {}).get("data") or {}
        if data.get("texts") and data.get("examples") and Path(data["examples"]).is_file():
            # no lineage stored at training time: read it now from the files the config names, and say so
            record = {**record, "lineage": {**data_lineage(data["texts"], data["examples"]), "read_at": "card"}}
    card = ModelCard.from_template(card_data(folder, record, evaluation), template_str=TEMPLATE,
                                   body=card_body(folder, record, evaluation))
    path = folder / CARD
    existing = path.read_bytes().decode("utf-8") if path.is_file() else None  # line ends as written (CRLF kept)
    text = compose(str(card), existing, str(path))  # CardKept: a README that is not the project's own stays
    with atomic_open(path) as fh:
        fh.write(text)
    return path


def refresh_card(folder: str | Path, summary: dict, row_name: str) -> Path | None:
    """Rewrite folder/README.md with the evaluation of row `row_name` of `summary` (summary.json's
    content).  Only a folder that holds care_training.json (a model this project trained) is written;
    anything else (a baseline's folder, a hub cache) is left alone and None returned."""
    folder = Path(folder)
    record = training_record(folder)
    if record is None:
        return None
    return write_model_card(folder, record, {"summary": summary, "row": row_name})
