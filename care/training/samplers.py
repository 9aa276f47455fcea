"""The epoch order of the training examples (`trainer.batching`): which examples each global batch holds.

Both samplers yield items (epoch, example index[, repeat]) that care.training.data's TrainingGroups turns
into groups, and both orders are seeded, so a group never depends on the worker or process that builds it
(care.training.data, "Determinism").  build_sampler picks one from the trainer config.

Mixed batches (`trainer.batching: mixed`, the default; EpochSampler): every example once an epoch, in an
order shuffled by (seed, epoch).

Batches from one rule (`trainer.batching: by_rule`; RuleBatchSampler).
Each row's `rule` (the build rule it came from: conf/build/default.yaml, `rules`) sorts the examples;
every global batch (trainer.batch_size x processes: under accelerate each process's share of a global batch
is then from the same rule) holds examples of one rule only, as the CARE release's same_dataset_within_batch.
Per epoch, with B the global batch and n_r the examples of rule r:
  * rule r's examples are shuffled (seeded by (seed, epoch, rule)) and cut into b_r = n_r // B batches; the
    last n_r % B examples are dropped (another few each epoch), never filled from elsewhere;
  * the epoch has T = sum of b_r global batches, whatever the weights;
  * rule_weights null: rule r gets its b_r batches, each example at most once (rules in proportion to their
    full batches; a rule with fewer than B examples gets none, and the run warns);
    rule_weights {r: w_r} (every rule of the file named; 0 leaves a rule out): rule r gets c_r batches,
    c_r = floor(T * w_r / sum w) plus one for the rules with the largest remainders (ties: by rule name) until
    the c_r sum to T.  c_r < b_r: the first c_r batches of its shuffled order (another subset each epoch);
    c_r > b_r: after its b_r batches, those of a second shuffle (seeded by (seed, epoch, rule, pass)), and so
    on, so an example comes back only once every example of its rule has been seen; a repeated example draws
    its group afresh (seeded by (seed, epoch, index, pass));
  * the T batches are interleaved in an order shuffled by (seed, epoch) (a permutation of c_r labels of each
    rule r; the i-th label r takes rule r's i-th batch).
The order is one list for the whole run, cut by accelerate as EpochSampler's, so it keeps every rule above:
the same batches on 1 process or N, an exact resume from (epoch, batches done).
"""
from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from fractions import Fraction

import numpy as np
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Sampler

from care.training.data import ORDER_STREAM, RULE_STREAM, TrainingGroups

BATCHINGS = ("mixed", "by_rule")


