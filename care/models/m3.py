"""BGE-M3 style encoder: one Hugging Face backbone, three heads (docs/facts.md s.2).

- dense:   the CLS (or mean-pooled) hidden state, L2-normalised; score = dot product.
- sparse:  Linear(hidden, 1) -> ReLU gives one weight per token; a token id that repeats keeps its largest
           weight; CLS/EOS/PAD/UNK are zeroed; score = sum over shared token ids of the weight products.
- ColBERT: Linear on every token but CLS, padding masked, L2-normalised; score = mean over query tokens
           of the best similarity with any passage token.

The definitions follow FlagEmbedding 1.4.2 (`finetune/embedder/encoder_only/m3/modeling.py`) exactly, and
`save` writes its checkpoint format (HF model folder + `colbert_linear.pt` + `sparse_linear.pt` +
tokenizer), so `FlagEmbedding.BGEM3FlagModel` loads what we train.  Two deliberate differences:

- training never builds a batch x length x vocabulary tensor for the sparse head (FlagEmbedding does, and
  it is its most reported out-of-memory cause): the model returns per-position weights and `sparse_scores`
  scatters them into batch x (token ids present in the batch);
- `M3Model.load` refuses a folder without the head files (FlagEmbedding silently uses random heads).

`python -m care.models.m3 tiny OUT` writes a tiny random M3 checkpoint (tests, smoke runs);
`python -m care.models.m3 init OUT --backbone PATH` turns any backbone folder into an M3 checkpoint with
freshly initialised heads (the starting point for training from a plain encoder).
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoTokenizer

from care.data.io import atomic_folder
from care.models import HEADS
from care.models.hub import load_encoder_model, local_folder, read_torch
from care.models.pooling import pool

HEAD_FILES = ("colbert_linear.pt", "sparse_linear.pt")
# Blocks of the ColBERT score: at most this many query-token x passage-token similarities exist at once
# (16 MiB in fp32), in the forward and in the backward alike, so the loss over a GradCache pool needs
# memory that does not grow with queries x passages x tokens (bench/train_bench.py measures it).
COLBERT_BLOCK_ELEMENTS = 1 << 22


def ensure_eos(tokenizer) -> None:
    """The M3 sparse head zeroes the EOS token, and FlagEmbedding reads `eos_token_id`; BERT vocabularies
    have no EOS, and there [SEP] plays that role (as in care.models.tiny.chinese_tokenizer)."""
    if tokenizer.eos_token_id is None:
        if tokenizer.sep_token is None:
            raise ValueError("the tokenizer has neither an EOS nor a SEP token; the M3 sparse head needs one")
        tokenizer.eos_token = tokenizer.sep_token


class M3Model(nn.Module):
    """Backbone + ColBERT and sparse heads.  `forward` returns the training representations:

    dense         [B, H]       normalised pooled vectors
    sparse        [B, L]       token weights, zero at special tokens and padding
    sparse_ids    [B, L]       the input ids the weights belong to (no gradient)
    colbert       [B, L-1, D]  normalised token vectors without CLS, zero at padding
    colbert_mask  [B, L-1]     1 for real tokens (no gradient)

    `backbone_heads` names the heads whose loss gradient reaches the backbone (all three by default, the
    source recipe).  A head left out reads the backbone's hidden states detached: it still learns, but its
    loss no longer moves the shared encoder, so fresh heads cannot drag a pretrained dense model around
    while they are still random (`trainer.backbone_heads`).
    """

    def __init__(self, backbone: nn.Module, tokenizer, pooling: str = "cls", colbert_dim: int = -1,
                 colbert_linear: nn.Linear | None = None, sparse_linear: nn.Linear | None = None):
        super().__init__()
        ensure_eos(tokenizer)
        if getattr(backbone, "pooler", None) is not None:
            backbone.pooler = None  # never used by M3; left in, it gets no gradient and DDP errors on it
        # ColBERT drops position 0 as CLS and keeps the real tokens that follow: right padding only.
        tokenizer.padding_side = "right"
        self.backbone, self.tokenizer, self.pooling = backbone, tokenizer, pooling
        hidden = backbone.config.hidden_size
        dtype = next(backbone.parameters()).dtype
        # nn.Linear's default initialisation, exactly what FlagEmbedding gives fresh heads.
        if colbert_linear is None:
            colbert_linear = nn.Linear(hidden, hidden if colbert_dim <= 0 else colbert_dim, dtype=dtype)
        self.colbert_linear = colbert_linear
        self.sparse_linear = sparse_linear if sparse_linear is not None else nn.Linear(hidden, 1, dtype=dtype)
        special = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
        self.backbone_heads: tuple[str, ...] = HEADS
        self.register_buffer("special_ids", torch.tensor(sorted(i for i in special if i is not None)),
                             persistent=False)

    def set_backbone_heads(self, heads: Sequence[str]) -> None:
        unknown = sorted(set(heads) - set(HEADS))
        if unknown or not heads:
            raise ValueError(f"backbone_heads={list(heads)}: name one or more of {', '.join(HEADS)} (the heads "
                             f"whose loss trains the backbone; to train no backbone at all, freeze it instead)")
        self.backbone_heads = tuple(h for h in HEADS if h in heads)

    @property
    def config(self):
        return self.backbone.config

    def gradient_checkpointing_enable(self) -> None:
        # Non-reentrant checkpointing: works with frozen inputs, GradCache's re-forward and DDP (docs/facts.md s.3).
        self.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **inputs) -> dict[str, torch.Tensor]:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **inputs).last_hidden_state
        return self.heads(hidden, input_ids, attention_mask)

    def heads(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The three heads on the backbone's last hidden states (care/encoders/m3.py runs the backbone in ONNX
        Runtime and these in torch)."""
        detached = hidden.detach()
        features = {h: hidden if h in self.backbone_heads else detached for h in HEADS}
        dense = F.normalize(pool(features["dense"], attention_mask, self.pooling), dim=-1)
        keep = attention_mask.bool() & ~torch.isin(input_ids, self.special_ids)
        sparse = torch.relu(self.sparse_linear(features["sparse"])).squeeze(-1) * keep
        colbert_mask = attention_mask[:, 1:]
        colbert = F.normalize(self.colbert_linear(features["colbert"][:, 1:]) * colbert_mask.unsqueeze(-1), dim=-1)
        return {"dense": dense, "sparse": sparse, "sparse_ids": input_ids, "colbert": colbert,
                "colbert_mask": colbert_mask}

    # ---- checkpoints in FlagEmbedding's format -------------------------------------------------------
    def save(self, out_dir: str | Path) -> Path:
        """Write the whole folder beside `out_dir`, then swap it in, so a crash never leaves half a
        checkpoint (the folder is replaced as a whole: give each checkpoint its own folder)."""
        with atomic_folder(out_dir) as tmp:
            self.backbone.save_pretrained(tmp)
            for name, head in zip(HEAD_FILES, (self.colbert_linear, self.sparse_linear)):
                torch.save({k: v.detach().clone().cpu() for k, v in head.state_dict().items()}, tmp / name)
            self.tokenizer.save_pretrained(tmp)
        return Path(out_dir)

    @classmethod
    def load(cls, name_or_path: str | Path, pooling: str = "cls", dtype: torch.dtype | None = None,
             build_hint: str = "") -> M3Model:
        folder = local_folder(name_or_path, build_hint)
        missing = [f for f in HEAD_FILES if not (folder / f).exists()]
        if missing:
            raise FileNotFoundError(
                f"{folder} is not an M3 checkpoint: {', '.join(missing)} missing. FlagEmbedding would silently "
                f"use randomly initialised heads here; we refuse. To start training from a plain encoder, "
                f"write fresh heads first: python -m care.models.m3 init OUT --backbone {folder}")
        backbone = load_encoder_model(folder, dtype)
        heads = [read_torch(folder / f) for f in HEAD_FILES]  # a truncated one named (DataError)
        colbert = nn.Linear(heads[0]["weight"].shape[1], heads[0]["weight"].shape[0], dtype=backbone.dtype)
        sparse = nn.Linear(heads[1]["weight"].shape[1], 1, dtype=backbone.dtype)
        colbert.load_state_dict(heads[0])
        sparse.load_state_dict(heads[1])
        return cls(backbone, AutoTokenizer.from_pretrained(folder), pooling, colbert_linear=colbert,
                   sparse_linear=sparse)

    @classmethod
    def from_backbone(cls, name_or_path: str | Path, pooling: str = "cls", colbert_dim: int = -1,
                      seed: int = 0, dtype: torch.dtype | None = None) -> M3Model:
        """Any HF encoder with fresh (seeded) heads: the starting point for M3 training."""
        folder = local_folder(name_or_path)
        backbone = load_encoder_model(folder, dtype)
        torch.manual_seed(seed)
        return cls(backbone, AutoTokenizer.from_pretrained(folder), pooling, colbert_dim)


