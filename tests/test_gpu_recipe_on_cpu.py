"""The GPU recipe, run on the CPU: `trainer=gpu` (bf16 autocast, gradient checkpointing, GradCache) on a tiny M3
and tiny CARE towers, and `experiment=bge_m3_medical_cn` end to end (train -> evaluate) from a tiny M3.

No GPU is lent to this project, so nothing else ever executes these settings.  torch runs bf16 autocast and
non-reentrant checkpointing on the CPU too, and accelerate's Accelerator(cpu=False, mixed_precision="bf16")
falls back to the CPU with CPU autocast.  Only the sizes are overridden (steps, batch, lengths, lr, data-loader
workers); the preset's precision, checkpointing and GradCache chunking are kept.  Forward hooks on every
Linear prove the run was bf16, not fp32 (autocast silently off would pass every loss check), and that the
checkpointed layers were recomputed inside the backward (checkpointing silently off would too).
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from _care_helpers import root, tiny, train_overrides  # noqa: F401  (root, tiny: fixtures)
from _training_helpers import make_training_files, train_config
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from test_evaluate_cli import overrides, task_paths  # noqa: F401  (task_paths: fixture)
from torch import nn

from care.config import load_config
from care.data.io import read_jsonl
from care.models.m3 import tiny_m3
from care.paths import PROJECT_ROOT
from care.training.care_recipe import stage_config
from care.training.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

# trainer=gpu with its hardware side kept; data-loader workers off (process start-up on a busy 2-core machine).
GPU = ["trainer=gpu", "trainer.num_workers=0"]


def reset_accelerate() -> None:
    """accelerate keeps one AcceleratorState per process and refuses an Accelerator of another mixed_precision
    ("AcceleratorState has already been initialized and cannot be changed"): these bf16 runs share pytest
    workers with fp32 ones (`make test`: xdist, --dist loadfile), so the state is dropped before and after."""
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(autouse=True, scope="module")
def fresh_accelerate_state():
    reset_accelerate()
    yield
    reset_accelerate()


class Probe:
    """Forward hooks on every Linear of the given modules, in training mode: the output dtypes of the forwards
    (GradCache's no-grad pass and re-forward) and of the recomputations gradient checkpointing runs inside the
    backward (autograd's graph task id is -1 outside a backward)."""

    def __init__(self, modules):
        self.forward, self.recompute = Counter(), Counter()
        self.handles = [m.register_forward_hook(self.hook) for module in modules for m in module.modules()
                        if isinstance(m, nn.Linear)]
        assert self.handles

    def hook(self, module, args, out):
        if module.training:
            in_backward = torch._C._current_graph_task_id() != -1
            (self.recompute if in_backward else self.forward)[out.dtype] += 1

    def assert_bf16_and_checkpointed(self) -> None:
        assert set(self.forward) == {torch.bfloat16}, self.forward  # autocast engaged, every Linear in bf16
        assert set(self.recompute) == {torch.bfloat16}, self.recompute  # recomputed in backward, autocast restored


def trained(cfg, callbacks=()) -> tuple[dict, Probe, Trainer]:
    reset_accelerate()
    trainer = Trainer(cfg, callbacks=callbacks)
    acc = trainer.accelerator
    assert acc.device.type == "cpu" and acc.mixed_precision == "bf16" and not cfg.trainer.cpu
    probe = Probe([m for m, k in zip(trainer.unwrapped(), trainer.trainable) if k])
    summary = trainer.fit()
    # autocast, not bf16 weights: the trained weights stay fp32
    assert {p.dtype for m in trainer.unwrapped() for p in m.parameters()} == {torch.float32}
    return summary, probe, trainer


def loss_rows(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "loss/loss" in r]


def assert_decreasing(losses: list[float], k: int = 3, ratio: float = 0.8) -> None:
    assert all(math.isfinite(x) for x in losses), losses
    assert np.mean(losses[-k:]) < ratio * np.mean(losses[:k]), losses


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor file of a saved model folder (M3: backbone + head files; CARE: query/ and document/)."""
    out = {}
    for f in sorted(folder.rglob("*.safetensors")):
        out.update({f"{f.relative_to(folder)}:{k}": v for k, v in load_file(f).items()})
    for f in sorted(folder.rglob("*_linear.pt")):
        out.update({f"{f.relative_to(folder)}:{k}": v
                    for k, v in torch.load(f, map_location="cpu", weights_only=True).items()})
    assert out
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def test_gpu_preset_is_what_runs():
    """What these tests keep of the preset (a change to conf/trainer/gpu.yaml shows here); GradCache is the
    source recipe's (the CPU default experiment turns it off: the M3 tests below set trainer.chunk_size=8)."""
    t = load_config("train", GPU).trainer
    assert (t.cpu, t.mixed_precision, t.gradient_checkpointing) == (False, "bf16", True)
    recipe = load_config("train", ["experiment=bge_m3_medical_cn"]).trainer
    assert (recipe.cpu, recipe.mixed_precision, recipe.gradient_checkpointing, recipe.chunk_size) == (False, "bf16", True, 64)


# ---- tiny M3: bf16, checkpointing, GradCache; the loss falls; a paused run resumes exactly -----------------

@pytest.fixture(scope="module")
def m3(tmp_path_factory, shared):
    folder = tmp_path_factory.mktemp("gpu-m3")
    texts, train = make_training_files(folder, shared, n_questions=16)

    def cfg(run: str, *extra: str):
        # 2 steps an epoch (8 queries x 3 passages, GradCache chunks of 8), 12 steps over 6 epochs, dropout on
        return train_config(folder, texts, train, run, *GPU, "trainer.lr=2e-3", "trainer.max_steps=12",
                            "trainer.epochs=6", "trainer.checkpoint_every=3", *extra)

    summary, probe, _ = trained(cfg("reference"))
    assert summary["step"] == 12
    return folder, cfg, probe


def test_m3_runs_in_bf16_with_checkpointing_and_the_loss_falls(m3):
    folder, _, probe = m3
    probe.assert_bf16_and_checkpointed()
    rows = loss_rows(folder / "reference")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert_decreasing([r["loss/loss"] for r in rows], k=4, ratio=0.7)
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)


def test_m3_paused_run_resumes_to_identical_weights(m3):
    """max_steps_this_session pauses at step 3 (mid-epoch, at a checkpoint) and step 7; the resumed run ends
    with the uninterrupted run's weights bit for bit: bf16 autocast on the CPU is deterministic, and GradCache's
    re-forward and the checkpointed recomputation draw the dropout masks the RNG checkpoint restored."""
    folder, cfg, _ = m3
    first, _, _ = trained(cfg("sessions", "trainer.max_steps_this_session=3"))
    assert first["stop_reason"] == "max_steps_this_session"
    trained(cfg("sessions", "trainer.max_steps_this_session=4"))
    last, probe, _ = trained(cfg("sessions"))
    assert last["step"] == 12
    probe.assert_bf16_and_checkpointed()  # the resumed session too
    assert_same(weights(folder / "sessions" / "final"), weights(folder / "reference" / "final"))
    assert [r["loss/loss"] for r in loss_rows(folder / "sessions")] == [r["loss/loss"] for r in loss_rows(folder / "reference")]


# ---- tiny CARE: stage I's query tower, stage II's LoRA document tower ---------------------------------------

def care_stage(files: Path, towers: Path, run: Path, stage: str, *extra: str):
    cfg = load_config("train", train_overrides(files, None, *GPU, f"model.query.path={towers / 'query'}",
                                               f"model.document.path={towers / 'document'}",
                                               f"model.stages.stage2.query_from={towers / 'query'}", *extra))
    return stage_config(cfg, stage, run)


def test_care_stage1_runs_in_bf16_with_checkpointing_and_the_loss_falls(root, tiny, tmp_path):  # noqa: F811
    run = tmp_path / "care"
    summary, probe, _ = trained(care_stage(root, tiny, run, "stage1", "model.stages.stage1.trainer.lr=2e-3",
                                           "model.stages.stage1.trainer.max_steps=8",
                                           "model.stages.stage1.trainer.epochs=2"))
    assert summary["step"] == 8
    probe.assert_bf16_and_checkpointed()
    # a steady fall from ~3.9 (lr 2e-3, same-text pairs of 8; InfoNCE over 8 + MSE): 3 steps vs 3 steps, 10% margin
    assert_decreasing([r["loss/loss"] for r in loss_rows(run / "stage1")], k=3, ratio=0.9)


def test_care_stage2_paused_run_resumes_to_identical_weights(root, tiny, tmp_path):  # noqa: F811
    """Stage II: the query tower and the LoRA-adapted document tower, both checkpointed, in bf16."""
    def cfg(name: str, *extra: str):
        return care_stage(root, tiny, tmp_path / name, "stage2", "model.stages.stage2.trainer.max_steps=4",
                          "trainer.checkpoint_every=2", *extra)

    reference, probe, trainer = trained(cfg("reference"))
    assert reference["step"] == 4 and len(probe.handles) > 0
    assert all(trainer.trainable)  # both towers train (the document tower through its adapter)
    probe.assert_bf16_and_checkpointed()
    assert all(math.isfinite(r["loss/loss"]) for r in loss_rows(tmp_path / "reference" / "stage2"))
    first, _, _ = trained(cfg("sessions", "trainer.max_steps_this_session=2"))
    assert first["stop_reason"] == "max_steps_this_session"
    trained(cfg("sessions"))
    assert_same(weights(tmp_path / "sessions" / "stage2" / "final"), weights(tmp_path / "reference" / "stage2" / "final"))


# ---- experiment=bge_m3_medical_cn end to end: train.py -> evaluate.py ------------------------------------

def test_bge_m3_medical_cn_trains_from_a_tiny_m3_and_evaluates(tmp_path, shared, task_paths, monkeypatch):  # noqa: F811
    """The source recipe with `model.path=` a tiny M3 and its own small files: only sizes are overridden (the
    recipe's 128 x 10 pool, 500-step checks and full dev set do not fit a test); bf16, checkpointing, GradCache,
    the loss, the schedule's shape and early stopping's validation stay the recipe's."""
    texts, train = make_training_files(tmp_path, shared, n_questions=16)
    tiny_m3().save(tmp_path / "tiny-m3")
    out = tmp_path / "run"
    argv = ["train.py", "experiment=bge_m3_medical_cn", f"model.path={tmp_path / 'tiny-m3'}", f"data.texts={texts}",
            f"data.examples={train}", f"output_dir={out}", "trainer.batch_size=4", "trainer.group_size=3",
            "trainer.chunk_size=6", "trainer.query_max_length=32", "trainer.passage_max_length=48",
            "trainer.max_steps=3", "trainer.num_workers=0", f"validation.task={tmp_path / 'dev.jsonl'}",
            "validation.max_queries=3", "validation.every_steps=2", f"hydra.run.dir={tmp_path / 'hydra'}"]
    spec = importlib.util.spec_from_file_location("train_cli", PROJECT_ROOT / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    monkeypatch.setattr(sys, "argv", argv)
    reset_accelerate()
    cli.main()

    record = json.loads((out / "final" / "care_training.json").read_text(encoding="utf-8"))
    t = record["config"]["trainer"]
    assert record["config"]["experiment_name"] == "bge_m3_medical_cn" and record["model"]["kind"] == "m3"
    assert (t["mixed_precision"], t["gradient_checkpointing"], t["lr"], t["warmup_ratio"]) == ("bf16", True, 1e-5, 0.01)
    rows = loss_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss/loss"]) for r in rows)
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "val/map_cut_10" in r] == [0, 2, 3]

    from evaluate import evaluate

    result = evaluate(load_config("evaluate", overrides(task_paths, tmp_path, f"ckpt={out / 'final'}", "baselines=[]",
                                                        "efficiency.enabled=false", cmedqa2=False)))
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text(encoding="utf-8"))
    (row,) = summary["models"]
    assert row["scores"] and all(math.isfinite(v) for v in row["scores"].values()), row["scores"]
    assert "cmedteb/avg" in row["scores"] and result["rows"][0]["scores"] == row["scores"]
