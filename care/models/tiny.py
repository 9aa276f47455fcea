"""Tiny models built from a config in milliseconds, for tests and CPU smoke runs.

- a BERT with the real bert-base-chinese WordPiece vocabulary (so Chinese text tokenises as it would
  with a real Chinese encoder), a few layers, hidden <= 128;
- a tiny Qwen3 decoder for the LLM document-encoder path (last-token pooling, left padding), using the
  same vocabulary through a fast BERT tokenizer so no hub download is needed; the CARE tiny document tower
  pairs it with `qwen3_embedding_like_tokenizer`, which handles the end token as a real Qwen3-Embedding
  tokenizer does (`QWEN3_EMBEDDING_TOKENIZER`);
- a tiny cross-encoder reranker: the BERT above with a one-label sequence-classification head (the folder
  layout FlagReranker and sentence-transformers' CrossEncoder load; care.encoders.cross_encoder).

`python -m care.models.tiny OUT_DIR [--kind bert|qwen3|reranker]` writes a Hugging Face folder.
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
    Qwen3Config,
    Qwen3Model,
)
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


def tiny_reranker(hidden: int = 64, layers: int = 2, heads: int = 2, seed: int = 0, dropout: float = 0.1):
    """tiny_bert's backbone with one relevance logit on top (num_labels 1)."""
    tok = chinese_tokenizer()
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=hidden * 2, max_position_embeddings=512,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, num_labels=1)
    return BertForSequenceClassification(cfg), tok


def tiny_qwen3(hidden: int = 64, layers: int = 2, heads: int = 2, seed: int = 0):
    tok = chinese_tokenizer()
    tok.padding_side = "left"
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=1, head_dim=hidden // heads,
                      intermediate_size=hidden * 2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id)
    return Qwen3Model(cfg), tok


#: What a real Qwen3-Embedding tokenizer (Qwen/Qwen3-Embedding-0.6B/4B/8B, transformers' Qwen2TokenizerFast)
#: does with the end token; the tiny document tower reproduces the behaviour, recorded in its manifest.
#: Sources: QwenLM/Qwen3-Embedding issues #54 (maintainer: "an EOS token is automatically added at the end, so
#: you no longer need to add it manually") and #122 (`tokenizer(["test", "test again"], padding=True)` gives
#: [[151643, 1944, 151643], [1944, 1549, 151643]] with eos_token_id 151645, pad_token_id 151643);
#: ggml-org/llama.cpp #14252 and PR #14314 (the TemplateProcessing was added to tokenizer.json later, as a fix,
#: and appends a different token than tokenizer_config's eos_token); transformers 4.57 Qwen2TokenizerFast
#: (no add_eos_token / add_bos_token handling: only tokenizer.json's post-processor adds tokens).
QWEN3_EMBEDDING_TOKENIZER = {
    "appended_token": "<|endoftext|> (151643), after every sequence, by the TemplateProcessing post-processor of "
                      "tokenizer.json; only with add_special_tokens=True (the default) and only by the fast "
                      "tokenizer (the slow Qwen2Tokenizer adds nothing)",
    "eos_token_attribute": "<|im_end|> (151645): NOT the appended token",
    "pad_token": "<|endoftext|> (151643): the same id as the appended token",
    "bos_token": None,
    "padding_side": "left (the model card loads the tokenizer with padding_side='left')",
    "truncation": "the post-processor's token is reserved, so a truncated text still ends with it",
    "pooling": "the hidden state of that last token (last_token_pool: position -1 under left padding)",
    "history": "the first release had no TemplateProcessing and the model card appended <|endoftext|> by hand; "
               "appending it by hand to the current tokenizer gives two",
    "rules": ["never append an end token by hand: the tokenizer does",
              "find the last token from the attention mask, never from input_ids != pad_token_id",
              "never check ids[-1] == tokenizer.eos_token_id: on the real tokenizer they differ"],
}


def qwen3_embedding_like_tokenizer():
    """The bert-base-chinese vocabulary behind a tokenizer that behaves like Qwen3-Embedding's: no BOS, the end
    token ([SEP]) appended by the post-processor, left padding, pad [PAD], only input_ids + attention_mask."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    bert = chinese_tokenizer()
    backend = copy.deepcopy(bert.backend_tokenizer)
    eos = "[SEP]"
    backend.post_processor = TemplateProcessing(single=f"$A:0 {eos}:0", pair=f"$A:0 {eos}:0 $B:1 {eos}:1",
                                                special_tokens=[(eos, bert.convert_tokens_to_ids(eos))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token=eos, unk_token="[UNK]",
                                   padding_side="left", model_max_length=512,
                                   model_input_names=["input_ids", "attention_mask"])


def save_tiny(out_dir: str | Path, kind: str = "bert", **kw) -> Path:
    out = Path(out_dir)
    model, tok = {"bert": tiny_bert, "qwen3": tiny_qwen3, "reranker": tiny_reranker}[kind](**kw)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--kind", choices=["bert", "qwen3", "reranker"], default="bert")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    print(save_tiny(a.out_dir, a.kind, hidden=a.hidden, layers=a.layers))


if __name__ == "__main__":
    main()
