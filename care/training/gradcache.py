"""Exact gradient caching (GradCache, Gao et al. 2021) for large contrastive pools on small memory.

1. Forward every chunk of queries and passages without gradients, saving the RNG states first.
2. Compute the loss on the full, detached set of representations (gathered across processes) and cache
   d(loss)/d(representation) for every dense vector, sparse weight and ColBERT vector.
3. Re-run each chunk's forward with gradients, RNG restored (same dropout), and back-propagate the cached
   gradient through it: sum(rep * cached_grad).backward().  The result equals the full-batch gradient.

Written here because the GradCache package is not on PyPI, and its code breaks with keyword-argument
models, bf16 and DeepSpeed (docs/facts.md s.3).

Distributed (DDP via accelerate or plain torch): negatives are gathered from all ranks, each rank's loss
is multiplied by the world size (care.training.distributed), and gradient sync happens only on the last
chunk's backward of each model (`no_sync` on the others).  Mixed precision: pass `autocast` (e.g.
`accelerator.autocast` or `lambda: torch.autocast("cuda", torch.bfloat16)`); the loss is computed in
fp32 outside it and never scaled here: the one scaling happens in `accelerator.backward` on each chunk.
A model (or tower) with no trainable parameter is run once without gradients and never re-run.

One chunk: when a single model is trained, on one side only, and its texts fit in one chunk (CARE's stage I
with chunk_size >= batch_size: the document side is frozen), caching saves no memory and the re-forward only
repeated the forward (the query tower ran twice a step).  The step is then the plain one: forward with
gradients, the loss (in at least fp32, outside autocast, as above), one backward.  Its gradients are those of
the cached path, which back-propagates exactly d(loss)/d(representation) through the same forward; the
dropout masks and the RNG left behind are the same too (tests/test_rule_batches.py).  Two trained sides (one
backbone, or CARE's stage II towers) keep the cached path: it holds one chunk's activations at a time.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from care.training.distributed import all_gather_with_grad, gather_reps, world_size
from care.training.loss_terms import at_least_fp32


class RngState:
    """The CPU and every CUDA device's RNG state, so a chunk's re-forward draws the same dropout masks
    (forgetting the CUDA states silently gives wrong gradients)."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def split_batch(batch: dict, chunk_size: int) -> list[dict]:
    n = len(next(iter(batch.values())))
    return [{k: v[s:s + chunk_size] for k, v in batch.items()} for s in range(0, n, chunk_size)]


def as_dict(out) -> dict[str, torch.Tensor]:
    """A model returns a dict of representations (M3Model) or one tensor (a dense-only tower)."""
    return out if isinstance(out, dict) else {"dense": out}


def trainable(model: nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())


