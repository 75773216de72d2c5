"""EWC++ (Chaudhry et al. 2018), the online EWC of the reference implementation.

The Fisher diagonal is a running average of squared gradients, refreshed every
`fisher_update_after` steps: F <- (1 - alpha) F + alpha / n * sum(g^2). At the end of each task
the weights are anchored and F is normalised to [0, 1]; later steps add
lambda * sum(F_norm * (theta - theta_anchor)^2) to the loss.
"""

from __future__ import annotations

import torch

from .base import ContinualLearner


class EWCpp(ContinualLearner):
    name = "ewc"

    def __init__(self, num_classes: int, ewc_lambda: float = 100.0, alpha: float = 0.9,
                 fisher_update_after: int = 50, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.ewc_lambda, self.alpha, self.fisher_update_after = ewc_lambda, alpha, fisher_update_after
        self.running_fisher = self._zeros()
        self.step_fisher = self._zeros()
        self.normalized_fisher: dict[str, torch.Tensor] = {}
        self.anchor: dict[str, torch.Tensor] = {}
        self.task_steps = 0

    def _zeros(self) -> dict[str, torch.Tensor]:
        return {n: torch.zeros_like(p) for n, p in self.model.named_parameters()}

    def ensure_classes(self, n: int) -> None:
        super().ensure_classes(n)
        for store in (getattr(self, "running_fisher", {}), getattr(self, "step_fisher", {}),
                      getattr(self, "normalized_fisher", {}), getattr(self, "anchor", {})):
            for name, p in self.model.named_parameters():
                if name in store and store[name].shape != p.shape:
                    store[name] = _pad_like(store[name], p)

    def penalty(self) -> torch.Tensor:
        params = dict(self.model.named_parameters())
        return self.ewc_lambda * sum((f * (params[n] - self.anchor[n]) ** 2).sum()
                                     for n, f in self.normalized_fisher.items())

    def _observe(self, images, labels):
        self.task_steps += 1
        if self.task_steps % self.fisher_update_after == 0:
            for n, f in self.running_fisher.items():
                f.mul_(1 - self.alpha).add_(self.step_fisher[n], alpha=self.alpha / self.fisher_update_after)
            self.step_fisher = self._zeros()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(images, labels)
        if self.anchor:
            loss = loss + self.penalty()
        loss.backward()
        for n, p in self.model.named_parameters():
            if p.grad is not None:
                self.step_fisher[n] += p.grad.detach() ** 2
        self.optimizer.step()
        self.weights_changed()
        return {"loss": loss.detach()}

    def end_task(self) -> None:
        self.anchor = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        hi = max(float(f.max()) for f in self.running_fisher.values())
        lo = min(float(f.min()) for f in self.running_fisher.values())
        self.normalized_fisher = {n: (f - lo) / (hi - lo + 1e-32) for n, f in self.running_fisher.items()}
        self.task_steps = 0

    def state_dict(self) -> dict:
        return {**super().state_dict(), "running_fisher": self.running_fisher, "step_fisher": self.step_fisher,
                "normalized_fisher": self.normalized_fisher, "anchor": self.anchor, "task_steps": self.task_steps}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for key in ("running_fisher", "step_fisher", "normalized_fisher", "anchor"):
            # a state may come from another device (a GPU checkpoint restored on a CPU)
            setattr(self, key, None if state[key] is None else {n: t.to(self.device) for n, t in state[key].items()})
        self.task_steps = state["task_steps"]


def _pad_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out
