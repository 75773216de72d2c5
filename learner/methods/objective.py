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
- loss `ace-lone`: ACE, except that an incoming batch of a single class takes the cross-entropy over
  every class, as `ce`. Under ACE such a batch has no loss at all (one logit against itself), so a
  class that arrives alone (a device that sees one class at a time, a last task of one class)
  learns from the replayed batch only.
- `distill` lambda (MKD, Michel et al., ICML 2024, with one teacher): the moving average of the
  weights (`learner.heads.ema`) teaches. On the same training batch the step adds
  lambda * T^2 * KL(softmax(teacher / T) || softmax(student / T)) at T = 4 (Hinton's scaling, as MKD's
  code), the teacher's logits from one extra forward pass without gradients (about a third of a
  step). It composes with both step forms and every loss; 0 (the default) adds nothing.

>>> import torch
>>> logits = torch.tensor([[2.0, 0.0, 5.0], [0.0, 1.0, 5.0]])
>>> incoming_losses(logits, torch.tensor([0, 1]), "ace")  # class 2 is absent: its logit is ignored
tensor([0.1269, 0.3133])
>>> incoming_losses(logits, torch.tensor([0, 0]), "ace").abs()  # one class: nothing to compare
tensor([0., 0.])
>>> incoming_losses(logits, torch.tensor([0, 0]), "ace-lone")  # one class: against every class
tensor([3.0550, 5.0247])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

LOSSES = ("ce", "ace", "ace-lone")
STEPS = ("joint", "separate")
DISTILL_TEMPERATURE = 4.0


def incoming_losses(logits: torch.Tensor, labels: torch.Tensor, loss: str) -> torch.Tensor:
    """Per-sample losses of the incoming batch B_n."""
    if loss == "ace" or (loss == "ace-lone" and bool((labels[1:] != labels[:-1]).any())):  # several classes
        present = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
        present[labels] = True
        logits = logits.masked_fill(~present, torch.finfo(logits.dtype).min)
    return F.cross_entropy(logits, labels, reduction="none")


def distillation(student: torch.Tensor, teacher: torch.Tensor,
                 temperature: float = DISTILL_TEMPERATURE) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), averaged over the batch; zero when
    they agree, and the teacher's logits get no gradient.

    >>> z = torch.tensor([[1.0, -2.0, 0.5]])
    >>> distillation(z, z).item()
    0.0
    """
    teacher_p = F.softmax(teacher.detach() / temperature, dim=1)
    student_log_p = F.log_softmax(student / temperature, dim=1)
    return F.kl_div(student_log_p, teacher_p, reduction="batchmean") * temperature**2


@dataclass(frozen=True)
class ReplayObjective:
    loss: str = "ce"
    step: str = "joint"
    distill: float = 0.0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        if self.step not in STEPS:
            raise ValueError(f"unknown step {self.step!r}; choose one of {', '.join(STEPS)}")
        if self.distill < 0:
            raise ValueError(f"the distillation weight must be >= 0, got {self.distill}")

    def __call__(self, forward: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, labels: torch.Tensor,
                 replay_images: torch.Tensor, replay_labels: torch.Tensor,
                 teacher: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The loss to differentiate for one step; `forward` maps uint8 images to float logits,
        `teacher` (needed when `distill` > 0) to the teacher's, without gradients."""
        if self.distill and teacher is None:
            raise ValueError("distillation needs a teacher (the learner's moving average)")
        n = images.shape[0]
        if self.step == "separate":
            incoming = forward(images)
            loss = incoming_losses(incoming, labels, self.loss).mean() + self._distilled(incoming, images, teacher)
            if replay_labels.numel():
                replayed = forward(replay_images)
                loss = (loss + F.cross_entropy(replayed, replay_labels)
                        + self._distilled(replayed, replay_images, teacher))
            return loss
        x = torch.cat([images, replay_images])
        logits = forward(x)
        y = torch.cat([labels, replay_labels])
        if self.loss == "ce":
            loss = F.cross_entropy(logits, y)  # the same operation as before the options existed
        else:
            loss = torch.cat([incoming_losses(logits[:n], labels, self.loss),
                              F.cross_entropy(logits[n:], y[n:], reduction="none")]).mean()
        return loss + self._distilled(logits, x, teacher)

    def _distilled(self, logits: torch.Tensor, images: torch.Tensor, teacher) -> torch.Tensor | float:
        return self.distill * distillation(logits, teacher(images)) if self.distill else 0.0
