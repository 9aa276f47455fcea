"""Make a model folder a sentence-transformers folder too: `SentenceTransformer(folder)` loads it offline, in a
process that never imports this project, and `encode_query` / `encode_document` return the vectors of the
project's own `encode_queries` / `encode_documents` (default task): same prompts, pooling, normalisation,
truncation and token limit (tests/test_st_folders.py holds them equal to 1e-5).

Only small configuration files are added; the weights stay where the project wrote them, and none of these
files enters a folder's weights digest (care.models.hub.DIGEST_SKIP), so embedding caches keyed before they
existed stay valid.

    dense, m3   modules.json: Transformer (the folder itself) -> Pooling (the model's own) -> Normalize
                [-> a fixed selection Dense when the config cuts vectors to `truncate_dim`].  An M3 folder keeps
                FlagEmbedding's colbert_linear.pt / sparse_linear.pt beside them (BGE-M3's own hub layout):
                sentence-transformers reads the dense head, BGEM3FlagModel all three.
    care        modules.json: one Router whose "query" route is the small tower (query/) and whose "document"
                route is the large one (document/), each Transformer -> Pooling -> Normalize; the document
                route ends in a fixed selection Dense that keeps the first query-width dimensions, after
                normalising and without re-normalising: CARE's cut (docs/facts.md s.1), built from
                sentence-transformers' own modules, so no trust_remote_code is needed.

Prompts: a side's prefix becomes its named prompt ("query", "document"); a template ending in `{text}` becomes
its prefix; a query template with `{instruction}` gives one prompt per task type, "query" for the default task
(retrieval) and "query_<task>" for the others (`model.encode_query(texts, prompt_name="query_sts")`).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from care.data.io import write_json
from care.encoders.prompts import DEFAULT_TASK, Prompts
from care.families import family_of, hook
from care.models.hub import POOLER_FAMILIES

#: the files this module writes at a folder's top level (and a tower's): never part of the weights digest
ST_FILES = ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json", "router_config.json")
#: the project's pooling names -> sentence-transformers' Pooling modes
POOLING_MODES = {"cls": "cls", "mean": "mean", "last_token": "lasttoken"}


def _type_name(cls) -> str:
    return f"{cls.__module__}.{cls.__name__}"


def _prefix(prompt: str, where: str) -> str:
    """A prompt as the prefix sentence-transformers prepends: a template must end in `{text}`."""
    if "{text}" not in prompt:
        return prompt
    if not prompt.endswith("{text}") or prompt.count("{text}") != 1:
        raise ValueError(f"{where} {prompt!r} puts text before its end: sentence-transformers prompts are "
                         f"prefixes, so this folder cannot be loaded there with the same inputs")
    return prompt[: -len("{text}")]


def st_prompts(prompts: Prompts) -> dict[str, str]:
    """sentence-transformers' named prompts for the project's Prompts (the module docstring)."""
    out = {"document": _prefix(prompts.document, "the document prompt")}
    if "{instruction}" in prompts.query:
        tasks = [DEFAULT_TASK, *sorted(t for t in prompts.instructions if t != DEFAULT_TASK)]
        for task in tasks:
            name = "query" if task == DEFAULT_TASK else f"query_{task}"
            out[name] = _prefix(prompts.query.replace("{instruction}", prompts.instruction("query", task)),
                                "the query prompt")
    else:
        out["query"] = _prefix(prompts.query, "the query prompt")
    return out


def declared_pooling(folder: str | Path) -> str | None:
    """The project's name of the pooling a sentence-transformers folder declares (1_Pooling), or None."""
    config = Path(folder) / "1_Pooling" / "config.json"
    if not config.is_file():
        return None
    mode = json.loads(config.read_text(encoding="utf-8")).get("pooling_mode")
    return next((ours for ours, theirs in POOLING_MODES.items() if theirs == mode), None)


def _hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} holds no config.json: not a Hugging Face model folder")
    return json.loads(path.read_text(encoding="utf-8"))


def _transformer_config(folder: Path, max_length: int, padding_side: str) -> None:
    """sentence_bert_config.json of a Transformer module whose weights are `folder`'s own files."""
    config = _hf_config(folder)
    body = {"max_seq_length": int(max_length), "transformer_task": "feature-extraction",
            "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
            "module_output_name": "token_embeddings",
            # the side the project pads on: a decoder tower's positions (and so its vectors) depend on it
            "processor_kwargs": {"padding_side": padding_side}}
    if config.get("model_type") in POOLER_FAMILIES:  # no random pooler (and no load warning): none is used
        body["model_kwargs"] = {"add_pooling_layer": False}
    write_json(folder / "sentence_bert_config.json", body)


