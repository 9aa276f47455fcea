"""Tiny models built from a config in milliseconds, for tests and CPU smoke runs.

- a BERT with the real bert-base-chinese WordPiece vocabulary (so Chinese text tokenises as it would
  with a real Chinese encoder), a few layers, hidden <= 128;
- a tiny Qwen3 decoder for the LLM document-encoder path (last-token pooling, left padding), using the
  same vocabulary through a fast BERT tokenizer so no hub download is needed.

`python -m care.models.tiny OUT_DIR [--kind bert|qwen3]` writes a Hugging Face folder.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import BertConfig, BertModel, BertTokenizerFast, Qwen3Config, Qwen3Model
from transformers.models.bert.tokenization_bert import load_vocab

from care.paths import shared_data


def chinese_vocab_file() -> Path:
    vocab = shared_data() / "bert_base_chinese_vocab" / "vocab.txt"
    if not vocab.exists():
        raise FileNotFoundError(f"{vocab} is missing: set CARE_SHARED_DATA to the folder holding "
                                "bert_base_chinese_vocab/vocab.txt")
    return vocab


def chinese_tokenizer() -> BertTokenizerFast:
    # transformers 5 builds the WordPiece model from `vocab` (a dict) and silently ignores `vocab_file=`
    # (it would give a 5-token vocabulary of special tokens); the ids are the same as 4.x's from vocab_file.
    tok = BertTokenizerFast(vocab=load_vocab(chinese_vocab_file()), do_lower_case=True, tokenize_chinese_chars=True)
    # FlagEmbedding's M3 sparse path needs an eos id; for BERT vocabularies [SEP] plays that role.
    tok.eos_token = "[SEP]"
    return tok


def tiny_bert(hidden: int = 64, layers: int = 2, heads: int = 2, seed: int = 0, dropout: float = 0.1):
    tok = chinese_tokenizer()
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=hidden * 2, max_position_embeddings=512,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertModel(cfg, add_pooling_layer=False), tok


def tiny_qwen3(hidden: int = 64, layers: int = 2, heads: int = 2, seed: int = 0):
    tok = chinese_tokenizer()
    tok.padding_side = "left"
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=1, head_dim=hidden // heads,
                      intermediate_size=hidden * 2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id)
    return Qwen3Model(cfg), tok


def save_tiny(out_dir: str | Path, kind: str = "bert", **kw) -> Path:
    out = Path(out_dir)
    model, tok = (tiny_bert if kind == "bert" else tiny_qwen3)(**kw)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--kind", choices=["bert", "qwen3"], default="bert")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    print(save_tiny(a.out_dir, a.kind, hidden=a.hidden, layers=a.layers))


if __name__ == "__main__":
    main()
