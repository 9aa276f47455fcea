"""Build the tower folders of CARE-style asymmetric encoders (docs/facts.md s.1): a small BERT-style query
tower (CLS pooling, runs online) and an LLM-style document tower (Qwen3, last-token pooling, left padding,
embeddings computed offline).  Each tower is a plain Hugging Face folder (config.json, model.safetensors,
the fast tokenizer files, manifest.json) that AutoModel / AutoTokenizer load from the folder alone, and a
sentence-transformers folder too (care.encoders.st_folder).  The command line is care.tools.build_towers:

    python -m care.tools.build_towers tiny OUT [--seed S] [--force]
    python -m care.tools.build_towers cut SRC OUT --layers N [--pick first|spread] [--force]

- `tiny OUT`: OUT/query = a 2-layer hidden-32 BERT with the real bert-base-chinese vocabulary
  (care.models.tiny.tiny_bert); OUT/document = a 2-layer hidden-64 Qwen3 (care.models.tiny.tiny_qwen3)
  whose tokenizer behaves like a real Qwen3-Embedding tokenizer (care.models.tiny.QWEN3_EMBEDDING_TOKENIZER): it appends
  the end token itself (post-processor, `add_special_tokens=True`), adds no BOS, pads on the left and returns
  no token_type_ids.  The document tower is wider than the query tower, as CARE needs (the document vector,
  normalised at full width, is cut to the query width).  Seeded: the same seed gives the same weights.
- `cut SRC OUT --layers N`: a BertModel-family folder (default source: the offline multilingual-e5-small,
  built first when missing) cut to its embeddings and N of its transformer layers; num_hidden_layers=N; the
  tokenizer files copied byte for byte.  `--pick first` (the default): layers 0..N-1, so its output equals
  the source's hidden_states[N]; `--pick spread`: N layers spread over the depth (`picked_layers`).  The
  manifest records the source layers kept (`picked_layers`).
- `build_from_spec(spec)`: what the model registry calls when a configured tower folder is missing.

Every build is locked, atomic and skipped when up to date (care.encoders.builders.folder; `--force` rebuilds).
"""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path

from care.data.io import file_digest, write_json
from care.encoders.builders.folder import locked_build
from care.encoders.st_folder import declared_pooling, write_st_files

#: bump when a builder's output changes for the same sources and options (invalidates built folders)
BUILDER_VERSION = 2  # 2: each tower is a sentence-transformers folder too (care.encoders.st_folder)

TINY_QUERY = {"hidden": 32, "layers": 2, "heads": 2}
TINY_DOCUMENT = {"hidden": 64, "layers": 2, "heads": 2}
MAX_LENGTH = 512  # both tiny towers have 512 positions

def _n_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    return {"parameters": total, "parameters_without_token_embeddings": total - emb}


# ----------------------------------------------------------------------------------------------------
# tiny

def _tiny_key(seed: int, query: dict, document: dict) -> dict:
    from care.models.tiny import chinese_vocab_file

    # Seeded random weights depend on torch's generator and transformers' initialisers: both versions key it.
    return {"builder_version": BUILDER_VERSION, "tool": "tiny", "seed": seed, "query": query, "document": document,
            "vocab_sha256_16": file_digest(chinese_vocab_file()),
            "torch": version("torch").split("+")[0], "transformers": version("transformers")}


