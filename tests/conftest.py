"""Shared fixtures.  Tests run with no network, no GPU and wandb disabled."""
from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

import care  # noqa: E402,F401  (registers config resolvers)
from care.paths import shared_data  # noqa: E402


@pytest.fixture(scope="session")
def shared():
    root = shared_data()
    if not root.exists():
        pytest.fail(f"shared data not found at {root}; set CARE_SHARED_DATA")
    return root


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A saved tiny BERT folder (real bert-base-chinese vocabulary, random weights)."""
    from care.models.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-bert"), "bert")
