"""Embed a corpus with a model's DOCUMENT side into the embedding cache, ahead of the stages that read it.

    python encode.py model=me5_small corpus=outputs/data/train/texts.jsonl   a text store {"id", "text"}
    python encode.py model=me5_small benchmark=cmedteb_open                  every document text of its tasks
    torchrun --nproc_per_node=8 encode.py model=me5_small corpus=...         8 processes (a GPU each, if any)

Made for asymmetric models whose document tower is a large LLM run offline (CARE), but any model that gives
vectors works (its family's `outputs`, care/families.py: dense, sparse, ColBERT); a reranker (pair scores,
no vectors) is refused in one line.
The texts (each once, in a fixed order: the text store's lines, then each benchmark's documents task by
task) are cut into shards of `shard_size`; process r of N encodes shards r, r+N, r+2N, ... and stores each
as one chunk of the embedding cache (care.encoders.cache: written atomically, named by the shard's texts,
recording the document side's fingerprint).  A shard is encoded alone, in batches that depend on its texts
only, so the vectors are the same whatever the number of processes, and a re-run skips every shard already
in the cache whose every array matches the digest stored with it; a shard whose chunk fails that check
(damaged vectors under intact keys, a truncated file) is reported, encoded again and its chunk rewritten.
evaluate.py (with the same `max_length` and `heads`), mining and dedup then read the vectors instead of
running the document network.  On a CPU the processes talk gloo: `Accelerator(cpu=True)`, since a plain Accelerator() under torchrun runs each rank alone (docs/facts.md s.6b).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import care  # noqa: F401  (registers the ${paths:...} resolver)
from care.allocator import keep_freed_memory
from care.config import CONF_DIR
from care.data.io import read_text_store
from care.encoders import Encoder, build_encoder
from care.encoders.cache import EmbeddingCache
from care.errors import app_errors
from care.evaluation import corpora
from care.evaluation.entries import row_name
from care.families import EMBEDDINGS, require
from care.progress import progress
from data_pipeline import benchmarks as builders

SIDE = "document"


@dataclass
class Shard:
    index: int
    fingerprint: str      # the document side's, for this shard's task type
    task: str | None      # the task type a document prompt's {instruction} is filled from (None: the default)
    texts: list[str]


def corpus_groups(cfg: dict, show_progress: bool = True) -> tuple[list[tuple[str | None, list[str]]], dict]:
    """[(task type, texts)] in corpus order: the text store (task `cfg.task`), then the document texts of
    every benchmark task, by task type, as evaluation embeds them (care.evaluation.corpora); and counts."""
    groups, counts = [], {}
    if cfg.get("corpus"):
        store = read_text_store(Path(cfg["corpus"]).expanduser())
        groups.append((cfg.get("task"), list(store.values())))
        counts["corpus"] = len(store)
    loaded = corpora.load_benchmarks(cfg, build=builders.build, show_progress=show_progress)
    for task, texts in corpora.document_texts(loaded).items():
        groups.append((task, texts))
        counts[f"benchmark {task}"] = len(texts)
    if not groups:
        raise ValueError("nothing to encode: give corpus=PATH (a JSON Lines text store {\"id\", \"text\"}) "
                         "and/or benchmark=NAME (a conf/benchmark/*.yaml)")
    return groups, counts


def make_shards(encoder: Encoder, groups: list[tuple[str | None, list[str]]], size: int) -> list[Shard]:
    """Texts sharing a document fingerprint (all of them, unless the document prompt takes a per-task
    instruction) are deduplicated together and cut into consecutive shards of `size`."""
    if size < 1:
        raise ValueError(f"shard_size must be >= 1, got {size}")
    by_fp: dict[str, tuple[str | None, dict[str, None]]] = {}
    for task, texts in groups:
        fp = encoder.side_fingerprint(SIDE, task)
        by_fp.setdefault(fp, (task, {}))[1].update(dict.fromkeys(texts))
    shards = []
    for fp, (task, unique) in by_fp.items():
        texts = list(unique)
        for s in range(0, len(texts), size):
            shards.append(Shard(len(shards), fp, task, texts[s:s + size]))
    return shards


def documents(encoder: Encoder, cfg: dict, heads: tuple[str, ...], task: str | None):
    """The document side, as a function of the texts the cache asks for (no progress bar: one per shard)."""
    def encode_texts(texts: list[str]):
        return encoder.encode_documents(texts, batch_size=int(cfg["batch_size"]), heads=heads, show_progress=False,
                                        task=task)
    return encode_texts


def make_accelerator(cfg: dict):
    import torch
    from accelerate import Accelerator, InitProcessGroupKwargs

    cpu = cfg.get("device") == "cpu" or not torch.cuda.is_available()
    wait = InitProcessGroupKwargs(timeout=timedelta(seconds=int(cfg["wait_timeout_s"])))
    return Accelerator(cpu=cpu, kwargs_handlers=[wait])


def encode(cfg: DictConfig | dict, accelerator=None, on_shard=None) -> dict:
    """Encode the configured corpus into the cache; the stats (the same on every process).  `on_shard(shard)`
    is called after each shard this process encodes (tests interrupt a run there)."""
    from accelerate.utils import gather_object

    cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    model = corpora.model_from_app_config(cfg)
    require(model, "encode.py", needs=EMBEDDINGS)  # before any work: a reranker's pair scores are no vectors
    acc = accelerator or make_accelerator(cfg)
    rank, world, main = acc.process_index, acc.num_processes, acc.is_main_process
    with acc.main_process_first():  # a stand-in benchmark is built by the main process, then read by all
        groups, counts = corpus_groups(cfg, show_progress=main)
    encoder = build_encoder(model, device=str(acc.device), backend=cfg.get("backend", "auto"))
    # ckpt=<folder>: labelled by the folder as evaluate.py names its row (the config's name is model='s)
    label = row_name(Path(cfg["ckpt"]).expanduser().resolve()) if cfg.get("ckpt") else encoder.name
    heads = encoder.select_heads(cfg.get("heads"))  # as evaluation's scorer picks them: part of the cache key
    shards = make_shards(encoder, groups, int(cfg["shard_size"]))
    cache = EmbeddingCache(cfg["cache"]["dir"])
    fingerprints = list(dict.fromkeys(s.fingerprint for s in shards))
    for fp in fingerprints:  # another encoder's chunk anywhere in the folder stops the run before any work
        cache.check_folder(fp, SIDE, heads)

    acc.wait_for_everyone()  # every process starts together: the time below is the encoding alone
    start = time.perf_counter()
    mine = shards[rank::world]
    done = {"rank": rank, "encoded": 0, "skipped": 0, "repaired": 0, "left": 0, "texts": 0, "encode_seconds": 0.0}
    max_shards = cfg.get("max_shards")
    bar = progress(total=len(mine), desc=f"encode {label} documents (process 0 of {world})", unit="shard",
                   enabled=main)
    for shard in mine:
        state = cache.chunk_state(shard.fingerprint, SIDE, heads, shard.texts)  # damaged: reported, encoded again
        if state == "ok":
            done["skipped"] += 1
        elif max_shards is not None and done["encoded"] >= int(max_shards):
            done["left"] += 1
        else:
            t0 = time.perf_counter()
            cache.put_chunk(shard.fingerprint, SIDE, heads, shard.texts, documents(encoder, cfg, heads, shard.task))
            done["encode_seconds"] += time.perf_counter() - t0
            done["encoded"] += 1
            done["repaired"] += state == "damaged"
            done["texts"] += len(shard.texts)
            if on_shard is not None:
                on_shard(shard)
        bar.update(1)
        if done["encode_seconds"]:
            bar.set_postfix(texts_per_s=f"{done['texts'] / done['encode_seconds']:.1f}")
    bar.close()
    acc.wait_for_everyone()
    seconds = time.perf_counter() - start
    per_process = sorted(gather_object([done]), key=lambda d: d["rank"])

    encoded_texts = sum(p["texts"] for p in per_process)
    stats = {"model": label, "fingerprints": fingerprints, "heads": list(heads),
             "folders": [str(cache.folder(fp, SIDE, heads)) for fp in fingerprints],
             "texts": sum(len(t) for _, t in groups), "unique_texts": sum(len(s.texts) for s in shards),
             "sources": counts, "shard_size": int(cfg["shard_size"]), "shards": len(shards),
             "encoded": sum(p["encoded"] for p in per_process), "skipped": sum(p["skipped"] for p in per_process),
             "repaired": sum(p["repaired"] for p in per_process), "left": sum(p["left"] for p in per_process),
             "processes": world, "encoded_texts": encoded_texts,
             "seconds": round(seconds, 2),
             "texts_per_second": round(encoded_texts / seconds, 1) if encoded_texts and seconds > 0 else None,
             "per_process": per_process}
    if main:
        print(summary(stats))
    return stats


def summary(stats: dict) -> str:
    head = (f"encode.py: {stats['texts']:,} texts ({stats['unique_texts']:,} unique) -> {stats['shards']:,} shards of "
            f"<= {stats['shard_size']:,}: {stats['encoded']:,} encoded, {stats['skipped']:,} skipped (already in the "
            f"cache), {stats['processes']} process{'es' if stats['processes'] > 1 else ''}")
    lines = [head]
    if stats["texts_per_second"]:
        lines.append(f"  {stats['encoded_texts']:,} texts encoded in {stats['seconds']} s: {stats['texts_per_second']:,} texts/s")
    lines.append("  per process (encoded/skipped shards): "
                 + ", ".join(f"{p['rank']}: {p['encoded']}/{p['skipped']}" for p in stats["per_process"]))
    for fp, folder in zip(stats["fingerprints"], stats["folders"]):
        lines.append(f"  document side of {stats['model']}: fingerprint {fp} -> {folder}")
    if stats["repaired"]:
        lines.append(f"  {stats['repaired']:,} of the encoded shards replaced a damaged chunk (named in a warning above)")
    if stats["left"]:
        lines.append(f"  {stats['left']:,} shards not encoded yet (max_shards): run the same command again to finish")
    return "\n".join(lines)


@hydra.main(config_path=str(CONF_DIR), config_name="encode", version_base="1.3")
def main(cfg: DictConfig) -> None:
    keep_freed_memory()
    with app_errors("encode.py", cfg, writes_to=cfg.get("cache", {}).get("dir")):
        encode(cfg)


if __name__ == "__main__":
    main()
