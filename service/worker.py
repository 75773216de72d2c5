"""The learner worker: one thread that drains the ingest log in arrival order, in mini-batches,
each sample once, and publishes a read-only copy of the weights for predictions after every
step (predictions never wait for training and never see a half-updated model).

It starts from the last committed checkpoint and trains on every acknowledged sample after
that checkpoint's `trained_upto`; work after the last checkpoint is simply redone, so every
sample is in the persisted lineage exactly once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from learner import make_learner
from learner.base import ContinualLearner
from learner.model import scale_pixels

from .checkpoints import CheckpointStore
from .metrics import Metrics
from .settings import Settings
from .snapshots import SnapshotStore
from .store import IngestLog

log = logging.getLogger("aser.worker")


@dataclass(frozen=True)
class Predictor:
    """An immutable inference model: folded f_ext, head weights, class names, version."""

    features: object
    head_weight: torch.Tensor
    head_bias: torch.Tensor
    classes: tuple[str, ...]
    version: int
    steps: int

    @classmethod
    def from_learner(cls, learner: ContinualLearner, classes: list[str]) -> "Predictor":
        head = learner.model.head
        # classes ingested but not yet trained on have no head row yet; they are not answered
        n = min(len(classes), head.out_features)
        return cls(learner.inference_features(), head.weight.detach()[:n].clone(), head.bias.detach()[:n].clone(),
                   tuple(classes[:n]), learner.version, learner.steps)

    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            logits = torch.nn.functional.linear(self.features(scale_pixels(images)), self.head_weight, self.head_bias)
            return torch.softmax(logits, dim=1)


class LearnerWorker:
    def __init__(self, settings: Settings, log_store: IngestLog, metrics: Metrics | None = None):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.store = log_store.reader()
        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.learner = make_learner(settings.method, num_classes=1, mem_size=settings.mem_size,
                                    k=settings.k, n_candidates=settings.n_candidates, per_class=settings.per_class,
                                    replay_batch=settings.replay_batch, lr=settings.lr, device=device,
                                    seed=settings.seed, image_shape=(3, settings.image_size, settings.image_size),
                                    latent_dtype=torch.bfloat16 if settings.latent_bf16 else None)
        self.checkpoints = CheckpointStore(log_store, settings.data_dir / "checkpoints")
        self.snapshots = SnapshotStore(log_store, settings.data_dir / "snapshots", settings.method)
        self._snapshot_requests: queue.SimpleQueue = queue.SimpleQueue()
        self.trained_upto = self.checkpoints.restore(self.learner)  # the last sequence number the model has seen
        self.checkpointed_steps = self.learner.steps
        self.last_step_seconds = 0.0
        self.wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="learner-worker", daemon=True)
        self.publish()
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the step in progress, then checkpoint (a clean shutdown redoes nothing)."""
        self._stop.set()
        self.wakeup.set()
        self._thread.join(timeout)
        if not self._thread.is_alive() and self.learner.steps != self.checkpointed_steps:
            self.checkpoint()
        self.snapshots.close()

    @property
    def trained(self) -> int:
        """Samples in the model's lineage (trained on, since the first one)."""
        return self.learner.samples_seen

    def checkpoint(self) -> None:
        self.checkpoints.save(self.learner, self.trained_upto)
        self.checkpointed_steps = self.learner.steps

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._serve_snapshot_requests()
                if not self.train_available():
                    self.wakeup.wait(timeout=min(0.5, self.settings.max_batch_wait_s or 0.5))
                    self.wakeup.clear()
        except BaseException as exc:  # surfaced through /readyz and /status
            log.exception("learner worker stopped")
            self.error = exc

    def request_snapshot(self) -> Future:
        """Export the model as it is after the step in progress; the future gives the snapshot row."""
        answer: Future = Future()
        self._snapshot_requests.put(answer)
        self.wakeup.set()
        return answer

    def _serve_snapshot_requests(self) -> None:
        while not self._snapshot_requests.empty():
            answer = self._snapshot_requests.get()
            if not self.predictor.classes:
                answer.set_exception(LookupError("the model has not learned any class yet"))
                continue
            self._snapshot("request").add_done_callback(lambda done, answer=answer: _relay(done, answer))

    def _snapshot(self, reason: str) -> Future:
        p = self.predictor  # the classes the published weights answer
        return self.snapshots.submit(self.learner.model, list(p.classes), p.version, p.steps, self.trained, reason)

    def publish(self) -> None:
        """What readers see of the learner, replaced whole (atomic swaps) between steps."""
        self.predictor = Predictor.from_learner(self.learner, self.store.classes())
        buffer = getattr(self.learner, "buffer", None)
        self.buffer_counts: dict[int, int] = buffer.class_counts() if buffer is not None else {}

    def train_available(self) -> bool:
        """Train on the next mini-batch if one is due; returns whether a step was taken."""
        b = self.settings.batch_size
        seqs, images, labels, received = self.store.after(self.trained_upto, b)
        if not seqs:
            return False
        if len(seqs) < b and time.time() - received[0] < self.settings.max_batch_wait_s:
            return False  # wait for a full batch a little longer
        t0 = time.perf_counter()
        self.learner.observe(images, labels)
        self.last_step_seconds = time.perf_counter() - t0
        self.trained_upto = seqs[-1]
        self.metrics.train_step.observe(self.last_step_seconds)
        self.metrics.samples_trained.inc(len(seqs))
        self.publish()
        if self.learner.steps - self.checkpointed_steps >= self.settings.checkpoint_every_steps:
            self.checkpoint()
        every = self.settings.snapshot_every_steps
        if every and self.learner.steps % every == 0:
            self._snapshot("periodic")
        return True


def _relay(done: Future, answer: Future) -> None:
    if done.exception() is not None:
        answer.set_exception(done.exception())
    else:
        answer.set_result(done.result())
