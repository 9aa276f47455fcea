"""The run log: metrics.jsonl (one row per logged step or validation), the same rows to wandb through
accelerate's tracker, and curves.png drawn from the file.  Only the main process writes."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil
import torch
from omegaconf import DictConfig, OmegaConf

from care.config import recipe_group
from care.data.io import atomic_open, read_jsonl, save_figure


def wandb_mode(cfg: DictConfig) -> str:
    """The WANDB_MODE environment variable wins over the config (tests and CI set it)."""
    return os.environ.get("WANDB_MODE") or cfg.wandb.mode


def memory_mb() -> float:
    """Peak accelerator memory on a GPU; the process's resident memory on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return psutil.Process().memory_info().rss / 2**20


class RunLog:
    def __init__(self, out: Path, accelerator, cfg: DictConfig, config_hash: str):
        self.path = Path(out) / "metrics.jsonl"
        self.accelerator, self.cfg, self.hash = accelerator, cfg, config_hash

    def start(self) -> None:
        """Open the wandb run (offline by default), resumable under the run's name and config hash."""
        if self.accelerator.log_with:
            self.accelerator.init_trackers(
                self.cfg.wandb.project, config=OmegaConf.to_container(self.cfg, resolve=True),
                init_kwargs={"wandb": {"name": self.cfg.run_name, "mode": wandb_mode(self.cfg),
                                       # one group per recipe: the seeds of a recipe side by side, as
                                       # care/evaluation/compare.py groups their evaluations
                                       "group": recipe_group(OmegaConf.to_container(self.cfg, resolve=True)),
                                       "dir": str(self.path.parent), "id": f"{self.cfg.run_name}-{self.hash}",
                                       "resume": "allow"}})

    def log(self, step: int, row: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        self.accelerator.log(row, step=step)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Appended row by row (one small write each); a resume rewrites the file up to its checkpoint.
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, **row}) + "\n")

    def rows(self) -> list[dict]:
        return list(read_jsonl(self.path)) if self.path.exists() else []

    def keep_until(self, step: int | None) -> None:
        """Drop rows past `step` (a resumed run recomputes them; None drops all), main process only."""
        if self.accelerator.is_main_process and self.path.exists():
            self.drop_torn_row()
            rows = [r for r in self.rows() if step is not None and r["step"] <= step]
            with atomic_open(self.path) as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)

    def drop_torn_row(self) -> None:
        """A kill during `log`'s append leaves the last row cut short, without its newline (each row is one
        write ending in one): drop it, saying so.  A bad line that ends in a newline is no torn write and
        stays an error (read_jsonl names it)."""
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        head, newline, tail = data.rpartition(b"\n")
        try:
            json.loads(tail)
            return  # whole, only its newline missing: kept (keep_until rewrites the file)
        except ValueError:
            pass
        line = head.count(b"\n") + 2 if newline else 1
        with atomic_open(self.path, "wb") as fh:
            fh.write(head + newline)
        print(f"note: {self.path}, line {line}: a row cut short by a killed run ({len(tail)} bytes, no newline) "
              f"is dropped; the run goes on from its last checkpoint", file=sys.stderr, flush=True)

    def plot(self, validation_metric: str | None) -> Path:
        """curves.png: each loss term, the learning rate and the validation metric against the step."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.rows()
        keys = sorted({k for r in rows for k in r})
        panels = {"loss": [k for k in keys if k.startswith("loss/")], "learning rate": ["lr"],
                  "validation": [f"val/{validation_metric}"] if validation_metric else []}
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, (title, names) in zip(axes, panels.items()):
            for name in names:
                points = [(r["step"], r[name]) for r in rows if name in r]
                if points:
                    ax.plot(*zip(*points), marker="o" if title == "validation" else None, label=name)
                    ax.legend(fontsize=8)
            ax.set_title(title)
            ax.set_xlabel("step")
        fig.suptitle(f"{self.cfg.run_name} ({self.hash})")
        fig.tight_layout()
        return save_figure(fig, self.path.with_name("curves.png"), dpi=100)
