"""Peak RSS and documents/s of one model's ONNX Runtime fp32 encoding, in a fresh process (docs/models.md,
"Memory"): `texts` distinct document texts of the evaluation (bench/encode_bench.py sample_texts, seed 0),
encoded by evaluate.py's model (me5_small unless `model=`) with `backend=onnx` at `threads` torch threads, the
evaluation's batch size.

    python -m bench.onnx_memory [--texts 2000] [--threads 2] [overrides of evaluate.py's config ...]

To measure the code of another commit, run this file by its path with that commit's checkout first on the
path (its care/ and bench/ are then the ones imported):

    git archive 4a278cd | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before CARE_SHARED_DATA=../shared/data CARE_OUTPUTS=outputs CARE_CACHE=.cache \
        python bench/onnx_memory.py

(the roots named, or that checkout's own empty ones would be used).

Prints one JSON line: the code measured (the folder `care` was imported from), the RSS in MB before the
encoder is built, after it is built, after encoding and at its peak (ru_maxrss: the process's whole life),
the documents/s of the encoding, and the xxh3_128 of the vectors' bytes (equal digests: bit-identical
vectors).  Memory needs no idle machine; documents/s do (compare them interleaved, at the same load)."""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
import xxhash


def rss_mb() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        return round(int(next(line for line in fh if line.startswith("VmRSS:")).split()[1]) / 1024)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="evaluate.py overrides (model=..., max_length=...)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from omegaconf import OmegaConf

    import care
    from bench.encode_bench import sample_texts
    from care.config import load_config
    from care.encoders import build_encoder
    from care.evaluation.corpora import evaluation_model

    cfg = load_config("evaluate", a.overrides)
    texts = sample_texts(cfg, a.texts)
    model = evaluation_model(OmegaConf.to_container(cfg.model, resolve=True), cfg.max_length)
    before = rss_mb()
    encoder = build_encoder({**model, "backend": "onnx"}, device="cpu")
    built = rss_mb()
    start = time.perf_counter()
    vectors = encoder.encode_documents(texts, batch_size=int(cfg.batch_size)).dense
    seconds = time.perf_counter() - start
    out = {"code": str(Path(care.__file__).parent.parent), "model": model.get("name"), "texts": len(texts),
           "threads": a.threads, "batch_size": int(cfg.batch_size), "load": round(os.getloadavg()[0], 2),
           "rss_mb": {"before": before, "built": built, "encoded": rss_mb(),
                      "peak": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)},
           "docs_per_s": round(len(texts) / seconds, 2), "vectors_xxh3_128": xxhash.xxh3_128_hexdigest(vectors.tobytes())}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
