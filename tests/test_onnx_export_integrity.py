"""A cached ONNX export is checked before it runs (care/encoders/onnx_backend.py verify_export): a file changed
on disk (4 KB of a weight shuffled, its mtime put back), truncated, emptied, or a folder from before digests
were recorded is exported again with one line, never run; the vectors an encoder makes are keyed by the
digest of the export that made them, so the embedding cache never serves a damaged export's vectors as the
model's.  Also the edges around the backend: `backend=onnx` without onnxruntime is one line at the app's
edge, `backend: auto` says once why it runs torch, a full disk during the export names the export's folder,
and a command line's cache_root= moves the export and the weights-digest memo.  The references: the vectors
of the first, untouched export (and torch's, independently, to 1e-5), the bytes the test changed itself,
and the folders the test chose."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from care.encoders import build_encoder, onnx_backend
from care.encoders.cache import EmbeddingCache, embed
from care.models import hub
from care.paths import PROJECT_ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["高血压患者能吃鸡蛋吗", "孩子发烧三天不退怎么办", "糖尿病的早期症状有哪些", "胃痛 吃什么药", "感冒咳嗽"]


@pytest.fixture(autouse=True)
def own_cache_root(tmp_path, monkeypatch):
    """Each test its own cache root (exports, the digest memo) and a fresh memo, as a new process has."""
    monkeypatch.setenv("CARE_CACHE", str(tmp_path / "cache_root"))
    monkeypatch.setattr(hub, "_MEMO", {})
    return tmp_path / "cache_root"


def dense(folder, backend: str = "auto"):
    return build_encoder({"kind": "dense", "path": str(folder)}, device="cpu", backend=backend)


def vectors(encoder, cache: EmbeddingCache | None = None) -> np.ndarray:
    return embed(encoder, TEXTS, "document", cache, show_progress=False).dense


def the_export(root) -> os.PathLike:
    (export,) = sorted((root / "onnx").glob("*/model.onnx"))
    return export


def shuffle_a_weight(export) -> str:
    """4 KB of the middle of the largest MatMul weight, its own floats shuffled (finite, plausible, wrong),
    written in place with the file's mtime put back: what a flipped disk block or a careless tool does."""
    import onnx

    weight = max((i for i in onnx.load(str(export)).graph.initializer if "MatMul" in i.name),
                 key=lambda i: len(i.raw_data))
    at = export.read_bytes().find(weight.raw_data) + len(weight.raw_data) // 2 - 2048
    before = os.stat(export)
    with open(export, "r+b") as fh:
        fh.seek(at)
        block = np.frombuffer(fh.read(4096), dtype=np.float32).copy()
        np.random.default_rng(0).shuffle(block)
        fh.seek(at)
        fh.write(block.tobytes())
    os.utime(export, ns=(before.st_atime_ns, before.st_mtime_ns))
    return weight.name


