"""The blocked ColBERT score (care.training.head_scores.colbert_scores) equals the plain one-tensor formula, scores and
gradients, for any block size, and never builds the queries x q_len x passages x p_len similarity tensor
(issue #14: GradCache's loss over a large pool must not grow with it)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from care.training import head_scores

pytestmark = pytest.mark.usefixtures("one_thread")

N_Q, Q_LEN, N_P, P_LEN, DIM = 5, 7, 13, 9, 6   # 13 passages: no block size below divides it evenly


def reference(q: dict, p: dict) -> torch.Tensor:
    """The whole similarity tensor at once, plain autograd: what colbert_scores computed before blocking."""
    sim = torch.einsum("qid,pjd->qipj", q["colbert"], p["colbert"])
    sim = sim.masked_fill(~p["colbert_mask"].bool()[None, None], float("-inf"))
    best = sim.max(-1).values * q["colbert_mask"].unsqueeze(-1)
    return best.sum(1) / q["colbert_mask"].sum(1, keepdim=True)


def reps(n: int, length: int, seed: int, dtype=torch.float64) -> dict:
    """M3Model's ColBERT output: right padding, lengths from 1 to full, zero normalised vectors at padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    vectors = F.normalize(torch.randn(n, length, DIM, generator=g, dtype=dtype) * mask.unsqueeze(-1), dim=-1)
    return {"colbert": vectors.requires_grad_(), "colbert_mask": mask}


def scores_and_grads(fn, q: dict, p: dict, weights: torch.Tensor):
    q = {**q, "colbert": q["colbert"].detach().clone().requires_grad_(q["colbert"].requires_grad)}
    p = {**p, "colbert": p["colbert"].detach().clone().requires_grad_(p["colbert"].requires_grad)}
    scores = fn(q, p)
    (scores * weights).sum().backward()
    return scores.detach(), q["colbert"].grad, p["colbert"].grad


# q_len x p_len = 63 similarities per (query, passage).  1, 50, 62: under one pair, clamped to 1 query x 1
# passage; 200: 3 queries (5 = 3 + 2) x 1 passage; 2000: all queries x 6 passages (13 = 6 + 6 + 1);
# 10**6: everything in one block
@pytest.mark.parametrize("budget", [1, 50, 62, 200, 2000, 10**6])
def test_blocked_equals_the_whole_tensor_fp64(budget, monkeypatch):
    q, p = reps(N_Q, Q_LEN, 0), reps(N_P, P_LEN, 1)
    weights = torch.randn(N_Q, N_P, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = scores_and_grads(reference, q, p, weights)
    monkeypatch.setattr(head_scores, "COLBERT_BLOCK_ELEMENTS", budget)
    got = scores_and_grads(head_scores.colbert_scores, q, p, weights)
    for name, a, b in zip(("scores", "query grad", "passage grad"), got, want):
        assert float(b.abs().max()) > 0, name
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    assert float(got[2][~p["colbert_mask"].bool()].abs().max()) == 0  # padding gets no gradient


def test_query_blocks_when_one_passage_is_too_big(monkeypatch):
    monkeypatch.setattr(head_scores, "COLBERT_BLOCK_ELEMENTS", 2 * Q_LEN * P_LEN)  # all 5 queries x 1 passage won't fit
    assert head_scores._colbert_blocks(N_Q, Q_LEN, N_P, P_LEN) == (2, 1)
    monkeypatch.setattr(head_scores, "COLBERT_BLOCK_ELEMENTS", 3 * N_Q * Q_LEN * P_LEN)
    assert head_scores._colbert_blocks(N_Q, Q_LEN, N_P, P_LEN) == (N_Q, 3)


def test_fp32_and_a_frozen_side(monkeypatch):
    """fp32 within 1e-6 of the whole tensor; a side without gradient (a frozen tower) gets none and the other
    side's gradient is unchanged."""
    q, p = reps(N_Q, Q_LEN, 3, torch.float32), reps(N_P, P_LEN, 4, torch.float32)
    p["colbert"].requires_grad_(False)
    weights = torch.randn(N_Q, N_P, generator=torch.Generator().manual_seed(5))
    want = scores_and_grads(reference, q, p, weights)
    monkeypatch.setattr(head_scores, "COLBERT_BLOCK_ELEMENTS", 50)
    got = scores_and_grads(head_scores.colbert_scores, q, p, weights)
    assert got[2] is None and want[2] is None
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class LargestTensor(TorchDispatchMode):
    """The element count of the largest tensor any aten op produces, forward and backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def test_no_queries_x_passages_x_tokens_tensor(monkeypatch):
    q, p = reps(N_Q, Q_LEN, 6), reps(N_P, P_LEN, 7)
    budget = 3 * N_Q * Q_LEN * P_LEN
    monkeypatch.setattr(head_scores, "COLBERT_BLOCK_ELEMENTS", budget)
    with LargestTensor() as rec:
        head_scores.colbert_scores(q, p).sum().backward()
    assert q["colbert"].grad is not None and p["colbert"].grad is not None
    assert rec.largest <= budget < N_Q * Q_LEN * N_P * P_LEN
    with LargestTensor() as rec:  # the control: the recorder does see the plain formula's whole tensor
        reference(q, p).sum().backward()
    assert rec.largest == N_Q * Q_LEN * N_P * P_LEN
