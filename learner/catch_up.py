"""Catching up when the stream outruns the learner: the lag bound's rule, one owner for the
service's worker and the benchmark's real-time protocol.

Over the bound (the oldest waiting sample is older than `bound_s`), the samples older than half
of it are skipped, `CHUNK` at a time: no gradient step. A skipped sample still reaches the
memory update (in batches of the stream's `batch_size`, as it would have trained), so the memory
keeps sampling the whole stream, while those updates keep within
`memory_share` of the clock: a token bucket that fills at `memory_share` seconds a second and
holds at most `memory_share x bound_s / 2`: a skipping episode that spends a full bucket at once lets the
oldest sample age by as much again, so at the default share of 0.5 the lag stays within 1.25x the bound
(a full `memory_share x bound_s` let it reach 10.2 s under a 6 s bound on the pretrained default, whose
skipped samples each pay a frozen forward: docs/results/speed-and-memory.md). Beyond it, only as many of a
chunk as the allowance pays for, drawn at random, reach the memory; the others are counted and nothing more
(thinned).
Before that, while the oldest waiting sample is past the cutoff (`behind`), a caller may take lean
steps (`observe(..., lean=True)`: the bare method's step, without repeated rehearsal or
augmentation, with the memory policies' lean forms), so that a costly learner trains on more of the
stream rather than skipping it; its skipped samples then reach the memory through the lean update
too (`skip(..., lean=True)`: for ASER's memory the reservoir, which never meets the cap).

Why a cap: the reservoir's update costs microseconds a sample and never meets it, but ASER's
KNN-SV update costs about 3 ms a sample on one CPU thread (results/realtime/cost-model.json),
more than the 2.5 ms between samples of a stream at 4x ER's throughput: uncapped, a learner
that only skips still falls further behind.

>>> import torch
>>> from learner import make_learner
>>> learner = make_learner("er", 2, mem_size=20)
>>> rule = CatchUp(bound_s=10, memory_share=0.5)
>>> rule.due(now=100.0, oldest_arrival=85.0), rule.cutoff(now=100.0), rule.behind(now=100.0, oldest_arrival=94.0)
(True, 95.0, True)
>>> labels = torch.tensor([0, 1] * 50)
>>> done = rule.skip(learner, 100.0, labels, lambda idx: torch.zeros(len(idx), 3, 32, 32, dtype=torch.uint8),
...                  seconds_per_sample=0.2)  # 2.5 s of allowance pays for 12 of the 100
>>> done.reached, done.thinned, round(done.seconds, 6), learner.samples_skipped, learner.samples_thinned
(12, 88, 2.4, 100, 88)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported where a draw needs it: the service's settings read MEMORY_SHARE
    import torch

CHUNK = 100  # samples skipped at a time, between two looks at what is waiting
MEMORY_SHARE = 0.5  # of the clock that skipped samples' memory updates may take at most


@dataclass(frozen=True)
class Skipped:
    """One chunk skipped: the samples that reached the memory, those thinned, the seconds spent."""

    reached: int
    thinned: int
    seconds: float


class CatchUp:
    """The lag bound of `bound_s` seconds and the allowance of its memory updates."""

    def __init__(self, bound_s: float, memory_share: float = MEMORY_SHARE, batch_size: int = 10, seed: int = 0):
        if bound_s <= 0 or not 0 < memory_share <= 1:
            raise ValueError("the bound must be positive and the memory share in (0, 1]")
        self.bound_s, self.memory_share, self.batch_size, self.seed = bound_s, memory_share, batch_size, seed
        self.allowance = self.capacity  # seconds of memory updates it may spend now
        self._filled_at: float | None = None
        self._seconds_per_sample: float | None = None  # the last timed pass's, per sample
        self._generator: torch.Generator | None = None

    @property
    def capacity(self) -> float:
        return self.memory_share * self.bound_s / 2

    def due(self, now: float, oldest_arrival: float) -> bool:
        """Whether the learner is over the bound: the oldest waiting sample arrived too long ago."""
        return now - oldest_arrival > self.bound_s

    def behind(self, now: float, oldest_arrival: float) -> bool:
        """Whether the oldest waiting sample is past the cutoff: the next time the bound bites it is
        skipped, so a cheaper (lean) step now trains more of what would be skipped."""
        return now - oldest_arrival > self.bound_s / 2

    def cutoff(self, now: float) -> float:
        """Samples that arrived before this are skipped (those older than half the bound)."""
        return now - self.bound_s / 2

    def skip(self, learner, now: float, labels: torch.Tensor, images_of: Callable[[torch.Tensor], torch.Tensor],
             seconds_per_sample: float | None = None, lean: bool = False, keys: torch.Tensor | None = None) -> Skipped:
        """Skip the samples of `labels`: those the allowance pays for reach `learner.pass_through`
        (`images_of(indices)` gives their images; `lean`: its lean form; `keys`: their ids), the others `learner.skip`.
        `seconds_per_sample` is a cost model's (the benchmark); without one the pass is timed (the
        worker, whose lean setting does not change while it runs)."""
        import torch

        self._fill(now)
        cost = seconds_per_sample if seconds_per_sample is not None else self._seconds_per_sample
        n = labels.numel()
        affordable = n if cost is None or cost <= 0 else min(n, max(0, int(self.allowance / cost + 1e-9)))
        chosen = torch.arange(n) if affordable == n else self._draw(n, affordable)
        thinned = torch.ones(n, dtype=torch.bool)
        thinned[chosen] = False
        seconds = 0.0
        if affordable:
            t0 = time.perf_counter()
            learner.pass_through(images_of(chosen), labels[chosen], self.batch_size, lean,
                                 keys=None if keys is None else keys[chosen])
            measured = time.perf_counter() - t0
            seconds = seconds_per_sample * affordable if seconds_per_sample is not None else measured
            self._seconds_per_sample = seconds / affordable
        if affordable < n:
            learner.skip(labels[thinned])
        self.allowance -= seconds
        return Skipped(affordable, n - affordable, seconds)

    def _fill(self, now: float) -> None:
        if self._filled_at is not None:
            self.allowance = min(self.capacity, self.allowance + self.memory_share * max(0.0, now - self._filled_at))
        self._filled_at = now

    def _draw(self, n: int, k: int) -> torch.Tensor:
        """k of n positions at random, in stream order (seeded: a run is reproducible)."""
        import torch

        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        return torch.randperm(n, generator=self._generator)[:k].sort().values
