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
>>> len(recent), recent.per_class, recent.keys(1)  # two a class: class 1's oldest went
(4, 2, [-1, -1])
>>> sums = torch.zeros(2, 2, dtype=torch.float64).index_add_(0, y, x.double())
>>> counts = torch.bincount(y).double()
>>> from learner.heads.calibration import unit_means
>>> means = unit_means(sums, counts, 2)
>>> [round(d, 3) for d in recent.distances(sums, counts, means).tolist()]  # each from the rest of its class
[0.03, 0.03, 0.002, 0.043]
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .calibration import seen_cosine

TOTAL = 1000  # samples kept over all classes: 2.8 MB of 1,280 features and 112 channel means in fp16
MIN_PER_CLASS = 10  # where many classes share them


class ClassRing:
    """One class's latest samples in one preallocated block (a ring): a thousand rows allocated apart would be a
    thousand small blocks spread over the C heap for the life of the process."""

    def __init__(self, capacity: int, dim: int):
        self.rows = torch.zeros(capacity, dim, dtype=torch.float16)
        self.row_keys = [-1] * capacity
        self.size = self.next = 0

    def push(self, features: torch.Tensor, key: int) -> None:
        self.rows[self.next], self.row_keys[self.next] = features, key
        self.next = (self.next + 1) % len(self.rows)
        self.size = min(self.size + 1, len(self.rows))

    def order(self) -> list[int]:
        """The filled rows, oldest first."""
        start = self.next if self.size == len(self.rows) else 0
        return [(start + i) % len(self.rows) for i in range(self.size)]

    def keys(self) -> list[int]:
        return [self.row_keys[i] for i in self.order()]

    def features(self) -> torch.Tensor:
        return self.rows[self.order()]  # a copy, oldest first

    @classmethod
    def of(cls, keys: list[int], features: torch.Tensor, capacity: int) -> ClassRing:
        """A ring holding the latest `capacity` of these (oldest first)."""
        ring = cls(capacity, features.shape[1])
        n = min(capacity, len(keys))
        ring.rows[:n], ring.row_keys[:n] = features[len(features) - n:], keys[len(keys) - n:]
        ring.size, ring.next = n, n % capacity
        return ring


class RecentFeatures:
    """`channels`: the number of the stored latent's channel means kept after each sample's frozen features (0: none),
    which "none of these" scores beside them (`channel_distances`)."""

    def __init__(self, total: int = TOTAL, min_per_class: int = MIN_PER_CLASS, channels: int = 0):
        self.total, self.min_per_class, self.channels = total, min_per_class, channels
        self.kept: dict[int, ClassRing] = {}  # class -> its latest samples' keys (the caller's or -1) and features

    @property
    def per_class(self) -> int:
        return self._capacity(len(self.kept))

    def _capacity(self, classes: int) -> int:
        return max(self.min_per_class, self.total // max(1, classes))

    def __len__(self) -> int:
        return sum(ring.size for ring in self.kept.values())

    def keys(self, class_id: int) -> list[int]:
        return self.kept[class_id].keys() if class_id in self.kept else []

    def features(self, class_id: int) -> torch.Tensor:
        rows = self.kept[class_id].features()
        return rows[:, :rows.shape[1] - self.channels]

    def channel_rows(self, class_id: int) -> torch.Tensor:
        rows = self.kept[class_id].features()
        return rows[:, rows.shape[1] - self.channels:]

    def keep(self, frozen: torch.Tensor, labels: torch.Tensor, keys: torch.Tensor | None = None,
             channels: torch.Tensor | None = None) -> None:
        """Samples streaming LDA's class sums have just taken in (the same features; the stored latents' channel
        means where kept)."""
        if (channels is None) != (self.channels == 0):
            raise ValueError(f"expected the stored latents' {self.channels} channel means beside the features")
        if channels is not None:
            frozen = torch.cat([frozen.to(channels.device, channels.dtype), channels], 1)
        labels = labels.cpu().tolist()
        keys = [-1] * len(labels) if keys is None else keys.cpu().tolist()
        new = sorted(set(labels) - set(self.kept))
        if new:
            n = self._capacity(len(self.kept) + len(new))
            self.kept = {c: ClassRing.of(ring.keys(), ring.features(), n) for c, ring in self.kept.items()}
            self.kept.update({c: ClassRing(n, frozen.shape[1]) for c in new})
        for features, label, key in zip(frozen.detach().to("cpu", torch.float16), labels, keys):
            self.kept[label].push(features, key)

    def distances(self, sums: torch.Tensor, counts: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
        """1 - the cosine similarity of each kept sample to the nearest class mean (`means`: `unit_means` of the class
        `sums` and `counts`, as the calibration has them), its own class's mean taken without it
        (`Calibration.distance`'s score, out of sample); a sample alone in its class has no mean there. A class at a
        time: a fit's extra memory is one class's samples, not all of them in float64."""
        parts = [self._class_distances(c, self.features(c), sums, counts, means)
                 for c, ring in self.kept.items() if c < len(means) and ring.size]
        return torch.cat(parts) if parts else torch.zeros(0)

    def channel_distances(self, sums: torch.Tensor, counts: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
        """`distances` of the kept channel means (`Calibration.channel_distance`'s score, out of sample), from the
        class sums of the channel means; the same samples in the same order."""
        parts = [self._class_distances(c, self.channel_rows(c), sums, counts, means)
                 for c, ring in self.kept.items() if c < len(means) and ring.size]
        return torch.cat(parts) if parts else torch.zeros(0)

    @staticmethod
    def _class_distances(c: int, x: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor,
                         means: torch.Tensor) -> torch.Tensor:
        x = x.float()
        unit = F.normalize(x, dim=1)
        cosine = seen_cosine(x, means)
        rest = float(counts[c]) - 1
        own = F.normalize(((sums[c] - x.double()) / rest).float(), dim=1) if rest > 0 else torch.zeros_like(x)
        cosine[:, c] = (unit * own).sum(1)
        return 1 - cosine.max(1).values

    def drop(self, key: int) -> None:
        """A sample whose label a person changed (its class sums changed with it)."""
        if key < 0:  # samples kept without a key cannot be told apart
            return
        for c, ring in self.kept.items():
            keys = ring.keys()
            if key in keys:
                kept = [i for i, k in enumerate(keys) if k != key]
                self.kept[c] = ClassRing.of([keys[i] for i in kept], ring.features()[kept], len(ring.rows))

    def forget(self, class_id: int) -> None:
        self.kept.pop(class_id, None)

    def state_dict(self) -> dict:
        return {c: (ring.keys(), ring.features(), self.channels) for c, ring in self.kept.items() if ring.size}

    def load_state_dict(self, state: dict) -> None:
        """A state kept with another number of channel means (before they were kept: pairs) starts empty: its rows
        would not line up, and the stream refills them."""
        if any((entry[2] if len(entry) == 3 else 0) != self.channels for entry in state.values()):
            state = {}
        n = self._capacity(len(state))
        self.kept = {int(c): ClassRing.of(list(entry[0]), entry[1].to(torch.float16), n) for c, entry in state.items()}
