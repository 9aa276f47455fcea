"""sentence-transformers' view of a model folder, from a process that never imports this project."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

#: short and long, Chinese and mixed: the long one is cut by every token limit the tests use
TEXTS = ["头痛怎么办", "高血压患者可以吃鸡蛋吗？医生建议每天一个", "糖尿病的早期症状有哪些 HbA1c" * 12]

_SCRIPT = """
import json, sys
from sentence_transformers import SentenceTransformer
folder, texts = sys.argv[1], json.loads(sys.argv[2])
model = SentenceTransformer(folder, device="cpu")
out = {"query": model.encode_query(texts, batch_size=2).tolist(),
       "document": model.encode_document(texts, batch_size=2).tolist(),
       "modules": [type(m).__name__ for m in model], "project_imported": "care" in sys.modules}
print("VECTORS " + json.dumps(out))
"""


def st_vectors(folder: Path, texts: list[str], cwd: Path) -> dict:
    """{"query", "document": arrays, "modules": [...]} from SentenceTransformer(folder) in a fresh interpreter,
    started in `cwd` (not the project root) with no PYTHONPATH: it cannot import this project."""
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HOME": str(cwd)}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(folder), json.dumps(texts, ensure_ascii=False)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("VECTORS "))
    out = json.loads(line[len("VECTORS "):])
    assert not out["project_imported"]
    return {**out, "query": np.array(out["query"]), "document": np.array(out["document"])}


def assert_same_vectors(folder: Path, encoder, cwd: Path, texts: list[str] = TEXTS) -> dict:
    """sentence-transformers' encode_query / encode_document equal the project's encode_queries /
    encode_documents (default task) to 1e-5; returns sentence-transformers' output."""
    st = st_vectors(folder, texts, cwd)
    for side, ours in (("query", encoder.encode_queries(texts, batch_size=2).dense),
                       ("document", encoder.encode_documents(texts, batch_size=2).dense)):
        assert st[side].shape == ours.shape, side
        np.testing.assert_allclose(st[side], ours, rtol=0, atol=1e-5, err_msg=side)
    return st
