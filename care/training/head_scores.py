"""The training scores of M3's three heads, query batch x passage pool, differentiable (care.training.losses
divides them by each head's temperature).  What care.models.m3.M3Model.forward returns is what they read:

- dense:   dot product of the normalised pooled vectors;
- sparse:  sum over shared token ids of the weight products.  The weights are scattered (max over repeats)
           into batch x (token ids present in the batch), never into the vocabulary: FlagEmbedding builds a
           batch x length x vocabulary tensor here, its most reported out-of-memory cause;
- ColBERT: mean over real query tokens of the best similarity with a real passage token, in blocks
           (`_MaxSim`), so the loss over a GradCache pool fits in a fixed memory.

Inference scores the same heads on numpy vectors in care/encoders/scores.py.
"""
from __future__ import annotations

import torch

# Blocks of the ColBERT score: at most this many query-token x passage-token similarities exist at once
# (16 MiB in fp32), in the forward and in the backward alike, so the loss over a GradCache pool needs
# memory that does not grow with queries x passages x tokens (bench/train_bench.py measures it).
COLBERT_BLOCK_ELEMENTS = 1 << 22


def dense_scores(q: dict, p: dict) -> torch.Tensor:
    return q["dense"] @ p["dense"].T


def sparse_scores(q: dict, p: dict) -> torch.Tensor:
    """Lexical matching score of every query with every passage.  Weights are scattered (max over repeats)
    into a [texts, U] matrix over the U distinct token ids of this batch, never into the vocabulary:
    exact, differentiable, and U is a few thousand where the vocabulary is 250,002."""
    q_ids, p_ids = q["sparse_ids"], p["sparse_ids"]
    unique, inverse = torch.unique(torch.cat([q_ids.flatten(), p_ids.flatten()]), return_inverse=True)
    q_cols, p_cols = inverse[: q_ids.numel()].view_as(q_ids), inverse[q_ids.numel():].view_as(p_ids)

    def bag(weights, cols):
        # include_self keeps the zero start, harmless because ReLU weights are >= 0.
        return weights.new_zeros(weights.size(0), len(unique)).scatter_reduce(1, cols, weights, "amax")

    return bag(q["sparse"], q_cols) @ bag(p["sparse"], p_cols).T


