"""The CARE recipe: `python train.py model=care_X` runs stage I then stage II (docs/facts.md s.1), each a run
of the ordinary loop with the stage's settings from the model config (`stages.stage1`, `stages.stage2`),
into outputs/train/<run>/stage1/ and stage2/; outputs/train/<run>/final/ then holds the last stage's model
(hard links to its files, its care_training.json naming both stages, which evaluate.py ckpt= reads).  `model.stage=stage1` (or stage2) runs one stage.

Stage I's examples are same-text pairs over the training text store (plus `stages.stage1.extra_texts`,
text stores of unlabelled texts the leakage rule admits): no labels needed.  Stage II trains on the mined
training file, starting from stage I's query tower; it alone can distil teacher scores
(`stages.stage2.loss.teacher_weight`: the mined file's `teacher_*_scores`).  Matryoshka widths
(`stages.<stage>.loss.matryoshka_dims`) apply to either stage.

Stage I's recipe-study options (`stages.stage1`, each off by default, and then stage I's files are those
same_text_pairs writes, byte for byte):
- `query_share` (null or 0..1): the share of query-kind texts in the stage-I example list (`text_mix`);
- `query_text_max_length` / `document_text_max_length` (null or tokens): the limit the QUERY tower
  tokenizes a text of that kind with in stage I's steps (care.training.care_family.CAREFamily.tokenize);
- `heldout_texts` (N >= 0): a seeded slice of N texts kept out of the examples, on which validation
  reports val/align_cos and val/align_acc (care.training.validation.AlignmentLog).
A text's kind (`text_kind`) is its id's role, {source}:{role}:{native} (care/data/records.py: text_id):
question, query, sentence -> query; answer, title, document -> document; an id without a known role is a
query when the training file names it as a query_id, else a document.  With any option on, stage I's
texts.jsonl carries each text's "kind" (and "heldout": true on the slice) and composition.json the counts.
"""
from __future__ import annotations

import gc
import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from care.data.examples import read_example_rows, write_examples
from care.data.io import (
    atomic_folder,
    link_or_copy_tree,
    read_text_store,
    write_json,
    write_jsonl,
)
from care.encoders.registry import TRAINING_RECORD, ensure_towers, read_record
from care.export.card import write_model_card
from care.training.care_family import KINDS, STAGES
from care.training.checkpoint import AlreadyFinished
from care.training.data import require_training_files
from care.training.trainer import Trainer
from care.training.validation import AlignmentLog

# The M3 recipe's knobs that mean nothing for two towers: set so in every CARE stage.
M3_ONLY_TRAINER = {"merge_with_start": None, "query_side_pools": []}
# a text's kind from its id's role (text_kind)
QUERY_ROLES, DOCUMENT_ROLES = frozenset({"question", "query", "sentence"}), frozenset({"answer", "title", "document"})
HELDOUT_STREAM, MIX_STREAM = 1, 2  # numpy seed tags (seed, tag): the two draws never share a stream


def stage1_pool(training: str, extra: list[str], max_extra: int | None = None, seed: int = 0) -> dict[str, str]:
    """Stage I's distinct texts -> the first id each came with, in store order: every training text, plus up
    to `max_extra` texts of the `extra` stores (a seeded sample, in store order)."""
    texts: dict[str, str] = {}  # text -> the first id it came with, in store order
    for tid, text in read_text_store(training).items():
        texts.setdefault(text, tid)
    extras: dict[str, str] = {}
    for store in extra:
        for tid, text in read_text_store(store).items():
            if text not in texts:
                extras.setdefault(text, tid)
    pool = list(extras.items())
    if max_extra is not None and len(pool) > max_extra:
        keep = sorted(random.Random(seed).sample(range(len(pool)), max_extra))
        pool = [pool[i] for i in keep]
    texts.update(pool)
    return texts


def same_text_pairs(training: str, extra: list[str], out: Path, max_extra: int | None = None,
                    seed: int = 0) -> tuple[Path, Path]:
    """texts.jsonl + train.jsonl of one example per distinct text of stage1_pool (the text is its own
    positive)."""
    texts = stage1_pool(training, extra, max_extra, seed)
    write_jsonl(out / "texts.jsonl", ({"id": tid, "text": text} for text, tid in texts.items()))
    write_examples(out / "train.jsonl", ({"query_id": tid, "pos_ids": [tid]} for tid in texts.values()))
    return out / "texts.jsonl", out / "train.jsonl"


def id_role(tid: str) -> str | None:
    """The role of an id of the import stage ({source}:{role}:{native}), if it is one of the known roles."""
    parts = str(tid).split(":", 2)
    return parts[1] if len(parts) == 3 and parts[1] in QUERY_ROLES | DOCUMENT_ROLES else None


