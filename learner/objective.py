"""What a replay step minimises: a loss (`ce` or `ace`) and a step form (`joint` or `separate`),
two independent options that compose with every memory update and retrieval policy.

- step `joint` (the default; Algorithm 1 of the paper): one train-mode forward pass of
  B_n u B_M and the mean loss over those samples.
- step `separate` (the authors' code for ER, MIR and GSS, `agents/exp_replay.py`): B_n and B_M
  go through the model in two train-mode forward passes (BatchNorm statistics per sub-batch,
  running statistics updated twice), and the step follows the sum of the two mean losses.
- loss `ce`: cross-entropy over every class the head has, for both batches.
- loss `ace` (ER-ACE, Caccia et al., ICLR 2022): the incoming batch's cross-entropy over the
  logits of the classes present in that batch only; the replayed batch's over all classes.
  It needs no task boundaries, so a service can use it.

>>> import torch
>>> logits = torch.tensor([[2.0, 0.0, 5.0], [0.0, 1.0, 5.0]])
>>> incoming_losses(logits, torch.tensor([0, 1]), "ace")  # class 2 is absent: its logit is ignored
tensor([0.1269, 0.3133])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

LOSSES = ("ce", "ace")
STEPS = ("joint", "separate")


def incoming_losses(logits: torch.Tensor, labels: torch.Tensor, loss: str) -> torch.Tensor:
    """Per-sample losses of the incoming batch B_n."""
    if loss == "ace":
        present = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
        present[labels] = True
        logits = logits.masked_fill(~present, torch.finfo(logits.dtype).min)
    return F.cross_entropy(logits, labels, reduction="none")


@dataclass(frozen=True)
class ReplayObjective:
    loss: str = "ce"
    step: str = "joint"

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        if self.step not in STEPS:
            raise ValueError(f"unknown step {self.step!r}; choose one of {', '.join(STEPS)}")

    def __call__(self, forward: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, labels: torch.Tensor,
                 replay_images: torch.Tensor, replay_labels: torch.Tensor) -> torch.Tensor:
        """The loss to differentiate for one step; `forward` maps uint8 images to float logits."""
        n = images.shape[0]
        if self.step == "separate":
            loss = incoming_losses(forward(images), labels, self.loss).mean()
            if replay_labels.numel():
                loss = loss + F.cross_entropy(forward(replay_images), replay_labels)
            return loss
        logits = forward(torch.cat([images, replay_images]))
        y = torch.cat([labels, replay_labels])
        if self.loss == "ce":
            return F.cross_entropy(logits, y)  # the same operation as before the options existed
        return torch.cat([incoming_losses(logits[:n], labels, "ace"),
                          F.cross_entropy(logits[n:], y[n:], reduction="none")]).mean()
