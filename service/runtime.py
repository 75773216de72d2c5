"""The parts of one running learner service, apart from HTTP: the database, the ingest log
and the learner worker. `service.app` opens one at start-up and closes it at shutdown."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .db import Database
from .metrics import Metrics
from .settings import Settings
from .store import IngestLog
from .worker import LearnerWorker


@dataclass
class Runtime:
    settings: Settings
    metrics: Metrics
    db: Database
    store: IngestLog
    worker: LearnerWorker
    started: float = field(default_factory=time.time)

    @classmethod
    def open(cls, settings: Settings, metrics: Metrics) -> "Runtime":
        db = Database(settings.database_path)
        store = IngestLog(db, (3, settings.image_size, settings.image_size))
        worker = LearnerWorker(settings, db, store, metrics)
        worker.start()
        return cls(settings, metrics, db, store, worker)

    def close(self) -> None:
        self.worker.stop()
        self.db.close()