DAMAGE = {
    "a weight shuffled": shuffle_a_weight,
    "truncated": lambda f: os.truncate(f, os.path.getsize(f) // 2),
    "emptied": lambda f: os.truncate(f, 0),
    "made before digests were recorded": lambda f: (f.parent / onnx_backend.DIGESTS).unlink(),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_export_is_exported_again_with_one_line(tiny_bert_dir, own_cache_root, capsys, damage):
    first = dense(tiny_bert_dir)
    reference = vectors(first)
    np.testing.assert_allclose(reference, vectors(dense(tiny_bert_dir, "torch")), rtol=0, atol=1e-5)
    export = the_export(own_cache_root)
    DAMAGE[damage](export)
    capsys.readouterr()
    exports = onnx_backend.EXPORTS
    again = dense(tiny_bert_dir)  # a later run: it checks the export before running it
    said = [line for line in capsys.readouterr().err.splitlines() if "ONNX export" in line]
    assert len(said) == 1 and str(export.parent) in said[0] and said[0].endswith("exporting it again"), said
    assert onnx_backend.EXPORTS == exports + 1
    np.testing.assert_array_equal(vectors(again), reference)  # the same vectors as the untouched export's
    assert onnx_backend.verify_export(export.parent) == (first.identity("document")["export"], "")
    dense(tiny_bert_dir)  # once exported again, trusted: nothing more said or exported
    assert onnx_backend.EXPORTS == exports + 1 and "ONNX export" not in capsys.readouterr().err


def test_an_unchanged_export_is_read_once_and_run(tiny_bert_dir, own_cache_root, monkeypatch):
    dense(tiny_bert_dir)
    exports, reads = onnx_backend.EXPORTS, []
    digest = hub.file_digest
    monkeypatch.setattr(hub, "file_digest", lambda p, *a, **k: reads.append(p.name) or digest(p, *a, **k))
    for _ in range(3):
        monkeypatch.setattr(hub, "_MEMO", {})  # each a new process
        dense(tiny_bert_dir)
    assert onnx_backend.EXPORTS == exports and reads.count("model.onnx") == 1  # then from the on-disk memo


def test_cached_vectors_are_keyed_by_the_export_that_made_them(tiny_bert_dir, own_cache_root, tmp_path):
    """The issue's reproduction: a damaged export, the cache on; then the export deleted and made again.  No
    vector the damaged export would make is stored or served: both runs give the untouched export's vectors."""
    first = dense(tiny_bert_dir)
    reference = vectors(first)  # no cache: the reference
    export = the_export(own_cache_root)
    shuffle_a_weight(export)
    cache = EmbeddingCache(tmp_path / "embeddings")
    np.testing.assert_array_equal(vectors(dense(tiny_bert_dir), cache), reference)
    for f in export.parent.iterdir():
        f.unlink()
    export.parent.rmdir()
    cache = EmbeddingCache(tmp_path / "embeddings")
    np.testing.assert_array_equal(vectors(dense(tiny_bert_dir), cache), reference)
    # the key: the side's identity holds the digest of the export's recorded files
    recorded = json.loads((export.parent / "digests.json").read_text())["files"]
    assert first.identity("document")["export"] == onnx_backend._digest_of(recorded)
    other = dense(tiny_bert_dir)
    other._onnx.digest = "0" * 16  # another export: another fingerprint
    assert other.side_fingerprint("document") != first.side_fingerprint("document")


def test_backend_onnx_without_onnxruntime_is_one_line(tiny_bert_dir, monkeypatch, capsys):
    from care.errors import app_errors

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` raises ImportError
    for model in ({"kind": "dense", "path": str(tiny_bert_dir)}, {"kind": "dense", "path": str(tiny_bert_dir),
                                                                    "backend": "onnx_int8"}):
        with pytest.raises(SystemExit) as stop, app_errors("evaluate.py"):
            build_encoder(model, device="cpu", backend="onnx")
        assert stop.value.code == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("evaluate.py: error: backend=onnx"), err  # before any loading
        assert "onnxruntime" in err[0] and "pip install onnxruntime==" in err[0] and "backend=torch" in err[0]


def test_auto_says_once_why_it_runs_torch(tiny_bert_dir, monkeypatch, capsys):
    monkeypatch.setattr(onnx_backend, "_SAID", set(), raising=False)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert [dense(tiny_bert_dir).backend for _ in range(2)] == ["torch", "torch"]
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if line.startswith("backend auto")]
    assert len(said) == 1 and "onnxruntime cannot be imported" in said[0] and "pip install" in said[0], err
    assert onnx_backend.resolve_backend("auto", "cuda") == "torch" and not capsys.readouterr().err  # the rule


def test_a_full_disk_during_the_export_names_the_export(tiny_bert_dir, own_cache_root, tmp_path, monkeypatch, capsys):
    """torch's exporter writes the file itself and its OSError names none: the line must name the export's
    folder (under the cache root), not the folder the app writes its results under."""
    import torch

    from care.errors import app_errors

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.onnx, "export", full)
    with pytest.raises(SystemExit), app_errors("evaluate.py", writes_to=tmp_path / "results"):
        dense(tiny_bert_dir)
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar
    assert err.startswith("evaluate.py: error: no space left on") and str(own_cache_root / "onnx") in err, err
    assert str(tmp_path / "results") not in err
    assert not list((own_cache_root / "onnx").glob("*/model.onnx"))  # nothing half-written left as an export


APP = """
import os, hydra
from care.config import CONF_DIR
from care.encoders import build_encoder
from care.paths import cache_dir

@hydra.main(config_path=str(CONF_DIR), config_name="encode", version_base="1.3")
def main(cfg):
    print("cache_dir", cache_dir())
    build_encoder({"kind": "dense", "path": os.environ["TINY_BERT"]}, device="cpu")

main()
"""


def test_cache_root_on_the_command_line_moves_the_export_and_the_memo(tiny_bert_dir, tmp_path):
    """A Hydra app (the apps' own conf/, conf/hydra/default.yaml) given cache_root= writes its ONNX export and
    its weights-digest memo there, and nothing under CARE_CACHE (the default root: a read-only checkout's)."""
    default, moved = tmp_path / "default", tmp_path / "moved"
    default.mkdir()
    env = {**os.environ, "CARE_CACHE": str(default), "TINY_BERT": str(tiny_bert_dir), "WANDB_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", APP, f"cache_root={moved}", f"out_root={tmp_path / 'out'}"],
                         cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"cache_dir {moved}" in run.stdout
    assert len(list((moved / "onnx").glob("*/model.onnx"))) == 1
    assert list((moved / hub.MEMO_FOLDER).glob("*.json"))
    assert not list(default.iterdir())


@pytest.mark.parametrize("argv", [["benchmark=cmedteb_open"], ["nano=some/Nano"]])
def test_the_mteb_command_line_follows_cache_root(tmp_path, monkeypatch, argv):
    """The mteb adapter's command line composes its config itself (no Hydra job): its cache_root= is the
    process's before the encoder (and its export) is built."""
    from care.evaluation.mteb_adapter import cli
    from care.paths import cache_dir

    class Built(Exception):
        pass

    def build(cfg):
        raise Built(cache_dir())

    monkeypatch.setenv("CARE_CACHE", str(tmp_path / "default"))  # put back after the test
    monkeypatch.setattr(cli, "encoder_from_config", build)
    with pytest.raises(Built) as built:
        cli.main(["model=tiny_bert", *argv, f"cache_root={tmp_path / 'moved'}"])
    assert built.value.args[0] == tmp_path / "moved"