class EpochSampler(Sampler):
    """Yields (epoch, example index) in an order shuffled by (seed, epoch).  The trainer calls set_epoch
    before each epoch; the epoch travels with every index so data-loader workers need no shared state."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        return iter([(self.epoch, int(i)) for i in order])


def rule_batch_counts(examples_per_rule: Mapping[str, int], global_batch: int,
                      weights: Mapping[str, float] | None = None) -> dict[str, int]:
    """Global batches of each rule in one by_rule epoch (the module docstring: b_r, T, c_r), by rule name."""
    full = {r: n // global_batch for r, n in sorted(examples_per_rule.items())}
    if weights is None:
        return full
    total, w = sum(full.values()), {r: Fraction(weights[r]) for r in full}
    quota = {r: total * w[r] / sum(w.values()) for r in full}
    counts = {r: math.floor(q) for r, q in quota.items()}
    by_remainder = sorted(full, key=lambda r: (-(quota[r] - counts[r]), r))
    for r in by_remainder[:total - sum(counts.values())]:
        counts[r] += 1
    return counts


class RuleBatchSampler(Sampler):
    """`trainer.batching: by_rule` (the module docstring): yields (epoch, example index[, repeat]) so that
    every run of `global_batch` consecutive items is one rule's.  `rules`: each example's rule (index order);
    `weights`: {rule: weight} or None; `key`: the config key of the weights, for messages."""

    def __init__(self, rules: Sequence[str], global_batch: int, seed: int = 0,
                 weights: Mapping[str, float] | None = None, key: str = "trainer.rule_weights"):
        if global_batch < 1:
            raise ValueError(f"the global batch must be >= 1, got {global_batch}")
        self.global_batch, self.seed, self.epoch = global_batch, seed, 0
        self.members: dict[str, np.ndarray] = {}
        for i, r in enumerate(rules):
            self.members.setdefault(r, []).append(i)
        self.members = {r: np.asarray(ix, dtype=np.int64) for r, ix in sorted(self.members.items())}
        sizes = {r: len(ix) for r, ix in self.members.items()}
        if weights is not None:
            weights = dict(weights)
            unknown, missing = sorted(set(weights) - set(sizes)), sorted(set(sizes) - set(weights))
            if unknown or missing:
                raise ValueError(f"{key} must name every rule of the training file once ({', '.join(sizes)}): "
                                 + "; ".join(x for x in (unknown and f"not in the file: {', '.join(unknown)}",
                                                         missing and f"missing: {', '.join(missing)} (weight 0 "
                                                         "leaves a rule out)") if x))
            bad = [r for r, v in weights.items()
                   if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0]
            if bad or not sum(weights.values()) > 0:
                raise ValueError(f"{key}: weights must be finite numbers >= 0, not all 0 (got {weights})")
            small = [r for r in sizes if weights[r] > 0 and sizes[r] < global_batch]
            if small:
                raise ValueError(f"{key} gives weight to {', '.join(f'{r} ({sizes[r]} examples)' for r in small)}, "
                                 f"fewer than one global batch of {global_batch} (batch_size x processes): a batch "
                                 "would repeat an example; give it weight 0 or lower trainer.batch_size")
        self.counts = rule_batch_counts(sizes, global_batch, weights)
        if weights is None:
            unused = [r for r in sizes if sizes[r] < global_batch]
            if unused:
                warnings.warn(f"trainer.batching=by_rule: {', '.join(f'{r} ({sizes[r]} examples)' for r in unused)} "
                              f"make no global batch of {global_batch} and are never trained on", stacklevel=2)
        if not sum(self.counts.values()):
            raise ValueError(f"no rule has a full global batch of {global_batch} (batch_size x processes) "
                             f"examples ({sizes}): lower trainer.batch_size")
        # a rule's stream key: from its name, so adding a rule to the file changes no other rule's order
        self.keys = {r: int.from_bytes(hashlib.sha256(r.encode()).digest()[:8], "little") for r in self.members}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return sum(self.counts.values()) * self.global_batch

    def rule_batches(self, epoch: int, rule: str) -> list[list[tuple[int, ...]]]:
        """Rule `rule`'s batches of `epoch` in its order: passes of its shuffled examples, each cut into full
        batches; items (epoch, index) in the first pass, (epoch, index, pass) in later ones."""
        members, want, b = self.members[rule], self.counts[rule], self.global_batch
        batches: list[list[tuple[int, ...]]] = []
        repeat = 0
        while len(batches) < want:
            seq = np.random.SeedSequence([self.seed, epoch], spawn_key=(RULE_STREAM, self.keys[rule], repeat))
            order = np.random.default_rng(seq).permutation(members)
            for s in range(0, len(order) // b * b, b):
                batches.append([(epoch, int(i), repeat) if repeat else (epoch, int(i)) for i in order[s:s + b]])
            repeat += 1
        return batches[:want]

    def plan(self, epoch: int) -> list[tuple[str, list[tuple[int, ...]]]]:
        """The epoch's global batches in order, each (rule, its items)."""
        labels = [r for r, c in self.counts.items() for _ in range(c)]
        order = np.random.default_rng(np.random.SeedSequence([self.seed, epoch], spawn_key=(ORDER_STREAM,)))
        labels = [labels[i] for i in order.permutation(len(labels))]
        pending = {r: iter(self.rule_batches(epoch, r)) for r, c in self.counts.items() if c}
        return [(r, next(pending[r])) for r in labels]

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter([item for _, batch in self.plan(self.epoch) for item in batch])


def build_sampler(t: DictConfig, data: TrainingGroups, seed: int, num_processes: int):
    """The epoch order of `trainer.batching` (EpochSampler or RuleBatchSampler); by_rule
    cuts the rules into global batches (batch_size x processes) and records its plan in data.stats."""
    batching = t.get("batching") or "mixed"
    if batching not in BATCHINGS:
        raise ValueError(f"trainer.batching={batching!r}: choose one of {', '.join(BATCHINGS)}")
    weights = t.get("rule_weights")
    if batching == "mixed":
        if weights is not None:
            raise ValueError("trainer.rule_weights is for trainer.batching=by_rule; with mixed batches set it null")
        return EpochSampler(len(data), seed)
    if OmegaConf.is_config(weights):
        weights = OmegaConf.to_container(weights, resolve=True)
    sampler = RuleBatchSampler(data.example_rules(), t.batch_size * num_processes, seed, weights)
    data.stats["batches_per_rule"] = dict(sampler.counts)  # per epoch, of batch_size x processes examples
    return sampler
