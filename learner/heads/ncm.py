"""The nearest-class-mean classifier on the replay memory (the authors' "NCM trick",
`agents/base.py` of their code): the mean of each class's L2-normalised latent features over the
memory samples, normalised again; a test sample takes the class of the nearest mean. It asks
whether a memory policy helps the representation even where the softmax head is biased towards
the newest classes. Only classes present in the memory can be predicted.

>>> import torch
>>> memory = torch.tensor([[1.0, 0.0], [2.0, 0.1], [0.0, 3.0]])
>>> ncm = NearestClassMean.fit(memory, torch.tensor([4, 4, 7]))
>>> ncm.classes.tolist(), ncm.predict(torch.tensor([[5.0, 1.0], [0.2, 1.0]])).tolist()
([4, 7], [4, 7])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class NearestClassMean:
    classes: torch.Tensor  # [c] class ids
    means: torch.Tensor  # [c, d] unit-norm class means

    @classmethod
    def fit(cls, features: torch.Tensor, labels: torch.Tensor) -> "NearestClassMean":
        classes, index = torch.unique(labels, return_inverse=True)
        unit = F.normalize(features.float(), dim=1)
        sums = torch.zeros(len(classes), unit.shape[1], device=unit.device).index_add_(0, index, unit)
        return cls(classes, F.normalize(sums, dim=1))

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        # both sides have unit norm, so the nearest mean is the one with the largest dot product
        unit = F.normalize(features.float(), dim=1)
        return self.classes[(unit @ self.means.T).argmax(1)]


NCM_SCALE = 16.0  # cosine similarities x16 as logits: softmax then gives probabilities that separate


def ncm_head(learner, scale: float = NCM_SCALE) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The memory's nearest-class-mean classifier as a linear head on unit-norm features:
    weight row c = scale * the unit mean of class c, bias 0; a class without memory samples gets
    a zero row and a bias of -1e4, so it is never predicted. Its argmax is NCM's; softmax of its
    logits gives probabilities. None for a learner without a memory (or an empty one).

    >>> from learner import make_learner
    >>> learner = make_learner("er", num_classes=3, mem_size=10)
    >>> learner.observe(torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8), torch.tensor([0, 0, 2, 2, 0, 2]))
    {...}
    >>> weight, bias = ncm_head(learner)
    >>> weight.shape, bias.tolist()
    (torch.Size([3, 160]), [0.0, -10000.0, 0.0])
    """
    ncm = memory_ncm(learner)
    if ncm is None:
        return None
    weight = torch.zeros(learner.num_classes, ncm.means.shape[1], device=ncm.means.device)
    bias = torch.full((learner.num_classes,), -1e4, device=ncm.means.device)
    weight[ncm.classes] = scale * ncm.means
    bias[ncm.classes] = 0.0
    return weight, bias


def memory_ncm(learner) -> NearestClassMean | None:
    """The NCM classifier of a learner's replay memory under its serving weights, or None for a
    learner without one."""
    buffer = getattr(learner, "buffer", None)
    if buffer is None or len(buffer) == 0:
        return None
    return NearestClassMean.fit(learner.serving_features(buffer.images[: buffer.size]), buffer.labels[: buffer.size])