def text_kind(tid: str, query_ids: set[str] | None = None) -> str:
    """"query" or "document": the role in the id, else whether the training file names the id as a
    query_id (`query_ids`)."""
    role = id_role(tid)
    if role is not None:
        return "query" if role in QUERY_ROLES else "document"
    return "query" if query_ids and tid in query_ids else "document"


def heldout_slice(texts: list[str], n: int, seed: int) -> set[str]:
    """A seeded sample of `n` of the texts (the same texts for the same pool and seed, whatever the mix)."""
    if n >= len(texts):
        raise ValueError(f"model.stages.stage1.heldout_texts={n} leaves none of stage I's {len(texts)} texts to train on")
    picked = np.random.default_rng([seed, HELDOUT_STREAM]).choice(len(texts), n, replace=False)
    return {texts[i] for i in picked}


def text_mix(texts: list[str], kinds: dict[str, str], query_share: float, seed: int) -> list[str]:
    """The example list at `query_share`: as many entries as `texts`, round(share x n) (halves up) of query
    kind and the rest of document kind.  A kind with more texts than entries gives a seeded sample of them
    (without repeats); one with fewer gives every text floor(entries / texts) times plus a seeded sample of
    the remainder.  In store order (the trainer shuffles the list every epoch; it is drawn once per run)."""
    n_query = int(query_share * len(texts) + 0.5)
    entries = {"query": n_query, "document": len(texts) - n_query}
    rng = np.random.default_rng([seed, MIX_STREAM])
    picked: list[int] = []
    for kind in KINDS:
        of_kind = [i for i, t in enumerate(texts) if kinds[t] == kind]
        if entries[kind] and not of_kind:
            raise ValueError(f"model.stages.stage1.query_share={query_share} asks for {entries[kind]} {kind} texts "
                             f"and stage I has none (a text's kind: care.training.care_recipe.text_kind)")
        whole, rest = divmod(entries[kind], len(of_kind)) if of_kind else (0, 0)
        picked += of_kind * whole + [of_kind[int(j)] for j in rng.choice(len(of_kind), rest, replace=False)]
    return [texts[i] for i in sorted(picked)]


