"""When the worker persists its lineage, and what a failed save leaves: it is logged and counted,
training goes on, the previous checkpoint stays in force, and the save is tried again after
ASER_CHECKPOINT_EVERY_STEPS more steps.

With `every_s` (half of ASER_MAX_LAG_S) a save is also due once that long has passed with progress since the last
try: a kill sends the service back to its last checkpoint, and the samples learned since are learned again after the
restart, so the checkpoint's age is what a kill adds to the lag. At 80 samples a second, ASER_MAX_LAG_S=6, two
classes forgotten and a SIGKILL between them, 100 steps (12 s) between checkpoints peaked at 13.9 s of lag and
every 3 s at 7.0 (results/reliability/forget-lag-*.json)."""

from __future__ import annotations

import logging
import time

from learner.methods.base import ContinualLearner
from service.metrics import Metrics
from service.storage.checkpoints import CheckpointStore
from service.storage.db import is_disk_full
from service.storage.errors import StorageFull

log = logging.getLogger("aser.worker")


class Checkpointing:
    def __init__(self, store: CheckpointStore, every_steps: int, metrics: Metrics, every_s: float = 0.0):
        self.store = store
        self.every_steps, self.every_s = every_steps, every_s
        self.metrics = metrics
        self.failures = 0
        self.saved_at = self.tried_at = 0  # the worker's progress (`LearnerWorker.progress`) at each
        self.tried_time = time.monotonic()

    def restarted(self, progress: int) -> None:
        """The worker restored the last checkpoint, which holds `progress`."""
        self.saved_at = self.tried_at = progress
        self.tried_time = time.monotonic()

    def due(self, progress: int) -> bool:
        if progress - self.tried_at >= self.every_steps:
            return True
        return bool(self.every_s) and progress > self.tried_at and time.monotonic() - self.tried_time >= self.every_s

    def save(self, learner: ContinualLearner, trained_upto: int, extra: dict, progress: int) -> bool:
        """Persist the learner as it is at `progress`; False (logged, counted) if the save failed."""
        self.tried_at, self.tried_time = progress, time.monotonic()
        try:
            self.store.save(learner, trained_upto, extra=extra)
        except Exception as exc:
            if isinstance(exc, StorageFull) or is_disk_full(exc):  # expected on a full disk: one line, no trace
                log.warning("checkpoint failed: the disk is full; training goes on, the previous checkpoint stays "
                            "in force")
            else:
                log.exception("checkpoint failed; training goes on, the previous checkpoint stays in force")
            self.failures += 1
            self.metrics.checkpoint_failures.inc()
            return False
        self.saved_at = progress
        return True
