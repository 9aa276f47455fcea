"""trainer.batching: by_rule (each global batch from one build rule, rule_weights) and mixed (today's order),
with the data guarantees of care/training/samplers.py: one global order for any number of processes, exact resume.
Also the fixes of CARE stage I's step cost (bench/care_step_bench.py): a batch in one GradCache chunk runs one
forward, and checkpoints leave frozen weights out."""
from __future__ import annotations

import contextlib
import copy
from collections import Counter

import numpy as np
import pytest
from _training_helpers import make_training_files, train_config
from omegaconf import OmegaConf, open_dict
from torch.utils.data import DataLoader

from care.data.io import DataError, read_jsonl, write_jsonl
from care.training import trainer as trainer_mod
from care.training.checkpoint import config_hash
from care.training.data import TrainingGroups, collate_groups
from care.training.samplers import EpochSampler, RuleBatchSampler, build_sampler
from care.training.trainer import Trainer

# 4 rules of uneven sizes; with a global batch of 4: full batches a 9, b 5, c 2, d 0 (T = 16 an epoch)
RULES = ["a"] * 37 + ["b"] * 20 + ["c"] * 9 + ["d"] * 3


def expected_counts(sizes: dict[str, int], batch: int, weights: dict[str, float] | None) -> dict[str, int]:
    """The documented rule, written out again: full batches per rule; with weights, the epoch's total shared
    by largest remainder (ties by name), in exact rational arithmetic."""
    full = {r: n // batch for r, n in sizes.items()}
    if weights is None:
        return {r: c for r, c in full.items()}
    total, wsum = sum(full.values()), sum(weights.values())
    floors = {r: (total * weights[r]) // wsum for r in sizes}        # integer weights: exact
    rest = {r: (total * weights[r]) % wsum for r in sizes}           # remainder x wsum
    for r in sorted(sizes, key=lambda r: (-rest[r], r))[:total - sum(floors.values())]:
        floors[r] += 1
    return floors


def global_batches(sampler: RuleBatchSampler, epoch: int) -> list[list[tuple]]:
    sampler.set_epoch(epoch)
    items = list(sampler)
    b = sampler.global_batch
    assert len(items) == len(sampler) and len(items) % b == 0
    return [items[s:s + b] for s in range(0, len(items), b)]


@pytest.mark.parametrize("weights, by_hand", [
    (None, {"a": 9, "b": 5, "c": 2, "d": 0}),
    ({"a": 1, "b": 1, "c": 1, "d": 0}, {"a": 6, "b": 5, "c": 5, "d": 0}),    # 16/3 each, the tie to a
    ({"a": 3, "b": 2, "c": 0, "d": 0}, {"a": 10, "b": 6, "c": 0, "d": 0}),   # 9.6, 6.4: a and b repeat
    ({"a": 1, "b": 1, "c": 2, "d": 0}, {"a": 4, "b": 4, "c": 8, "d": 0}),    # c: 4 shuffles of its 9
])
def test_every_global_batch_is_one_rule_and_counts_follow_the_weights(weights, by_hand):
    sizes = dict(Counter(RULES))
    assert expected_counts(sizes, 4, weights) == by_hand
    warns = pytest.warns(UserWarning, match=r"d \(3 examples\).*never trained on")
    with warns if weights is None else contextlib.nullcontext():
        sampler, again = (RuleBatchSampler(RULES, 4, seed=5, weights=weights) for _ in range(2))
    assert sampler.counts == by_hand and len(sampler) == 16 * 4
    for epoch in (0, 1):
        batches = global_batches(sampler, epoch)
        rules = [{RULES[item[1]] for item in batch} for batch in batches]
        assert all(len(r) == 1 for r in rules), rules
        labels = [r.pop() for r in rules]
        assert Counter(labels) == Counter({r: c for r, c in by_hand.items() if c})
        assert labels != sorted(labels)  # interleaved, not one rule after another
        for rule, count in by_hand.items():
            items = [item for batch in batches for item in batch if RULES[item[1]] == rule]
            full = sizes[rule] // 4
            # the first pass: distinct examples; a later pass only after every example of the rule was seen
            first = [i for i in items if len(i) == 2]
            assert len(first) == 4 * min(count, full) and len({i[1] for i in first}) == len(first)
            passes = Counter(i[2] if len(i) == 3 else 0 for i in items)
            assert all(passes[k] <= 4 * full for k in passes)
            assert all(len({i[1] for i in batch}) == 4 for batch in batches)  # no example twice in a batch
            assert all(item[0] == epoch for item in items)
    # another epoch, another order; the same epoch again, the same order
    assert global_batches(sampler, 0) != global_batches(sampler, 1)
    assert global_batches(sampler, 1) == global_batches(again, 1)


def test_a_rules_order_depends_on_seed_epoch_and_rule_only():
    """Adding a rule to the file (or other examples before it) does not reorder another rule's batches."""
    more = ["z"] * 11 + RULES  # every index shifted by 11
    with pytest.warns(UserWarning):  # d: no full batch
        one, two, other = (RuleBatchSampler(r, 4, seed=s) for r, s in ((RULES, 5), (more, 5), (RULES, 6)))
    for rule in "abc":
        assert [[i for _, i in b] for b in one.rule_batches(3, rule)] == \
               [[i - 11 for _, i in b] for b in two.rule_batches(3, rule)]
    assert one.rule_batches(3, "a") != other.rule_batches(3, "a")


def test_weights_are_refused_when_they_cannot_be_followed():
    with pytest.raises(ValueError, match=r"every rule.*missing: c, d"):
        RuleBatchSampler(RULES, 4, weights={"a": 1, "b": 1})
    with pytest.raises(ValueError, match=r"not in the file: e"):
        RuleBatchSampler(RULES, 4, weights={"a": 1, "b": 1, "c": 1, "d": 0, "e": 1})
    with pytest.raises(ValueError, match=r"d \(3 examples\), fewer than one global batch of 4"):
        RuleBatchSampler(RULES, 4, weights={"a": 1, "b": 1, "c": 1, "d": 1})
    with pytest.raises(ValueError, match=r">= 0, not all 0"):
        RuleBatchSampler(RULES, 4, weights={"a": -1, "b": 1, "c": 1, "d": 0})
    with pytest.raises(ValueError, match=r">= 0, not all 0"):
        RuleBatchSampler(RULES, 4, weights={"a": 0, "b": 0, "c": 0, "d": 0})
    with pytest.raises(ValueError, match=r"no rule has a full global batch of 64"), pytest.warns(UserWarning):
        RuleBatchSampler(RULES, 64)


# ---- through the data loader, as the trainer builds it ---------------------------------------------------

@pytest.fixture(scope="module")
def ruled(tmp_path_factory, shared):
    """Real training files whose 40-odd examples come from 3 rules of uneven sizes."""
    root = tmp_path_factory.mktemp("rules")
    texts, train = make_training_files(root, shared, n_questions=48)
    rows = list(read_jsonl(train))
    names = ["cepilepsyqa"] * (len(rows) // 2) + ["kuake_qqr"] * (len(rows) // 3)
    names += ["chip_sts"] * (len(rows) - len(names))
    write_jsonl(train, [{**r, "rule": n, "pool": "answers"} for r, n in zip(rows, names)])
    return root, texts, train


def _loader(data, batch_size, sampler, workers=0):
    return DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=collate_groups, drop_last=True,
                      num_workers=workers)


@pytest.mark.parametrize("weights", [None, {"cepilepsyqa": 1, "kuake_qqr": 1, "chip_sts": 2}])
def test_the_same_batches_on_one_process_or_several(ruled, weights):
    """Each process's share of a global batch comes from the same rule, and the global batches are those of
    one process holding them whole (accelerate's own sharding, as the trainer prepares its loader)."""
    from accelerate.data_loader import prepare_data_loader

    _, texts, train = ruled
    data = TrainingGroups(texts, train, group_size=3, seed=7)
    rule_of = {data.texts[e["query_id"]]: e["rule"] for e in data.examples}
    rules = data.example_rules()

    def one_process(epoch, global_batch, workers=0):
        sampler = RuleBatchSampler(rules, global_batch, seed=7, weights=weights)
        sampler.set_epoch(epoch)
        return [(b["queries"], b["passages"]) for b in _loader(data, global_batch, sampler, workers)]

    for n, per_process in ((2, 4), (4, 2)):
        whole = one_process(1, n * per_process)
        shards = []
        t = OmegaConf.create({"batch_size": per_process, "batching": "by_rule", "rule_weights": weights})
        for p in range(n):
            sampler = build_sampler(t, data, 7, num_processes=n)  # the trainer's: a global batch of n x 4
            assert sampler.global_batch == n * per_process
            shard = prepare_data_loader(_loader(data, per_process, sampler), num_processes=n, process_index=p,
                                        put_on_device=False)
            shard.set_epoch(1)
            shards.append([(b["queries"], b["passages"]) for b in shard])
        assert [len(s) for s in shards] == [len(whole)] * n
        for step, global_batch in enumerate(whole):
            queries = [q for s in shards for q in s[step][0]]
            passages = [x for s in shards for x in s[step][1]]
            assert (queries, passages) == global_batch
            assert len({rule_of[q] for q in queries}) == 1
    assert one_process(1, 8, workers=2) == one_process(1, 8)
    assert one_process(2, 8) != one_process(1, 8)


def test_a_repeated_example_draws_its_group_afresh(ruled):
    _, texts, train = ruled
    data = TrainingGroups(texts, train, group_size=3, seed=7)
    sampler = RuleBatchSampler(data.example_rules(), 4, seed=7,
                               weights={"cepilepsyqa": 0, "kuake_qqr": 0, "chip_sts": 1})
    seen: dict[int, list] = {}
    for batch in global_batches(sampler, 0):
        for item in batch:
            seen.setdefault(item[1], []).append(data[item]["passages"])
    repeated = [groups for groups in seen.values() if len(groups) > 1]
    assert repeated and any(len({tuple(g) for g in groups}) > 1 for groups in repeated)
    # the first pass draws exactly what mixed batching draws for (epoch, index)
    assert all(data[(0, i)]["passages"] == groups[0] for i, groups in seen.items())


# ---- the trainer: keys, hash, resume ---------------------------------------------------------------------

def _recording(monkeypatch) -> list[tuple[int, int, list[str]]]:
    """Trainer.train_step replaced by a recorder of (epoch, batch in epoch, queries): the data position alone."""
    seen = []

    def step(self, batch):
        seen.append((self.epoch, self.batch_in_epoch, list(batch["queries"])))
        return {"loss/loss": 0.0, "grad_norm": 0.0, "lr": 0.0}

    monkeypatch.setattr(Trainer, "train_step", step)
    return seen


class Crash(RuntimeError):
    pass


def test_by_rule_resumes_mid_epoch_at_the_exact_batch(ruled, monkeypatch):
    root, texts, train = ruled
    seen = _recording(monkeypatch)
    rule_of = {e["query_id"]: e["rule"] for e in TrainingGroups(texts, train).examples}
    text_rule = {t["text"]: rule_of[t["id"]] for t in read_jsonl(texts) if t["id"] in rule_of}

    def cfg(run):  # 4 queries a batch: 12 batches an epoch (weights: 3 + 3 + 6), 16 steps cross into epoch 1
        return train_config(root, texts, train, run, "trainer.batch_size=4", "trainer.batching=by_rule",
                            "trainer.rule_weights={cepilepsyqa: 1, kuake_qqr: 1, chip_sts: 2}",
                            "trainer.max_steps=16", "trainer.epochs=3", "trainer.checkpoint_every=3")

    Trainer(cfg("reference")).fit()
    reference = list(seen)
    assert [(e, b) for e, b, _ in reference] == [(0, b) for b in range(12)] + [(1, b) for b in range(4)]
    assert all(len({text_rule[q] for q in qs}) == 1 for _, _, qs in reference)
    assert Counter(text_rule[qs[0]] for e, _, qs in reference if e == 0) == \
        Counter({"cepilepsyqa": 3, "kuake_qqr": 3, "chip_sts": 6})

    def crash(trainer):
        if trainer.step == 8:
            raise Crash("killed")

    seen.clear()
    with pytest.raises(Crash):
        Trainer(cfg("killed"), callbacks=[crash]).fit()  # last checkpoint: step 6, mid-epoch 0
    assert seen == reference[:8]
    seen.clear()
    Trainer(cfg("killed")).fit()
    assert seen == reference[6:]


def test_mixed_is_todays_order_and_keeps_todays_hash(ruled):
    """batching=mixed (the default) is the epoch order of before the key existed: a permutation by (seed,
    epoch), cut into batches, written out here again; and the config hash is that of a config without the
    new keys, so a run begun before them resumes."""
    root, texts, train = ruled
    cfg = train_config(root, texts, train, "mixed", "trainer.batch_size=8")
    assert cfg.trainer.batching == "mixed" and cfg.trainer.rule_weights is None  # conf/train.yaml's defaults
    trainer = Trainer(cfg)
    assert type(trainer.sampler) is EpochSampler and "batches_per_rule" not in trainer.data.stats
    data = trainer.data
    for epoch in (0, 1):
        trainer.loader.set_epoch(epoch)
        got = [(b["queries"], b["passages"]) for b in trainer.loader]
        order = np.random.default_rng([cfg.seed, epoch]).permutation(len(data))
        want = []
        for s in range(0, len(order) // 8 * 8, 8):
            groups = [data.group(epoch, int(i)) for i in order[s:s + 8]]
            want.append(([data.texts[q] for q, _, _ in groups], [data.texts[p] for _, ps, _ in groups for p in ps]))
        assert got == want
    old = copy.deepcopy(cfg)
    with open_dict(old):
        del old.trainer["batching"], old.trainer["rule_weights"]
    assert config_hash(cfg) == trainer.hash == config_hash(old)
    by_rule = train_config(root, texts, train, "mixed", "trainer.batch_size=8", "trainer.batching=by_rule")
    assert config_hash(by_rule) != config_hash(cfg)
    assert "batching" in cfg.trainer  # config_hash left the config itself alone


def test_bad_settings_are_refused_in_one_line(ruled, tmp_path, shared, monkeypatch):
    root, texts, train = ruled
    # every refusal comes before the model loads
    monkeypatch.setattr(trainer_mod, "build_family", lambda cfg: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError, match=r"trainer.batching='by_task': choose one of mixed, by_rule"):
        Trainer(train_config(root, texts, train, "bad1", "trainer.batching=by_task"))
    with pytest.raises(ValueError, match=r"rule_weights is for trainer.batching=by_rule"):
        Trainer(train_config(root, texts, train, "bad2", "trainer.rule_weights={cepilepsyqa: 1}"))
    with pytest.raises(ValueError, match=r"missing: chip_sts"):
        Trainer(train_config(root, texts, train, "bad3", "trainer.batching=by_rule",
                             "trainer.rule_weights={cepilepsyqa: 1, kuake_qqr: 1}"))
    plain_texts, plain = make_training_files(tmp_path, shared, n_questions=16)  # no rule field
    with pytest.raises(DataError, match=r"line 1, field 'rule'.*batching=by_rule.*stage2.trainer.batching"):
        Trainer(train_config(tmp_path, plain_texts, plain, "bad4", "trainer.batching=by_rule"))


def test_the_plan_is_recorded(ruled, monkeypatch):
    root, texts, train = ruled
    _recording(monkeypatch)
    summary = Trainer(train_config(root, texts, train, "plan", "trainer.batch_size=4", "trainer.batching=by_rule",
                                   "trainer.max_steps=2")).fit()
    sizes = Counter(e["rule"] for e in TrainingGroups(texts, train).examples)
    assert summary["data"]["batches_per_rule"] == {r: n // 4 for r, n in sorted(sizes.items())}


# ---- stage I's step cost (issue #23, item 3): the fixes in gradcache.py and trainer.py ---------------------
# (kept beside the batching tests because this file is the one new test file of that change)

def _stage1_step(one_pass: bool):
    """One GradCache step of CARE's stage I shape: a trainable query model with dropout, the document side a
    frozen table of vectors (care_family.CachedDocuments), the whole batch in one chunk."""
    import torch

    from care.models.m3 import tiny_m3
    from care.training.care_family import CachedDocuments
    from care.training.gradcache import GradCache
    from care.training.losses import AsymmetricLoss

    torch.manual_seed(0)
    query = tiny_m3(hidden=32, dropout=0.1).train()
    calls = []
    query.register_forward_hook(lambda *a: calls.append(1))
    documents = CachedDocuments(np.random.default_rng(0).standard_normal((40, 32)).astype(np.float32))
    texts = ["头痛怎么办", "癫痫发作时应该怎么处理？", "孩子发烧三天不退", "高血压患者能喝咖啡吗",
             "失眠多梦"] * 2
    batch = dict(query.tokenizer(texts, padding=True, return_tensors="pt"))
    gc = GradCache(AsymmetricLoss(temperature=0.1, mse_weight=1.0, group_size=1), chunk_size=len(texts))
    if not one_pass:
        gc.fits_one_chunk = lambda towers: False  # the cached path: no-grad forward, loss, re-forward
    torch.manual_seed(7)
    losses = gc.step(query, batch, {"rows": torch.arange(3, 3 + len(texts))}, passage_model=documents)
    grads = {n: p.grad for n, p in query.named_parameters() if p.grad is not None}
    return losses, grads, torch.get_rng_state(), len(calls)


def test_a_batch_in_one_chunk_is_one_forward_with_the_cached_gradients_bit_for_bit():
    import torch

    losses, grads, rng, forwards = _stage1_step(one_pass=True)
    ref_losses, ref_grads, ref_rng, ref_forwards = _stage1_step(one_pass=False)
    assert (forwards, ref_forwards) == (1, 2)  # the query model's forward ran twice a step before
    assert losses == ref_losses and set(losses) == {"loss", "infonce", "mse"}
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)  # same dropout masks, same gradients
    assert torch.equal(rng, ref_rng)  # and the RNG left where the cached step leaves it


def test_checkpoints_leave_frozen_weights_out_and_resume_exactly(ruled):
    import torch
    from safetensors.torch import load_file

    from care.models.m3 import tiny_m3
    from care.training.checkpoint import ResumeError as Refused
    from care.training.model_saving import load_trained, trained_state

    root, texts, train = ruled

    def cfg(run):
        return train_config(root, texts, train, run, "trainer.freeze=[embeddings.word_embeddings]",
                            "trainer.max_steps=4", "trainer.checkpoint_every=2")

    Trainer(cfg("frozen-reference")).fit()

    def crash(trainer):
        if trainer.step == 3:
            raise Crash("killed")

    with pytest.raises(Crash):
        Trainer(cfg("frozen-killed"), callbacks=[crash]).fit()
    state = torch.load(root / "frozen-killed/checkpoints/step-0000002/state.pt", weights_only=True)["model"]
    assert state and not [k for k in state if "word_embeddings" in k]
    assert any("position_embeddings" in k for k in state)  # trained weights are all there
    Trainer(cfg("frozen-killed")).fit()
    reference = load_file(root / "frozen-reference/final/model.safetensors")
    resumed = load_file(root / "frozen-killed/final/model.safetensors")
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)

    model = tiny_m3(hidden=32)
    model.backbone.embeddings.word_embeddings.requires_grad_(False)
    full = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    load_trained(model, full, "old")  # a checkpoint from before: whole state_dicts still load
    assert all(torch.equal(v, full[k]) for k, v in model.state_dict().items())
    lean = trained_state(model)
    assert len(lean) == len(full) - 1
    load_trained(model, lean, "new")
    with pytest.raises(Refused, match=r"checkpoint x: the model weights do not fit this model: 1 missing"):
        load_trained(model, {k: v for k, v in lean.items() if "position_embeddings" not in k},
                     "checkpoint x: the model")
    with pytest.raises(Refused, match=r"1 unexpected"):
        load_trained(model, {**lean, "no.such.weight": torch.zeros(1)}, "checkpoint x: the model")
