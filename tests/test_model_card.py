# ruff: noqa: F811  (task_paths, imported from test_evaluate_cli, is a fixture named as a test parameter)
"""The model card (care.export.card): a tiny M3 run's final/README.md parses with huggingface_hub, names its
start and its data lineage, holds no absolute path; `evaluate.py ckpt=final` rewrites it with a model-index
equal to summary.json's numbers; a CARE record names both towers' starts."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from test_evaluate_cli import overrides, task_paths  # noqa: F401  (task_paths: a fixture)

from care.config import load_config
from care.data.io import write_json, write_jsonl
from care.encoders.registry import TRAINING_RECORD, read_record
from care.export.card import refresh_card, write_model_card
from care.export.provenance import base_models, data_lineage

pytestmark = pytest.mark.usefixtures("one_thread")

QUERIES = ["头痛发烧怎么办", "糖尿病人能吃西瓜吗", "高血压要吃什么药", "孩子咳嗽有痰"]
DOCS = ["发烧头痛可以先物理降温，多喝水", "糖尿病患者少量吃西瓜，注意血糖", "高血压常用药有氨氯地平",
        "小儿咳嗽有痰可以拍背", "胃疼吃什么药好", "失眠怎么调理", "感冒流鼻涕怎么办", "腰疼是肾的问题吗"]
ABSOLUTE = re.compile(r"(?<![\w.:/~-])/(?:tmp|home|work|root|Users|private|var|mnt|data)\b")


def pipeline_layout(data: Path, texts: Path, train: Path) -> tuple[Path, Path]:
    """The training files moved into <data_dir>/train/ with stats.json files beside them and in the sibling
    stage folders, each with the keys its stage writes (data_pipeline: import_stage, dedup/stage, build,
    mining) and build's leakage.json (copied by mine beside the training files)."""
    n = sum(1 for _ in train.open(encoding="utf-8"))
    leakage = {"rule": "...", "options": {}, "removed": {"training_pairs": 7, "examples_query_leaked": 3,
                                                       "examples_no_positive_left": 1},
               "eval_sets": {"cmed_v1 (cEpilepsyQA test)": {
                   "queries": 490, "relevant_pairs": 512, "matches_shown": [],
                   "before": {"as_query": 4, "as_text": 1, "exact": 3, "near": 2, "relevant_pairs": 2},
                   "after": {"as_query": 0, "as_text": 0, "exact": 0, "near": 0, "relevant_pairs": 0}}}}
    stages = {
        "import": {"stage": "import", "fingerprint": "f_import", "root": str(data / "shared"),
                   "outputs": {"texts": 9000, "pairs": 500, "candidate_lists": 900},
                   "sources": {"cepilepsyqa": {"path": str(data / "shared" / "cepilepsyqa")}, "kuake_qtr": {}}},
        "dedup": {"stage": "dedup", "fingerprint": "f_dedup", "input": str(data / "import" / "texts.jsonl"),
                  "roles": ["answer"], "sources": ["cepilepsyqa"], "stage_order": ["exact", "minhash", "semantic"],
                  "stages": {"exact": {"in": 4900, "out": 4811}, "minhash": {"in": 4811, "out": 4790},
                             "semantic": {"in": 4790, "out": 4702}},
                  "texts_in": 4900, "texts_out": 4702, "thresholds": {"dedup_cosine": 0.98, "source": "model"}},
        "build": {"stage": "build", "fingerprint": "f_build", "examples": n + 5, "texts": 300, "training_pairs": 80,
                  "unlabelled_texts": 1000, "rules": {"cepilepsyqa": {"kept": n + 5}},
                  "leakage_removed": leakage["removed"]},
        "train": {"stage": "mine", "fingerprint": "f_mine", "examples": n, "texts": 200,
                  "encoder": {"name": "me5_small"}, "window": {"lo": 0.91, "hi": 0.97, "source": "model"},
                  "negatives": {"per_example_mean": 6.0}, "dedup_clusters": str(data / "dedup" / "clusters.jsonl")},
    }
    for folder, stats in stages.items():
        write_json(data / folder / "stats.json", stats)
    write_json(data / "build" / "leakage.json", leakage)
    write_json(data / "train" / "leakage.json", leakage)
    moved = data / "train" / "texts.jsonl", data / "train" / "train.jsonl"
    texts.replace(moved[0])
    train.replace(moved[1])
    return moved


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared):
    """A 2-step tiny M3 run on real cEpilepsyQA files laid out as the data pipeline writes them."""
    from _training_helpers import make_training_files, train_config

    from care.training.trainer import Trainer

    root = tmp_path_factory.mktemp("card")
    texts, train = pipeline_layout(root / "data", *make_training_files(root, shared, n_questions=24, n_negs=3))
    Trainer(train_config(root, texts, train, "run", "trainer.max_steps=2", "trainer.epochs=1",
                         "trainer.checkpoint_every=100", "trainer.query_side_pools=[]")).fit()
    return {"root": root, "final": root / "run" / "final", "texts": texts, "train": train}