def _colbert_blocks(n_q: int, q_len: int, n_p: int, p_len: int) -> tuple[int, int]:
    """(queries, passages) per block so that one block's similarity tensor has at most
    COLBERT_BLOCK_ELEMENTS entries: the whole query batch x a passage slice or, where one passage against
    all queries is already too big, a query slice x one passage (never less than 1 x 1)."""
    pair = max(1, q_len * p_len)
    q_block = n_q if n_q * pair <= COLBERT_BLOCK_ELEMENTS else max(1, COLBERT_BLOCK_ELEMENTS // pair)
    return q_block, max(1, min(n_p, COLBERT_BLOCK_ELEMENTS // (q_block * pair)))


def _blocks(n_q: int, q_len: int, n_p: int, p_len: int):
    q_block, p_block = _colbert_blocks(n_q, q_len, n_p, p_len)
    for qs in range(0, n_q, q_block):
        for ps in range(0, n_p, p_block):
            yield slice(qs, qs + q_block), slice(ps, ps + p_block)


def _block_buffer(like: torch.Tensor, n_q: int, q_len: int, n_p: int, p_len: int) -> torch.Tensor:
    """One flat buffer for the largest block, reused by every block: a fresh similarity-sized tensor per
    block fragments the CPU heap, and the resident memory then keeps several of them."""
    q_block, p_block = _colbert_blocks(n_q, q_len, n_p, p_len)
    return like.new_empty(min(q_block, n_q) * q_len * min(p_block, n_p) * p_len)


def _as_block(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return buffer[: rows * cols].view(rows, cols)


class _MaxSim(torch.autograd.Function):
    """best[q, i, p] = max over the real tokens j of passage p of <qv[q, i], pv[p, j]>, block by block
    (`_colbert_blocks`) in one reused buffer.  Plain autograd over the blocks would keep every block's argmax
    as int64 and build two or three similarity-sized tensors per block in the backward (max's scatter,
    masked_fill's copy).  Here the forward keeps only the argmax (int16 for passages under 32768 tokens), and
    the backward writes the one-hot gradient of one block at a time into the buffer and accumulates both
    products in place.  The gradient is autograd's (same argmax, same products), summed over blocks.
    The products run in the inputs' dtype, also under autocast (the loss is at least fp32: losses.py)."""

    @staticmethod
    def forward(ctx, qv: torch.Tensor, pv: torch.Tensor, p_pad: torch.Tensor) -> torch.Tensor:
        (n_q, q_len, dim), (n_p, p_len, _) = qv.shape, pv.shape
        best = qv.new_empty(n_q, q_len, n_p)
        index_dtype = torch.int16 if p_len <= torch.iinfo(torch.int16).max else torch.int64
        argmax = torch.empty(n_q, q_len, n_p, dtype=index_dtype, device=qv.device)
        buffer = _block_buffer(qv, n_q, q_len, n_p, p_len)
        for qs, ps in _blocks(n_q, q_len, n_p, p_len):
            q_rows, p_rows = qv[qs].reshape(-1, dim), pv[ps].reshape(-1, dim)
            sim = torch.mm(q_rows, p_rows.T, out=_as_block(buffer, len(q_rows), len(p_rows)))
            sim = sim.view(-1, q_len, len(p_rows) // p_len, p_len)
            best[qs, :, ps], argmax[qs, :, ps] = sim.masked_fill_(p_pad[ps][None, None], float("-inf")).max(-1)
        ctx.save_for_backward(qv, pv, p_pad, argmax)
        return best

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        qv, pv, p_pad, argmax = ctx.saved_tensors
        want_q, want_p = ctx.needs_input_grad[:2]
        (n_q, q_len, dim), (n_p, p_len, _) = qv.shape, pv.shape
        grad_q = qv.new_zeros(qv.shape) if want_q else None
        grad_p = pv.new_zeros(pv.shape) if want_p else None
        buffer = _block_buffer(grad, n_q, q_len, n_p, p_len)
        for qs, ps in _blocks(n_q, q_len, n_p, p_len):
            g = grad[qs, :, ps]  # [queries, q_len, passages] of this block
            one_hot = _as_block(buffer, g.size(0) * q_len, g.size(2) * p_len)
            blocked = one_hot.view(*g.shape, p_len).zero_()
            blocked.scatter_(-1, argmax[qs, :, ps].long().unsqueeze(-1), g.unsqueeze(-1))
            blocked.masked_fill_(p_pad[ps][None, None], 0)  # as masked_fill's backward (an all-padding passage)
            if want_q:
                grad_q[qs].view(-1, dim).addmm_(one_hot, pv[ps].reshape(-1, dim))
            if want_p:
                grad_p[ps].view(-1, dim).addmm_(one_hot.T, qv[qs].reshape(-1, dim))
        return grad_q, grad_p, None


def colbert_scores(q: dict, p: dict) -> torch.Tensor:
    """Mean over real query tokens of the max similarity with a real passage token.  Padding is excluded
    from the max, as FlagEmbedding's inference does (its training lets zero padding vectors into the max).
    Computed in blocks (`_MaxSim`): the queries x q_len x passages x p_len similarity tensor is never built,
    so GradCache's loss over a large pool fits in a fixed memory (measured by bench/train_bench.py)."""
    qv, q_mask, pv, p_mask = q["colbert"], q["colbert_mask"], p["colbert"], p["colbert_mask"]
    best = _MaxSim.apply(qv, pv, ~p_mask.bool()) * q_mask.unsqueeze(-1)  # [Q, q_len, P]; padded queries 0
    return best.sum(1) / q_mask.sum(1, keepdim=True)


HEAD_SCORES = {"dense": dense_scores, "sparse": sparse_scores, "colbert": colbert_scores}
