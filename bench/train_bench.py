"""Training benchmarks, all measured in one run on this machine (`run() -> dict`; the lead wires it into `make bench`).

1. GradCache memory: peak resident memory of one training step as the pool of passages grows at a fixed
   chunk size, against the plain step (whole pool in one forward).  With caching it should stay nearly flat:
   `cached_peak_ratio_256_over_32` (issue #14: at most 1.3).  What still grows is the cached representations
   and their gradients; the loss over them is computed in blocks (care.training.head_scores.colbert_scores never
   builds the queries x q_len x passages x p_len ColBERT tensor, which made this ratio 2.4).
2. GradCache time against the plain step at the same pool (the extra no-grad forward costs ~1/3).
3. Throughput against FlagEmbedding's own M3 fine-tuning (its training model class,
   `EncoderOnlyEmbedderM3Model`, driven directly: its runner needs the hub and a launcher) on the same tiny
   model, the same real texts and the same batch shape, interleaved in one process; reported as a ratio.

Everything runs on one torch thread: tiny models gain nothing from a second one, and on a busy 2-core machine
two threads make timings swing by an order of magnitude.  Each memory point runs in a fresh process (a process's allocator keeps freed memory, so points measured one
after another in one process would hide the growth); a thread samples the resident set every millisecond
during the step.  `python bench/train_bench.py` prints the JSON.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"hidden": 128, "layers": 4, "heads": 4}     # tiny model: activations, not weights, dominate memory
GROUP, CHUNK, Q_LEN, P_LEN = 4, 8, 32, 128             # 1 positive + 3 negatives; texts per forward; lengths
POOLS = (32, 64, 128, 256)                             # passages per step (queries = pool / GROUP)


def real_texts(n_queries: int) -> tuple[list[str], list[str]]:
    """cEpilepsyQA questions and, per question, its answer + (GROUP - 1) other answers (pool layout)."""
    import csv

    from care.paths import shared_data

    folder = shared_data() / "cepilepsyqa"
    with open(folder / "question.csv", encoding="utf-8-sig") as fh:
        questions = {r["question_id"]: r["content"] for r in csv.DictReader(fh)}
    with open(folder / "answer.csv", encoding="utf-8-sig") as fh:
        answers = [(r["question_id"], r["content"]) for r in csv.DictReader(fh)]
    rng = np.random.default_rng(0)
    chosen = rng.choice(len(answers), n_queries, replace=False)
    queries, passages = [], []
    for i in chosen:
        qid, ans = answers[i]
        queries.append(questions[qid])
        passages.append(ans)
        passages += [answers[j][1] for j in rng.choice(len(answers), GROUP - 1, replace=False)]
    return queries, passages


def tiny_model():
    from care.models.m3 import tiny_m3

    return tiny_m3(**SHAPE, dropout=0.1)


def tokenize(tok, texts, max_length):
    return dict(tok(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"))


# ---- 1 + 2: one step in a fresh process ------------------------------------------------------------------
def _measure(mode: str, pool: int) -> dict:
    """Peak RSS growth of a first step ("cached" or "plain") in this fresh process, and the time of a
    second step run without the sampling thread (which would slow the many small cached chunks most)."""
    from care.training.gradcache import GradCache
    from care.training.losses import M3Loss

    torch.manual_seed(0)
    model = tiny_model().train()
    loss_fn = M3Loss(group_size=GROUP)
    queries, passages = real_texts(pool // GROUP)
    q, p = tokenize(model.tokenizer, queries, Q_LEN), tokenize(model.tokenizer, passages, P_LEN)

    def step():
        if mode == "cached":
            GradCache(loss_fn, CHUNK).step(model, q, p)
        else:
            loss_fn(model(**q), model(**p))["loss"].backward()

    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    base = proc.memory_info().rss
    thread = threading.Thread(target=sample)
    thread.start()
    step()
    done.set()
    thread.join()
    peak_mb = (max(peak[0], proc.memory_info().rss) - base) / 2**20
    t0 = time.perf_counter()
    step()
    return {"mode": mode, "pool": pool, "peak_mb": peak_mb, "seconds": time.perf_counter() - t0}


def memory_and_time() -> dict:
    rows = []
    for pool in POOLS:
        for mode in ("cached", "plain"):
            out = subprocess.run([sys.executable, __file__, "--measure", mode, str(pool)], capture_output=True,
                                 text=True, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cached = {r["pool"]: r for r in rows if r["mode"] == "cached"}
    plain = {r["pool"]: r for r in rows if r["mode"] == "plain"}
    lo, hi = POOLS[0], POOLS[-1]
    return {
        "points": rows,
        "chunk": CHUNK, "group": GROUP, "q_len": Q_LEN, "p_len": P_LEN,
        "cached_peak_ratio_256_over_32": cached[256]["peak_mb"] / cached[32]["peak_mb"],   # issue #14: <= 1.3
        "cached_peak_growth": cached[hi]["peak_mb"] / cached[lo]["peak_mb"],   # ~1 = flat
        "plain_peak_growth": plain[hi]["peak_mb"] / plain[lo]["peak_mb"],
        "cached_vs_plain_time": {pool: cached[pool]["seconds"] / plain[pool]["seconds"] for pool in POOLS},
    }


# ---- 3: throughput against FlagEmbedding ------------------------------------------------------------------
def throughput(steps: int = 5, n_queries: int = 8) -> dict:
    from FlagEmbedding.finetune.embedder.encoder_only.m3.modeling import EncoderOnlyEmbedderM3Model

    from care.config import load_config
    from care.data.io import write_jsonl
    from care.training.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="train-bench-"))
    queries, passages = real_texts(n_queries * steps)
    ids = {t: f"t{i}" for i, t in enumerate(dict.fromkeys(queries + passages))}
    write_jsonl(tmp / "texts.jsonl", ({"id": i, "text": t} for t, i in ids.items()))
    write_jsonl(tmp / "train.jsonl", ({"query_id": ids[q], "pos_ids": [ids[passages[k * GROUP]]],
                                       "neg_ids": [ids[x] for x in passages[k * GROUP + 1:(k + 1) * GROUP]]}
                                      for k, q in enumerate(queries)))
    ours_model = tiny_model()
    ours_model.save(tmp / "tiny-m3")

    results = {}
    for label, chunk in (("ours_plain", "null"), ("ours_gradcache", str(CHUNK))):
        cfg = load_config("train", [
            "model=tiny_m3", f"model.path={tmp / 'tiny-m3'}", f"data.texts={tmp / 'texts.jsonl'}",
            f"data.examples={tmp / 'train.jsonl'}", f"output_dir={tmp / label}", "validation.task=null",
            f"trainer.batch_size={n_queries}", f"trainer.group_size={GROUP}", f"trainer.chunk_size={chunk}",
            f"trainer.query_max_length={Q_LEN}", f"trainer.passage_max_length={P_LEN}", "wandb.mode=disabled"])
        trainer = Trainer(cfg)
        results[label] = (trainer, list(trainer.loader))

    # FlagEmbedding's training model on a copy of the same weights, same loss temperature, AdamW, clipping.
    theirs_init = copy.deepcopy(ours_model)
    theirs = EncoderOnlyEmbedderM3Model(
        {"model": theirs_init.backbone, "colbert_linear": theirs_init.colbert_linear,
         "sparse_linear": theirs_init.sparse_linear}, tokenizer=theirs_init.tokenizer, temperature=0.02,
        sentence_pooling_method="cls", normalize_embeddings=True, unified_finetuning=True).train()
    optim = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=2e-5)
    batches = results["ours_plain"][1]

    def their_step(batch):
        tok = theirs_init.tokenizer
        q = dict(tok(batch["queries"], padding=True, truncation=True, max_length=Q_LEN, return_tensors="pt"))
        p = dict(tok(batch["passages"], padding=True, truncation=True, max_length=P_LEN, return_tensors="pt"))
        theirs(queries=q, passages=p).loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)

    steppers = {"flagembedding": their_step,
                **{label: results[label][0].train_step for label in ("ours_plain", "ours_gradcache")}}
    for stepper in steppers.values():  # warm-up, not timed
        stepper(batches[0])
    seconds = {k: 0.0 for k in steppers}
    for batch in batches[1:]:  # interleaved, so machine load hits all three alike
        for label, stepper in steppers.items():
            t0 = time.perf_counter()
            stepper(batch)
            seconds[label] += time.perf_counter() - t0
    per_s = {k: n_queries * (len(batches) - 1) / v for k, v in seconds.items()}
    return {"queries_per_s": per_s,
            "ratio_ours_plain_vs_flagembedding": per_s["ours_plain"] / per_s["flagembedding"],
            "ratio_ours_gradcache_vs_flagembedding": per_s["ours_gradcache"] / per_s["flagembedding"],
            "shape": {"queries": n_queries, "group": GROUP, "q_len": Q_LEN, "p_len": P_LEN, **SHAPE}}


def run() -> dict:
    torch.set_num_threads(1)
    return {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "load_avg_1min": os.getloadavg()[0]},
            "gradcache": memory_and_time(), "throughput": throughput()}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    if len(sys.argv) == 4 and sys.argv[1] == "--measure":
        print(json.dumps(_measure(sys.argv[2], int(sys.argv[3]))))
    else:
        print(json.dumps(run(), indent=2))
