"""The timers of bench/care_step_bench.py: StepClock, the trainer callback that times each step of a
Trainer.fit (and the query tower's own forward + backward of the same batch), and PartTimers, the wrappers
and module hooks that split a step into its parts.  Both only wrap the one trainer they are given.
"""
from __future__ import annotations

import time

import torch


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PartTimers:
    """Seconds per part of the current step: wrappers on the trainer's own objects (instance attributes and
    module hooks, so nothing outside this trainer changes)."""

    def __init__(self, trainer):
        self.step: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.undo: list = []
        self._wrap(trainer, "_tokenize", lambda texts, sides, *a: "tokenize queries" if set(sides) == {"query"}
                   else "document side: tokenize (stage I: row numbers)")
        acc = trainer.accelerator
        self._wrap(acc, "backward", "backward (accelerator.backward)")
        self._wrap(acc, "clip_grad_norm_", "clip_grad_norm")
        self._wrap(trainer.optimizer, "step", "optimizer step (AdamW)")
        self._wrap(trainer.optimizer, "zero_grad", "zero_grad")
        self._wrap(trainer.scheduler, "step", "scheduler step")
        self._wrap(trainer.log_rows, "log", "log row (metrics.jsonl)")
        query, document = trainer.towers[0], trainer.towers[-1]
        self._hook(query, "query tower forward")
        if document is not query:
            self._hook(document, "document lookup (CachedDocuments)" if not trainer.trainable[-1]
                       else "document tower forward")
        self._hook(trainer.loss, "loss")

    def add(self, name: str, seconds: float) -> None:
        self.step[name] = self.step.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def _wrap(self, owner, attr: str, name) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            label = name(*args, **kwargs) if callable(name) else name
            _sync()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _sync()
                self.add(label, time.perf_counter() - start)

        own = attr in vars(owner)  # an instance attribute already (put back), else the class's (uncovered)
        setattr(owner, attr, timed)
        self.undo.append(lambda: setattr(owner, attr, original) if own else delattr(owner, attr))

    def _hook(self, module: torch.nn.Module, name: str) -> None:
        starts = []

        def pre(*_):
            _sync()
            starts.append(time.perf_counter())

        def post(*_):
            _sync()
            self.add(name, time.perf_counter() - starts.pop())

        self.undo += [module.register_forward_pre_hook(pre).remove, module.register_forward_hook(post).remove]

    def remove(self) -> None:
        """Every wrapper and hook off again (a checkpoint pickles the scheduler's attributes)."""
        for undo in reversed(self.undo):
            undo()


class StepClock:
    """The trainer's callback: after `warmup` untimed steps, `repeats` steps of the ratio phase (each step
    timed callback to callback, then the query tower's own forward + backward of the step's batch right after
    it), then `repeats` steps of the breakdown phase, under PartTimers."""

    def __init__(self, trainer, repeats: int, warmup: int):
        self.trainer, self.repeats, self.warmup = trainer, repeats, warmup
        self.batch = self.last = self.timers = None
        self.step_s: list[float] = []       # ratio phase: whole steps
        self.tower_s: list[float] = []      # ratio phase: the tower's own forward + backward
        self.profiled: list[dict] = []      # breakdown phase: parts of each step
        self.checkpoint_s: list[float] = []
        self.calls: dict[str, int] = {}     # timed calls in a breakdown step
        self.entered = self.left = None
        step, checkpoint = trainer.train_step, trainer.save_checkpoint

        def train_step(batch):
            self.batch = batch
            self.entered = time.perf_counter()
            try:
                return step(batch)
            finally:
                self.left = time.perf_counter()

        def save_checkpoint():
            start = time.perf_counter()
            try:
                return checkpoint()
            finally:
                self.checkpoint_s.append(time.perf_counter() - start)

        trainer.train_step, trainer.save_checkpoint = train_step, save_checkpoint

    def tower_alone(self) -> float:
        """The query tower's forward + backward of the last batch: tokenized first (not timed), then a plain loss
        on its vectors; its gradients are dropped afterwards so the next training step starts clean."""
        t = self.trainer
        queries = self.batch["queries"]
        inputs = t.family.tokenize(queries, ["query"] * len(queries), t.cfg.trainer.query_max_length)
        inputs = {k: v.to(t.accelerator.device) for k, v in inputs.items()}
        tower = t.towers[0]
        tower.train()
        _sync()
        start = time.perf_counter()
        with t.accelerator.autocast():
            out = tower(**inputs)["dense"]
        out.float().pow(2).sum().backward()
        _sync()
        seconds = time.perf_counter() - start
        t.optimizer.zero_grad(set_to_none=True)
        return seconds

    def __call__(self, trainer) -> None:
        now = time.perf_counter()
        step, r, warmup = trainer.step, self.repeats, self.warmup
        if warmup < step <= warmup + r:
            self.step_s.append(now - self.last)
        elif warmup + r < step <= warmup + 2 * r:
            parts = dict(self.timers.step)
            inside = self.left - self.entered
            parts["data: loader batch (groups + collate)"] = self.entered - self.last
            parts["train_step: not in a timer above (GradCache bookkeeping, loss floats, ...)"] = inside - sum(
                v for k, v in parts.items() if not k.startswith(("data:", "log row")))
            parts["loop: after train_step (log row, tqdm, callbacks)"] = now - self.left
            parts["total"] = now - self.last
            self.profiled.append(parts)
            self.calls = dict(self.timers.calls)
        if step <= warmup + r:
            self.tower_s.append(self.tower_alone()) if step > warmup else self.tower_alone()
        if step == warmup + r:
            self.timers = PartTimers(trainer)
        if step == warmup + 2 * r:
            self.timers.remove()
        if self.timers is not None:
            self.timers.step, self.timers.calls = {}, {}
        self.last = time.perf_counter()
