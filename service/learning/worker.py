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

The concerns beside the loop have modules of their own in this folder: which learner the data directory holds
(`lineage`), what readers see and its corrections (`serving`), when to export (`snapshot_schedule`), setting bad samples
aside (`quarantine`), forgetting a class (`forgetting`), the history's points (`online.HistoryRecorder`), when to
checkpoint (`checkpointing`), the lag bound (`lag_bound`, its arithmetic in `learner.catch_up`) and a sleep's files
(`sleep_stores`: the latent store and the night's pixel store).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from learner.methods.base import ContinualLearner
from service.learning.checkpointing import Checkpointing
from service.learning.corrections import CorrectionRequests
from service.learning.forgetting import ForgetRequests
from service.learning.lag_bound import LagBound
from service.learning.lineage import LearnerSpec, describe_learner
from service.learning.online import History, HistoryRecorder, OnlineAccuracy
from service.learning.quarantine import PoisonGuard, fails_alone
from service.learning.serving import MemoryView, Predictor, Published, Publisher
from service.learning.sleep_stores import SleepStores
from service.learning.snapshot_schedule import SnapshotPlan, SnapshotSchedule
from service.metrics import Metrics
from service.storage.checkpoints import CheckpointStore, VersionLease
from service.storage.db import Database
from service.storage.snapshots import SnapshotStore
from service.storage.store import IngestLog, LogEntry, images_from_blobs

log = logging.getLogger("aser.worker")


@dataclass(frozen=True)
class LoopSpec:
    """What the worker's loop reads of the settings, handed to it once at start-up (as `LearnerSpec` is): the
    batches, the lag bound, when to persist and publish, the history, idle rehearsal, sleep and the snapshots."""

    data_dir: Path
    batch_size: int
    max_batch_wait_s: float
    max_lag_s: float
    catch_up_memory_share: float
    checkpoint_every_steps: int
    serving_refresh_steps: int
    ncm_refresh_steps: int
    history_max_points: int
    max_classes: int
    history_every_steps: int
    online_window: int
    online_score_top_every: int
    idle_rehearsal: bool
    idle_rehearsal_per_step: float
    idle_rehearsal_share: float
    sleep_idle_s: float
    sleep_min_new: int
    sleep_fresh_idle_s: float
    sleep_fresh_growth: float
    pixel_store_mb: float
    seed: int
    snapshots: SnapshotPlan

    @classmethod
    def of(cls, settings) -> "LoopSpec":
        """The loop `settings` (`service.settings.Settings`) ask for."""
        plain = {f.name: getattr(settings, f.name) for f in fields(cls) if f.name != "snapshots"}
        snapshots = {f.name: getattr(settings, "snapshot_" + f.name) for f in fields(SnapshotPlan)}
        return cls(**plain, snapshots=SnapshotPlan(**snapshots))

    @property
    def night_idle_s(self) -> float | None:
        """The idle time after which a sleep is a night's (fresh) one; None: fresh sleeps only on request."""
        return self.sleep_fresh_idle_s or None


class LearnerWorker:
    """`spec`: the learner the data directory holds, as start-up described it (`service.learning.lineage`);
    `loop`: how the loop runs; `checkpoints`: the directory's checkpoint store (`open` makes all three)."""

    def __init__(self, loop: LoopSpec, db: Database, store: IngestLog, spec: LearnerSpec,
                 checkpoints: CheckpointStore, metrics: Metrics | None = None):
        self.loop = loop
        self.metrics = metrics or Metrics()
        self.store = store
        self.spec, self.lineage, self.device = spec, spec.lineage, spec.device
        self.checkpoints = checkpoints
        self.checkpoints.identity = self.lineage.identity()
        self.damage = checkpoints.damage  # the derived files set aside as damaged, with this run's others
        self.image_shape = spec.image_shape
        self.versions = VersionLease(db)
        self.lag = LagBound(loop.max_lag_s, loop.catch_up_memory_share, loop.batch_size,
                            self.lineage.lean_when_behind)
        self.checkpointing = Checkpointing(self.checkpoints, loop.checkpoint_every_steps, self.metrics,
                                           every_s=loop.max_lag_s / 2)  # a kill costs the lag the checkpoint's age
        self.publisher = Publisher(self.versions, self.lineage.head == "ncm", loop.serving_refresh_steps,
                                   loop.ncm_refresh_steps)  # what readers see
        self.snapshots = SnapshotStore(db, loop.data_dir / "snapshots", self.lineage.method,
                                       loop.snapshots.timeout_s, loop.snapshots.keep,
                                       keep_exporter=self.lineage.backbone == "scratch", damage=self.damage)
        self.history = History(db, loop.history_max_points)
        self.schedule = SnapshotSchedule(self.snapshots, loop.snapshots, store, self.image_shape)
        self.forgetting = ForgetRequests(self)
        self.corrections = CorrectionRequests(self, loop.max_classes)
        self.restarts = 0
        self.last_error: str | None = None
        self.poison = PoisonGuard(store, lambda entry: fails_alone(self._build_learner(), self.learner, entry,
                                                                   self.image_shape))  # a sample that keeps failing
        self._in_step: list[int] = []
        self.last_step_seconds = 0.0
        self.stores = SleepStores(loop, spec.sleep_store_mb, store, self.image_shape, self.damage)  # a sleep's files
        self._sleep_asked = threading.Event()
        self._fresh_asked = False  # the sleep asked for trains the top again from its initial weights
        self._busy_at = time.monotonic()  # when the worker last had samples to train: idle since
        self.recorder = HistoryRecorder(self.history, loop.history_every_steps)
        self.wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="learner-worker", daemon=True)
        self.error: BaseException | None = None  # set only if the thread itself ends abnormally
        self._load()

    @classmethod
    def open(cls, settings, db: Database, store: IngestLog, metrics: Metrics | None = None):
        """The worker of the learner `settings` make with the data directory's checkpoints."""
        checkpoints = CheckpointStore(db, settings.data_dir / "checkpoints")
        spec = describe_learner(settings, checkpoints.saved_identity())
        return cls(LoopSpec.of(settings), db, store, spec, checkpoints, metrics)

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the step in progress, then checkpoint (a clean shutdown redoes nothing); a
        learner left half-updated by a failed step is never checkpointed."""
        self._stop.set()
        self.wakeup.set()
        self._thread.join(timeout)
        if not self._thread.is_alive() and self.consistent and self.progress() != self.checkpointing.saved_at:
            self.checkpoint()
        self.snapshots.close()
        self.stores.close()

    @property
    def latent_store(self):
        return self.stores.latents

    @property
    def pixels(self):
        return self.stores.pixels

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _build_learner(self) -> ContinualLearner:
        return self.spec.build()

    def _load(self) -> None:
        """(Re)start from the last committed checkpoint."""
        learner = self._build_learner()
        learner.warm_up()
        self.stores.attach(learner)
        self.trained_upto, extra = self.checkpoints.restore(learner)  # the last sequence number the model has seen
        refill = self.stores.restore(learner, self.trained_upto, extra.get("pixel_store_token"))
        self.online = OnlineAccuracy.from_state(extra.get("online"), self.loop.online_window,
                                                 self.loop.online_score_top_every)
        forgotten = self.store.forgotten()
        for f in forgotten:  # a crash may have come between the forgetting and the next checkpoint
            learner.forget_class(f.class_id)
            self.online.forget_class(f.class_id)
            self.stores.forget_class(f.class_id)
        self.snapshots.purge(forgotten)
        reserved = self.versions.reserved()
        if reserved and learner.version <= reserved:  # the checkpoint is older than what was served since
            learner.rename_weights(above=reserved)
        self.learner = learner
        self.corrections.restored(extra.get("corrections_upto", 0))  # made after that checkpoint, before a crash
        self.schedule.last_at = learner.steps
        self.checkpointing.restarted(self.progress())
        self._rehearsal_next = 0.0  # monotonic time before which idle rehearsal pauses
        self.publisher.restart()
        self.consistent = True
        self.publish()
        if refill:  # the checkpoint names the new stores' tokens: a restart from it finds them its own
            self.checkpoint()
        if self.snapshots.lost_latest and self.predictor.labels:  # replicas and downloads need an intact one
            self.schedule.export(learner, self.predictor, "rebuilt")
        self.snapshots.lost_latest = False
        s = self.loop
        log.info("learner: %s (%s), M=%d, %s, device %s, data in %s, %s", self.lineage.method, learner.name,
                 self.spec.mem_size, self.lineage.describe(), self.device, s.data_dir.resolve(),
                 f"resumed from a checkpoint at sample {self.trained_upto} ({learner.steps} steps)"
                 if self.trained_upto else "a new lineage")

    def _run(self) -> None:
        failures_in_a_row = 0
        try:
            while not self._stop.is_set():
                try:
                    self.forgetting.apply_pending()
                    self.corrections.apply_pending()
                    self.schedule.serve_requests(self.learner, self.predictor)
                    if (self.train_available() or self.sleep_if_due() or self.rehearse_if_idle()
                            or self.correct_serving_if_idle()):
                        failures_in_a_row = 0
                    else:
                        self.wakeup.wait(timeout=min(0.5, self.loop.max_batch_wait_s or 0.5))
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
        b = self.loop.batch_size
        entries = self.store.after(self.trained_upto, b)
        if not entries:
            return False
        self._busy_at = time.monotonic()
        if self.lag.over(entries[0].received, self.learner.samples_skipped):
            self._skip_behind()
            return True
        if len(entries) < b and time.time() - entries[0].received < self.loop.max_batch_wait_s:
            return False  # wait for a full batch a little longer
        lean = self.lag.lean(entries[0].received)
        entries = self.poison.set_aside(entries)
        if entries:
            self._step(entries, lean)
        return True

    def _step(self, entries: list[LogEntry], lean: bool) -> None:
        self._in_step = [e.seq for e in entries]
        self.consistent = False
        t0 = time.perf_counter()
        images = images_from_blobs([e.image for e in entries], self.image_shape)
        labels = [e.class_id for e in entries]
        encoded = self.learner.encode_incoming(images.to(self.learner.device))  # the frozen part once, for both
        self.online.score_batch(self.predictor, encoded, labels)  # test-then-train: the model about to step
        stats = self.learner.observe(images, torch.tensor(labels), lean=lean, encoded=encoded,
                                     keys=torch.tensor([e.seq for e in entries]))
        self.last_step_seconds = time.perf_counter() - t0
        self.trained_upto = entries[-1].seq
        self.consistent = True
        self._in_step = []
        self.poison.passed(e.seq for e in entries)
        self.stores.keep_pixels(entries, images)
        self.metrics.observe_step(self.last_step_seconds, len(entries), lean, stats)
        self.publish()
        self.recorder.stepped(self, stats)
        self._checkpoint_if_due()
        self.schedule.export_if_due(self.learner, self.predictor)

    def _skip_behind(self) -> None:
        """Over the lag bound: the next chunk of samples behind it skips the step (`service.learning.lag_bound`)."""
        entries = self.lag.behind(self.store.after(self.trained_upto, self.lag.chunk))
        entries = self.poison.set_aside(entries)
        if not entries:
            return
        self._in_step = [e.seq for e in entries]
        self.consistent = False
        done = self.lag.skip(self.learner, entries, self.image_shape)
        self.stores.keep_pixels(entries)
        self.trained_upto = entries[-1].seq
        self.consistent = True
        self._in_step = []
        self.metrics.observe_skip(len(entries), done.thinned)
        self.publish(solve=False)  # behind the bound: the next step's publication solves the streaming head
        self._checkpoint_if_due()

    # --- sleep (learner.methods.sleep) ----------------------------------------------------
    def request_sleep(self, fresh: bool = False) -> None:
        """Sleep as soon as nothing is waiting, however little is new; `fresh`: the top trained again from its
        initial weights over everything held."""
        self._fresh_asked = self._fresh_asked or fresh
        self._sleep_asked.set()
        self.wakeup.set()

    def sleep_if_due(self) -> bool:
        """With ASER_SLEEP: a sleep when asked, or once nothing has been there to train for ASER_SLEEP_IDLE_S and
        ASER_SLEEP_MIN_NEW samples are new (or a sleep that yielded owes the rest); a fresh one after
        ASER_SLEEP_FRESH_IDLE_S once enough has arrived since the last fresh one (`Sleeper.night_needs`). It yields to
        the next sample acknowledged, a forgetting or a stop, between two of its steps. Returns whether it trained."""
        sleeper = self.learner.sleeper
        if sleeper is None or self.requests_waiting:
            return False
        s, asked = self.loop, self._sleep_asked.is_set()
        idle_s = time.monotonic() - self._busy_at
        night = (s.night_idle_s is not None and s.night_idle_s <= idle_s
                 and sleeper.new_since_fresh >= sleeper.night_needs(s.sleep_min_new, s.sleep_fresh_growth))
        due = sleeper.new_samples >= s.sleep_min_new or sleeper.owed or sleeper.fresh_asked
        if not asked and not (idle_s >= s.sleep_idle_s and due) and not night:
            return False
        self._sleep_asked.clear()
        fresh, self._fresh_asked = self._fresh_asked or night, False
        self.consistent = False  # a failure or a kill mid-sleep restarts from the last checkpoint
        self.metrics.sleeping.set(1)
        try:
            report = self.learner.sleep(should_yield=self._sleep_yields, fresh=fresh)
        finally:
            self.metrics.sleeping.set(0)
        self.consistent = True
        if not report.updates:
            return False
        self.metrics.observe_sleep(report)
        log.info("sleep: %d sample-updates in %.1f CPU s, held-back %s -> %s, %s", report.updates,
                 report.cpu_seconds, report.held_before, report.held_after,
                 "yielded" if report.yielded else "kept" if report.kept else "rolled back")
        self.publish()
        self.checkpoint()
        if report.kept and self.predictor.labels:  # the served model changed: replicas follow
            self.schedule.export(self.learner, self.predictor, "sleep")
        return True

    @property
    def requests_waiting(self) -> bool:
        """A forgetting or a correction waits: idle work and sleep give way to it."""
        return self.forgetting.waiting or self.corrections.waiting

    def _sleep_yields(self) -> bool:
        return self._stop.is_set() or self.requests_waiting or bool(self.store.after(self.trained_upto, 1))

    def rehearse_if_idle(self) -> bool:
        """While no batch is due: a replay-only step, within its share of the worker's time.
        Returns whether it rehearsed (or is pausing to keep to its share)."""
        s = self.loop
        if not s.idle_rehearsal or len(self.memory.class_ids) == 0 or self.requests_waiting:
            return False
        lr = self.learner
        if s.idle_rehearsal_per_step and lr.rehearsal_steps >= s.idle_rehearsal_per_step * lr.steps:
            return False  # the budget the stream has earned so far is spent
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
        return lr.steps + lr.rehearsal_steps + lr.samples_skipped // self.loop.batch_size

    def _checkpoint_if_due(self) -> None:
        if self.checkpointing.due(self.progress()):
            self.checkpoint()

    def lag_seconds(self) -> float:
        """The age of the oldest acknowledged sample the published model has not learned (0: none)."""
        return self.store.lag_seconds(self.trained_upto)

    def publish(self, refresh_head: bool = False, solve: bool = True) -> None:
        """What readers see of the learner, replaced whole (atomic swaps) between steps."""
        self.publisher.publish(self.learner, self.store.classes(), self.trained_upto, self.progress(), refresh_head,
                               solve)

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
        """Nothing to train: bring the served copy's corrections, and the choice of heads on held-back samples, up
        to the learner, so that an idle service answers with its latest weights as an evaluation in process does,
        not with those of up to ASER_SERVING_REFRESH_STEPS (corrections) or 50 (the choice) steps ago (a young
        service has had fewer steps than that). Returns whether it did."""
        if not self.publisher.correct_now(self.learner, self.progress()):
            return False
        self.publish()
        return True

    def checkpoint(self) -> bool:
        """Persist the lineage; a failure (disk full, say) is logged and retried later (`checkpointing`)."""
        saved = self.checkpointing.save(self.learner, self.trained_upto, {
            "online": self.online.state_dict(), "corrections_upto": self.corrections.applied_upto,
            "pixel_store_token": None if self.pixels is None else self.pixels.token}, self.progress())
        if saved:
            try:
                self.store.settle_corrections(self.corrections.applied_upto)
            except Exception:  # a full disk, say: the pixels go at the next checkpoint
                log.warning("the pixels of forgotten samples stay until the next checkpoint", exc_info=True)
        return saved

    # --- snapshots (service.learning.snapshot_schedule) -------------------------------------------
    def request_snapshot(self) -> Future:
        """Export the model as it is after the step in progress; the future gives the snapshot row."""
        answer = self.schedule.request()
        self.wakeup.set()
        return answer
