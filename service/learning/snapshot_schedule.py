"""When the learner's model is exported (`service.storage.snapshots` does the exporting): on request, every
ASER_SNAPSHOT_EVERY_STEPS steps, and as soon as the published model answers a class set no snapshot
has (so replicas follow new classes without waiting N steps), one scheduled export at a time. It
runs on the worker's thread, between two steps, so an export copies the weights of one step."""

from __future__ import annotations

import logging
import queue
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from learner.methods.base import ContinualLearner
from service.learning.serving import Predictor
from service.storage.errors import NoClassesYet
from service.storage.snapshots import SnapshotStore
from service.storage.store import IngestLog, images_from_blobs

log = logging.getLogger("aser.worker")

MIN_CALIBRATION_IMAGES = 16  # an int8 variant calibrates on half and is checked on the other half


@dataclass(frozen=True)
class SnapshotPlan:
    """The ASER_SNAPSHOT_* settings: exports every `every_steps` (0: on request and new classes only), each within
    `timeout_s`, the last `keep` kept; with `int8`, an int8 variant calibrated on `int8_images` recent images, kept
    where its top-1 agrees with the float model's on at least `int8_min_agreement` of them."""

    every_steps: int
    timeout_s: float
    keep: int
    int8: bool
    int8_images: int
    int8_min_agreement: float


class SnapshotSchedule:
    def __init__(self, snapshots: SnapshotStore, plan: SnapshotPlan, store: IngestLog,
                 image_shape: tuple[int, int, int]):
        self.snapshots, self.plan = snapshots, plan
        self.store, self.image_shape = store, image_shape
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.last_at = 0  # the learner's steps at the last export

    def request(self) -> Future:
        """An export of the model as it is after the step in progress; the future gives the snapshot row."""
        answer: Future = Future()
        self._requests.put(answer)
        return answer

    def serve_requests(self, learner: ContinualLearner, predictor: Predictor) -> None:
        while not self._requests.empty():
            answer = self._requests.get()
            if not predictor.labels:
                answer.set_exception(NoClassesYet("the model has not learned any class yet"))
                continue
            self.export(learner, predictor, "request").add_done_callback(lambda done, a=answer: _relay(done, a))

    def export_if_due(self, learner: ContinualLearner, predictor: Predictor) -> None:
        every = self.plan.every_steps
        if not every or self.snapshots.in_flight:
            return
        new_classes = predictor.labels != self.snapshots.latest_classes
        if new_classes or learner.steps - self.last_at >= every:
            self.export(learner, predictor, "new classes" if new_classes else "periodic")

    def export(self, learner: ContinualLearner, predictor: Predictor, reason: str) -> Future:
        """The published model (its classes and head) with the learner's network, copied now."""
        p = predictor
        self.last_at = learner.steps
        return self.snapshots.submit(learner, list(p.classes), p.version, p.steps, p.samples_trained, reason,
                                     (p.head_weight, p.head_bias), p.head_name,
                                     self._calibration_images(p.trained_upto),
                                     self.plan.int8_min_agreement,
                                     None if p.choice is None else (*p.stream_head, p.choice), p.calibration)

    def _calibration_images(self, trained_upto: int) -> np.ndarray | None:
        """With ASER_SNAPSHOT_INT8: recent images for the int8 variant's calibration and check (None:
        off, or too few yet)."""
        if not self.plan.int8:
            return None
        blobs = self.store.recent_pixels(trained_upto, self.plan.int8_images)
        if len(blobs) < MIN_CALIBRATION_IMAGES:
            log.info("no int8 variant yet: %d recent images, %d needed", len(blobs), MIN_CALIBRATION_IMAGES)
            return None
        return images_from_blobs(blobs, self.image_shape).numpy()


def _relay(done: Future, answer: Future) -> None:
    if done.exception() is not None:
        answer.set_exception(done.exception())
    else:
        answer.set_result(done.result())
