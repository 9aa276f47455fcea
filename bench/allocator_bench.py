"""A fresh training process with glibc's default malloc against one that keeps freed memory
(care/allocator.py): `run() -> dict`, registered as `python -m bench allocator` (bench/results/allocator.json).

Each arm is `train.py experiment=hn_ablation_long` (me5-small, 16 queries + 3 mined negatives each, 128
tokens: the ablations' step) for ALLOCATOR_BENCH_STEPS steps (default 4) in its own fresh process, on the
pipeline's training files; `CARE_KEEP_FREED_MEMORY=0` gives glibc's defaults.  Reported per arm: the median
seconds of the steps after the first (from the run's metrics.jsonl), the process's user and kernel CPU seconds,
its minor page faults and peak resident set (wait4's usage of that child), and the losses, which must be
equal (the setting changes where memory comes from, not what is computed).  Ratios: kept / default.
The arms run one after the other on the same machine: on a busy machine take the fault and kernel-time
ratios, which load does not move, over the seconds.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = int(os.environ.get("ALLOCATOR_BENCH_STEPS", "4"))


def _train(out: Path, keep: bool) -> dict:
    env = {**os.environ, "CARE_KEEP_FREED_MEMORY": "1" if keep else "0", "WANDB_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    child = subprocess.Popen([sys.executable, "train.py", "experiment=hn_ablation_long", "trainer.group_size=4",
                              f"trainer.max_steps={STEPS}", f"trainer.checkpoint_every={STEPS}",
                              "validation.task=null", f"output_dir={out}",
                              f"run_name=bench-allocator-{'kept' if keep else 'default'}"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage (Popen.wait would discard it)
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"train.py exited {os.waitstatus_to_exitcode(status)} (`make run` first: it needs the "
                           "pipeline's training files)")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_seconds" in r]
    return {"step_seconds_median": round(statistics.median(r["step_seconds"] for r in rows[1:]), 2),
            "step_seconds": [round(r["step_seconds"], 2) for r in rows],
            "user_s": round(usage.ru_utime, 1), "kernel_s": round(usage.ru_stime, 1),
            "minor_faults": usage.ru_minflt, "peak_rss_mb": round(usage.ru_maxrss / 1024),
            "losses": [r["loss/loss"] for r in rows]}


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        kept = _train(Path(tmp) / "kept", keep=True)
        default = _train(Path(tmp) / "default", keep=False)
    return {
        "what": f"train.py experiment=hn_ablation_long, {STEPS} steps, a fresh process per arm",
        "default": default, "kept": kept,
        "same_losses": default.pop("losses") == kept.pop("losses"),
        "ratio_kept_over_default": {k: round(kept[k] / default[k], 3) for k in
                                    ("step_seconds_median", "user_s", "kernel_s", "minor_faults")},
        "load_avg_1min": os.getloadavg()[0],
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
