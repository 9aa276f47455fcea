"""Project benchmarks and C-MTEB tasks through mteb 2.x (care/evaluation/mteb_adapter/), offline: on small task
files in the CMedTEB slot layouts (a reranking file with graded positives, a BEIR folder with graded qrels, an
STS file), mteb.evaluate through the adapter gives evaluate.py's own numbers: map_at_10 = map_cut_10 (MAP
divided by all relevant), ndcg_at_10 = ndcg_cut_10 (graded gains), cosine_pearson = pearson and
cosine_spearman = spearman (evaluate.py's STS is the cosine, the mean of both directions; mteb's main STS score
here is cosine_pearson, CMedTEB's Pearson; C-MTEB's STS tasks use cosine_spearman).  Also: a local copy of a
C-MTEB task (mteb's parquet layout, or the project's), prompt routing, the CLI in a fresh interpreter with
HOME and every cache pointed at a temporary folder, and the plain error when the hub is off.

Scores are compared with `spread_bert` (conftest), whose cosines have no ties (tiny_bert's do: see
tests/test_nano_mteb.py).  mteb rounds its retrieval scores to 5 decimals, hence the 1e-4 tolerance.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _evaluation_helpers import Recorder
from _home_helpers import user_env

from care.config import load_config
from care.data.io import write_jsonl
from care.paths import PROJECT_ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
SLOTS = ("rerank", "retrieval", "sts")
#: (slot, mteb score, evaluate.py metric): every pair compared
PAIRS = [("rerank", "map_at_10", "map_cut_10"), ("rerank", "map_at_1000", "map_cut_1000"),
         ("rerank", "mrr_at_10", "mrr_10"), ("rerank", "ndcg_at_10", "ndcg_cut_10"),
         ("retrieval", "ndcg_at_10", "ndcg_cut_10"), ("retrieval", "map_at_10", "map_cut_10"),
         ("retrieval", "mrr_at_10", "mrr_10"), ("retrieval", "recall_at_100", "recall_100"),
         ("sts", "cosine_pearson", "pearson"), ("sts", "cosine_spearman", "spearman")]


@pytest.fixture(scope="module", autouse=True)
def mteb_cache(tmp_path_factory):
    """mteb's import-time result folder in a temporary place (as test_nano_mteb.py does), and the `datasets`
    cache too, for whatever this module's in-process runs load."""
    import datasets

    from care.evaluation.mteb_adapter import import_mteb

    folder = tmp_path_factory.mktemp("mteb-cache")
    saved_env, saved_ds = os.environ.get("MTEB_CACHE"), datasets.config.HF_DATASETS_CACHE
    os.environ["MTEB_CACHE"] = str(folder)
    datasets.config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("hf-datasets")
    import_mteb()
    yield folder
    datasets.config.HF_DATASETS_CACHE = saved_ds
    if saved_env is None:
        os.environ.pop("MTEB_CACHE")
    else:
        os.environ["MTEB_CACHE"] = saved_env


@pytest.fixture(scope="module")
def files(shared, tmp_path_factory) -> dict[str, Path]:
    """Small copies of three CMedTEB slots from the shared data: cMedIR test lists (label >= 1 a positive with
    its label as grade, 0 a negative), 15 KUAKE-QTR dev queries against their titles and 60 train titles
    (graded qrels 0-3), 60 KUAKE-QQR dev pairs (0/1/2)."""
    from _evaluation_helpers import kuake_qtr_beir

    tmp = tmp_path_factory.mktemp("slots")
    groups: dict[str, dict[str, int]] = {}
    for line in (shared / "chineseblue_cmedir" / "test.json").read_text(encoding="utf-8").splitlines()[:150]:
        r = json.loads(line)
        for d in r["documents"]:
            groups.setdefault(r["query"].strip(), {})[d["title"].lstrip(":").strip()] = int(d["label"])
    rows = []
    for query, judged in groups.items():
        pos = [t for t, g in judged.items() if g >= 1]
        neg = [t for t, g in judged.items() if g == 0]
        if pos and neg and query and all(pos + neg):
            rows.append({"query": query, "positive": pos, "positive_grades": [judged[t] for t in pos],
                         "negative": neg})
    rerank = tmp / "rerank.jsonl"
    write_jsonl(rerank, rows[:24])

    retrieval = kuake_qtr_beir(shared, tmp / "retrieval", 15, 60)[0]

    qqr = json.loads((shared / "cblue_kuake_qqr" / "KUAKE-QQR_dev.json").read_text(encoding="utf-8"))
    sts = tmp / "sts.jsonl"
    write_jsonl(sts, ({"sentence1": r["query1"], "sentence2": r["query2"], "score": int(r["label"])}
                      for r in qqr[10:70]))
    return {"rerank": rerank, "retrieval": retrieval, "sts": sts}


