"""Fine-tune: plain SGD on each incoming batch, no measure against forgetting.
With an iid-shuffled stream this is also the iid-online / iid-offline baseline."""

from __future__ import annotations

from .base import ContinualLearner


class FineTune(ContinualLearner):
    name = "finetune"

    def _observe(self, images, labels):
        return {"loss": self.sgd_step(images, labels)}
