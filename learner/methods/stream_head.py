"""A learner that trains nothing: a streaming head (`learner.heads.streaming_lda`: the nearest class mean
or streaming LDA) on the pretrained backbone's frozen features, no memory, no replay. The floor
every configuration with a memory and a trainable top must beat (Deep SLDA, Hayes & Kanan 2020).

>>> import torch
>>> from learner.networks.backbone import PretrainedBackbone
>>> learner = StreamHeadLearner(2, backbone=PretrainedBackbone(input_size=64), serving_head="slda")
>>> dark, light = torch.full((3, 3, 32, 32), 30, dtype=torch.uint8), torch.full((3, 3, 32, 32), 220, dtype=torch.uint8)
>>> _ = learner.observe(torch.cat([dark, light]), torch.tensor([0, 0, 0, 1, 1, 1]))
>>> learner.predict(torch.cat([dark[:1], light[:1]])).tolist()
[0, 1]
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