def stage1_options(spec: dict) -> dict:
    """The recipe-study options of `model.stages.stage1`, checked (each absent or null = off)."""
    opts = {"query_share": spec.get("query_share"), "heldout_texts": spec.get("heldout_texts") or 0,
            **{f"{k}_text_max_length": spec.get(f"{k}_text_max_length") for k in KINDS}}
    share = opts["query_share"]
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1):
        raise ValueError(f"model.stages.stage1.query_share={share!r}: a share from 0 to 1, or null (every text once)")
    for key, low in (("heldout_texts", 0), *((f"{k}_text_max_length", 1) for k in KINDS)):
        v = opts[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ValueError(f"model.stages.stage1.{key}={v!r}: an integer >= {low}" + (", or null" if low else ""))
    return opts


def annotated_text_pairs(training: str, examples: str, extra: list[str], out: Path, max_extra: int | None,
                         seed: int, opts: dict) -> tuple[Path, Path]:
    """same_text_pairs with the study's options: texts.jsonl of every text of the pool with its "kind" (and
    "heldout": true on the held-out slice), train.jsonl of the rest at the query share, composition.json."""
    pool = stage1_pool(training, extra, max_extra, seed)
    texts = list(pool)
    query_ids = None
    if any(id_role(tid) is None for tid in pool.values()):  # the training file, for ids without a role
        query_ids = {r["query_id"] for _, r in read_example_rows(examples)}
    kinds = {t: text_kind(tid, query_ids) for t, tid in pool.items()}
    held = heldout_slice(texts, opts["heldout_texts"], seed) if opts["heldout_texts"] else set()
    rest = [t for t in texts if t not in held]
    chosen = rest if opts["query_share"] is None else text_mix(rest, kinds, opts["query_share"], seed)
    write_jsonl(out / "texts.jsonl", ({"id": pool[t], "text": t, "kind": kinds[t],
                                       **({"heldout": True} if t in held else {})} for t in texts))
    write_examples(out / "train.jsonl", ({"query_id": pool[t], "pos_ids": [pool[t]]} for t in chosen))
    uses = Counter(chosen)
    write_json(out / "composition.json", {
        "texts": dict(Counter(kinds.values())), "heldout": dict(Counter(kinds[t] for t in held)),
        "query_share": opts["query_share"], "examples": dict(Counter(kinds[t] for t in chosen)),
        "repeated_texts": sum(n > 1 for n in uses.values()), "unused_texts": len(rest) - len(uses)})
    return out / "texts.jsonl", out / "train.jsonl"


def stage_config(cfg: DictConfig, stage: str, run_dir: Path) -> DictConfig:
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    spec = c.model.stages[stage]
    with open_dict(c):
        c.trainer = OmegaConf.merge(c.trainer, M3_ONLY_TRAINER, spec.get("trainer") or {})
        # a stage's own validation schedule over train.yaml's, as its trainer block (stage I's long fixed budget)
        c.validation = OmegaConf.merge(c.validation, spec.get("validation") or {})
        c.loss = spec.loss
        c.model.current_stage = stage
        c.model.stages = {stage: spec}  # a stage's config (and hash) never depends on another stage's settings
        c.output_dir = str(run_dir / stage)
        c.run_name = f"{cfg.run_name}-{stage}"
        if stage == "stage1":
            require_training_files(cfg.data.texts, cfg.data.examples)
            if (spec.loss.get("teacher_weight") or 0) > 0:
                raise ValueError("model.stages.stage1.loss.teacher_weight > 0: stage I trains on same-text pairs, "
                                 "which have no teacher scores; distil in stage II "
                                 "(model.stages.stage2.loss.teacher_weight), or set it to 0")
            for extra in spec.get("extra_texts") or []:
                if not Path(extra).exists():
                    raise FileNotFoundError(
                        f"model.stages.stage1.extra_texts names {extra}, which does not exist: the build stage of "
                        f"`python -m data_pipeline` writes unlabelled_texts.jsonl; or pass "
                        f"model.stages.stage1.extra_texts=[] to align the training texts only")
            opts, extra = stage1_options(spec), list(spec.get("extra_texts") or [])
            if opts["query_share"] is not None or opts["heldout_texts"] or any(
                    opts[f"{k}_text_max_length"] is not None for k in KINDS):
                files = annotated_text_pairs(cfg.data.texts, cfg.data.examples, extra, run_dir / "stage1-data",
                                             spec.get("extra_texts_max"), cfg.seed, opts)
            else:  # today's files, byte for byte
                files = same_text_pairs(cfg.data.texts, extra, run_dir / "stage1-data", spec.get("extra_texts_max"),
                                        cfg.seed)
                (run_dir / "stage1-data" / "composition.json").unlink(missing_ok=True)  # an earlier option run's
            c.data.texts, c.data.examples = (str(p) for p in files)
        else:
            start = Path(spec.get("query_from") or run_dir / "stage1" / "final" / "query")
            if not (start / "config.json").exists():
                raise FileNotFoundError(
                    f"stage II starts from stage I's query tower, and {start} holds none: run stage I first "
                    f"(model.stage=stage1, or model.stage=all) or name one with model.stages.stage2.query_from=PATH")
            c.model.query.path = str(start)
            c.model.query.pop("build", None)
    return c


def run_care(cfg: DictConfig) -> dict:
    ensure_towers(OmegaConf.to_container(cfg.model, resolve=True))  # missing towers: said in seconds
    run_dir = Path(cfg.output_dir)
    chosen = cfg.model.get("stage", "all")
    stages = list(STAGES) if chosen == "all" else [chosen]
    if any(s not in STAGES for s in stages):
        raise ValueError(f"model.stage={chosen!r}: choose stage1, stage2 or all")
    summaries = {}
    for stage in stages:
        # stage I's held-out slice: val/align_* at step 0 and on the validation schedule (a step callback)
        heldout = stage == "stage1" and (cfg.model.stages.stage1.get("heldout_texts") or 0) > 0
        callbacks = [AlignmentLog()] if heldout else []
        try:
            trainer = Trainer(stage_config(cfg, stage, run_dir), callbacks=callbacks)
        except AlreadyFinished as done:
            print(f"{stage}: {done}")
            summaries[stage] = done.summary
            continue
        if callbacks and trainer.step == 0:
            callbacks[0](trainer, at_start=True)
        # Under torchrun the process group must outlive stage I (the next Accelerator would not re-create it).
        summaries[stage] = trainer.fit(end_training=stage == stages[-1])
        del trainer  # stage I's towers and optimizer, before stage II loads its own
        gc.collect()
    last = run_dir / stages[-1] / "final"
    # one process writes it (two would race on the folder swap); by the launcher's RANK, since the last
    # stage's end_training has already torn down accelerate's process group
    if os.environ.get("RANK", "0") == "0":
        # the last stage's model, whole (hard links: no second copy of the towers on disk), its record naming
        # each stage's folder relative to the run
        record = {**read_record(last), "stages": {s: f"{s}/final" for s in stages}}
        with atomic_folder(run_dir / "final") as tmp:
            link_or_copy_tree(last, tmp, skip=frozenset({TRAINING_RECORD, "README.md"}))
            write_json(tmp / TRAINING_RECORD, record)
        write_model_card(run_dir / "final", record)
    best = summaries[stages[-1]].get("best_metric")
    return {"stages": summaries, "final": str(run_dir / "final"), "best_metric": best}