def test_card_of_a_trained_model_parses_and_names_its_start_and_lineage(trained):
    final = trained["final"]
    record = json.loads((final / TRAINING_RECORD).read_text(encoding="utf-8"))
    record["lineage"] = data_lineage(trained["texts"], trained["train"])
    json.dumps(record["lineage"])  # JSON-able: stored in care_training.json
    assert record["lineage"]["pipeline"] and record["lineage"]["stages"]["dedup"]["after"] == \
        {"exact": 4811, "minhash": 4790, "semantic": 4702}
    path = write_model_card(final, record)
    assert path == final / "README.md"
    card = ModelCard.load(path)
    assert card.data.base_model == "tiny-m3"  # a local start: the folder's name
    assert card.data.library_name == "sentence-transformers" and card.data.language == ["zh"]
    assert card.data.pipeline_tag == "sentence-similarity" and "bge-m3" in card.data.tags
    assert card.data.eval_results is None and "datasets" not in card.data.to_dict()  # no hub dataset ids
    text = path.read_text(encoding="utf-8")
    assert text.startswith("---\n") and "\nmodel-index:" not in text
    assert not ABSOLUTE.search(text), ABSOLUTE.search(text)
    for expected in ("`f_import`", "`f_dedup`", "`f_build`", "`f_mine`", "exact 4,811 -> minhash 4,790 -> semantic 4,702",
                     "removed 7 training pairs", "| cmed_v1 (cEpilepsyQA test) | 490 | 4 | 1 | 2 | 0 |",
                     'BGEM3FlagModel("run/final", pooling_method="cls"', "encode_query", "encode_document",
                     "python evaluate.py ckpt=outputs/train/run/final", "| `trainer.max_steps` | `2` |",
                     "2402.03216", "- sentence-transformers: ", "- care-medical: "):
        assert expected in text, expected
    # the same files without the pipeline's stats: a lineage that says so
    own = trained["root"] / "own"
    own.mkdir()
    write_jsonl(own / "texts.jsonl", [{"id": "a", "text": "头痛"}])
    write_jsonl(own / "train.jsonl", [{"query_id": "a", "pos_ids": ["a"]}])
    lineage = data_lineage(own / "texts.jsonl", own / "train.jsonl")
    assert lineage["pipeline"] is False and lineage["training_examples"] == 1 and "not written by" in lineage["note"]