def build_tiny(out: str | Path, seed: int = 0, force: bool = False, query_hidden: int = TINY_QUERY["hidden"],
               document_hidden: int = TINY_DOCUMENT["hidden"]) -> dict:
    """OUT/query (tiny BERT, CLS pooling) and OUT/document (tiny Qwen3, last-token pooling); returns the manifest
    with `skipped` added."""
    if document_hidden < query_hidden:
        raise ValueError(f"the document tower ({document_hidden}) must be at least as wide as the query tower "
                         f"({query_hidden}): its vector is cut to the query width")
    query, document = {**TINY_QUERY, "hidden": query_hidden}, {**TINY_DOCUMENT, "hidden": document_hidden}
    out = Path(out).resolve()

    def write(tmp: Path) -> dict:
        from care.models.tiny import (
            QWEN3_EMBEDDING_TOKENIZER,
            qwen3_embedding_like_tokenizer,
            tiny_bert,
            tiny_qwen3,
        )

        q_model, q_tok = tiny_bert(hidden=query["hidden"], layers=query["layers"], heads=query["heads"], seed=seed)
        q_tok.model_max_length = MAX_LENGTH
        d_model, _ = tiny_qwen3(hidden=document["hidden"], layers=document["layers"], heads=document["heads"],
                                seed=seed)
        d_tok = qwen3_embedding_like_tokenizer()
        assert d_model.config.pad_token_id == d_tok.pad_token_id
        towers = {
            "query": (q_model, q_tok, {"pooling": "cls", "padding_side": q_tok.padding_side}),
            "document": (d_model, d_tok, {
                "pooling": "last_token", "padding_side": "left",
                "tokenizer": {"appended_token": d_tok.eos_token, "appended_token_id": d_tok.eos_token_id,
                              "appended_by": "tokenizer.json post-processor (add_special_tokens=True)",
                              "bos_token": None, "pad_token": d_tok.pad_token, "pad_token_id": d_tok.pad_token_id,
                              "eos_token_attribute_is_appended_token": True,
                              "real_qwen3_embedding": QWEN3_EMBEDDING_TOKENIZER}}),
        }
        info = {}
        for role, (model, tok, extra) in towers.items():
            folder = tmp / role
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
            tower = {"role": role, "model_type": model.config.model_type, "hidden": model.config.hidden_size,
                     "layers": model.config.num_hidden_layers, **_n_params(model), **extra}
            write_json(folder / "manifest.json", {"built_by": "care.tools.build_towers tiny", "seed": seed, **tower})
            write_st_files(folder, {"kind": "dense", "pooling": extra["pooling"], "padding_side": extra["padding_side"],
                                    "max_length": MAX_LENGTH})
            info[role] = tower
        return info

    return locked_build("build_towers", out, _tiny_key(seed, query, document), force, write)


# ----------------------------------------------------------------------------------------------------
# cut

TOKENIZER_FILES = re.compile(r"^(tokenizer(_config)?\.json|special_tokens_map\.json|added_tokens\.json|vocab\.(txt|json)|"
                             r"merges\.txt|.*\.model)$")


def default_source() -> Path:
    from care.encoders.builders.me5 import default_out

    return default_out()


def _load_bert_family(folder: Path):
    from transformers import AutoConfig, AutoModel

    from care.models.hub import POOLER_FAMILIES

    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in POOLER_FAMILIES or not hasattr(config, "num_hidden_layers"):
        raise ValueError(f"{folder} is a {config.model_type!r} model; cut takes a BertModel-family folder "
                         f"({', '.join(POOLER_FAMILIES)})")
    return AutoModel.from_pretrained(folder, dtype="auto", add_pooling_layer=False)


PICKS = ("first", "spread")


