"""evaluate.py end to end on tiny models and small task files: the CLI, the cached re-run, `ckpt=` folders of
several checkpoints side by side, efficiency columns, and the errors a user sees for bad checkpoints."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from safetensors import safe_open

from care.config import load_config
from care.data.io import write_jsonl
from care.paths import PROJECT_ROOT

QUERIES = ["头痛发烧怎么办", "糖尿病人能吃西瓜吗", "高血压要吃什么药", "孩子咳嗽有痰"]
DOCS = ["发烧头痛可以先物理降温，多喝水", "糖尿病患者少量吃西瓜，注意血糖", "高血压常用药有氨氯地平",
        "小儿咳嗽有痰可以拍背", "胃疼吃什么药好", "失眠怎么调理", "感冒流鼻涕怎么办", "腰疼是肾的问题吗"]


@pytest.fixture(scope="module")
def task_paths(tmp_path_factory):
    """One small file or folder per CMedTEB slot (the user's-own-copy layouts) and a cMedQA2-style BEIR folder."""
    tmp = tmp_path_factory.mktemp("cmedteb_copy")
    beir = tmp / "retrieval"
    write_jsonl(beir / "corpus.jsonl", ({"_id": f"d{i}", "text": t} for i, t in enumerate(DOCS)))
    write_jsonl(beir / "queries.jsonl", ({"_id": f"q{i}", "text": t} for i, t in enumerate(QUERIES)))
    (beir / "qrels").mkdir()
    (beir / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t{2 if i % 2 else 1}\n" for i in range(4)), encoding="utf-8")
    rerank = tmp / "rerank.jsonl"
    write_jsonl(rerank, ({"query": q, "positive": [DOCS[i]], "negative": DOCS[4:6] + DOCS[(i + 1) % 4:(i + 1) % 4 + 1]}
                         for i, q in enumerate(QUERIES)))
    sts = tmp / "sts.jsonl"
    write_jsonl(sts, ({"sentence1": q, "sentence2": d, "score": s}
                      for q, d, s in zip(QUERIES + QUERIES, DOCS[:4] + DOCS[4:], [2, 2, 1, 2, 0, 0, 1, 0])))
    return {"beir": beir, "rerank": rerank, "sts": sts}


def overrides(paths, tmp_path, *extra: str, cmedqa2: bool = True) -> list[str]:
    """benchmark=cmedteb with every slot pointed at the small files (a user's own copy), and the cMedQA2
    extra benchmark at the BEIR folder (or dropped)."""
    extra_benchmark = [f"extra_benchmark.tasks.cmedqa2.path={paths['beir']}",
                       "extra_benchmark.tasks.cmedqa2.metrics=[success_10,mrr_10,acc_4]"] if cmedqa2 else \
        ["~benchmark@extra_benchmark"]
    return ["benchmark=cmedteb", f"benchmark.tasks.cmed_v1.path={paths['rerank']}",
            f"benchmark.tasks.cmed_v2.path={paths['rerank']}", f"benchmark.tasks.retrieval.path={paths['beir']}",
            f"benchmark.tasks.rerank.path={paths['rerank']}", f"benchmark.tasks.sts.path={paths['sts']}",
            *extra_benchmark, f"out_dir={tmp_path / 'eval'}", f"cache.dir={tmp_path / 'cache'}",
            "efficiency.queries=3", "efficiency.docs=8", *extra]


def test_cli_prints_the_table_and_a_rerun_encodes_nothing(task_paths, tiny_bert_dir, tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "CARE_OUTPUTS": str(tmp_path / "outputs")}
    cmd = [sys.executable, "evaluate.py", "model=tiny_bert", f"model.path={tiny_bert_dir}", "baselines=[bm25]",
           *overrides(task_paths, tmp_path)]
    first = subprocess.run(cmd, check=False, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path / "eval"
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["models"]] == ["tiny_bert", "bm25"]
    assert "| tiny BERT (random init, bert-base-chinese vocab) |" in first.stdout and "| BM25 (bm25s + jieba) |" in first.stdout
    assert "CMedTEB Avg" in first.stdout and "cmedqa2 Acc@4 (stand-in)" in first.stdout  # the extra stays a stand-in
    assert "CMed v1 MAP@10 |" in first.stdout  # a user's own copy is not labelled a stand-in
    for row in summary["models"]:
        slots = [row["scores"][f"cmedteb/{k}"] for k in ("cmed_v1", "cmed_v2", "retrieval", "rerank", "sts")]
        assert row["scores"]["cmedteb/avg"] == pytest.approx(sum(slots) / 5)
        assert row["efficiency"]["docs_per_second"] > 0 and row["efficiency"]["query_latency_ms_p95"] >= \
            row["efficiency"]["query_latency_ms_p50"] > 0
    tiny_row, bm25_row = summary["models"]
    with safe_open(tiny_bert_dir / "model.safetensors", "np") as weights:  # every weight runs at query time
        assert tiny_row["efficiency"]["online_parameters"] == sum(weights.get_tensor(k).size for k in weights.keys())  # noqa: SIM118 (no __iter__)
        lookup = weights.get_tensor("embeddings.word_embeddings.weight").size  # the token matrix: no compute
        assert tiny_row["efficiency"]["online_parameters_without_embeddings"] == \
            tiny_row["efficiency"]["online_parameters"] - lookup
    assert bm25_row["efficiency"]["online_parameters"] == 0
    task = json.loads((out / "tiny_bert" / "cmedteb" / "retrieval.json").read_text())
    assert task["value"] == pytest.approx(100 * task["scores"]["dense"]["ndcg_cut_10"])
    assert (out / "summary.md").read_text().startswith("# Evaluation") and (out / "slots.png").stat().st_size > 1000
    assert summary["settings"]["embeddings_encoded"] > 0

    # the same run again (in-process: no second interpreter start) encodes nothing and scores the same
    from evaluate import evaluate

    again = evaluate(load_config("evaluate", cmd[2:]))
    assert again["settings"]["embeddings_encoded"] == 0 and again["settings"]["embeddings_from_cache"] > 0
    assert again["rows"][0]["scores"] == summary["models"][0]["scores"]


def test_ckpt_folder_scores_each_checkpoint_side_by_side(task_paths, tiny_bert_dir, tmp_path):
    import shutil

    from care.models.m3 import tiny_m3
    from evaluate import evaluate

    ckpts = tmp_path / "run"
    shutil.copytree(tiny_bert_dir, ckpts / "a_dense")
    tiny_m3().save(ckpts / "b_m3")
    (ckpts / "logs").mkdir()  # not a checkpoint: ignored
    cfg = load_config("evaluate", overrides(task_paths, tmp_path, f"ckpt={ckpts}", "baselines=[]",
                                            "efficiency.enabled=false", cmedqa2=False))
    result = evaluate(cfg)
    assert [r["name"] for r in result["rows"]] == ["run/a_dense", "run/b_m3"]
    m3 = json.loads((tmp_path / "eval" / "run_b_m3" / "cmedteb" / "rerank.json").read_text())
    assert set(m3["scores"]) == {"dense", "sparse", "colbert", "hybrid"}
    dense = json.loads((tmp_path / "eval" / "run_a_dense" / "cmedteb" / "rerank.json").read_text())
    assert set(dense["scores"]) == {"dense"}
    assert "| run/a_dense |" in result["table"] and "| run/b_m3 |" in result["table"]


def test_a_row_that_holds_its_runs_starting_weights_is_named_in_a_warning(tmp_path, caplog):
    from care.evaluation.entries import checkpoint_models

    run = tmp_path / "run"
    for folder, weights, steps in (("final", "best (step 0)", 20), ("best", "best (step 40)", 60),
                                   ("tuned", "best (step 0)", 0)):  # 0 steps: nothing was trained to lose
        (run / folder).mkdir(parents=True)
        record = {"model": {"name": "tiny", "kind": "dense"}, "weights": weights, "steps": steps}
        (run / folder / "care_training.json").write_text(json.dumps(record), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="care.evaluation.entries"):
        rows = checkpoint_models(str(run), {"kind": "dense"})
        alone = checkpoint_models(str(run / "final"), {"kind": "dense"})  # the folder itself as ckpt=
    assert [name for name, _ in rows] == ["run/best", "run/final", "run/tuned"] and alone[0][0] == "run/final"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all(m.startswith("row run/final: ") and "after 20 steps" in m for m in said), said


def test_a_folder_that_is_not_a_model_is_refused(task_paths, tmp_path):
    from care.evaluation.entries import checkpoint_models

    resume = tmp_path / "step-0000010"
    resume.mkdir()
    (resume / "state.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="not a model checkpoint.*state.pt"):
        checkpoint_models(str(resume), {"kind": "dense"})
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        checkpoint_models(str(tmp_path / "nope"), {"kind": "dense"})
    runs = tmp_path / "train"  # outputs/train: the folder of runs, one level too high
    (runs / "run_a" / "final").mkdir(parents=True)
    with pytest.raises(ValueError, match=f"holds training runs \\(run_a\\): pass one of them, ckpt={runs}/run_a"):
        checkpoint_models(str(runs), {"kind": "dense"})
    # a folder with config.json but no weights: the loader's own error names the folder
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    from evaluate import evaluate

    cfg = load_config("evaluate", overrides(task_paths, tmp_path, f"ckpt={broken}", "baselines=[]", cmedqa2=False))
    with pytest.raises(Exception, match="broken"):
        evaluate(cfg)


def test_cli_reports_missing_benchmark_data_without_a_traceback(tmp_path, tiny_bert_dir):
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "evaluate.py", "model=tiny_bert", f"model.path={tiny_bert_dir}",
                          "benchmark=cmedteb", "~benchmark@extra_benchmark", "baselines=[]", f"out_dir={tmp_path}"],
                         check=False, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert "error: benchmark cmedteb: no data for 5 task(s)" in run.stderr and "Traceback" not in run.stderr


def test_truncate_dim_cuts_the_models_under_test_not_the_baselines():
    """evaluate.py truncate_dim=D: the model under test becomes its own D-d row (a separate cache entry), the
    zero-shot baseline of the same folder stays whole and stays a row of its own; CARE is refused."""
    from omegaconf import OmegaConf

    import evaluate

    cfg = OmegaConf.to_container(load_config("evaluate", ["truncate_dim=128", "baselines=[me5_small]"]), resolve=True)
    rows = evaluate.model_entries(cfg)
    assert [(r["name"], r["model"].get("truncate_dim")) for r in rows] == [("me5_small@128d", 128), ("me5_small", None)]
    care = OmegaConf.to_container(load_config("evaluate", ["truncate_dim=64", "model=care_tiny", "baselines=[]"]),
                                  resolve=True)
    with pytest.raises(ValueError, match="already cut to its query tower's width"):
        evaluate.model_entries(care)


def test_a_trained_care_checkpoint_is_not_taken_for_its_untrained_baseline(tmp_path):
    """A CARE model has no top-level path: its towers' folders, not its kind and prompts, decide whether the
    model under test is the baseline itself (one row) or a row of its own (the untrained cut of the table)."""
    from omegaconf import OmegaConf

    import evaluate

    cfg = OmegaConf.to_container(load_config("evaluate", ["model=care_tiny", "baselines=[care_tiny]"]), resolve=True)
    assert [r["label"] for r in evaluate.model_entries(cfg)] == [f"{cfg['model']['label']} [zero-shot baseline]"]
    trained = {**cfg["model"], "query": {**cfg["model"]["query"], "path": str(tmp_path / "final" / "query")}}
    rows = evaluate.model_entries({**cfg, "model": trained})
    assert [r.get("baseline", False) for r in rows] == [False, True]
