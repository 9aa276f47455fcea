"""`make bench` / `python -m bench [NAME ...]`: run the benchmarks and write one JSON per benchmark
to bench/results/<name>.json (throughput, memory and ratios against the reference measured in the
same run), plus the machine they ran on.  Speed is measured here, never asserted in tests."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import time

import torch

from care.data.io import write_json
from care.paths import PROJECT_ROOT

BENCHES = {
    "dedup": "bench.dedup_bench",
    "mining": "bench.mining_bench",
    "eval": "bench.eval_bench",
    "train": "bench.train_bench",
    "encode": "bench.encode_bench",
    "care_step": "bench.care_step_bench",
    "allocator": "bench.allocator_bench",
    "latency": "bench.latency_bench",
}


def machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("names", nargs="*", default=list(BENCHES), help=f"any of {list(BENCHES)}")
    args = ap.parse_args()
    out_dir = PROJECT_ROOT / "bench" / "results"
    for name in args.names:
        start = time.perf_counter()
        print(f"== bench {name}", flush=True)
        result = importlib.import_module(BENCHES[name]).run()
        result = {"benchmark": name, "wall_s": round(time.perf_counter() - start, 2),
                  "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **result}
        write_json(out_dir / f"{name}.json", result)
        print(json.dumps(result, indent=2, ensure_ascii=False)[:4000])


if __name__ == "__main__":
    main()