def load_backbone(name_or_path: str | Path, build_hint: str = "") -> nn.Module:
    """The plain encoder of a Hugging Face folder, an M3 checkpoint or a hub id, without heads: what a
    merge with the start needs (care.training.merge)."""
    return load_encoder_model(local_folder(name_or_path, build_hint))


def tiny_m3(hidden: int = 64, layers: int = 2, heads: int = 2, seed: int = 0, dropout: float = 0.1,
            pooling: str = "cls") -> M3Model:
    """A tiny BERT with the bert-base-chinese vocabulary and seeded random heads (tests, smoke runs)."""
    from care.models.tiny import tiny_bert

    backbone, tok = tiny_bert(hidden=hidden, layers=layers, heads=heads, seed=seed, dropout=dropout)
    torch.manual_seed(seed + 1)
    return M3Model(backbone, tok, pooling)


# ---- differentiable scores: query batch x passage pool -----------------------------------------------
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tiny = sub.add_parser("tiny", help="a tiny random M3 checkpoint (bert-base-chinese vocabulary)")
    tiny.add_argument("out_dir")
    tiny.add_argument("--hidden", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    init = sub.add_parser("init", help="an M3 checkpoint from any HF encoder folder, with fresh heads")
    init.add_argument("out_dir")
    init.add_argument("--backbone", required=True)
    init.add_argument("--colbert-dim", type=int, default=-1, help="-1: the hidden size (as bge-m3)")
    init.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.cmd == "tiny":
        model = tiny_m3(hidden=a.hidden, layers=a.layers)
    else:
        model = M3Model.from_backbone(a.backbone, colbert_dim=a.colbert_dim, seed=a.seed)
    print(model.save(a.out_dir))


if __name__ == "__main__":
    main()
