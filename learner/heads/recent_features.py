"""The latest trained samples of each class, scored out of sample for "none of these"'s threshold.

"None of these" flags an image past a quantile of known classes' scores taken out of sample
(`learner.heads.calibration`). The held-back samples are such scores, but a class holds at most 20 (they cost its
training), and the 95% quantile of 180 scores leaves the false-alarm rate a run about 1.6 points either side of the
rate asked: 4 of 15 runs on Split EuroSAT, Split CIFAR-10 and the Mini-ImageNet slice ended more than 2 points from
5% (docs/results/calibration.md). The samples that did train can be scored out of sample as well, and exactly:
a class's mean without one of them is (sum - x) / (n - 1) from streaming LDA's class sums. `RecentFeatures` keeps
the frozen features of each class's latest trained samples (`TOTAL` over the classes, at least `MIN_PER_CLASS` a
class) and scores them so.

>>> import torch
>>> recent = RecentFeatures(total=4, min_per_class=1)
>>> x = torch.tensor([[1.0, 0.0], [0.8, 0.2], [0.0, 1.0], [0.2, 0.8], [0.3, 0.7]])
>>> y = torch.tensor([0, 0, 1, 1, 1])
>>> recent.keep(x, y)
>>> len(recent), recent.per_class  # two a class: class 1's oldest went
(4, 2)
>>> sums = torch.zeros(2, 2, dtype=torch.float64).index_add_(0, y, x.double())
>>> counts = torch.bincount(y).double()
>>> from learner.heads.calibration import unit_means
>>> means = unit_means(sums, counts, 2)
>>> [round(d, 3) for d in recent.distances(sums, counts, means).tolist()]  # each from the rest of its class
[0.03, 0.03, 0.002, 0.043]
"""

from __future__ import annotations

from collections import deque

import torch
from torch.nn import functional as F

TOTAL = 1000  # samples kept over all classes: 2.6 MB of 1,280 features in fp16
MIN_PER_CLASS = 10  # where many classes share them


class RecentFeatures:
    def __init__(self, total: int = TOTAL, min_per_class: int = MIN_PER_CLASS):
        self.total, self.min_per_class = total, min_per_class
        self.kept: dict[int, deque] = {}  # class -> (the caller's key or -1, frozen features in fp16), oldest first

    @property
    def per_class(self) -> int:
        return max(self.min_per_class, self.total // max(1, len(self.kept)))

    def __len__(self) -> int:
        return sum(len(d) for d in self.kept.values())

    def keep(self, frozen: torch.Tensor, labels: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """Samples streaming LDA's class sums have just taken in (the same features)."""
        labels = labels.cpu().tolist()
        keys = [-1] * len(labels) if keys is None else keys.cpu().tolist()
        if any(c not in self.kept for c in labels):
            for c in labels:
                self.kept.setdefault(c, deque())
            self._resize()
        for features, label, key in zip(frozen.detach().to("cpu", torch.float16), labels, keys):
            self.kept[label].append((key, features.clone()))  # a row of its own: a view would keep its whole batch

    def _resize(self) -> None:
        n = self.per_class
        self.kept = {c: deque(list(d)[-n:], maxlen=n) for c, d in self.kept.items()}

    def distances(self, sums: torch.Tensor, counts: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
        """1 - the cosine similarity of each kept sample to the nearest class mean (`means`: `unit_means` of the class
        `sums` and `counts`, as the calibration has them), its own class's mean taken without it
        (`Calibration.distance`'s score, out of sample); a sample alone in its class has no mean there. A class at a
        time: a fit's extra memory is one class's samples, not all of them in float64."""
        parts = [self._class_distances(c, kept, sums, counts, means)
                 for c, kept in self.kept.items() if c < len(means) and kept]
        return torch.cat(parts) if parts else torch.zeros(0)

    @staticmethod
    def _class_distances(c: int, kept: deque, sums: torch.Tensor, counts: torch.Tensor,
                         means: torch.Tensor) -> torch.Tensor:
        x = torch.stack([f for _, f in kept]).float()
        unit = F.normalize(x, dim=1)
        cosine = unit @ means.T
        rest = float(counts[c]) - 1
        own = F.normalize(((sums[c] - x.double()) / rest).float(), dim=1) if rest > 0 else torch.zeros_like(x)
        cosine[:, c] = (unit * own).sum(1)
        return 1 - cosine.max(1).values

    def drop(self, key: int) -> None:
        """A sample whose label a person changed (its class sums changed with it)."""
        if key < 0:  # samples kept without a key cannot be told apart
            return
        for c, d in self.kept.items():
            if any(k == key for k, _ in d):
                self.kept[c] = deque(((k, f) for k, f in d if k != key), maxlen=d.maxlen)

    def forget(self, class_id: int) -> None:
        self.kept.pop(class_id, None)

    def state_dict(self) -> dict:
        return {c: ([k for k, _ in d], torch.stack([f for _, f in d])) for c, d in self.kept.items() if d}

    def load_state_dict(self, state: dict) -> None:
        self.kept = {int(c): deque(zip(keys, features)) for c, (keys, features) in state.items()}
        self._resize()
