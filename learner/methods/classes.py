"""The head's classes: grown as new labels arrive (a service does not know its classes in advance)
and silenced for good when one is forgotten. `ContinualLearner` inherits it."""

from __future__ import annotations

import torch

FORGOTTEN_LOGIT = -1e4


class HeadClasses:
    @property
    def num_classes(self) -> int:
        return self.model.num_classes

    def ensure_classes(self, n: int) -> None:
        """Grow the head to at least n classes (new rows start from the default init)."""
        if n > self.model.num_classes:
            self.model.grow(n)
            if self.ema is not None:
                self.ema.grow(self.model)
            if self._optimizer is not None:
                self._optimizer = self._make_optimizer(carry_from=self._optimizer)
            self.version += 1
            if self._served_copy is not None:  # the served copy answers the new classes too
                self.refresh_serving()

    def forget_class(self, class_id: int) -> int:
        """Forget a class: its samples leave the memory and its head output is silenced for good
        (a label sent again later must come as a new class id). Returns the memory samples removed."""
        self.forgotten.add(class_id)
        self._silence_forgotten()
        if self.stream_head is not None:
            self.stream_head.forget(class_id)
            self._solved = None
        if self.head_choice is not None:
            self.head_choice.forget(class_id)
        if self._own_held is not None:
            self._own_held.forget(class_id)
        if self.recent_features is not None:
            self.recent_features.forget(class_id)
        if self.channel_sums is not None:
            self.channel_sums.forget(class_id)
        if self.sleeper is not None:
            self.sleeper.forget(class_id)
        self.version += 1
        buffer = getattr(self, "buffer", None)
        return buffer.remove_class(class_id) if buffer is not None else 0

    def _silence_forgotten(self) -> None:
        # a logit of -1e4 gets probability exactly 0 in float32 softmax, so the row also gets no
        # gradient; finite, so no inf - inf anywhere
        with torch.no_grad():
            for net in {self.model, self.averaged_model, self.serving_model}:
                rows = [c for c in self.forgotten if c < net.num_classes]
                net.head.weight[rows] = 0.0
                net.head.bias[rows] = FORGOTTEN_LOGIT

