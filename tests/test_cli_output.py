"""What the apps print: third-party INFO chatter (faiss's loader lines) stays out of the user's terminal."""
from __future__ import annotations

import os
import subprocess
import sys

from care.paths import PROJECT_ROOT


def test_no_faiss_loader_lines_under_hydra(tmp_path):
    # the mine stage imports faiss after Hydra has set up logging; here it stops at once on missing inputs
    proc = subprocess.run([sys.executable, "-m", "data_pipeline", "stage=mine", f"data_dir={tmp_path}",
                           f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "disabled"}, timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "build/texts.jsonl does not exist" in out, out[-2000:]
    assert "faiss.loader" not in out and "Loading faiss" not in out, out[-2000:]
    log = (tmp_path / "hydra" / "data_pipeline.log").read_text(encoding="utf-8")
    assert "faiss.loader" not in log and "Loading faiss" not in log
