"""Experience replay with swappable MemoryUpdate and MemoryRetrieval (Algorithm 1).

Each step: B_M <- retrieve(B_n, M); one SGD step on the objective of (B_n, B_M) (by default one
forward pass of B_n u B_M and its mean cross-entropy; see `learner.methods.objective` for the `separate`
step and the ACE loss); M <- update(B_n, M). ER, MIR, GSS, ASER, ASER_mu and the ablations are
all this class with different policies (see `learner.methods.registry`).

Two options compose with every policy pair:
- `iterations` N (repeated rehearsal, the authors' `mem_iters`): N SGD steps per incoming batch,
  each with a fresh replay draw and the incoming batch in every one, as the authors' code and
  RAR do: under ACE the incoming term is the only one that teaches the new classes, so a
  replay-only step would rehearse the old ones N-1 times for each time the new ones are seen.
  The memory update runs once, after the last step, as with N = 1.
- `augment` (`learner.methods.augment`): the incoming and replayed images of each step are cropped and
  flipped afresh; the memory stores the incoming samples as they came.
The objective's distillation term (`learner.methods.objective`, `distill`) composes with both: the moving
average teaches each of the N steps.
A lean step (`observe(..., lean=True)`, for a learner behind its stream) takes none of them: one step,
with the policies' lean forms (`lean_policies`, `learner.methods.registry.LEAN_POLICIES`: ASER's KNN-SV
update and ASV retrieval give way to the reservoir and random draws, which need no feature pass),
so it costs what ER's step costs. Samples skipped behind the stream reach the memory through the
lean update too (`pass_through(..., lean=True)`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch.nn import functional as F

from ..memory.buffer import ReplayBuffer
from ..memory.latent import Latent
from ..memory.policy import MemoryRetrieval, MemoryUpdate, StepContext
from ..memory.shapley import MemoryReference, leave_one_out_values
from .augment import Augment
from .base import FROZEN_SPACE_VERSION, ContinualLearner
from .objective import ReplayObjective


class ReplayLearner(ContinualLearner):
    def __init__(self, num_classes: int, update: MemoryUpdate, retrieval: MemoryRetrieval, mem_size: int,
                 replay_batch: int = 10, exclude_current_task: bool = False,
                 objective: ReplayObjective = ReplayObjective(), iterations: int = 1,
                 augment: Augment | None = None,
                 lean_policies: tuple[MemoryUpdate, MemoryRetrieval] | None = None, **kwargs):
        super().__init__(num_classes, **kwargs)
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        self.iterations = iterations
        self.augment = augment
        self.objective = objective
        self.update_policy = update
        self.retrieval_policy = retrieval
        self.lean_update, self.lean_retrieval = lean_policies or (update, retrieval)
        self.replay_batch = replay_batch
        self.exclude_current_task = exclude_current_task
        self.buffer = ReplayBuffer(mem_size, self.backbone.stored_shape, self.device,
                                   self.backbone.stored_dtype)
        self.name = f"replay[{update.name}+{retrieval.name}]"

    def context(self) -> StepContext:
        eligible = None
        if self.exclude_current_task and self.current_task_classes is not None:
            eligible = ~torch.isin(self.buffer.labels, self.current_task_classes)
        trusted = self.trusted(self.buffer.keys)  # the suspect rule's suspects are not replayed
        if trusted is not None:
            trusted = trusted.to(self.buffer.device)
            eligible = trusted if eligible is None else eligible & trusted
        return self.step_context(self.buffer, eligible)

    def retrieve(self, images: torch.Tensor, labels: torch.Tensor, ctx: StepContext,
                 policy: MemoryRetrieval | None = None) -> torch.Tensor:
        if len(self.buffer) == 0 or self.replay_batch == 0:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        return (policy or self.retrieval_policy).retrieve(self.buffer, images, labels, self.replay_batch, ctx)

    def _observe(self, images, labels):
        return self._steps(images, labels, self.iterations, self.augment, self.update_policy, self.retrieval_policy,
                           self.objective)

    def _lean_observe(self, images, labels):
        """One step without augmentation or distillation, with the policies' lean forms: ER's
        cost, whatever the method and its options."""
        return self._steps(images, labels, 1, None, self.lean_update, self.lean_retrieval,
                           replace(self.objective, distill=0.0))

    def _steps(self, images, labels, iterations: int, augment: Augment | None, update: MemoryUpdate,
               retrieval: MemoryRetrieval, objective: ReplayObjective) -> dict:
        ctx = self.context()
        teacher = self.teacher_logits if objective.distill else None
        replayed, incoming = 0, 0
        for _ in range(iterations):
            slots = self.retrieve(images, labels, ctx, retrieval)
            replay_x, replay_y = self.buffer.images[slots], self.buffer.labels[slots]
            x, rx = (images, replay_x) if augment is None else (augment(images), augment(replay_x))
            loss = self.optimize(lambda: objective(self.forward_logits, x, labels, rx, replay_y, teacher))
            ctx.latent = Latent(self.extract, self.buffer, self.version)  # the weights just changed
            # replayed samples of the incoming batch's classes: what lets new classes compete with the
            # old ones under ACE, whose incoming term masks every absent class. A tensor, like the loss:
            # reading it here would wait for the device every step
            replayed, incoming = replayed + slots.numel(), incoming + torch.isin(replay_y, labels).sum()
        update.update(self.buffer, images, labels, ctx)
        ctx.stats.update(loss=loss, replayed=replayed, replayed_incoming=incoming)
        return ctx.stats

    def _pass_through(self, images: torch.Tensor, labels: torch.Tensor, lean: bool) -> None:
        (self.lean_update if lean else self.update_policy).update(self.buffer, images, labels, self.context())

    def _rehearse(self) -> dict | None:
        """A step on a random draw of twice the replay batch (the size of a stream step's batch),
        with the replayed term of the objective: cross-entropy over every class."""
        n = min(len(self.buffer), 2 * self.replay_batch)
        if n == 0:
            return None
        slots = torch.randperm(len(self.buffer), generator=self.generator)[:n].to(self.device)
        x, y = self.buffer.images[slots], self.buffer.labels[slots]
        x = self.augment(x) if self.augment is not None else x
        return {"loss": self.optimize(lambda: F.cross_entropy(self.forward_logits(x), y))}

    def suspects(self, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The memory's slots by how likely their labels are wrong, most likely first, and each one's score: its
        mean KNN-SV (eqs. 3-4) to the other remembered samples, in the space ASER's values are taken in and with the
        memory update's K (`shapley.leave_one_out_values`); below zero, the label disagrees with its neighbours'."""
        slots = torch.arange(len(self.buffer), device=self.device)
        feats, _ = self.step_context(self.buffer).latent.of(slots)
        scores = leave_one_out_values(feats, self.buffer.labels[slots], getattr(self.update_policy, "k", 3))
        order = torch.argsort(scores, stable=True)
        if self.confirmed:  # valued with the others, listed never
            confirmed = torch.tensor(sorted(self.confirmed))
            order = order[~torch.isin(self.buffer.keys[order], confirmed)]
        order = order[:limit]
        return slots[order.to(self.device)], scores[order]

    def values_to_memory(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """What `suspects` says of the memory, for samples it may never have kept (`batches`: (stored form, labels)
        pairs, each batch's samples candidates beside each other): each one's mean KNN-SV with the remembered samples
        as the evaluation points (`shapley.MemoryReference`), in the same space and with the same K; below zero, its
        label disagrees with the remembered samples around it."""
        slots = torch.arange(len(self.buffer), device=self.device)
        latent = self.step_context(self.buffer).latent
        memory, _ = latent.of(slots)
        reference = MemoryReference(memory.float().cpu(), self.buffer.labels[slots].cpu(),
                                    getattr(self.update_policy, "k", 3))
        values = [reference.values_of(latent.of(slots[:0], stored.to(self.device))[1].float().cpu(), labels.cpu())
                  for stored, labels in batches]
        return torch.cat(values) if values else torch.zeros(0)

    def forget_class(self, class_id: int) -> int:
        removed = super().forget_class(class_id)
        self.update_policy.forget(class_id)  # a lean form shares what its full form keeps
        return removed

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["buffer"] = self.buffer.state_dict()
        state["update"] = self.update_policy.state_dict()
        if self.augment is not None:
            state["augment"] = self.augment.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.buffer.load_state_dict(state["buffer"])
        valid = (self.buffer.feature_version >= 0) & (self.buffer.feature_version < FROZEN_SPACE_VERSION)
        self.buffer.feature_version[valid] += 1  # the learner's versions moved one on at the load (not the frozen's)
        self.update_policy.load_state_dict(state["update"])

        if self.augment is not None and "augment" in state:
            self.augment.load_state_dict(state["augment"])
