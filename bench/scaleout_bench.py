"""`make bench-scaleout`: exact + MinHash dedup on both engines (`dedup.engine=native|datatrove`) at 226K, 1M
and 4M medical-like Chinese texts; writes bench/results/scaleout.json (docs/scale.md, "Past one machine"),
after every run, so a stopped benchmark keeps what it measured.  First (`--equal` alone): both engines on
the real sets, the import store (every row), its cEpilepsyQA answers and the cMedQA2 answers: identical
kept.jsonl and clusters.jsonl or not.

Texts: the import stage's 204,583 real texts, then texts recombined from their clauses (split after
，。！？；, a seeded draw of as many clauses as a randomly drawn real text has), and PLANTED_SHARE x N planted
near duplicates of recombined texts of at least 30 characters (data_pipeline/planted.py `edit_until`: random
character edits down to a character-bigram Jaccard drawn from [0.85, 0.97]), all shuffled with a fixed seed.
The stores are written once under the work folder (default /tmp/scaleout_bench; `--work DIR`).

Each engine runs the real stage (`data_pipeline.dedup.stage.run`, stages exact and MinHash, force=true) in its
own process, niced; datatrove on the local executor, tasks=auto (one per 100,000 texts), one worker per CPU.
Measured: the wall time of that process, the stage's own seconds (stats.json) and the CPU seconds of the
process and all its children (on a shared machine, the figure the load moves least), the peak resident memory
of the stage's process and of the largest of its children (getrusage: a datatrove worker, which runs tasks
one after another), and the peak of the whole process tree sampled every 0.2 s (sum of RSS; and of PSS,
which counts pages shared by forked workers once, every second: reading it stalls the process read).  A run whose tree passes --mem-cap-gb (default 12) is
stopped and recorded as such, so a 2-core machine shared with other work is not driven out of memory.
Planted duplicates found: a planted pair counts when clusters.jsonl puts both texts under one kept text.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

SIZES = (226_000, 1_000_000, 4_000_000)
PLANTED_SHARE = 0.01
SEED = 0
_CLAUSE = re.compile(r"[^，。！？；\n]+[，。！？；\n]?")


def _real_texts() -> list[str]:
    from care.data.io import read_text_store
    from care.paths import outputs_dir

    store = outputs_dir() / "data" / "import" / "texts.jsonl"
    if not store.is_file():
        raise FileNotFoundError(f"{store} is missing: run `python -m data_pipeline stage=import` first "
                                "(make bench-scaleout does)")
    return list(read_text_store(store).values())


def build_store(n: int, path: Path, real: list[str]) -> dict:
    """The store of n texts at `path` (module docstring) and its planted pairs beside it; built once."""
    planted_path = path.with_suffix(".planted.json")
    if path.is_file() and planted_path.is_file():
        return json.loads(planted_path.read_text(encoding="utf-8"))
    from care.data.io import write_jsonl
    from data_pipeline.dedup.minhash_reference import jaccard, shingles
    from data_pipeline.dedup.normalize import Normalizer
    from data_pipeline.planted import edit_until

    rng = random.Random(SEED)
    split = [_CLAUSE.findall(t) or [t] for t in real]
    pool = [c for parts in split for c in parts]
    n_planted = int(PLANTED_SHARE * n)
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(real[:n - n_planted])]
    for k in range(n - n_planted - len(rows)):
        count = len(split[rng.randrange(len(split))])
        rows.append({"id": f"m{k}", "text": "".join(rng.choice(pool) for _ in range(count))})
    normalise = Normalizer()
    made = [r for r in rows if r["id"].startswith("m") and len(r["text"]) >= 30] or \
        [r for r in rows if len(r["text"]) >= 30]
    alphabet = sorted({c for c in "".join(rng.sample(pool, min(len(pool), 20_000))) if not c.isspace()})
    planted = []
    for k in range(n_planted):
        orig = made[rng.randrange(len(made))]
        text, _, _ = edit_until(normalise(orig["text"]), rng.uniform(0.85, 0.97), 2, alphabet, rng)
        copy_id = f"{orig['id']}-near{k}"
        rows.append({"id": copy_id, "text": text})
        reached = jaccard(shingles(normalise(orig["text"]), 2), shingles(normalise(text), 2))
        planted.append([orig["id"], copy_id, round(reached, 4)])
    rng.shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, rows)
    info = {"n": len(rows), "real": min(len(real), n - n_planted), "planted": planted}
    planted_path.write_text(json.dumps(info), encoding="utf-8")
    return info


def _step_stats(logs: Path) -> dict:
    """Per datatrove step (each task's stats file): tasks, their CPU seconds summed and the largest, and the
    largest peak resident memory of a process that ran one (dedup_steps.py `measured`)."""
    out = {}
    for step in sorted(p for p in logs.iterdir() if (p / "stats").is_dir()):
        cpu, rss, start = [], [], []
        for path in sorted((step / "stats").glob("*.json")):
            for entry in json.loads(path.read_text(encoding="utf-8")):
                if "cpu_seconds" in entry["stats"]:
                    cpu.append(entry["stats"]["cpu_seconds"]["total"])
                    rss.append(entry["stats"]["peak_rss_mb"]["total"])
                    start.append(entry["stats"]["start_rss_mb"]["total"])
        out[step.name] = {"tasks": len(cpu), "cpu_s": round(sum(cpu), 2), "max_task_cpu_s": round(max(cpu), 2),
                          "max_task_peak_rss_mb": round(max(rss), 1),
                          # a worker runs tasks one after another: its peak may be an earlier task's
                          "max_task_growth_mb": round(max(r - s for r, s in zip(rss, start)), 1)}
    return out


def _stage(engine: str, store: str, out: str, cache: str) -> None:
    """In the measured process: the dedup stage, then this process's and its children's peak memory."""
    from care.config import load_config
    from data_pipeline.dedup.stage import run

    work = Path(cache) / "work"
    cfg = load_config("data_pipeline", [f"++input={store}", f"++out={out}", "dedup.stages=[exact,minhash]",
                                        "dedup.roles=null", "dedup.sources=null", f"dedup.engine={engine}",
                                        "force=true", f"cache_root={cache}", "dedup.keep_work=true",
                                        f"dedup.work_dir={work}"])
    shutil.rmtree(work, ignore_errors=True)
    stats = run(cfg)
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    steps = _step_stats(work / "logs") if engine == "datatrove" else None
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"stage_seconds": stats["seconds"], "texts_out": stats["texts_out"],
                      "cpu_s": round(own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, 1),
                      "stages": {k: v["seconds"] for k, v in stats["stages"].items()},
                      "engine_stats": stats.get("engine"), "steps": steps,
                      "self_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "largest_child_peak_rss_mb":
                          round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)}))


def measure(engine: str, store: Path, out: Path, cache: Path, mem_cap_gb: float, nice: int = 10) -> dict:
    """The stage in a niced subprocess, its process tree's memory sampled until it ends."""
    import psutil

    t0 = time.perf_counter()
    step = max(0, nice - os.nice(0))   # `nice -n` adds to this process's niceness: the stage runs at `nice`
    # its output to files, not pipes: nothing reads a pipe until the end, and datatrove's logs fill one (64 KB)
    # and block the tasks writing to it
    log = Path(cache) / f"{engine}_{store.stem}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{log}.out", "w") as out_fh, open(f"{log}.err", "w") as err_fh:
        proc = subprocess.Popen(["nice", "-n", str(step), sys.executable, "-m", "bench.scaleout_bench", "--stage",
                                 engine, str(store), str(out), str(cache)], stdout=out_fh, stderr=err_fh,
                                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    root = psutil.Process(proc.pid)
    peak_rss = peak_pss = 0.0
    capped = False
    polls = 0
    while proc.poll() is None:
        rss = pss = 0.0
        # PSS reads smaps, which holds each process's memory map lock while it walks it and stalls a process
        # that is allocating: once a second; RSS (statm, cheap) every 0.2 s
        full = polls % 5 == 0
        polls += 1
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    info = p.memory_full_info() if full else p.memory_info()
                    rss, pss = rss + info.rss, pss + (info.pss if full else 0.0)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        except psutil.NoSuchProcess:
            break
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        if rss > mem_cap_gb * 2**30:
            capped = True
            for p in [*root.children(recursive=True), root]:
                p.kill()
            break
        time.sleep(0.2)
    proc.wait()
    wall = time.perf_counter() - t0
    stdout, stderr = (Path(f"{log}.{x}").read_text(encoding="utf-8", errors="replace") for x in ("out", "err"))
    row = {"engine": engine, "wall_s": round(wall, 1), "tree_peak_rss_mb": round(peak_rss / 2**20, 1),
           "tree_peak_pss_mb": round(peak_pss / 2**20, 1)}
    if capped:
        return {**row, "stopped": f"the process tree passed {mem_cap_gb} GB resident; stopped"}
    if proc.returncode:
        return {**row, "failed": stderr[-3000:]}
    return {**row, **json.loads(stdout.strip().splitlines()[-1])}


def planted_found(out: Path, planted: list) -> dict:
    """Planted pairs whose two texts clusters.jsonl puts under one kept text (through every stage)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])
            x = parent[x]
        return x

    with open(out / "clusters.jsonl", encoding="utf-8") as fh:
        for line in fh:
            c = json.loads(line)
            root = find(str(c["kept_id"]))
            for r in c["removed_ids"]:
                parent[find(str(r))] = root
    hits = [find(a) == find(b) for a, b, _ in planted]
    over = [h for (_, _, j), h in zip(planted, hits) if j >= 0.8]
    return {"planted": len(planted), "found": sum(hits), "planted_jaccard_at_least_0.8": len(over),
            "found_of_those": sum(over)}


REAL_SETS = {   # name: (store, filters) for the equality check on the real sets (`--equal`)
    "import store": (None, ["dedup.roles=null", "dedup.sources=null"], "auto"),
    "cEpilepsyQA answers": (None, ["dedup.roles=[answer]", "dedup.sources=[cepilepsyqa]"], 4),
    "cMedQA2 answers": ("cmedqa2", ["dedup.roles=null", "dedup.sources=null"], 4),
}


def _cmedqa2_answers(path: Path) -> Path:
    """Every answer of the shared cMedQA2 pairs (dev and test, tab-separated label, question, answer) as a
    text store, repeats included (11,624 rows, 9,390 distinct texts)."""
    import csv

    from care.data.io import write_jsonl
    from care.paths import shared_data

    rows = []
    for split in ("dev", "test"):
        with open(shared_data() / "chineseblue_cmedqa2_pairs" / f"{split}.txt", encoding="utf-8", newline="") as fh:
            rows += [{"id": f"{split}:{i}", "text": r[2]} for i, r in enumerate(csv.reader(fh, delimiter="\t"))
                     if len(r) == 3 and r[2].strip()]
    write_jsonl(path, rows)
    return path


def equal_on_real_sets(work: Path) -> dict:
    """Both engines on the import store (every row), its cEpilepsyQA answers and the cMedQA2 answers, stages
    exact and MinHash: the counts, and whether kept.jsonl and clusters.jsonl are the same bytes."""
    from care.config import load_config
    from care.data.io import file_digest
    from care.paths import outputs_dir
    from data_pipeline.dedup.stage import run as run_stage

    out = {}
    for name, (store, filters, tasks) in REAL_SETS.items():
        src = _cmedqa2_answers(work / "cmedqa2_answers.jsonl") if store == "cmedqa2" else \
            outputs_dir() / "data" / "import" / "texts.jsonl"
        row = {}
        for engine in ("native", "datatrove"):
            folder = work / "equal" / f"{name.replace(' ', '_')}_{engine}"
            t0 = time.perf_counter()
            stats = run_stage(load_config("data_pipeline", [
                f"++input={src}", f"++out={folder}", "dedup.stages=[exact,minhash]", *filters, "force=true",
                f"dedup.engine={engine}", f"dedup.tasks={tasks}", f"cache_root={work / 'cache'}"]))
            row[engine] = {"seconds": round(time.perf_counter() - t0, 1), "texts_in": stats["texts_in"],
                           **({"tasks": stats["engine"]["tasks"]} if engine == "datatrove" else {}),
                           **{f"after_{s}": v["out"] for s, v in stats["stages"].items()},
                           **{f"{s}_clusters": v["clusters"] for s, v in stats["stages"].items()},
                           **{f: file_digest(folder / f) for f in ("kept.jsonl", "clusters.jsonl")}}
        row["datatrove"]["tasks_setting"] = tasks
        row["identical"] = all(row["native"][f] == row["datatrove"][f] for f in ("kept.jsonl", "clusters.jsonl"))
        out[name] = row
        print(f"scaleout: {name}: " + json.dumps(row), flush=True)
    return out


def run(sizes=SIZES, engines=("native", "datatrove"), work: Path = Path("/tmp/scaleout_bench"),
        mem_cap_gb: float = 12.0, save=lambda result: None, nice: int = 10, repeat: int = 1,
        done: list | None = None) -> dict:
    """The sizes, each engine in turn (`repeat` times, alternating); `save(result)` after every run, so a run
    stopped half-way leaves what it measured.  `done`: runs measured before (--resume), not run again."""
    real = _real_texts()
    result: dict = {"sizes": list(sizes), "planted_share": PLANTED_SHARE, "seed": SEED, "nice": nice,
                    "mem_cap_gb": mem_cap_gb, "runs": list(done or [])}
    for r in done or []:   # rows written before the child's key was "engine_stats" lost the engine's name
        if not isinstance(r["engine"], str):
            r["engine_stats"], r["engine"] = r["engine"], "datatrove" if r["engine"] else "native"
    measured = {(r["n"], r["engine"]) for r in done or [] if "failed" not in r}
    for n in sizes:
        if all((n, e) in measured for e in engines):
            continue
        t0 = time.perf_counter()
        store = work / f"store_{n}.jsonl"
        info = build_store(n, store, real)
        print(f"scaleout: store of {n:,} texts ({len(info['planted']):,} planted) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        outs = {}
        for engine in [e for _ in range(repeat) for e in engines if (n, e) not in measured]:
            out = work / f"out_{engine}_{n}"
            load = [round(x, 2) for x in os.getloadavg()]
            row = {"n": n, **measure(engine, store, out, work / "cache", mem_cap_gb, nice), "load_before": load,
                   "load_after": [round(x, 2) for x in os.getloadavg()]}
            if "failed" not in row and "stopped" not in row:
                row["planted"] = planted_found(out, info["planted"])
                outs[engine] = out
            result["runs"].append(row)
            save(result)
            print(f"scaleout: {engine} at {n:,}: " + json.dumps({k: v for k, v in row.items() if k != "failed"}),
                  flush=True)
        if len(outs) == 2:
            same = all((outs["native"] / f).read_bytes() == (outs["datatrove"] / f).read_bytes()
                       for f in ("kept.jsonl", "clusters.jsonl"))
            result["runs"][-1]["identical_to_native"] = same
            save(result)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    ap.add_argument("--engines", nargs="*", default=["native", "datatrove"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/scaleout_bench"))
    ap.add_argument("--mem-cap-gb", type=float, default=12.0)
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/scaleout.json")
    ap.add_argument("--equal", action="store_true", help="only the equality check on the real sets")
    ap.add_argument("--skip-equal", action="store_true", help="no equality check on the real sets")
    ap.add_argument("--nice", type=int, default=10, help="niceness of the measured runs (default 10)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each engine per size, alternating")
    ap.add_argument("--resume", action="store_true", help="keep what --out holds; run only what it lacks")
    ap.add_argument("--stage", nargs=4, metavar=("ENGINE", "STORE", "OUT", "CACHE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        _stage(*args.stage)
        return
    from bench.__main__ import machine
    from care.data.io import write_json
    from care.paths import PROJECT_ROOT

    start, date = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S")
    target = args.out or PROJECT_ROOT / "bench" / "results" / "scaleout.json"
    head = {"benchmark": "scaleout", "date": date, "machine": machine(), "load_at_start": os.getloadavg()}
    partial: dict = {}
    if args.resume and target.is_file():
        earlier = json.loads(target.read_text(encoding="utf-8"))
        partial = {k: v for k, v in earlier.items() if k not in ("benchmark", "wall_s")}
        head.update(date=earlier.get("date", date), resumed=date)

    def save(result: dict) -> None:
        partial.update(result)
        write_json(target, {**head, "wall_s": round(time.perf_counter() - start, 1), **partial})

    if not args.skip_equal and "equal_on_real_sets" not in partial:
        save({"equal_on_real_sets": equal_on_real_sets(args.work)})
    if not args.equal:
        run(args.sizes, args.engines, args.work, args.mem_cap_gb, save, args.nice, args.repeat,
            partial.get("runs"))
    print(json.dumps(json.loads(target.read_text(encoding="utf-8")), indent=2)[:6000])


if __name__ == "__main__":
    main()
