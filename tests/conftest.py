"""Shared fixtures.  Tests run with no network, no GPU and wandb disabled."""
from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

import care  # noqa: F401  (registers config resolvers)
from care.paths import shared_data


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy 2-core machine OpenMP's spinning threads
    made their tests ~10x slower.  Use per module (`pytestmark = pytest.mark.usefixtures("one_thread")`);
    the thread count is restored afterwards for the other test modules of the process."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