def picked_layers(total: int, n: int, pick: str = "first") -> list[int]:
    """The source layers (0-based, in order) a cut to `n` of `total` layers keeps.

    first:  0 .. n-1 (the output is the source's hidden_states[n]).
    spread: n layers evenly spaced over the depth, the first and the last always kept: layer
            floor(i (total - 1) / (n - 1) + 1/2) for i = 0 .. n-1 (n = 1: the last layer alone), e.g.
            12 -> 4: 0, 4, 7, 11; 12 -> 6: 0, 2, 4, 7, 9, 11; n = total: every layer.  Layer 0 reads the kept
            embeddings and the last layer's output is what the source's pooling was trained on, so the stack
            starts and ends as the source's does, with the skipped layers spread evenly between (gaps differ
            by at most one layer; the indices are distinct, each step being >= 1 layer).
    """
    if pick not in PICKS:
        raise ValueError(f"pick={pick!r}: choose one of {', '.join(PICKS)}")
    if not 1 <= n <= total:
        raise ValueError(f"cannot keep {n} of {total} layers")
    if pick == "first":
        return list(range(n))
    if n == 1:
        return [total - 1]
    return [(2 * i * (total - 1) + (n - 1)) // (2 * (n - 1)) for i in range(n)]


def build_cut(source: str | Path | None, out: str | Path, layers: int, force: bool = False,
              pick: str = "first") -> dict:
    """OUT = SOURCE's embeddings + the transformer layers `picked_layers(source layers, layers, pick)`
    (num_hidden_layers=layers) and its tokenizer."""
    from torch import nn

    from care.models.hub import weights_digest

    source = Path(source or default_source()).resolve()
    if not (source / "config.json").is_file():
        if source == default_source().resolve():
            from care.encoders.builders import me5

            me5.build(source)
        else:
            raise FileNotFoundError(f"{source} is not a Hugging Face model folder (no config.json)")
    full = json.loads((source / "config.json").read_text(encoding="utf-8")).get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or not isinstance(full, int) or not 1 <= layers <= full:
        raise ValueError(f"--layers must be an integer from 1 to {full} (the layers {source.name} has), "
                         f"got {layers!r}")
    picks = picked_layers(full, layers, pick)
    out = Path(out).resolve()
    if out == source:
        raise ValueError(f"cut would overwrite its source {source}")
    # `first` keeps the key it had before `pick` existed, so folders cut then stay up to date
    key = {"builder_version": BUILDER_VERSION, "tool": "cut", "source_digest": weights_digest(source),
           "layers": layers, **({} if pick == "first" else {"pick": pick})}

    def write(tmp: Path) -> dict:
        from transformers import AutoTokenizer

        model = _load_bert_family(source)
        model.encoder.layer = nn.ModuleList(model.encoder.layer[i] for i in picks)
        model.config.num_hidden_layers = layers
        model.save_pretrained(tmp)
        copied = sorted(f.name for f in source.iterdir() if f.is_file() and TOKENIZER_FILES.match(f.name))
        if "tokenizer.json" not in copied:
            raise FileNotFoundError(f"{source} has no tokenizer.json (a fast tokenizer) to copy")
        for name in copied:
            shutil.copy2(source / name, tmp / name)
        probe = "癫痫患者可以正常怀孕吗？"
        ids = [AutoTokenizer.from_pretrained(f)(probe)["input_ids"] for f in (tmp, source)]
        if ids[0] != ids[1]:
            raise RuntimeError(f"the tokenizer copied into {out} tokenizes differently from {source}'s")
        write_st_files(tmp, {"kind": "dense", "pooling": declared_pooling(source) or "cls", "max_length": MAX_LENGTH})
        return {"source": str(source), "source_layers": full, "layers": layers, "pick": pick,
                "picked_layers": picks, "tokenizer_files": copied, "hidden": model.config.hidden_size,
                **_n_params(model)}

    return locked_build("build_towers", out, key, force, write)


# ----------------------------------------------------------------------------------------------------
# what the model registry calls

def build_from_spec(spec: Mapping) -> None:
    """Build the folder a model config points at when it is missing (a no-op when it is up to date).

    `spec` names the builder and its arguments, as the command line does:
        {"tool": "tiny", "out": PATH}                                   (optional: "seed")
            -> PATH/query and PATH/document
        {"tool": "cut", "source": PATH, "layers": N, "out": PATH}       ("source" may be left out: me5;
                                                                         optional: "pick", first | spread)
    """
    spec = dict(spec)
    tool, out = spec.pop("tool", None), spec.pop("out", None)
    allowed = {"tiny": {"seed"}, "cut": {"source", "layers", "pick"}}
    if tool not in allowed:
        raise ValueError(f"tower spec 'tool' must be 'tiny' or 'cut', got {tool!r}")
    if out is None:
        raise ValueError(f"tower spec for {tool!r} needs 'out'")
    if unknown := set(spec) - allowed[tool]:
        raise ValueError(f"tower spec for {tool!r} has unknown keys {sorted(unknown)}")
    if tool == "tiny":
        build_tiny(out, **spec)
    elif "layers" not in spec:
        raise ValueError("tower spec for 'cut' needs 'layers'")
    else:
        build_cut(spec.get("source"), out, layers=spec["layers"], pick=spec.get("pick") or "first")
