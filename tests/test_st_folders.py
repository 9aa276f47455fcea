"""Every model folder the project writes is a sentence-transformers folder (care.encoders.st_folder): loaded by
SentenceTransformer in a process that never imports the project, its encode_query / encode_document equal the
project's encode_queries / encode_documents.  CARE's two towers: tests/test_care_end_to_end.py."""
from __future__ import annotations

import json
import shutil

import pytest
from _export_helpers import assert_same_vectors
from _training_helpers import make_training_files, train_config

from care.encoders import build_encoder, detect
from care.encoders.prompts import Prompts
from care.encoders.st_folder import ST_FILES, st_prompts, write_st_files
from care.models.hub import weights_digest
from care.training.trainer import Trainer

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def project_encoder(folder):
    return build_encoder(detect(folder, {}), device="cpu")


@pytest.fixture(scope="module")
def m3_run(tmp_path_factory, shared):
    """A 3-step tiny M3 run with a checkpoint at step 2."""
    root = tmp_path_factory.mktemp("st-m3")
    texts, train = make_training_files(root, shared, n_questions=16)
    Trainer(train_config(root, texts, train, "run", "trainer.max_steps=3", "trainer.checkpoint_every=2",
                         "trainer.keep_checkpoints=5")).fit()
    return root / "run"


def test_m3_final_and_checkpoint_folders_load_with_sentence_transformers(m3_run, tmp_path):
    for folder in (m3_run / "final", m3_run / "checkpoints" / "step-0000002" / "model"):
        st = assert_same_vectors(folder, project_encoder(folder), tmp_path)
        assert st["modules"] == ["Transformer", "Pooling", "Normalize"], folder
        assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "cls"
        assert (folder / "colbert_linear.pt").is_file() and (folder / "sparse_linear.pt").is_file()  # FlagEmbedding's


def test_a_copied_folder_loads_alone(m3_run, tmp_path):
    run = shutil.copytree(m3_run, tmp_path / "run")
    moved = shutil.copytree(run / "final", tmp_path / "elsewhere" / "final")
    run.rename(tmp_path / "gone")  # the run it came from is no longer where it was written
    assert str(m3_run) not in (moved / "care_training.json").read_text()  # no path of the run inside
    ours = project_encoder(moved)
    assert ours.encode_queries(["头痛"]).dense.tolist() == project_encoder(m3_run / "final").encode_queries(["头痛"]).dense.tolist()
    assert_same_vectors(moved, ours, tmp_path)


def test_an_e5_style_run_keeps_mean_pooling_and_prefixes_in_merged_and_tuned_folders(tmp_path, shared, tiny_bert_dir):
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    cfg = train_config(tmp_path, texts, train, "run", "model=tiny_bert", f"model.path={tiny_bert_dir}",
                       "model.pooling=mean", "model.prompts.query='query: '", "model.prompts.document='passage: '",
                       "trainer.max_steps=2", "trainer.merge_with_start=0.5", "trainer.checkpoint_every=100")
    Trainer(cfg).fit()
    for name in ("final", "tuned"):
        folder = tmp_path / "run" / name
        assert_same_vectors(folder, project_encoder(folder), tmp_path)
        config = json.loads((folder / "config_sentence_transformers.json").read_text())
        assert config["prompts"] == {"query": "query: ", "document": "passage: "}
        assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "mean"


def test_a_dense_config_with_a_matryoshka_cut_and_the_digest_unchanged(tiny_bert_dir, tmp_path):
    folder = shutil.copytree(tiny_bert_dir, tmp_path / "dense")
    before = weights_digest(folder)
    cfg = {"kind": "dense", "name": "cut", "path": str(folder), "pooling": "mean",
           "prompts": {"query": "q: ", "document": ""}, "max_length": 16, "truncate_dim": 24}
    write_st_files(folder, cfg)
    assert weights_digest(folder) == before  # embedding caches keyed before these files existed stay valid
    assert all((folder / name).is_file() for name in ST_FILES if name != "router_config.json")
    st = assert_same_vectors(folder, build_encoder(cfg, device="cpu"), tmp_path)
    assert st["modules"] == ["Transformer", "Pooling", "Normalize", "Dense"] and st["query"].shape[1] == 24
    assert json.loads((folder / "config_sentence_transformers.json").read_text())["similarity_fn_name"] == "dot"


def test_prompts_templates_and_instructions():
    prompts = Prompts("<instruct>{instruction}\n<query>{text}", "", {"retrieval": "find", "sts": "same"})
    assert st_prompts(prompts) == {"query": "<instruct>find\n<query>", "query_sts": "<instruct>same\n<query>",
                                   "document": ""}
    with pytest.raises(ValueError, match="puts text before its end"):
        st_prompts(Prompts("{text} is the question", ""))


def test_an_m3_folder_cut_to_truncate_dim(m3_run, tmp_path):
    """kind m3 with truncate_dim: the dense vector is the full one's first d coordinates (normalised at full
    width, not re-normalised), the other heads unchanged, and a sentence-transformers folder gives the same."""
    folder = shutil.copytree(m3_run / "final", tmp_path / "cut")
    full_cfg = detect(folder, {})
    full, cut = build_encoder(full_cfg, device="cpu"), build_encoder({**full_cfg, "truncate_dim": 24}, device="cpu")
    texts = ["头痛怎么办", "高血压患者的饮食"]
    a, b = full.encode_documents(texts, heads=("dense", "sparse")), cut.encode_documents(texts, heads=("dense", "sparse"))
    assert b.dense.shape[1] == 24 and b.dense.tolist() == a.dense[:, :24].tolist() and b.sparse == a.sparse
    assert cut.fingerprint != full.fingerprint  # a cut is its own cache entry
    write_st_files(folder, {**full_cfg, "truncate_dim": 24})
    st = assert_same_vectors(folder, cut, tmp_path)
    assert st["modules"] == ["Transformer", "Pooling", "Normalize", "Dense"] and st["query"].shape[1] == 24
    with pytest.raises(ValueError, match="choose 0 < truncate_dim"):
        build_encoder({**full_cfg, "truncate_dim": 10_000}, device="cpu")
