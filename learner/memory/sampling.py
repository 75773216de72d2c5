"""Random subsets of buffer slots: uniform, and class-balanced (S_sub of the paper).

Both take a `torch.Generator` so a learner's choices are reproducible and checkpointable.

>>> import torch
>>> g = torch.Generator().manual_seed(0)
>>> labels = torch.tensor([0, 0, 0, 1, 1, 2])
>>> sorted(labels[class_balanced_sample(labels, torch.arange(6), 2, g)].tolist())
[0, 0, 1, 1, 2]
"""

from __future__ import annotations

import torch


def random_sample(slots: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `n` distinct entries of `slots`, uniformly at random."""
    perm = torch.randperm(slots.numel(), generator=generator)[:n]
    return slots[perm.to(slots.device)]


def class_balanced_sample(labels: torch.Tensor, slots: torch.Tensor, per_class: int,
                          generator: torch.Generator) -> torch.Tensor:
    """Up to `per_class` random entries of `slots` from every class present among them.

    `labels` is indexed by slot. Vectorised: shuffle, group by label with a stable sort, keep
    the first `per_class` of each group. The result is ordered by class.
    """
    if slots.numel() == 0 or per_class <= 0:
        return slots[:0]
    slots = slots[torch.randperm(slots.numel(), generator=generator).to(slots.device)]
    lab = labels[slots]
    order = torch.sort(lab, stable=True).indices
    slots, lab = slots[order], lab[order]
    _, inverse, counts = torch.unique_consecutive(lab, return_inverse=True, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(slots.numel(), device=slots.device) - starts[inverse]
    return slots[rank < per_class]


def exclude(slots: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """`slots` without the entries in `removed` (order kept)."""
    if removed.numel() == 0:
        return slots
    return slots[~torch.isin(slots, removed)]