class GradCache:
    """`gc.step(model, query_batch, passage_batch)` runs forward and backward for one optimisation step and
    returns the loss terms as floats; the caller then steps its optimiser.

    loss_fn:      (query_reps, passage_reps[, teacher_scores=...]) -> {"loss": total, ...terms}, e.g.
                  care.training.losses.M3Loss; teacher scores (a constant, no gradient) are passed only
                  when the step is given some
    chunk_size:   texts per forward pass (memory), independent of the pool size (the batch)
    accelerator:  optional accelerate.Accelerator: its backward (fp16 loss scaling, gradient accumulation,
                  DeepSpeed's engine) and no_sync are used; without it, plain backward and DDP's no_sync
    autocast:     optional zero-argument factory of an autocast context for the forwards
    """

    def __init__(self, loss_fn: Callable[[dict, dict], dict], chunk_size: int = 32, accelerator=None,
                 autocast: Callable[[], contextlib.AbstractContextManager] | None = None):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.loss_fn, self.chunk_size, self.accelerator = loss_fn, chunk_size, accelerator
        self.autocast = autocast or contextlib.nullcontext

    def _no_grad_pass(self, model: nn.Module, chunks: list[dict]) -> tuple[dict, list[RngState]]:
        states, outs = [], []
        with torch.no_grad():
            for chunk in chunks:
                states.append(RngState())
                with self.autocast():
                    outs.append(as_dict(model(**chunk)))
        # the loss runs in at least fp32, outside autocast
        reps = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
        reps = {k: at_least_fp32(v) if v.is_floating_point() else v for k, v in reps.items()}
        if trainable(model):  # leaves whose gradient the loss will fill; a frozen tower's stay constants
            reps = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in reps.items()}
        return reps, states

    def _no_sync(self, model: nn.Module, sync: bool):
        if sync:
            return contextlib.nullcontext()
        if self.accelerator is not None:
            return self.accelerator.no_sync(model)
        return getattr(model, "no_sync", contextlib.nullcontext)()

    def _backward(self, surrogate: torch.Tensor) -> None:
        if self.accelerator is not None:
            self.accelerator.backward(surrogate)
        else:
            surrogate.backward()

    @staticmethod
    def fits_one_chunk(towers: list[tuple[nn.Module, list[dict]]]) -> bool:
        """One side trained (the other frozen), its texts in one chunk."""
        trained = [chunks for m, chunks in towers if trainable(m)]
        return len(trained) == 1 and len(trained[0]) == 1

    def _one_pass(self, towers: list[tuple[nn.Module, list[dict]]],
                  teacher_scores: torch.Tensor | None) -> dict[str, float]:
        """The plain step, when fits_one_chunk (the module docstring)."""
        reps = []
        for m, chunks in towers:
            if not trainable(m):
                reps.append(self._no_grad_pass(m, chunks)[0])
                continue
            with self.autocast():
                out = as_dict(m(**chunks[0]))
            reps.append({k: at_least_fp32(v) if v.is_floating_point() else v for k, v in out.items()})
        teacher = {} if teacher_scores is None else {"teacher_scores": all_gather_with_grad(teacher_scores.detach())}
        out = self.loss_fn(*(gather_reps(r) for r in reps), **teacher)
        if any(v.requires_grad for r in reps for v in r.values()):
            self._backward(out["loss"] * world_size())
        return {k: float(v.detach()) for k, v in out.items()}

    def step(self, model: nn.Module, query_batch: dict, passage_batch: dict,
             passage_model: nn.Module | None = None, teacher_scores: torch.Tensor | None = None) -> dict[str, float]:
        """`passage_model`: a separate document tower (asymmetric models); default: `model` for both.
        `teacher_scores`: (queries, group_size) teacher scores of this process's groups, for the loss's
        distillation; gathered across processes with the representations, in the same rank order."""
        towers = [(model, split_batch(query_batch, self.chunk_size)),
                  (passage_model or model, split_batch(passage_batch, self.chunk_size))]
        if self.fits_one_chunk(towers):
            return self._one_pass(towers, teacher_scores)

        # 1. representations without gradients, RNG state saved per chunk
        passes = [self._no_grad_pass(m, chunks) for m, chunks in towers]
        (q_reps, _), (p_reps, _) = passes
        after_first_pass = RngState()

        # 2. loss on the full pool (all ranks), cached gradients for the local representations
        teacher = {} if teacher_scores is None else {"teacher_scores": all_gather_with_grad(teacher_scores.detach())}
        out = self.loss_fn(gather_reps(q_reps), gather_reps(p_reps), **teacher)
        leaves = [v for reps in (q_reps, p_reps) for v in reps.values() if v.requires_grad]
        if leaves:
            torch.autograd.backward(out["loss"] * world_size(), inputs=leaves)

        # Only the cached gradients are needed from here on: dropping the loss graph and the representations
        # keeps the re-forward's peak memory flat as the pool grows (README, "Tests and benchmarks").
        losses = {k: float(v.detach()) for k, v in out.items()}
        cached = [({k: v.grad for k, v in reps.items() if v.grad is not None}, states) for reps, states in passes]
        del out, leaves, q_reps, p_reps, passes

        # 3. re-forward each trainable tower's chunks with gradients and push the cached gradient through
        jobs = []
        for (m, chunks), (grads_all, states) in zip(towers, cached):
            if not trainable(m):
                continue
            start = 0
            for chunk, state in zip(chunks, states):
                n = len(next(iter(chunk.values())))
                grads = {k: g[start:start + n] for k, g in grads_all.items()}
                if grads:
                    jobs.append((m, chunk, state, grads))
                start += n
        for i, (m, chunk, state, grads) in enumerate(jobs):
            # gradients are synced across ranks only on each model's last backward of the step
            with self._no_sync(m, sync=all(other is not m for other, *_ in jobs[i + 1:])):
                state.restore()
                with self.autocast():
                    fresh = as_dict(m(**chunk))
                self._backward(sum((fresh[k].to(g.dtype) * g).sum() for k, g in grads.items()))
        after_first_pass.restore()  # leave the RNG where one plain forward pass would have left it
        return losses
