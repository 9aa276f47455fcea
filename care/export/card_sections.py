"""The Markdown sections of a model card's body, each a list of lines (care.export.card joins them).

    load_section(record, name, family, folder) how to load the folder: sentence-transformers, FlagEmbedding
                                               (M3's three heads), this project
    lineage_section(record)                    the data pipeline's stages, fingerprints and leakage report
    training_section(record)                   steps, validation, merge, and the settings that differ from
                                               the defaults (provenance.changed_settings)
    evaluation_section(summary, row_name)      evaluate.py's summary.json row: the table, the gain
                                               intervals, the efficiency columns, the benchmarks' sources
    citation_section(family, bases)            the BibTeX entries of the papers behind the model

summary_row(summary, name) finds a row of summary.json (card.eval_results uses it too).
"""
from __future__ import annotations

import json
from pathlib import Path

from care.data.numbers import EFFICIENCY_TITLES, efficiency_cells, fmt_number, gain_rows
from care.export.provenance import changed_settings, portable
from care.families import Family

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


# ---- evaluation -----------------------------------------------------------------------------------------

def summary_row(summary: dict, name: str) -> dict:
    row = next((r for r in summary.get("models", []) if r.get("name") == name), None)
    if row is None:
        raise ValueError(f"summary.json of run {summary.get('run')!r} has no model row {name!r} "
                         f"(rows: {', '.join(r.get('name', '?') for r in summary.get('models', []))})")
    return row


