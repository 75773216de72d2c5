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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from learner import make_learner
from learner.base import ContinualLearner
from learner.catch_up import CHUNK, CatchUp
from learner.model import scale_pixels
from learner.ncm import ncm_head

from .checkpoints import CheckpointStore, VersionLease
from .db import Database, is_disk_full
from .errors import NoClassesYet, StorageFull
from .metrics import Metrics
from .online import History, HistoryPoint, OnlineAccuracy
from .settings import Settings
from .snapshots import SnapshotStore
from .store import Forgotten, IngestLog, LogEntry, by_label, images_from_blobs

log = logging.getLogger("aser.worker")

SUSPECT_AFTER = 2  # failed steps a sample took part in before it is tried alone
SET_ASIDE_AFTER = 3  # ... before its batch is quarantined even though each sample passes alone


@dataclass(frozen=True)
class Predictor:
    """An immutable inference model and the progress it stands for."""

    features: object
    head_weight: torch.Tensor
    head_bias: torch.Tensor
    classes: tuple[str | None, ...]  # by class id; None: forgotten
    version: int
    steps: int
    samples_trained: int
    trained_upto: int
    samples_skipped: int = 0
    samples_thinned: int = 0
    rehearsal_steps: int = 0
    lean_steps: int = 0
    normalize: bool = False  # the head takes unit-norm features (the NCM head)

    @classmethod
    def from_learner(cls, learner: ContinualLearner, classes: list[str], trained_upto: int,
                     ncm: tuple[torch.Tensor, torch.Tensor] | None = None) -> "Predictor":
        """The serving weights' softmax head, or `ncm` (`learner.ncm.ncm_head`) on unit-norm features."""
        weight, bias = ncm if ncm is not None else (learner.serving_model.head.weight, learner.serving_model.head.bias)
        # classes ingested but not yet trained on have no head row yet; they are not answered
        n = min(len(classes), weight.shape[0])
        return cls(learner.inference_features(), weight.detach()[:n].clone(), bias.detach()[:n].clone(),
                   tuple(classes[:n]), learner.version, learner.steps, learner.samples_seen, trained_upto,
                   learner.samples_skipped, learner.samples_thinned, learner.rehearsal_steps, learner.lean_steps,
                   normalize=ncm is not None)

    @property
    def labels(self) -> tuple[str, ...]:
        """The classes it answers (learned, not forgotten)."""
        return tuple(c for c in self.classes if c is not None)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return self.probabilities(images)

    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities of uint8 images [n, 3, H, W], on the CPU whatever device the model is on."""
        with torch.inference_mode():
            features = self.features(scale_pixels(images.to(self.head_weight.device)))
            if self.normalize:
                features = torch.nn.functional.normalize(features, dim=1)
            logits = torch.nn.functional.linear(features, self.head_weight, self.head_bias)
            return torch.softmax(logits, dim=1).cpu()


@dataclass(frozen=True)
class MemoryView:
    """A copy of the replay memory as of one step: class id, stream position and pixels per slot."""

    class_ids: tuple[int, ...]
    entered: tuple[int, ...]  # samples trained when the slot was written
    images: torch.Tensor  # uint8 [size, 3, H, W]

    @classmethod
    def of(cls, learner: ContinualLearner) -> "MemoryView":
        buffer = getattr(learner, "buffer", None)
        if buffer is None:
            return cls((), (), torch.zeros(0, dtype=torch.uint8))
        n = buffer.size
        return cls(tuple(buffer.labels[:n].tolist()), tuple(buffer.entered[:n].tolist()),
                   buffer.images[:n].cpu().clone())

    def class_counts(self) -> dict[int, int]:
        return dict(sorted(Counter(self.class_ids).items()))


def resolve_device(name: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


class MemoryDerived:
    """When something derived from the memory (the NCM head, the served copy's corrections) is
    remade: every `every` steps of progress, and whenever the memory's classes change."""

    def __init__(self, every: int):
        self.every, self.at, self.classes = every, -(10**9), set()

    def due(self, progress: int, classes: set[int], force: bool = False) -> bool:
        return force or progress - self.at >= self.every or classes != self.classes

    def made(self, progress: int, classes: set[int]) -> None:
        self.at, self.classes = progress, classes


@dataclass(frozen=True)
class Published:
    """What readers see of the learner after one step: its predictor and its memory, together."""

    predictor: Predictor
    memory: MemoryView
    current: bool = True  # the served corrections are those of the learner's latest step


class LearnerWorker:
    def __init__(self, settings: Settings, db: Database, store: IngestLog, metrics: Metrics | None = None):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.store = store
        self.device = resolve_device(settings.device)
        self.image_shape = (3, settings.image_size, settings.image_size)
        self.checkpoints = CheckpointStore(db, settings.data_dir / "checkpoints")
        self.versions = VersionLease(db)
        self.catch_up = CatchUp(settings.max_lag_s, settings.catch_up_memory_share, settings.batch_size) if settings.max_lag_s else None
        self._follow_lineage()
        self.lean_when_behind = bool(settings.option("lean_when_behind"))  # of the method the lineage has
        self._over_lag_bound = False  # in a lag-bound episode (logged once when it begins and when it ends)
        self.published: Published | None = None  # what readers see; set by publish()
        self.snapshots = SnapshotStore(db, settings.data_dir / "snapshots", settings.method,
                                       settings.snapshot_timeout_s, settings.snapshot_keep)
        self.history = History(db, settings.history_max_points)
        self._snapshot_requests: queue.SimpleQueue = queue.SimpleQueue()
        self._forget_requests: queue.SimpleQueue = queue.SimpleQueue()
        self.restarts = 0
        self.last_error: str | None = None
        self.checkpoint_failures = 0
        self._failures: Counter[int] = Counter()  # seq -> failed steps it took part in
        self._in_step: list[int] = []
        self.last_step_seconds = 0.0
        self._replayed_since_point = [0, 0.0]  # replayed samples, of them of an incoming class
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

    def _follow_lineage(self) -> None:
        """Go on as the data directory's lineage was trained where the settings leave it open (an
        upgrade whose defaults differ), and check a restore against the result."""
        taken = self.settings.follow_lineage(self.checkpoints.saved_identity())
        if taken:
            log.warning("the data directory's lineage was trained with %s, which this configuration does not set: "
                        "going on with them (set them to choose otherwise; another lineage needs an empty data "
                        "directory)", " ".join(f"ASER_{k.upper()}={v}" for k, v in taken.items()))
        self.checkpoints.identity = self.settings.learner_identity()

    def _build_learner(self) -> ContinualLearner:
        s = self.settings
        return make_learner(s.method, num_classes=1, mem_size=s.mem_size, k=s.k, n_candidates=s.n_candidates,
                            per_class=s.per_class, replay_batch=s.replay_batch_on(self.device), lr=s.lr,
                            **s.replay_objective(), **s.stronger_learner(), device=self.device, seed=s.seed,
                            image_shape=self.image_shape, latent_dtype=torch.bfloat16 if s.latent_bf16 else None,
                            serving_bn=s.serving_bn, serving_bias=s.serving_bias)

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
        self._last_snapshot = learner.steps
        self.checkpointed = self._last_checkpoint_try = self.progress()
        self._rehearsal_next = 0.0  # monotonic time before which idle rehearsal pauses
        self._ncm, self._ncm_made = None, MemoryDerived(self.settings.ncm_refresh_steps)  # the NCM head
        self._served_made = MemoryDerived(self.settings.serving_refresh_steps)  # the served copy's corrections
        self.consistent = True
        self.publish()
        s = self.settings
        log.info("learner: %s (%s), M=%d, %s, device %s, data in %s, %s", s.method, learner.name, s.mem_size,
                 " ".join(f"{k}={v}" for k, v in {**s.replay_objective(), **s.stronger_learner()}.items()),
                 self.device, s.data_dir.resolve(),
                 f"resumed from a checkpoint at sample {self.trained_upto} ({learner.steps} steps)"
                 if self.trained_upto else "a new lineage")

    def _run(self) -> None:
        failures_in_a_row = 0
        try:
            while not self._stop.is_set():
                try:
                    self._serve_forget_requests()
                    self._serve_snapshot_requests()
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
        self._failures.update(self._in_step)
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
        entries = self._set_aside_poison(entries)
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
        for e in entries:
            self._failures.pop(e.seq, None)
        self.metrics.train_step.observe(self.last_step_seconds)
        self.metrics.samples_trained.inc(len(entries))
        self.metrics.lean_steps.inc(lean)
        replayed, incoming = stats.get("replayed", 0), float(stats.get("replayed_incoming", 0))
        self.metrics.samples_replayed.inc(replayed)
        self.metrics.replayed_incoming.inc(incoming)
        self._replayed_since_point[0] += replayed
        self._replayed_since_point[1] += incoming
        self.publish()
        if self.learner.steps % self.settings.history_every_steps == 0:
            self._record_history(stats.get("loss"))
        self._checkpoint_if_due()
        self._maybe_snapshot()

    def _skip_behind(self) -> None:
        """Over the lag bound: the samples older than half of it are skipped, a chunk at a time,
        each sample once; they reach the memory update while its share of time allows
        (`learner.catch_up`), so the memory keeps sampling the whole stream."""
        cutoff = self.catch_up.cutoff(time.time())
        entries = [e for e in self.store.after(self.trained_upto, CHUNK) if e.received < cutoff]
        entries = self._set_aside_poison(entries)
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
        if not s.idle_rehearsal or len(self.memory.class_ids) == 0 or self._forget_requests.qsize():
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

    def _record_history(self, loss) -> None:
        """One point of the time series; a failure to write it never stops training."""
        classes = self.predictor.classes
        replayed, incoming = self._replayed_since_point
        point = HistoryPoint(
            samples_trained=self.learner.samples_seen, steps=self.learner.steps, at=time.time(),
            accuracy=self.online.accuracy, window_accuracy=self.online.window_accuracy,
            new_class_samples=self.online.new_class_samples, loss=None if loss is None else float(loss),
            step_ms=round(1000 * self.last_step_seconds, 2), received=self.store.received(),
            backlog=self.store.pending(self.trained_upto), lag_s=round(self.lag_seconds(), 3),
            samples_skipped=self.learner.samples_skipped, samples_thinned=self.learner.samples_thinned,
            rehearsal_steps=self.learner.rehearsal_steps,
            per_class=by_label(classes, {c: right / n for c, (right, n) in self.online.per_class().items()}),
            memory=by_label(classes, self.memory.class_counts()),
            replayed_incoming_share=round(100 * incoming / replayed, 2) if replayed else None)
        self._replayed_since_point = [0, 0.0]
        try:
            self.history.add(point)
        except Exception:
            log.exception("writing a history point failed; training goes on")

    def _set_aside_poison(self, entries: list[LogEntry]) -> list[LogEntry]:
        """Quarantine the samples of this batch that make training fail every time."""
        worst = max(self._failures.get(e.seq, 0) for e in entries)
        if worst < SUSPECT_AFTER:
            return entries
        errors = {e.seq: err for e in entries if (err := self._fails_alone(e)) is not None}
        if not errors and worst >= SET_ASIDE_AFTER:
            errors = {e.seq: f"its batch failed {worst} times" for e in entries}
        for seq, error in errors.items():
            log.error("quarantining sample %d: %s", seq, error)
            self.store.quarantine(seq, error)
            self._failures.pop(seq, None)
        return [e for e in entries if e.seq not in errors]

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
        self._refresh_serving(refresh_head)
        self._refresh_ncm_head(refresh_head)
        try:
            self.versions.cover(self.learner.version)
        except StorageFull:  # the database logs the episode; learning and serving go on, reserved once space returns
            pass
        known = set(self.published.predictor.labels) if self.published is not None else None
        # one object, one swap: a reader never sees the model of one step beside the memory of another
        self.published = Published(Predictor.from_learner(self.learner, self.store.classes(), self.trained_upto,
                                                          self._ncm), MemoryView.of(self.learner),
                                   self._serving_current())
        if known is not None:
            for label in sorted(set(self.published.predictor.labels) - known):
                log.info("learner: new class %r (%d classes, step %d)", label, len(self.published.predictor.labels),
                         self.learner.steps)

    @property
    def predictor(self) -> "Predictor":
        return self.published.predictor

    @property
    def memory(self) -> "MemoryView":
        return self.published.memory

    def correct_serving_if_idle(self) -> bool:
        """Nothing to train: bring the served copy's corrections up to the learner, so that an idle
        service answers with its latest weights, not those of up to ASER_SERVING_REFRESH_STEPS steps
        ago (a young service has had fewer steps than that). Returns whether it did."""
        if self._serving_current():
            return False
        self._refresh_serving(force=True)
        self.learner.rename_weights()  # other answers from the same step: another model_version
        self.publish()
        return True

    def _corrects_serving(self) -> bool:
        return self.learner.serving_bn == "memory" or self.learner.serving_bias

    def _serving_current(self) -> bool:
        """Whether the served copy carries the corrections of the learner's latest step."""
        return not self._corrects_serving() or self._served_made.at == self.progress()

    def _refresh_serving(self, force: bool) -> None:
        """With ASER_SERVING_BN=memory or ASER_SERVING_BIAS: a copy of the served weights corrected
        on the memory (`ContinualLearner.refresh_serving`), every ASER_SERVING_REFRESH_STEPS steps
        and whenever the memory's classes change."""
        if not self._corrects_serving():
            return
        classes = self._memory_classes()
        if self._served_made.due(self.progress(), classes, force):
            self.learner.refresh_serving()
            self._served_made.made(self.progress(), classes)

    def _refresh_ncm_head(self, force: bool) -> None:
        """With ASER_HEAD=ncm: the class means, from a feature pass over the memory, every
        ASER_NCM_REFRESH_STEPS steps and whenever the memory's classes change (a new class is
        answered at once, a forgotten one never again)."""
        if self.settings.head != "ncm":
            return
        classes = self._memory_classes()
        if self._ncm_made.due(self.progress(), classes, force):
            self._ncm = ncm_head(self.learner)
            self._ncm_made.made(self.progress(), classes)

    def _memory_classes(self) -> set[int]:
        buffer = getattr(self.learner, "buffer", None)
        return set(buffer.class_counts()) if buffer is not None else set()

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

    # --- forgetting a class -------------------------------------------------------------
    def forget(self, label: str) -> tuple[Forgotten, Future]:
        """Forget a class: durably first (log, memory rows, in one transaction), then in the
        learner between two steps; the future is done when the live model has forgotten it."""
        forgotten = self.store.forget(label, also=self.checkpoints.forget_rows)
        applied: Future = Future()
        self._forget_requests.put((forgotten, applied))
        self.wakeup.set()
        return forgotten, applied

    def _serve_forget_requests(self) -> None:
        while not self._forget_requests.empty():
            forgotten, applied = self._forget_requests.get()
            try:
                removed = self.learner.forget_class(forgotten.class_id)
                self.online.forget_class(forgotten.class_id)
                self.publish(refresh_head=True)
                self.checkpoint()
                self.snapshots.purge(self.store.forgotten())
                self._maybe_snapshot()
            except Exception as exc:  # durable already: a restart applies it from the log
                applied.set_exception(exc)
                raise
            # beside the worker: rewriting a long history must not hold training (or the lag bound); the
            # request is answered once it is done
            threading.Thread(target=self._forget_in_history, args=(forgotten.label, applied, removed),
                             name="history-forget", daemon=True).start()

    def _forget_in_history(self, label: str, applied: Future, removed: int) -> None:
        try:
            self.history.forget_label(label)
        except Exception:  # the history is what the dashboard draws; the forgetting itself is durable
            log.exception("removing %r from the history failed", label)
        applied.set_result(removed)

    # --- snapshots ---------------------------------------------------------------------
    def request_snapshot(self) -> Future:
        """Export the model as it is after the step in progress; the future gives the snapshot row."""
        answer: Future = Future()
        self._snapshot_requests.put(answer)
        self.wakeup.set()
        return answer

    def _serve_snapshot_requests(self) -> None:
        while not self._snapshot_requests.empty():
            answer = self._snapshot_requests.get()
            if not self.predictor.labels:
                answer.set_exception(NoClassesYet("the model has not learned any class yet"))
                continue
            self._snapshot("request").add_done_callback(lambda done, answer=answer: _relay(done, answer))

    def _maybe_snapshot(self) -> None:
        """Export every N steps, and as soon as the model answers a class set no snapshot has
        (so replicas follow new classes without waiting N steps); one export at a time."""
        every = self.settings.snapshot_every_steps
        if not every or self.snapshots.in_flight:
            return
        new_classes = self.predictor.labels != self.snapshots.latest_classes
        if new_classes or self.learner.steps - self._last_snapshot >= every:
            self._snapshot("new classes" if new_classes else "periodic")

    def _snapshot(self, reason: str) -> Future:
        p = self.predictor  # the classes the published weights answer
        self._last_snapshot = self.learner.steps
        head = (p.head_weight, p.head_bias) if p.normalize else None  # the NCM head, as a layer of the graph
        return self.snapshots.submit(self.learner.serving_model, list(p.classes), p.version, p.steps, p.samples_trained,
                                     reason, head, self.settings.head)


def _relay(done: Future, answer: Future) -> None:
    if done.exception() is not None:
        answer.set_exception(done.exception())
    else:
        answer.set_result(done.result())