def test_evaluate_ckpt_writes_model_index_equal_to_summary(trained, task_paths, tmp_path):
    from evaluate import evaluate

    final = trained["final"]
    cfg = load_config("evaluate", [f"ckpt={final}", "baselines=[bm25]", "gain_over=bm25",
                                   *overrides(task_paths, tmp_path)])
    result = evaluate(cfg)
    assert result["cards"] == [str(final / "README.md")]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text(encoding="utf-8"))
    row = next(r for r in summary["models"] if r["name"] == "run/final")
    tasks = {(b["name"], k) for b in summary["benchmarks"] for k in b["tasks"]}
    expected = {}
    for col in summary["columns"]:
        bench, task, *metric = col["key"].split("/")
        if (bench, task) in tasks:
            primary = next(b for b in summary["benchmarks"] if b["name"] == bench)["tasks"][task]["primary"]
            expected[(f"{bench}-{task}", metric[0] if metric else primary)] = row["scores"][col["key"]]
    assert len(expected) == 8  # five CMedTEB slots + cmedqa2's three metrics

    card = ModelCard.load(final / "README.md")
    got = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert got == expected  # exactly as stored, no rounding
    names = {r.dataset_name for r in card.data.eval_results}
    assert "cmedqa2_retrieval open stand-in: cmedqa2" in names and "cmedteb local copy: CMed v1" in names
    assert not any("C-MTEB" in r.dataset_type or "CMedQA" in r.dataset_type for r in card.data.eval_results)
    text = (final / "README.md").read_text(encoding="utf-8")
    assert "gain over BM25" in text and "95% interval of that gain" in text and "Query ms p50" in text
    assert f"| **{row['label']}** | {row['scores']['cmedteb/cmed_v1']:,.2f} |" in text
    assert card.data.base_model == "tiny-m3" and not ABSOLUTE.search(text)
    # the trainer stored the lineage in the record: the card shows it without reading outputs/ again
    assert "`f_dedup`" in text and "The training run stored no lineage" not in text
    assert read_record(final)["lineage"]["pipeline"]


def test_care_record_names_both_base_models_and_baselines_are_never_written(tmp_path):
    # CARE's stage II query tower starts from stage I's, whose record names the real start
    run = tmp_path / "care-run"
    stage1 = run / "stage1" / "final"
    (stage1 / "query").mkdir(parents=True)
    write_json(stage1 / TRAINING_RECORD, {"config": {"model": {
        "kind": "care", "query": {"path": "Alibaba-NLP/gte-multilingual-base"},
        "document": {"path": "Qwen/Qwen3-Embedding-4B"}}}})
    local_doc = tmp_path / "models" / "Qwen3-Embedding-4B"
    local_doc.mkdir(parents=True)
    model = {"name": "care_0.3b_4b", "kind": "care", "current_stage": "stage2",
             "query": {"path": str(stage1 / "query"), "pooling": "cls"},
             "document": {"path": str(local_doc), "pooling": "last_token"}}
    assert base_models(model) == ["Alibaba-NLP/gte-multilingual-base", "Qwen3-Embedding-4B"]
    assert base_models({**model, "document": {**model["document"], "hub_id": "Qwen/Qwen3-Embedding-4B"}}) == \
        ["Alibaba-NLP/gte-multilingual-base", "Qwen/Qwen3-Embedding-4B"]
    assert base_models({"kind": "dense", "path": str(local_doc), "hub_id": "intfloat/multilingual-e5-small"}) == \
        ["intfloat/multilingual-e5-small"]
    record = {"config_hash": "abc", "steps": 3, "stop_reason": "completed", "weights": "last", "merge": None,
              "data": {"examples": 12, "group_size": 4}, "validation": None,
              "model": {**model, "query": {**model["query"], "path": str(run / "stage2" / "final" / "query")},
                        "document": {**model["document"], "path": str(run / "stage2" / "final" / "document")}},
              "config": {"model": model, "trainer": {"lr": 1e-4}, "output_dir": str(run / "stage2")},
              "stages": {"stage1": str(stage1), "stage2": str(run / "stage2" / "final")}}
    final = run / "final"
    final.mkdir()
    card = ModelCard.load(write_model_card(final, record))
    assert card.data.base_model == ["Alibaba-NLP/gte-multilingual-base", "Qwen3-Embedding-4B"]
    assert "care" in card.data.tags
    text = (final / "README.md").read_text(encoding="utf-8")
    assert "2604.10937" in text and "2402.03216" not in text and "No data lineage was recorded" in text
    assert not ABSOLUTE.search(text), ABSOLUTE.search(text)
    # a folder with sentence-transformers module files (care.encoders.st_folder) loads with a bare SentenceTransformer
    (final / "modules.json").write_text("[]", encoding="utf-8")
    text = write_model_card(final, record).read_text(encoding="utf-8")
    assert 'model = SentenceTransformer("care-run/final")' in text and "a Router sends queries" in text
    # a folder without care_training.json (a baseline's model, the hub cache) is never written
    assert refresh_card(local_doc, {"models": []}, "x") is None and not (local_doc / "README.md").exists()