def overrides(files: dict, spread_bert: Path, *extra: str) -> list[str]:
    """evaluate.py benchmark=cmedteb (a user's own copy) with three slots pointed at the small files."""
    return ["model=tiny_bert", f"model.path={spread_bert}", "benchmark=cmedteb", "~benchmark.tasks.cmed_v1",
            "~benchmark.tasks.cmed_v2", f"benchmark.tasks.rerank.path={files['rerank']}",
            f"benchmark.tasks.retrieval.path={files['retrieval']}", f"benchmark.tasks.sts.path={files['sts']}",
            *extra]


@pytest.fixture(scope="module")
def evaluate_cfg(files, spread_bert, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    return load_config("evaluate", overrides(files, spread_bert, "~benchmark@extra_benchmark", "baselines=[]",
                                             f"out_dir={tmp / 'out'}", "cache.enabled=false",
                                             "efficiency.enabled=false"))


@pytest.fixture(scope="module")
def ours(evaluate_cfg) -> dict[str, dict[str, float]]:
    """evaluate.py's numbers: {slot: {metric: value}} of the dense method."""
    from evaluate import evaluate

    methods = evaluate(evaluate_cfg)["rows"][0]["methods"]
    return {slot: methods[f"cmedteb/{slot}"]["dense"] for slot in SLOTS}


@pytest.fixture(scope="module")
def encoder(spread_bert):
    from care.evaluation.mteb_adapter import encoder_from_config

    return encoder_from_config(["model=tiny_bert", f"model.path={spread_bert}"])


@pytest.fixture(scope="module")
def tasks(evaluate_cfg):
    from care.evaluation.mteb_adapter import benchmark_tasks

    return benchmark_tasks(evaluate_cfg)


@pytest.fixture(scope="module")
def theirs(encoder, tasks) -> dict[str, dict[str, float]]:
    from care.evaluation.mteb_adapter import evaluate_tasks

    return {name.split(".", 1)[1]: s for name, s in evaluate_tasks(encoder, tasks).items()}


# ---- the tasks ---------------------------------------------------------------------------------------------

def test_benchmark_tasks_carry_their_metadata_and_the_loaded_data(tasks):
    from mteb.abstasks.retrieval import AbsTaskRetrieval
    from mteb.abstasks.sts import AbsTaskSTS

    by_key = {t.metadata.name: t for t in tasks}
    assert list(by_key) == [f"cmedteb.{k}" for k in ("retrieval", "rerank", "sts")]
    rerank, retrieval, sts = by_key["cmedteb.rerank"], by_key["cmedteb.retrieval"], by_key["cmedteb.sts"]
    assert isinstance(rerank, AbsTaskRetrieval) and isinstance(retrieval, AbsTaskRetrieval)
    assert isinstance(sts, AbsTaskSTS)
    assert [(t.metadata.type, t.metadata.main_score, t.eval_splits) for t in (rerank, retrieval, sts)] == [
        ("Reranking", "map_at_10", ["test"]), ("Retrieval", "ndcg_at_10", ["test"]), ("STS", "cosine_pearson", ["test"])]
    for t in tasks:
        assert "metadata" in type(t).__dict__ and t.metadata.eval_langs == ["cmn-Hans"]
        assert Path(t.metadata.dataset["path"]).exists() and len(t.metadata.dataset["revision"]) == 16
    rerank.load_data()
    split = rerank.dataset["default"]["test"]
    data = rerank.care_data
    assert split["top_ranked"] == {q: list(j) for q, j in data.qrels.items()}  # the candidates, in file order
    assert split["relevant_docs"] == data.qrels
    assert max(g for j in data.qrels.values() for g in j.values()) >= 2  # graded positives reach mteb
    assert max(g for j in retrieval.care_data.qrels.values() for g in j.values()) >= 2
    assert 1000 in rerank.k_values and (sts.min_score, sts.max_score) == (0.0, 2.0)


# ---- mteb.evaluate == evaluate.py ----------------------------------------------------------------------------

def test_mteb_scores_equal_evaluate_py(theirs, ours):
    diffs = {(slot, m): abs(theirs[slot][m] - ours[slot][t]) for slot, m, t in PAIRS}
    print("max abs diff per (slot, mteb score):", {f"{s}/{m}": f"{d:.2e}" for (s, m), d in diffs.items()})
    assert max(diffs.values()) < TOL, diffs
    assert theirs["rerank"]["main_score"] == theirs["rerank"]["map_at_10"] > 0
    assert theirs["retrieval"]["main_score"] == theirs["retrieval"]["ndcg_at_10"] > 0
    assert theirs["sts"]["main_score"] == theirs["sts"]["cosine_pearson"]
    # mteb's plain pearson/spearman use the model's similarity (torch, float32): cosine for this model, the
    # same numbers up to float32 (sklearn's cosine_* are float64, as evaluate.py's)
    assert theirs["sts"]["pearson"] == pytest.approx(theirs["sts"]["cosine_pearson"], abs=TOL)
    assert theirs["sts"]["spearman"] == pytest.approx(theirs["sts"]["cosine_spearman"], abs=TOL)
    # not a vacuous equality: graded gains change nDCG, and Pearson is not Spearman here
    assert abs(ours["rerank"]["ndcg_cut_10"] - ours["rerank"]["map_cut_10"]) > 10 * TOL
    assert abs(ours["sts"]["pearson"] - ours["sts"]["spearman"]) > 10 * TOL


def test_local_copies_of_cmteb_tasks(files, encoder, ours, tmp_path):
    """A local copy of CMedQAv2-reranking in mteb's parquet layout, and of ATEC in the project's STS layout:
    tasks with mteb's names and main scores (map_at_1000, cosine_spearman), read by the project's loaders,
    scored alike by mteb and by evaluate.py's runners."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from care.data.tasks import load_task
    from care.evaluation.mteb_adapter import cmteb_task, compare

    data = load_task("reranking", files["rerank"], "test")
    folder = tmp_path / "CMedQAv2-reranking"
    tables = {"corpus": {"_id": list(data.docs), "text": list(data.docs.values())},
              "queries": {"_id": list(data.queries), "text": list(data.queries.values())},
              "default": {"query-id": [q for q, j in data.qrels.items() for d, g in j.items() if g],
                          "corpus-id": [d for j in data.qrels.values() for d, g in j.items() if g],
                          "score": [g for j in data.qrels.values() for g in j.values() if g]},
              "top_ranked": {"query-id": list(data.qrels), "corpus-ids": [list(j) for j in data.qrels.values()]}}
    readme = ["---", "configs:"]
    for config, columns in tables.items():
        (folder / config).mkdir(parents=True)
        pq.write_table(pa.table(columns), folder / config / "test-00000-of-00001.parquet")
        readme += [f"- config_name: {config}", "  data_files:", "  - split: test", f"    path: {config}/test-*.parquet"]
    (folder / "README.md").write_text("\n".join([*readme, "---", ""]), encoding="utf-8")  # as on the hub
    rerank, atec = cmteb_task("CMedQAv2-reranking", folder), cmteb_task("ATEC", files["sts"], split="test")
    assert (rerank.metadata.name, rerank.metadata.main_score, rerank.care_data.qrels) == (
        "CMedQAv2-reranking", "map_at_1000", data.qrels)  # only positives stored: the lists give the negatives
    assert (atec.metadata.name, atec.metadata.main_score, atec.metadata.dataset["path"]) == (
        "ATEC", "cosine_spearman", str(files["sts"]))
    rows = compare(encoder, [rerank, atec])
    assert [rows[n]["metric"] for n in rows] == ["map_cut_1000", "spearman"]
    assert max(abs(r["diff"]) for r in rows.values()) < TOL, rows
    assert rows["CMedQAv2-reranking"]["mteb"] == pytest.approx(ours["rerank"]["map_cut_1000"], abs=TOL)
    assert rows["ATEC"]["mteb"] == pytest.approx(ours["sts"]["spearman"], abs=TOL)

    # mteb's own CMedQAv2-reranking task on that folder read by mteb's stock loader (what a hub run loads, minus
    # the download): the project's number is computed on mteb's data (task_data), and agrees
    import mteb
    from mteb.abstasks.retrieval_dataset_loaders import RetrievalDatasetLoader

    hub = mteb.get_task("CMedQAv2-reranking")
    hub.dataset = {"default": {"test": RetrievalDatasetLoader(hf_repo=str(folder), revision="local").load()}}
    hub.data_loaded = True
    row = compare(encoder, [hub])["CMedQAv2-reranking"]
    assert row["data"] == "mteb" and row["counts"]["skipped_one_sided_lists"] == 0
    assert abs(row["diff"]) < TOL and row["mteb"] == pytest.approx(ours["rerank"]["map_cut_1000"], abs=TOL)


# ---- prompt routing ------------------------------------------------------------------------------------------

def test_prompt_routing(tasks):
    """Documents never go through encode_queries in a retrieval or reranking task, queries never through
    encode_documents; both STS sides go through encode_queries, as evaluate.py embeds them; each call carries
    the project task type (the query instruction an instruction model takes)."""
    from care.evaluation.mteb_adapter import evaluate_tasks

    by_key = {t.metadata.name.split(".", 1)[1]: t for t in tasks}
    for key in ("rerank", "retrieval", "sts"):
        rec = Recorder()
        evaluate_tasks(rec, [by_key[key]])
        data = by_key[key].care_data
        sent = {(side, task): set() for side, task, _ in rec.calls}
        for side, task, texts in rec.calls:
            sent[side, task].update(texts)
        kind = {"rerank": "reranking"}.get(key, key)
        if key == "sts":
            assert set(sent) == {("query", "sts")}
            assert sent["query", "sts"] == {t for pair in data.pairs for t in pair}
        else:
            queries, docs = set(data.queries.values()), set(data.docs.values())
            assert set(sent) == {("query", kind), ("document", kind)}
            assert sent["query", kind] == queries and sent["document", kind] == docs
            assert sent["query", kind].isdisjoint(docs - queries) and docs - queries  # (a few titles are queries too)


# ---- the command line ----------------------------------------------------------------------------------------

def test_cli_in_a_fresh_interpreter_writes_nothing_under_home(files, spread_bert, encoder, theirs, tmp_path):
    """`python -m care.evaluation.mteb_adapter` with HOME, the project cache and the outputs in a temporary
    folder and no MTEB_CACHE/HF_HOME/HF_DATASETS_CACHE set: it prints mteb's main score beside evaluate.py's
    with the difference, writes mteb's results where mteb's result cache reads them (<outputs>/mteb by
    default: results/care__tiny_bert/<fingerprint>/<task>.json + model_meta.json, read back here by mteb's own
    loader), and nothing under the (temporary) home, neither mteb's result cache nor the datasets cache nor
    onnxruntime's telemetry device id.  The environment is a user's: onnxruntime writes no device id when a CI
    variable or ORT_DISABLE_TELEMETRY is set, so those are removed (the project must switch it off itself)."""
    home = tmp_path / "home"
    home.mkdir()
    env = user_env(home, CARE_CACHE=str(tmp_path / "care-cache"), CARE_OUTPUTS=str(tmp_path / "outputs"),
                   HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "care.evaluation.mteb_adapter", *overrides(files, spread_bert), "keys=rerank,sts"]
    run = subprocess.run(cmd, check=False, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in run.stdout.splitlines() if line.startswith("| cmedteb.")}
    assert set(rows) == {"cmedteb.rerank", "cmedteb.sts"}
    for key, kind, score, ours_name in (("rerank", "Reranking", "map_at_10", "map_cut_10"),
                                        ("sts", "STS", "cosine_pearson", "pearson")):
        _, printed_kind, main, mteb_value, metric, project_value, diff = rows[f"cmedteb.{key}"]
        assert (printed_kind, main, metric) == (kind, score, ours_name)
        assert float(mteb_value) == pytest.approx(100 * theirs[key][score], abs=0.006)
        assert abs(float(diff)) < 100 * TOL and abs(float(mteb_value) - float(project_value)) < 0.006
    assert [p for p in home.rglob("*")] == []
    mteb_dir = tmp_path / "care-cache" / "mteb"
    assert mteb_dir.is_dir() and not any(mteb_dir.iterdir())  # created by `import mteb`, left empty

    import mteb

    results = tmp_path / "outputs" / "mteb"
    where = results / "results" / "care__tiny_bert" / encoder.fingerprint
    assert f"mteb results: {where}" in run.stdout
    assert {p.name for p in where.iterdir()} == {"cmedteb.rerank.json", "cmedteb.sts.json", "model_meta.json",
                                                  "run_settings.jsonl"}
    (loaded,) = mteb.ResultCache(results).load_results(include_remote=False).model_results
    assert (loaded.model_name, loaded.model_revision) == ("care/tiny_bert", encoder.fingerprint)
    assert loaded.model_meta.model_type == ["dense"] and loaded.model_meta.embed_dim == 64
    got = {r.task_name: r.get_score() for r in loaded.task_results}
    assert got.keys() == {"cmedteb.rerank", "cmedteb.sts"}
    for key, score in (("rerank", "map_at_10"), ("sts", "cosine_pearson")):
        assert got[f"cmedteb.{key}"] == pytest.approx(theirs[key][score], abs=1e-5)  # 6 decimals on disk


def test_cli_says_the_hub_is_unreachable_offline(spread_bert, monkeypatch):
    from care.evaluation.mteb_adapter import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"CMedQAv2-reranking: its data \(mteb/CMedQAv2-reranking on the "
                       r"Hugging Face hub\).*the hub is unreachable: HF_HUB_OFFLINE=1.*tasks=CMedQAv2-reranking=<path>"):
        main(["model=tiny_bert", f"model.path={spread_bert}", "tasks=CMedQAv2-reranking"])
    with pytest.raises(ValueError, match="benchmark=.*tasks=.*nano="):
        main(["model=tiny_bert"])
    with pytest.raises(KeyError, match="not found"):
        main(["model=tiny_bert", f"model.path={spread_bert}", "tasks=NoSuchTask"])


def test_cli_help_prints_the_command_lines(capsys):
    from care.evaluation.mteb_adapter import main

    for argv in (["--help"], ["-h"], [], ["model=tiny_bert", "--help"]):
        assert main(argv) == {}
        out = capsys.readouterr().out
        assert "python -m care.evaluation.mteb_adapter model=" in out and "results=<dir>" in out
    with pytest.raises(ValueError, match="argument 'oops': expected key=value"):
        main(["model=tiny_bert", "oops"])
