"""The two swappable halves of a replay method: MemoryUpdate and MemoryRetrieval.

A method of the paper is a pair of them (Algorithm 1): ER = reservoir + random,
ASER = KNN-SV update + ASV retrieval, and so on (see `learner.methods.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .buffer import ReplayBuffer
from .latent import Latent


@dataclass
class StepContext:
    """What a policy may use during one step, besides the buffer and the batch."""

    latent: Latent
    generator: torch.Generator
    model: nn.Module
    lr: float
    num_classes: int  # classes known to the learner so far (the head's width)
    to_input: object  # callable: uint8 images -> model input
    eligible: torch.Tensor | None = None  # bool [capacity]: slots retrieval may return
    stats: dict = field(default_factory=dict)

    def eligible_slots(self, buffer: ReplayBuffer) -> torch.Tensor:
        slots = torch.arange(buffer.size, device=buffer.device)
        if self.eligible is not None:
            slots = slots[self.eligible[: buffer.size]]
        return slots


class MemoryUpdate:
    """Decides which incoming samples enter the memory and which leave it."""

    name = "update"

    def update(self, buffer: ReplayBuffer, images: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> None:
        raise NotImplementedError

    def forget(self, class_id: int) -> None:
        """A class was forgotten (its samples already left the memory): drop what is kept of it."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class MemoryRetrieval:
    """Chooses the replay batch B_M from the memory for an incoming batch B_n."""

    name = "retrieval"

    def retrieve(self, buffer: ReplayBuffer, images: torch.Tensor, labels: torch.Tensor,
                 n: int, ctx: StepContext) -> torch.Tensor:
        """Returns at most `n` buffer slots."""
        raise NotImplementedError
