"""The parts of one running learner service, apart from HTTP: the database, the ingest log,
the learner worker and the prediction batcher. `service.web.app` opens one at start-up and closes it at shutdown."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from service.learning.batching import PredictBatcher
from service.learning.lineage import describe_learner
from service.learning.worker import LearnerWorker, LoopSpec
from service.metrics import Metrics
from service.settings import Settings
from service.storage.checkpoints import CheckpointStore
from service.storage.db import Database
from service.storage.integrity import Damage, check_ingest_log
from service.storage.retention import Retention, RetentionPolicy
from service.storage.store import IngestLog


@dataclass
class Runtime:
    settings: Settings
    metrics: Metrics
    db: Database
    store: IngestLog
    worker: LearnerWorker
    batcher: PredictBatcher
    retention: Retention
    started: float = field(default_factory=time.time)

    @property
    def image_size(self) -> int:
        """The side every image is brought to: the lineage's (`service.learning.lineage`)."""
        return self.worker.lineage.image_size

    @classmethod
    def open(cls, settings: Settings, metrics: Metrics) -> "Runtime":
        check_ingest_log(settings.database_path)  # damaged: refused, never replaced
        db = Database(settings.database_path)
        damage = Damage(on_set_aside=lambda kind: metrics.damaged_files.labels(kind=kind).inc())
        checkpoints = CheckpointStore(db, settings.data_dir / "checkpoints", damage=damage)
        spec = describe_learner(settings, checkpoints.saved_identity())  # read once: the restore reuses what it read
        store = IngestLog(db, spec.image_shape)
        worker = LearnerWorker(LoopSpec.of(settings), db, store, spec, checkpoints, metrics)
        worker.start()
        batcher = PredictBatcher(lambda: worker.predictor, settings.predict_batch_wait_ms / 1000,
                                 settings.predict_max_batch, on_batch=metrics.predict_batch.observe)
        policy = RetentionPolicy(settings.retain_pixels_s, int(settings.retain_max_mb * 2**20), settings.retain_ids_s)
        retention = Retention(db, policy, settings.retain_every_s, worker.checkpoints.trained_upto,
                              on_run=metrics.observe_retention)
        retention.start()
        return cls(settings, metrics, db, store, worker, batcher, retention)

    def close(self) -> None:
        self.retention.stop()
        self.worker.stop()
        self.db.close()
