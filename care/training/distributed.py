"""Cross-process negatives: gather every rank's representations, keeping the gradient of the local slice.

Each rank then computes the loss over the whole gathered batch; gradients reach only its own slice, and
DDP averages them over ranks, so each rank's loss must be multiplied by the world size for the result to
equal the single-process full-batch gradient (docs/facts.md s.6b; FlagEmbedding omits the factor, and its
gradients are 1/N).  torch.distributed.nn.functional.all_gather has autograd too, but needs equal shapes;
ranks pad their texts to different lengths, so trailing dimensions are padded here first.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_gather_with_grad(t: torch.Tensor) -> torch.Tensor:
    """Concatenate `t` from every rank along dim 0 (rank order).  Trailing dimensions are zero-padded to the
    largest across ranks (zero = padding for token weights, ColBERT vectors and masks); the local slice is
    `t` itself, so gradients flow into it; the other ranks' slices are constants."""
    n = world_size()
    if n == 1:
        return t
    shapes = [torch.zeros(t.dim(), dtype=torch.long, device=t.device) for _ in range(n)]
    dist.all_gather(shapes, torch.tensor(t.shape, device=t.device))
    shapes = torch.stack(shapes)
    if bool((shapes[:, 0] != shapes[0, 0]).any()):
        # Unequal batches would also give ranks different chunk counts, and DDP would hang waiting for a
        # gradient sync one rank never reaches: refuse instead.
        raise ValueError(f"ranks hold different batch sizes {shapes[:, 0].tolist()}; use even batches "
                         "(accelerate's default even_batches=True, or drop_last=True)")
    target = shapes.max(0).values.tolist()
    pad = []
    for have, want in zip(reversed(t.shape[1:]), reversed(target[1:])):
        pad += [0, want - have]
    local = F.pad(t, pad) if any(pad) else t
    gathered = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(gathered, local.detach().contiguous())
    gathered[rank()] = local
    return torch.cat(gathered, dim=0)


def gather_reps(reps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: all_gather_with_grad(v) for k, v in reps.items()}
