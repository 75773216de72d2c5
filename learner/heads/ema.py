"""An exponential moving average of a model's weights, for serving: after the t-th SGD step
theta_ema <- d_t * theta_ema + (1 - d_t) * theta with d_t = min(decay, (1 + t) / (10 + t)) (TensorFlow's
ExponentialMovingAverage with num_updates), over the parameters and the BatchNorm running statistics
alike (the average model is evaluated with its own statistics). The warm-up forgets the early,
near-random weights fast: a plain mean of every step so far (this module's first form) still carried
them after hundreds of steps, so a young service answered one class for its first minutes. At decay
0.99 the average is a moving one from step 890 on; a new class's head rows follow within tens of steps
while t is small. Training never reads it; predictions and evaluation may
(`ContinualLearner(ema_decay=...)`).

>>> import torch
>>> net = torch.nn.Linear(1, 1, bias=False)
>>> with torch.no_grad(): _ = net.weight.fill_(0.0)
>>> avg = WeightAverage(net, decay=0.5)
>>> for w in (11.0, 20.0, 30.0):
...     with torch.no_grad(): _ = net.weight.fill_(w)
...     avg.update(net)
...     print(round(avg.model.weight.item(), 3))  # d_1 = 2/11, d_2 = 3/12, d_3 = 4/13
9.0
17.25
26.077
"""

from __future__ import annotations

import copy

import torch
from torch import nn

WARMED_UP = 2**31  # updates enough for any decay to be past its warm-up


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.model = copy.deepcopy(model).eval()
        self.model.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One step of the average towards `model`'s current weights."""
        self.updates += 1
        mine, theirs = self._floats(self.model), self._floats(model)
        kept = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(mine, theirs, 1.0 - kept)
        for name, buf in model.named_buffers():  # integer buffers (BatchNorm's step count) are copied
            if not buf.is_floating_point():
                self.model.get_buffer(name).copy_(buf)

    @torch.no_grad()
    def grow(self, model: nn.Module) -> None:
        """Follow a head that grew: the new rows start as the model's (nothing to average yet)."""
        n_old = self.model.head.out_features
        self.model.grow(model.head.out_features)
        self.model.head.requires_grad_(False)
        self.model.head.weight[n_old:] = model.head.weight[n_old:]
        self.model.head.bias[n_old:] = model.head.bias[n_old:]

    @staticmethod
    def _floats(model: nn.Module) -> list[torch.Tensor]:
        return [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]

    def state_dict(self) -> dict:
        return {"weights": self.model.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict | None, model: nn.Module) -> None:
        """`state` None: a lineage that takes up the average starts it from `model`'s weights."""
        self.grow(model)
        if state is None:
            self.model.load_state_dict(model.state_dict())
            self.updates = 0
        elif "weights" in state:
            self.model.load_state_dict(state["weights"])
            self.updates = state["updates"]
        else:  # saved before the warm-up existed: its average was a moving one from the start
            self.model.load_state_dict(state)
            self.updates = WARMED_UP
