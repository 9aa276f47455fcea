"""A Nano dataset as benchmark tasks (conf/benchmark/nano.yaml): any folder in HAKARI-bench's layout
(this project's `nano` stage output, a local copy of hakari-bench/NanoCMTEB) or a hub id when the hub is
reachable.  A benchmark config with a `nano:` block gets its tasks from the folder, per split:

    <split>                 retrieval over the split's whole corpus (every head the model has, BM25 too)
    <split>_hybrid          reranking of the stored `reranking_hybrid` candidates, shuffled first
    <split>_hybrid_nosg     the same without the rank-101 safeguard positive (HAKARI's without_safeguard)

Each view has its own mean column: the retrieval mean is the benchmark's Avg.
"""
from __future__ import annotations

from care.data.nano import HYBRID, resolve, splits

VIEWS = {
    "retrieval": {"suffix": "", "type": "retrieval", "slot": "{split}", "average": None, "options": {}},
    "hybrid": {"suffix": "_hybrid", "type": "candidates", "slot": "{split} hybrid", "average": "Hybrid mean",
               "options": {"safeguard": True}},
    "hybrid_nosg": {"suffix": "_hybrid_nosg", "type": "candidates", "slot": "{split} hybrid w/o safeguard",
                    "average": "Hybrid mean w/o safeguard", "options": {"safeguard": False}},
}


def nano_tasks(spec: dict, where: str = "benchmark.nano") -> dict[str, dict]:
    """Task specs (as a benchmark config lists them) for every split and view of the Nano dataset `spec`:
    {path, splits (null = all), views (null = all of VIEWS), metrics, primary, candidates}."""
    if not spec.get("path"):
        raise ValueError(f"{where}.path: give a Nano dataset folder (or a hub id where the hub is reachable)")
    try:
        folder = resolve(spec["path"])
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{where}.path: {e}. The open Nano dataset is built by "
                                "`python -m data_pipeline stage=nano` (make run does it).") from None
    available = splits(folder)
    chosen = spec.get("splits") or available
    unknown = [s for s in chosen if s not in available]
    if unknown:
        raise ValueError(f"{where}.splits: {unknown} not in {folder} (splits: {', '.join(available)})")
    views = spec.get("views") or list(VIEWS)
    if bad := [v for v in views if v not in VIEWS]:
        raise ValueError(f"{where}.views: unknown {bad} (choose from {', '.join(VIEWS)})")
    metrics = list(spec.get("metrics") or ["ndcg_cut_10", "recall_100", "mrr_10"])
    tasks = {}
    for view in views:
        v = VIEWS[view]
        for split in chosen:
            options = {**v["options"], "candidates": spec.get("candidates", HYBRID)} if v["type"] == "candidates" else {}
            tasks[split + v["suffix"]] = {
                "type": v["type"], "path": str(folder), "split": split, "reader": "nano", "reader_options": options,
                "slot": v["slot"].format(split=split), "average": v["average"], "metrics": metrics,
                "primary": spec.get("primary", metrics[0]),
                "source": f"{folder.name}/{split}: " + ("full-corpus retrieval" if v["type"] == "retrieval" else
                          f"{options['candidates']} candidates, shuffled" + ("" if options["safeguard"] else
                                                                               ", safeguard removed"))}
    return tasks
