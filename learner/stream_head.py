"""A learner that trains nothing: a streaming head (`learner.streaming`: the nearest class mean
or streaming LDA) on the pretrained backbone's frozen features, no memory, no replay. The floor
every configuration with a memory and a trainable top must beat (Deep SLDA, Hayes & Kanan 2020).

>>> import torch
>>> from learner.backbone import PretrainedBackbone
>>> learner = StreamHeadLearner(2, backbone=PretrainedBackbone(input_size=64), serving_head="slda")
>>> images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
>>> _ = learner.observe(images, torch.tensor([0, 1, 0, 1]))
>>> learner.predict(images).tolist()
[0, 1, 0, 1]
"""

from __future__ import annotations

from .base import ContinualLearner


class StreamHeadLearner(ContinualLearner):
    name = "stream-head"

    def __init__(self, num_classes: int, serving_head: str = "slda", **kwargs):
        super().__init__(num_classes, serving_head=serving_head, **kwargs)
        self.name = serving_head

    def _observe(self, images, labels):
        return {}  # the base class's observe updated the streaming head; nothing else learns
