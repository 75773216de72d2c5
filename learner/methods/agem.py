"""A-GEM (Chaudhry et al. 2019): project the batch gradient g when it conflicts with the
gradient g_ref of a random memory batch, g <- g - (g.g_ref / g_ref.g_ref) g_ref.

The memory is filled by reservoir sampling. As in the reference, the constraint applies only
once a task has ended (memory of *previous* tasks); without task hints it applies as soon as
the memory holds samples.
"""

from __future__ import annotations

import torch

from ..memory.buffer import ReplayBuffer
from ..memory.retrieval import RandomRetrieval
from ..memory.update import ReservoirUpdate
from .base import ContinualLearner


class AGEM(ContinualLearner):
    name = "agem"

    def __init__(self, num_classes: int, mem_size: int, replay_batch: int = 10, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.buffer = ReplayBuffer(mem_size, self.backbone.stored_shape, self.device,
                                   self.backbone.stored_dtype)
        self.update_policy, self.retrieval_policy = ReservoirUpdate(), RandomRetrieval()
        self.replay_batch = replay_batch
        self.tasks_ended = 0
        self.task_hints = False

    def begin_task(self, classes) -> None:
        super().begin_task(classes)
        self.task_hints = True

    def end_task(self) -> None:
        self.tasks_ended += 1

    def _observe(self, images, labels):
        ctx = self.step_context(self.buffer)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(images, labels)
        grads = torch.autograd.grad(loss, params)
        projected = False
        constrain = len(self.buffer) > 0 and (self.tasks_ended > 0 or not self.task_hints)
        if constrain:
            slots = self.retrieval_policy.retrieve(self.buffer, images, labels, self.replay_batch, ctx)
            ref = torch.autograd.grad(self.loss(self.buffer.images[slots], self.buffer.labels[slots]), params)
            dot = sum((g * r).sum() for g, r in zip(grads, ref))
            if dot < 0:
                ref_sq = sum((r * r).sum() for r in ref)
                grads = [g - dot / ref_sq * r for g, r in zip(grads, ref)]
                projected = True
        for p, g in zip(params, grads):
            p.grad = g
        self.optimizer.step()
        self.weights_changed()
        self.update_policy.update(self.buffer, images, labels, ctx)
        return {"loss": loss.detach(), "projected": projected}

    def _pass_through(self, images: torch.Tensor, labels: torch.Tensor, lean: bool) -> None:
        self.update_policy.update(self.buffer, images, labels, self.step_context(self.buffer))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "buffer": self.buffer.state_dict(), "tasks_ended": self.tasks_ended,
                "task_hints": self.task_hints}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.buffer.load_state_dict(state["buffer"])
        self.tasks_ended, self.task_hints = state["tasks_ended"], state["task_hints"]
