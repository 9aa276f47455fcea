"""`python -m bench.eval_workload [evaluate.py overrides] [--tokens-per-s N]`: the document side of an
evaluation as work, read from the benchmark files (nothing is encoded): per task type and in all, the texts one
evaluated model encodes (each once, as care.evaluation.corpora.document_texts gives them to the runners) and
their tokens under the model's tokenizer, document prompt and token limit (evaluate.yaml's `max_length`), and
the minutes that takes at a rate of N tokens/s.

Why tokens: a transformer encoder's cost on a CPU is close to proportional to the tokens it reads, so the
evaluation's encode minutes are these tokens over the machine's tokens/s, whatever the batch; the floor of
`make run` follows from it (docs/results.md, "Where make run's time goes").
"""
from __future__ import annotations

import argparse
import json

from omegaconf import OmegaConf
from transformers import AutoTokenizer

from care.config import load_config
from care.encoders.prompts import Prompts
from care.evaluation import corpora
from care.families import family_of
from data_pipeline import benchmarks as builders


def document_tokens(cfg: dict) -> dict:
    """{task type: {texts, tokens}, "all": {...}} for the model and benchmarks of an evaluate.py config."""
    model = corpora.model_from_app_config(cfg)
    prompts = Prompts.from_config(model)  # the one place prompts are applied (templates, older keys)
    tower = model["document"] if family_of(model).towers else model  # two towers: the document tower reads them
    tokenizer = AutoTokenizer.from_pretrained(tower["path"])
    limit = int(tower.get("max_length", 512))
    texts = corpora.document_texts(corpora.load_benchmarks(cfg, build=builders.build, show_progress=False))
    out, union = {}, {}
    for task, items in texts.items():
        prompted = prompts.apply(items, "document", task)
        lengths = [len(ids) for ids in tokenizer(prompted, truncation=True, max_length=limit)["input_ids"]]
        out[task] = {"texts": len(items), "tokens": sum(lengths)}
        union.update(zip(items, lengths))
    out["all"] = {"texts": len(union), "tokens": sum(union.values())}  # a text in two task types is encoded once
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="evaluate.py overrides (model=, ckpt=, benchmark=, max_length=)")
    ap.add_argument("--tokens-per-s", type=float, default=None, help="a measured rate: print the minutes it gives")
    args = ap.parse_args()
    cfg = OmegaConf.to_container(load_config("evaluate", args.overrides), resolve=True)
    result = document_tokens(cfg)
    if args.tokens_per_s:
        result["all"]["minutes_at_rate"] = round(result["all"]["tokens"] / args.tokens_per_s / 60, 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
