"""When the worker persists its lineage, and what a failed save leaves: it is logged and counted,
training goes on, the previous checkpoint stays in force, and the save is tried again after
ASER_CHECKPOINT_EVERY_STEPS more steps."""

from __future__ import annotations

import logging

from learner.methods.base import ContinualLearner
from service.metrics import Metrics
from service.storage.checkpoints import CheckpointStore
from service.storage.db import is_disk_full
from service.storage.errors import StorageFull

log = logging.getLogger("aser.worker")


class Checkpointing:
    def __init__(self, store: CheckpointStore, every_steps: int, metrics: Metrics):
        self.store = store
        self.every_steps = every_steps
        self.metrics = metrics
        self.failures = 0
        self.saved_at = self.tried_at = 0  # the worker's progress (`LearnerWorker.progress`) at each

    def restarted(self, progress: int) -> None:
        """The worker restored the last checkpoint, which holds `progress`."""
        self.saved_at = self.tried_at = progress

    def due(self, progress: int) -> bool:
        return progress - self.tried_at >= self.every_steps

    def save(self, learner: ContinualLearner, trained_upto: int, extra: dict, progress: int) -> bool:
        """Persist the learner as it is at `progress`; False (logged, counted) if the save failed."""
        self.tried_at = progress
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
