"""Helper for tests/test_gradcache.py (not a test): run under `torchrun --nproc_per_node=2`.

Each of the 2 CPU (gloo) processes takes half of the queries with their passage groups, runs one GradCache
step of a tiny fp64 M3 model wrapped by accelerate (DDP) with negatives gathered across the processes, and
saves its gradients: once as written (loss x world size) and once with the world-size factor removed, as
FlagEmbedding does.  The test compares both with one process on the whole batch.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from care.paths import shared_data

N_QUERIES, GROUP, MAX_LENGTH, CHUNK = 4, 3, 32, 2


def medical_batch(n_queries: int = N_QUERIES, group: int = GROUP) -> tuple[list[str], list[str]]:
    """Real KUAKE-QTR queries; per query its own title (positive) then titles of other rows (negatives)."""
    rows = json.loads((shared_data() / "cblue_kuake_qtr" / "KUAKE-QTR_dev.json").read_text(encoding="utf-8"))
    queries = [r["query"] for r in rows[:n_queries]]
    passages = []
    for i in range(n_queries):
        passages.append(rows[i]["title"])
        passages += [rows[n_queries + i * (group - 1) + j]["title"] for j in range(group - 1)]
    return queries, passages


def tokenize(tokenizer, texts: list[str]) -> dict:
    return dict(tokenizer(texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt"))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def main(out: Path) -> None:
    from accelerate import Accelerator

    from care.models.m3 import tiny_m3
    from care.training import gradcache
    from care.training.losses import M3Loss

    # cpu=True: under torchrun a plain Accelerator() on a CPU machine would run each rank alone (docs/facts.md s.6b)
    acc = Accelerator(cpu=True)
    if acc.num_processes != 2:
        raise SystemExit(f"expected 2 processes, accelerate sees {acc.num_processes} ({acc.distributed_type})")
    model = tiny_m3(dropout=0.0).double()  # same seed on both ranks (DDP also broadcasts rank 0's weights)
    queries, passages = medical_batch()
    r, nq, npool = acc.process_index, N_QUERIES // 2, N_QUERIES // 2 * GROUP
    qb = tokenize(model.tokenizer, queries[r * nq:(r + 1) * nq])  # each rank pads to its own longest text
    pb = tokenize(model.tokenizer, passages[r * npool:(r + 1) * npool])
    ddp = acc.prepare(model)
    gc = gradcache.GradCache(M3Loss(group_size=GROUP), chunk_size=CHUNK, accelerator=acc)

    losses = gc.step(ddp, qb, pb)
    lengths = [qb["input_ids"].shape[1], pb["input_ids"].shape[1]]
    torch.save({"grads": grads(model), "losses": losses, "lengths": lengths}, out / f"scaled_rank{r}.pt")

    model.zero_grad(set_to_none=True)
    gradcache.world_size = lambda: 1  # drop the factor, as FlagEmbedding does
    gc.step(ddp, qb, pb)
    torch.save({"grads": grads(model)}, out / f"unscaled_rank{r}.pt")
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
