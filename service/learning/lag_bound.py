"""The lag bound (ASER_MAX_LAG_S) as the worker applies it. When the oldest waiting sample is over
the bound, the samples older than half of it pass through the memory without a gradient step, a
chunk at a time, while the memory update's share of time allows (`learner.catch_up`: the rest are
thinned), so the memory keeps sampling the whole stream; while behind, a method that chooses to
steps lean. An episode over the bound is logged once when it begins and once when it ends."""

from __future__ import annotations

import logging
import time

import torch

from learner.catch_up import CHUNK, CatchUp
from learner.methods.base import ContinualLearner
from service.storage.store import LogEntry, images_from_blobs

log = logging.getLogger("aser.worker")


class LagBound:
    chunk = CHUNK  # samples skipped at a time

    def __init__(self, max_lag_s: float, memory_share: float, batch_size: int, lean_when_behind: bool):
        self.max_lag_s = max_lag_s
        self.catch_up = CatchUp(max_lag_s, memory_share, batch_size) if max_lag_s else None
        self.lean_when_behind = lean_when_behind  # of the method the lineage has
        self._over = False

    def over(self, oldest_received: float, samples_skipped: int) -> bool:
        """Whether the oldest waiting sample is over the bound (the next work is skipping)."""
        over = bool(self.catch_up and self.catch_up.due(time.time(), oldest_received))
        if over and not self._over:
            log.warning("lag: the oldest waiting sample is over ASER_MAX_LAG_S (%g s); samples older than half of it "
                        "are skipped until the learner has caught up", self.max_lag_s)
        elif self._over and not over:
            log.info("lag: back within ASER_MAX_LAG_S; %d samples skipped so far", samples_skipped)
        self._over = over
        return over

    def lean(self, oldest_received: float) -> bool:
        """Whether the next step is lean: behind, under a method that steps lean then."""
        return bool(self.lean_when_behind and self.catch_up
                    and self.catch_up.behind(time.time(), oldest_received))

    def behind(self, entries: list[LogEntry]) -> list[LogEntry]:
        """The waiting samples old enough to skip (older than half of the bound)."""
        cutoff = self.catch_up.cutoff(time.time())
        return [e for e in entries if e.received < cutoff]

    def skip(self, learner: ContinualLearner, entries: list[LogEntry], image_shape: tuple[int, int, int]):
        """Pass `entries` through the memory without a gradient step; what `CatchUp.skip` did."""
        return self.catch_up.skip(learner, time.monotonic(), torch.tensor([e.class_id for e in entries]),
                                  lambda idx: images_from_blobs([entries[i].image for i in idx.tolist()], image_shape),
                                  lean=self.lean_when_behind,  # over the bound is behind: lean
                                  keys=torch.tensor([e.seq for e in entries]))
