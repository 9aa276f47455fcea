"""Merge a fine-tuned model back toward the model it started from (LM-Cocktail, BAAI 2023).

Fine-tuning on one kind of pair (question -> answer) moves the backbone away from what made the
pretrained encoder general: on the default CPU run the medical answer ranking gains 7 points while the
paraphrase STS slot loses 2.  A weighted average of the two backbones, `weight * tuned + (1 - weight) *
start`, keeps most of the gain and most of what the start knew (LM-Cocktail's "mix_models" with
weights [0.5, 0.5], the recipe FlagEmbedding gives for exactly this).

Only the backbone is merged, as LM-Cocktail does (it loads the checkpoint as a plain AutoModel): the
sparse and ColBERT heads stay as trained.  A start with fresh heads has nothing in them to keep.

Why not call LM_Cocktail itself: its `mix_models` reads and writes whole model folders as
sentence-transformers models with CLS pooling (wrong for E5's mean pooling) and knows nothing of the M3
head files; the arithmetic itself is one line.  tests/test_merge.py holds this function equal to
LM_Cocktail.utils.merge_param.

    python -m care.training.merge TUNED_DIR START --weight 0.5 --out OUT_DIR
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn


def merge_state(tuned: nn.Module, start: nn.Module, weight: float) -> None:
    """In place: every floating-point tensor of `tuned` becomes weight * tuned + (1 - weight) * start.
    Integer buffers (position ids) are left as they are."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"merge weight must be in [0, 1] (the share of the fine-tuned model), got {weight}")
    mine, theirs = tuned.state_dict(), start.state_dict()
    if mine.keys() != theirs.keys():
        differ = sorted(mine.keys() ^ theirs.keys())
        raise ValueError(f"cannot merge models of different architectures: {len(differ)} parameter names differ, "
                         f"e.g. {differ[0]!r}")
    with torch.no_grad():
        for name, value in mine.items():
            other = theirs[name]
            if other.shape != value.shape:
                raise ValueError(f"cannot merge: {name} is {tuple(value.shape)} in the fine-tuned model and "
                                 f"{tuple(other.shape)} in the start")
            if value.is_floating_point():
                value.mul_(weight).add_(other.to(value.device, value.dtype), alpha=1.0 - weight)


def merge_with_start(model, start, weight: float):
    """An M3Model whose backbone is merged with `start`'s (an M3Model or a plain Hugging Face encoder)."""
    merge_state(model.backbone, getattr(start, "backbone", start), weight)
    return model


def main(argv: list[str] | None = None) -> None:
    from care.encoders.registry import TRAINING_RECORD, read_record
    from care.encoders.st_folder import declared_pooling, write_st_files
    from care.errors import app_errors
    from care.models.m3 import M3Model, load_backbone

    p = argparse.ArgumentParser(description="Merge a fine-tuned M3 checkpoint with the encoder it started from.")
    p.add_argument("tuned", help="fine-tuned M3 checkpoint folder (FlagEmbedding's format)")
    p.add_argument("start", help="the encoder training started from (a Hugging Face folder or M3 checkpoint)")
    p.add_argument("--weight", type=float, default=0.5, help="share of the fine-tuned model (default 0.5)")
    p.add_argument("--out", required=True, help="output folder (must not exist)")
    a = p.parse_args(argv)
    out = Path(a.out)
    if out.exists():
        p.error(f"{out} exists; the merge never replaces a folder")
    with app_errors("python -m care.training.merge", writes_to=out.parent, resumes=False):
        record = Path(a.tuned) / TRAINING_RECORD
        # the tuned folder's pooling and prompts: from its training record, else its sentence-transformers files
        model_cfg = (read_record(a.tuned)["model"] if record.is_file()
                     else {"kind": "m3", "pooling": declared_pooling(a.tuned) or "cls"})
        model = M3Model.load(a.tuned, model_cfg.get("pooling", "cls"))
        merge_with_start(model, load_backbone(a.start), a.weight)
        model.save(out)
        write_st_files(out, model_cfg)
    print(f"merged {a.tuned} ({a.weight}) with {a.start} ({1 - a.weight:g}) -> {out}")


if __name__ == "__main__":
    main()