def evaluation_section(summary: dict, row_name: str) -> list[str]:
    """The evaluation table: this model, the baseline rows it was scored beside, its gain row with the
    paired-bootstrap 95% intervals, and the efficiency columns; then the benchmarks' sources."""
    row = summary_row(summary, row_name)
    cols = summary.get("columns", [])
    benches = {b["name"]: b for b in summary.get("benchmarks", [])}
    stand_in = {c["key"]: benches.get(c.get("benchmark"), {}).get("open_stand_in") for c in cols}
    rows = [row] + [r for r in summary.get("models", []) if r.get("baseline") and r is not row]
    head = ["Model"] + [c["title"] + (" (stand-in)" if stand_in[c["key"]] else "") for c in cols] \
        + EFFICIENCY_TITLES
    lines = [(f"Scored by `python evaluate.py ckpt=...` (run `{summary.get('run')}`); scores on a 0-100 scale "
             "(Pearson x 100 for STS), trec_eval conventions; table method "
             f"`{(summary.get('settings') or {}).get('table_method')}`."), ""]
    for b in summary.get("benchmarks", []):
        tag = (" (**open stand-in**, built from public data: not the real sets, not comparable with published "
               "scores)") if b.get("open_stand_in") else ""
        lines.append(f"- `{b['name']}`: {b.get('label')}{tag}")
    lines += ["", "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        cells = [("**" + r["label"] + "**") if r is row else r["label"]]
        cells += [fmt_number((r.get("scores") or {}).get(c["key"])) for c in cols]
        cells += efficiency_cells(r.get("efficiency"))
        lines.append("| " + " | ".join(cells) + " |")
    gain = row.get("gain") or {}
    ref = next((r for r in summary.get("models", []) if r.get("name") == gain.get("over")), None)
    if ref is not None:
        gain_lines = gain_rows(f"gain over {ref['label']}", row["scores"], ref["scores"], gain.get("intervals"),
                               [c["key"] for c in cols])
        lines += gain_lines
        if len(gain_lines) > 1:  # an interval row
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



# ---- how to load ----------------------------------------------------------------------------------------

ST_SNIPPET = ["```python", "from sentence_transformers import SentenceTransformer", "",
              'model = SentenceTransformer("{name}")  # this folder (or its hub id once uploaded)',
              'q = model.encode_query(["头痛发烧怎么办"])',
              'd = model.encode_document(["发烧头痛可以先物理降温，多喝水"])',
              "print(model.similarity(q, d))", "```", ""]


#: a cross-encoder's folder: raw logits from both libraries (config.json names CrossEncoder's activation)
CROSS_SNIPPET = ["**sentence-transformers** or **FlagEmbedding** (a cross-encoder: one relevance logit a pair):", "",
                 "```python", "from sentence_transformers import CrossEncoder", "from FlagEmbedding import FlagReranker",
                 "", "pairs = [[\"头痛发烧怎么办\", \"发烧头痛可以先物理降温，多喝水\"]]",
                 'print(CrossEncoder("{name}").predict(pairs))',
                 'print(FlagReranker("{name}", use_fp16=False).compute_score(pairs))', "```", ""]


def load_section(record: dict, name: str, family: Family, folder: Path | None = None) -> list[str]:
    """sentence-transformers (where the folder has its files, care.encoders.st_folder), FlagEmbedding for M3's
    heads, then this project's own loading."""
    m = record.get("model") or {}
    if family.cross_encoder:  # a sequence-classification folder (care.encoders.cross_encoder)
        return [x.replace("{name}", name) for x in CROSS_SNIPPET] + ["**This project**:", ""] + _project_snippet(name)[:4]
    if folder is not None and (folder / "modules.json").is_file():
        lines = ["**sentence-transformers** (the folder carries its modules, prompts and pooling"
                 + ("; a Router sends queries to the query tower and documents to the document tower"
                    if family.towers else "") + "):", ""]
        lines += [line.replace("{name}", name) for line in ST_SNIPPET]
    else:
        lines = ["This folder has no sentence-transformers files: load it through this project (below).", ""]
    if family.flag_embedding:
        lines += _flag_snippet(name, m.get("pooling", "cls"))
    return lines + ["**This project**:", ""] + _project_snippet(name)


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


# ---- lineage and training -------------------------------------------------------------------------------

def lineage_section(record: dict) -> list[str]:
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
                lines.append(f"| {name} | {fmt_number(v.get('queries'), 0)} | {b.get('as_query', 0)} | {b.get('as_text', 0)} "
                             f"| {b.get('relevant_pairs', 0)} | {v.get('after', 0)} |")
        sources = ((lineage.get("stages") or {}).get("import") or {}).get("sources")
        if sources:
            lines += ["", "Public sources read by the import stage (../shared/data; non-commercial research use): "
                      + ", ".join(f"`{s}`" for s in sources) + "."]
    n = data.get("examples", (lineage or {}).get("training_examples"))
    lines += ["", (f"Training examples used: {fmt_number(n, 0)} (group size {data.get('group_size')}; "
                  f"{data.get('short_of_negatives', 0)} short of negatives, {data.get('without_negatives', 0)} "
                  "without any).")]
    return lines


def _stage_result(name: str, s: dict) -> str:
    if name == "import":
        o = s.get("outputs") or {}
        return f"{fmt_number(o.get('texts'), 0)} texts, {fmt_number(o.get('pairs'), 0)} pairs, {fmt_number(o.get('candidate_lists'), 0)} candidate lists"
    if name == "dedup":
        steps = " -> ".join(f"{k} {fmt_number(v, 0)}" for k, v in (s.get("after") or {}).items())
        cos = f" (semantic cut cosine {s['semantic_cosine']})" if s.get("semantic_cosine") is not None else ""
        return f"texts in {fmt_number(s.get('texts_in'), 0)}; after {steps}{cos}"
    if name == "build":
        return (f"{fmt_number(s.get('examples'), 0)} examples, {fmt_number(s.get('training_pairs'), 0)} training pairs, "
                f"{fmt_number(s.get('texts'), 0)} texts")
    if name == "mine":
        w = s.get("window") or {}
        return (f"{fmt_number(s.get('examples'), 0)} examples, {s.get('negatives_per_example')} negatives each, window "
                f"[{w.get('lo')}, {w.get('hi')}) by `{s.get('encoder')}`")
    return ""


def training_section(record: dict) -> list[str]:
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


# ---- citations ------------------------------------------------------------------------------------------

def citation_section(family: Family, bases: list[str]) -> list[str]:
    keys = ["bge-m3"] if any("bge-m3" in b.lower() for b in bases) else []
    if family.citation and family.citation not in keys:
        keys.append(family.citation)
    if any("e5" in b.lower() for b in bases):
        keys.append("e5")
    lines = []
    for key in keys:
        title, bib = CITATIONS[key]
        lines += [f"{title}:", "", "```bibtex", bib, "```", ""]
    return lines
