"""An exponential moving average of a model's weights, for serving: after every SGD step
theta_ema <- decay * theta_ema + (1 - decay) * theta, over the parameters and the BatchNorm
running statistics alike (the average model is evaluated with its own statistics). Training
never reads it; predictions and evaluation may (`ContinualLearner(ema_decay=...)`).

>>> import torch
>>> net = torch.nn.Linear(1, 1, bias=False)
>>> with torch.no_grad(): _ = net.weight.fill_(1.0)
>>> avg = WeightAverage(net, decay=0.5)
>>> with torch.no_grad(): _ = net.weight.fill_(3.0)
>>> avg.update(net)
>>> avg.model.weight.item()  # 0.5 * 1 + 0.5 * 3
2.0
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.model = copy.deepcopy(model).eval()
        self.model.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One step of the average towards `model`'s current weights."""
        mine, theirs = self._floats(self.model), self._floats(model)
        torch._foreach_lerp_(mine, theirs, 1.0 - self.decay)
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
        return self.model.state_dict()

    def load_state_dict(self, state: dict, model: nn.Module) -> None:
        self.grow(model)
        self.model.load_state_dict(state)
