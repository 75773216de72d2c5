"""A logit bias fitted on the replay memory, for serving (`ContinualLearner(serving_bias=True)`):
one offset per class added to the served head's bias, chosen to minimise the class-balanced
cross-entropy of the served model's logits on the memory, with a small L2 penalty (softmax is
shift-invariant; the penalty picks the smallest offsets). Task-free, in the spirit of online bias
correction (OBC, Chrysakis & Moens, 2023), whose bias layer is trained on the memory with the
network frozen: here the layer is one vector, fitted in closed loop by L-BFGS at the points where
predictions are published, never per step. A stream's classes end up under- or over-predicted
as their tasks age (the moving average trails the newest, replay under-represents it); the
memory, balanced by class, is the one held-out-like sample of every class a service has.

>>> import torch
>>> logits = torch.tensor([[2.0, 0.0], [2.0, 0.0], [1.0, 0.0], [1.0, 0.0]])  # class 1 scored 1.5 too low
>>> labels = torch.tensor([0, 0, 1, 1])
>>> b = fit_logit_bias(logits, labels, 2)
>>> ((logits + b).argmax(1) == labels).float().mean().item()
1.0
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def fit_logit_bias(logits: torch.Tensor, labels: torch.Tensor, num_classes: int, l2: float = 1e-3,
                   max_iter: int = 100) -> torch.Tensor:
    """[num_classes] offsets b minimising sum_i w_i CE(logits_i + b, y_i) + l2 |b|^2, w_i = 1 / (n_y_i
    * classes present): each class present in `labels` weighs alike, whatever its count."""
    logits, labels = logits.detach().float().cpu(), labels.cpu()
    counts = torch.bincount(labels, minlength=num_classes).float()
    weights = 1.0 / (counts[labels] * (counts > 0).sum())
    bias = torch.zeros(num_classes, requires_grad=True)
    optimizer = torch.optim.LBFGS([bias], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def objective() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (F.cross_entropy(logits + bias, labels, reduction="none") * weights).sum() + l2 * bias.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(objective)
    return bias.detach()
