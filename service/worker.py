"""The learner worker: one thread that drains the ingest log in arrival order, in mini-batches,
each sample once, and publishes a read-only copy of the weights for predictions after every
step (predictions never wait for training and never see a half-updated model).

It starts from the last committed checkpoint and trains on every acknowledged sample after
that checkpoint's `trained_upto`; work after the last checkpoint is simply redone, so every
sample is in the persisted lineage exactly once. Over the lag bound (ASER_MAX_LAG_S) the oldest
samples pass through the memory without a gradient step instead (skipped, not scored; a part of
them thinned where the memory update itself would take too long: `learner.catch_up`); while no
batch is due it may rehearse from the memory (ASER_IDLE_REHEARSAL).

It is supervised: a step that raises leaves the learner half-updated, so that learner is
dropped, nothing of it is persisted, and training restarts from the last committed
checkpoint (with a growing pause if failures repeat). A sample whose batch keeps failing is
tried alone on a scratch copy of the learner; if it fails alone it is quarantined (recorded,
skipped from then on, reported), so one bad sample cannot stop learning. A checkpoint or a
snapshot that fails is logged and counted; training goes on.

The concerns beside the loop have modules of their own: which learner the data directory holds
(`service.lineage`), what readers see and its corrections (`service.serving`), when to export
(`service.snapshot_schedule`), setting bad samples aside (`service.quarantine`), forgetting a class
(`service.forgetting`), the history's points (`service.online.HistoryRecorder`) and the lag bound's
arithmetic (`learner.catch_up`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import torch

from learner.base import ContinualLearner
from learner.catch_up import CHUNK, CatchUp

from .checkpoints import CheckpointStore, VersionLease
from .db import Database, is_disk_full
from .errors import StorageFull
from .forgetting import ForgetRequests
from .lineage import Lineage, lineage_of, make_learner_of
from .metrics import Metrics
from .online import History, HistoryRecorder, OnlineAccuracy
from .quarantine import PoisonGuard
from .serving import MemoryView, Predictor, Published, Publisher
from .settings import Settings
from .snapshot_schedule import SnapshotSchedule
from .snapshots import SnapshotStore
from .store import Forgotten, IngestLog, LogEntry, images_from_blobs

log = logging.getLogger("aser.worker")



def resolve_device(name: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


class LearnerWorker:
    """`checkpoints` and `lineage`: the data directory's checkpoint store and the learner it holds
    (`service.lineage`, resolved from them), made here when not given."""

    def __init__(self, settings: Settings, db: Database, store: IngestLog, metrics: Metrics | None = None,
                 lineage: Lineage | None = None, checkpoints: CheckpointStore | None = None):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.store = store
        self.device = resolve_device(settings.device)
        self.checkpoints = checkpoints or CheckpointStore(db, settings.data_dir / "checkpoints")
        self.lineage = lineage or lineage_of(settings, self.checkpoints)
        self.checkpoints.identity = self.lineage.identity()
        self.image_shape = (3, self.lineage.image_size, self.lineage.image_size)
        self.versions = VersionLease(db)
        self.catch_up = CatchUp(settings.max_lag_s, settings.catch_up_memory_share, settings.batch_size) if settings.max_lag_s else None
        self.lean_when_behind = self.lineage.lean_when_behind  # of the method the lineage has
        self._over_lag_bound = False  # in a lag-bound episode (logged once when it begins and when it ends)
        self.publisher = Publisher(self.versions, self.lineage.head == "ncm", settings.serving_refresh_steps,
                                   settings.ncm_refresh_steps)  # what readers see
        self.snapshots = SnapshotStore(db, settings.data_dir / "snapshots", self.lineage.method,
                                       settings.snapshot_timeout_s, settings.snapshot_keep,
                                       keep_exporter=self.lineage.backbone == "scratch")
        self.history = History(db, settings.history_max_points)
        self.schedule = SnapshotSchedule(self.snapshots, settings, self.lineage.head, store, self.image_shape)
        self.forgetting = ForgetRequests(self)
        self.restarts = 0
        self.last_error: str | None = None
        self.checkpoint_failures = 0
        self.poison = PoisonGuard(store)  # a sample whose batch keeps failing is set aside
        self._in_step: list[int] = []
        self.last_step_seconds = 0.0
        self.recorder = HistoryRecorder(self.history, settings.history_every_steps)
        self.wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="learner-worker", daemon=True)
        self.error: BaseException | None = None  # set only if the thread itself ends abnormally
        self._load()

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the step in progress, then checkpoint (a clean shutdown redoes nothing); a
        learner left half-updated by a failed step is never checkpointed."""
        self._stop.set()
        self.wakeup.set()
        self._thread.join(timeout)
        if not self._thread.is_alive() and self.consistent and self.progress() != self.checkpointed:
            self.checkpoint()
        self.snapshots.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _build_learner(self) -> ContinualLearner:
        return make_learner_of(self.lineage, self.settings, self.device)

    def _load(self) -> None:
        """(Re)start from the last committed checkpoint."""
        learner = self._build_learner()
        self.trained_upto, extra = self.checkpoints.restore(learner)  # the last sequence number the model has seen
        self.online = OnlineAccuracy.from_state(extra.get("online"), self.settings.online_window)
        forgotten = self.store.forgotten()
        for f in forgotten:  # a crash may have come between the forgetting and the next checkpoint
            learner.forget_class(f.class_id)
            self.online.forget_class(f.class_id)
        self.snapshots.purge(forgotten)
        reserved = self.versions.reserved()
        if reserved and learner.version <= reserved:  # the checkpoint is older than what was served since
            learner.rename_weights(above=reserved)
        self.learner = learner
        self.schedule.last_at = learner.steps
        self.checkpointed = self._last_checkpoint_try = self.progress()
        self._rehearsal_next = 0.0  # monotonic time before which idle rehearsal pauses
        self.publisher.restart()
        self.consistent = True
        self.publish()
        s = self.settings
        log.info("learner: %s (%s), M=%d, %s, device %s, data in %s, %s", self.lineage.method, learner.name,
                 s.mem_size, self.lineage.describe(), self.device, s.data_dir.resolve(),
                 f"resumed from a checkpoint at sample {self.trained_upto} ({learner.steps} steps)"
                 if self.trained_upto else "a new lineage")

    def _run(self) -> None:
        failures_in_a_row = 0
        try:
            while not self._stop.is_set():
                try:
                    self.forgetting.apply_pending()
                    self.schedule.serve_requests(self.learner, self.predictor)
                    if self.train_available() or self.rehearse_if_idle() or self.correct_serving_if_idle():
                        failures_in_a_row = 0
                    else:
                        self.wakeup.wait(timeout=min(0.5, self.settings.max_batch_wait_s or 0.5))
                        self.wakeup.clear()
                except Exception as exc:
                    failures_in_a_row += 1
                    self._recover(exc, failures_in_a_row)
        except BaseException as exc:  # the thread itself ends: surfaced through /readyz and /status
            log.exception("learner worker stopped")
            self.error = exc

    def _recover(self, exc: Exception, failures_in_a_row: int) -> None:
        """Drop the half-updated learner and restart from the last committed checkpoint."""
        log.error("learner step failed (samples %s); restarting from the last checkpoint",
                  f"{self._in_step[0]}..{self._in_step[-1]}" if self._in_step else "none", exc_info=exc)
        self.consistent = False
        self.poison.failed(self._in_step)
        self._in_step = []
        self.restarts += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.metrics.worker_restarts.inc()
        pause = min(30.0, 0.1 * 2 ** (failures_in_a_row - 1))  # a failure that is not a sample's must not spin
        while not self._stop.wait(pause):
            try:
                self._load()
                return
            except Exception:
                log.exception("restoring the last checkpoint failed; trying again")
                pause = min(30.0, pause * 2)

    # --- training ----------------------------------------------------------------------
    def train_available(self) -> bool:
        """Train on the next mini-batch if one is due; returns whether anything was done."""
        b = self.settings.batch_size
        entries = self.store.after(self.trained_upto, b)
        if not entries:
            return False
        if self.catch_up and self.catch_up.due(time.time(), entries[0].received):
            if not self._over_lag_bound:
                self._over_lag_bound = True
                log.warning("lag: the oldest waiting sample is over ASER_MAX_LAG_S (%g s); samples older than half of "
                            "it are skipped until the learner has caught up", self.settings.max_lag_s)
            self._skip_behind()
            return True
        if self._over_lag_bound:
            self._over_lag_bound = False
            log.info("lag: back within ASER_MAX_LAG_S; %d samples skipped so far", self.learner.samples_skipped)
        if len(entries) < b and time.time() - entries[0].received < self.settings.max_batch_wait_s:
            return False  # wait for a full batch a little longer
        lean = bool(self.lean_when_behind and self.catch_up
                    and self.catch_up.behind(time.time(), entries[0].received))
        entries = self.poison.set_aside(entries, self._fails_alone)
        if entries:
            self._step(entries, lean)
        return True

    def _step(self, entries: list[LogEntry], lean: bool) -> None:
        self._in_step = [e.seq for e in entries]
        self.consistent = False
        t0 = time.perf_counter()
        images = images_from_blobs([e.image for e in entries], self.image_shape)
        labels = [e.class_id for e in entries]
        self._score_before_training(images, labels)
        stats = self.learner.observe(images, torch.tensor(labels), lean=lean)
        self.last_step_seconds = time.perf_counter() - t0
        self.trained_upto = entries[-1].seq
        self.consistent = True
        self._in_step = []
        self.poison.passed(e.seq for e in entries)
        self.metrics.observe_step(self.last_step_seconds, len(entries), lean, stats)
        self.publish()
        self.recorder.stepped(self, stats)
        self._checkpoint_if_due()
        self.schedule.export_if_due(self.learner, self.predictor)

    def _skip_behind(self) -> None:
        """Over the lag bound: the samples older than half of it are skipped, a chunk at a time,
        each sample once; they reach the memory update while its share of time allows
        (`learner.catch_up`), so the memory keeps sampling the whole stream."""
        cutoff = self.catch_up.cutoff(time.time())
        entries = [e for e in self.store.after(self.trained_upto, CHUNK) if e.received < cutoff]
        entries = self.poison.set_aside(entries, self._fails_alone)
        if not entries:
            return
        self._in_step = [e.seq for e in entries]
        self.consistent = False
        done = self.catch_up.skip(self.learner, time.monotonic(), torch.tensor([e.class_id for e in entries]),
                                  lambda idx: images_from_blobs([entries[i].image for i in idx.tolist()],
                                                                self.image_shape),
                                  lean=self.lean_when_behind)  # over the bound is behind: lean
        self.trained_upto = entries[-1].seq
        self.consistent = True
        self._in_step = []
        self.metrics.samples_skipped.inc(len(entries))
        self.metrics.samples_thinned.inc(done.thinned)
        self.publish()
        self._checkpoint_if_due()

    def rehearse_if_idle(self) -> bool:
        """While no batch is due: a replay-only step, within its share of the worker's time.
        Returns whether it rehearsed (or is pausing to keep to its share)."""
        s = self.settings
        if not s.idle_rehearsal or len(self.memory.class_ids) == 0 or self.forgetting.waiting:
            return False
        pause = self._rehearsal_next - time.monotonic()
        if pause > 0:  # keeping to the share; an arriving sample wakes the loop
            self.wakeup.wait(min(pause, 0.5))
            self.wakeup.clear()
            return True
        self.consistent = False
        t0 = time.perf_counter()
        stats = self.learner.rehearse()
        spent = time.perf_counter() - t0
        self.consistent = True
        if stats is None:
            return False
        self._rehearsal_next = time.monotonic() + spent * (1 - s.idle_rehearsal_share) / s.idle_rehearsal_share
        self.metrics.rehearsal_steps.inc()
        self.publish()
        self._checkpoint_if_due()
        return True

    def progress(self) -> int:
        """Work done, in steps: stream steps, rehearsal steps, and skipped samples by the batch."""
        lr = self.learner
        return lr.steps + lr.rehearsal_steps + lr.samples_skipped // self.settings.batch_size

    def _checkpoint_if_due(self) -> None:
        if self.progress() - self._last_checkpoint_try >= self.settings.checkpoint_every_steps:
            self.checkpoint()

    def lag_seconds(self) -> float:
        """The age of the oldest acknowledged sample the published model has not learned (0: none)."""
        oldest = self.store.oldest_pending(self.trained_upto)
        return 0.0 if oldest is None else max(0.0, time.time() - oldest)

    def _score_before_training(self, images: torch.Tensor, labels: list[int]) -> None:
        """Test-then-train: the published model (the one about to step) predicts the batch."""
        known = len(self.predictor.classes)
        predicted = self.predictor.probabilities(images).argmax(1).tolist() if known else [-1] * len(labels)
        self.online.score(predicted, labels, known)

    def _fails_alone(self, entry: LogEntry) -> str | None:
        """Train a scratch copy of the learner on this one sample; the error, if it fails."""
        scratch = self._build_learner()
        scratch.load_state_dict(self.learner.state_dict())
        try:
            scratch.observe(images_from_blobs([entry.image], self.image_shape), torch.tensor([entry.class_id]))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def publish(self, refresh_head: bool = False) -> None:
        """What readers see of the learner, replaced whole (atomic swaps) between steps."""
        self.publisher.publish(self.learner, self.store.classes(), self.trained_upto, self.progress(), refresh_head)

    @property
    def published(self) -> Published | None:
        return self.publisher.published

    @property
    def predictor(self) -> Predictor:
        return self.published.predictor

    @property
    def memory(self) -> MemoryView:
        return self.published.memory

    def correct_serving_if_idle(self) -> bool:
        """Nothing to train: bring the served copy's corrections up to the learner, so that an idle
        service answers with its latest weights, not those of up to ASER_SERVING_REFRESH_STEPS steps
        ago (a young service has had fewer steps than that). Returns whether it did."""
        if not self.publisher.correct_now(self.learner, self.progress()):
            return False
        self.publish()
        return True

    def checkpoint(self) -> bool:
        """Persist the lineage; a failure (disk full, say) is logged and retried later."""
        try:
            self.checkpoints.save(self.learner, self.trained_upto, extra={"online": self.online.state_dict()})
        except Exception as exc:
            if isinstance(exc, StorageFull) or is_disk_full(exc):  # expected on a full disk: one line, no trace
                log.warning("checkpoint failed: the disk is full; training goes on, the previous checkpoint stays "
                            "in force")
            else:
                log.exception("checkpoint failed; training goes on, the previous checkpoint stays in force")
            self.checkpoint_failures += 1
            self.metrics.checkpoint_failures.inc()
            self._last_checkpoint_try = self.progress()
            return False
        self.checkpointed = self._last_checkpoint_try = self.progress()
        return True

    # --- forgetting a class (service.forgetting) -----------------------------------------
    def forget(self, label: str) -> tuple[Forgotten, Future]:
        """Forget a class: durably first, then in the learner between two steps; the future is done
        when the live model has forgotten it."""
        return self.forgetting.submit(label)

    # --- snapshots (service.snapshot_schedule) -------------------------------------------
    def request_snapshot(self) -> Future:
        """Export the model as it is after the step in progress; the future gives the snapshot row."""
        answer = self.schedule.request()
        self.wakeup.set()
        return answer