def _route(root: Path, transformer: str, prefix: str, pooling: str, max_length: int, normalize: bool = True,
           truncate_dim: int | None = None, padding_side: str = "right") -> list[tuple[str, type]]:
    """Write one chain's small modules under `root`; returns (path relative to root, class) in order."""
    import torch
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling {pooling!r} has no sentence-transformers equivalent (choose {', '.join(POOLING_MODES)})")
    tower = root / transformer if transformer else root
    width = int(_hf_config(tower)["hidden_size"])
    _transformer_config(tower, max_length, padding_side)
    chain: list[tuple[str, object]] = [(transformer, None), (f"{prefix}1_Pooling", Pooling(width, POOLING_MODES[pooling]))]
    if normalize:
        chain.append((f"{prefix}{len(chain)}_Normalize", Normalize()))
    if truncate_dim and truncate_dim < width:
        # the first truncate_dim coordinates, exactly (x * 1 + 0 * rest): CARE's Matryoshka cut
        select = torch.eye(width)[:truncate_dim].clone()
        with torch.random.fork_rng(devices=[]):  # nn.Linear's init draws from torch's RNG: a checkpoint written
            # mid-run must not move the run's random stream (dropout), or resume would not be exact
            dense = Dense(width, truncate_dim, bias=False, activation_function=torch.nn.Identity(), init_weight=select)
        chain.append((f"{prefix}{len(chain)}_Dense", dense))
    out = [(transformer, Transformer)]
    for path, module in chain[1:]:
        # a fresh folder: its files may be hard links shared with the folder this one was made from
        # (care.data.io.link_or_copy_tree), and a module's save writes them in place
        shutil.rmtree(root / path, ignore_errors=True)
        (root / path).mkdir(parents=True)
        module.save(str(root / path))
        out.append((path, type(module)))
    return out


def _modules_json(folder: Path, chain: list[tuple[str, type]]) -> None:
    write_json(folder / "modules.json", [{"idx": i, "name": str(i), "path": path, "type": _type_name(cls)}
                                          for i, (path, cls) in enumerate(chain)])


def _model_config(folder: Path, prompts: dict[str, str], similarity: str) -> None:
    import sentence_transformers
    import torch
    import transformers

    write_json(folder / "config_sentence_transformers.json", {
        "__version__": {"sentence_transformers": sentence_transformers.__version__,
                        "transformers": transformers.__version__, "pytorch": torch.__version__},
        "model_type": "SentenceTransformer", "prompts": prompts, "default_prompt_name": None,
        "similarity_fn_name": similarity})


def write_st_files(folder: str | Path, model_cfg: dict) -> Path:
    """Add the sentence-transformers files to a saved model folder described by `model_cfg` (a model config as
    care_training.json records it: kind, pooling, prompts, max_length; a CARE config's towers live in
    `folder`/query and `folder`/document): its family's layout (care.families).  Returns the folder."""
    return hook(family_of(model_cfg), "st_files")(Path(folder), model_cfg)


def write_dense(folder: Path, model_cfg: dict) -> Path:
    """One backbone, normalised unless the config says otherwise, padded on the configured side."""
    return _one_backbone(folder, model_cfg, bool(model_cfg.get("normalize", True)),
                         model_cfg.get("padding_side", "right"))


def write_m3(folder: Path, model_cfg: dict) -> Path:
    """One backbone as care.encoders.m3 runs it: always normalised, padded on the right."""
    return _one_backbone(folder, model_cfg, True, "right")


def _one_backbone(folder: Path, model_cfg: dict, normalize: bool, padding_side: str) -> Path:
    truncate = model_cfg.get("truncate_dim")  # the dense vector cut, as the encoders cut it
    chain = _route(folder, "", "", model_cfg.get("pooling", "cls"), model_cfg.get("max_length", 512),
                   normalize, truncate, padding_side)
    _modules_json(folder, chain)
    # a cut vector is not unit length: its score is the dot product, as evaluate.py scores it
    _model_config(folder, st_prompts(Prompts.from_config(model_cfg)),
                  "dot" if truncate or not normalize else "cosine")
    return folder


def write_router(folder: Path, model_cfg: dict) -> Path:
    """Two towers behind one Router (the module docstring)."""
    from sentence_transformers.base.modules import Router

    query, document = model_cfg["query"], model_cfg["document"]
    q_width = int(_hf_config(folder / "query")["hidden_size"])
    structure, types = {}, {}
    for side, tower, cut in (("query", query, None), ("document", document, q_width)):
        chain = _route(folder, side, f"{side}_", tower.get("pooling", "cls"), tower.get("max_length", 512),
                       truncate_dim=cut, padding_side=tower.get("padding_side", "right"))
        structure[side] = [path for path, _ in chain]
        types.update({path: _type_name(cls) for path, cls in chain})
    write_json(folder / "router_config.json", {
        "types": types, "structure": structure,
        "parameters": {"default_route": "document", "allow_empty_key": True, "route_mappings": {}}})
    _modules_json(folder, [("", Router)])
    # queries are unit vectors, documents a unit vector's prefix: CARE scores with the dot product
    _model_config(folder, st_prompts(Prompts.from_config(model_cfg)), "dot")
    return folder


#: sentence-transformers' CrossEncoder applies this to a one-label model's logits (its default there is a sigmoid)
CROSS_ENCODER_ACTIVATION = "torch.nn.modules.linear.Identity"


def write_cross_encoder(folder: Path, model_cfg: dict) -> Path:
    """A cross-encoder (care.encoders.cross_encoder) is a sequence-classification folder that CrossEncoder and
    FlagReranker load as they find it; config.json only learns the activation, so that CrossEncoder.predict
    returns the raw logit the project scores (FlagReranker's compute_score without normalize)."""
    config = _hf_config(folder)
    config["sentence_transformers"] = {**config.get("sentence_transformers", {}),
                                       "activation_fn": CROSS_ENCODER_ACTIVATION}
    write_json(folder / "config.json", config)
    return folder
