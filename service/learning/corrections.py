"""One sample corrected on request (a label found wrong, a sample to forget), and the memory's suspects, on the
worker's thread between two steps: the log first (durably, the correction recorded in the same transaction), then
the learner where it learned the old label (`ContinualLearner.correct_sample`: streaming LDA exactly, the memory's
slot, the held-back samples), a publication and a checkpoint, which records the last correction the learner holds.

On the worker's thread, "learned the old label" is exact: every sample up to `trained_upto` was read before the
correction was made, every later one is read after it, with the new label. A crash between the log and the next
checkpoint is harmless: a restart applies again what the log recorded after the restored checkpoint's last
correction, for the samples that checkpoint had learned (the others are learned again from the corrected log). A
forgotten sample's pixels wait in its correction's row until a checkpoint holds the correction, then go."""

from __future__ import annotations

import logging
import queue
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from learner.methods.corrections import Correction
from service.storage.errors import NotFound, ServiceError
from service.storage.store import LabelChange, SampleRecord, images_from_blobs, label_of

log = logging.getLogger("aser.worker")
RECENT_BATCH = 10  # recent samples valued together (candidates beside each other, as an ingest batch's are)
MAX_RECENT = 1000  # recent samples a request may value: their frozen pass pauses the learner (docs/api.md)


@dataclass(frozen=True)
class Corrected:
    """What a correction changed: the log always; the model where it had learned the sample (`model`)."""

    seq: int
    label: str | None  # None: forgotten
    previous: str | None
    learned: bool
    model: Correction


class CorrectionRequests:
    def __init__(self, worker, max_classes: int):
        self.worker = worker  # the LearnerWorker whose log and learner are corrected
        self.max_classes = max_classes
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self.applied_upto = 0  # the last correction the learner holds (saved with each checkpoint)

    def relabel(self, seq: int, label: str) -> Future:
        """The future gives the `Corrected` (NotFound: no such sample)."""
        return self._submit(("relabel", seq, label))

    def forget(self, seq: int) -> Future:
        return self._submit(("forget", seq, None))

    def suspects(self, limit: int, recent: int = 0) -> Future:
        """The memory's most suspected samples (`suspect_rows`), or with `recent` those among the latest `recent`
        learned samples whose pixels are kept (`recent_suspect_rows`), valued under the weights of the next pause."""
        return self._submit(("suspects", limit, recent))

    def _submit(self, request: tuple) -> Future:
        answer: Future = Future()
        self._pending.put((request, answer))
        self.worker.wakeup.set()
        return answer

    @property
    def waiting(self) -> bool:
        return not self._pending.empty()

    def apply_pending(self) -> None:
        """On the worker's thread, between two steps."""
        while not self._pending.empty():
            (kind, arg, extra), answer = self._pending.get()
            try:
                if kind == "suspects":
                    result = self.recent_suspect_rows(arg, extra) if extra else self.suspect_rows(arg)
                else:
                    result = self._correct(arg, extra)
            except ServiceError as exc:  # no such sample, too many classes, a full disk: nothing changed
                answer.set_exception(exc)
                continue
            except Exception as exc:
                answer.set_exception(exc)
                raise
            answer.set_result(result)

    def _correct(self, seq: int, label: str | None) -> Corrected | None:
        w = self.worker
        record = w.store.sample(seq)  # before the change: its pixels, whether it trained
        change = w.store.relabel(seq, label, self.max_classes) if label is not None else w.store.forget_sample(seq)
        if change is None:  # confirmed before, or forgotten before: nothing more to do
            return Corrected(seq, label, label, seq <= w.trained_upto, Correction())
        learned = seq <= w.trained_upto and not record.quarantined
        confirmed = change.new_class == change.old_class  # kept by the learner, learned or not yet
        if w.pixels is not None and not confirmed:  # on the file at once, as the log
            w.pixels.correct(seq, change.new_class)
        model = self._apply(change, record.pixels) if learned or confirmed else Correction()
        self.applied_upto = change.id
        w.publish(refresh_head=True)
        w.checkpoint()
        classes = w.store.classes()
        log.info("sample %d: %s -> %s (%s)", seq, label_of(classes, change.old_class),
                 "forgotten" if label is None else label, model)
        return Corrected(seq, label, label_of(classes, change.old_class), learned, model)

    def _apply(self, change: LabelChange, pixels: bytes | None) -> Correction:
        """The learner's part of a correction, for a sample it learned as `change.old_class` (the same class: a
        person confirmed it, and it is never a suspect again)."""
        lr = self.worker.learner
        if change.old_class in lr.forgotten or change.new_class in lr.forgotten:  # the class went since, and all of it
            return Correction()
        if change.new_class == change.old_class:
            return lr.correct_sample(change.seq, change.old_class, change.new_class)
        stored = None
        if pixels:
            stored = lr.encode(images_from_blobs([pixels], self.worker.image_shape).to(lr.device))
        return lr.correct_sample(change.seq, change.old_class, change.new_class, stored)

    def restored(self, applied_upto: int) -> None:
        """After a restore: apply the corrections recorded since the checkpoint's last to what it had learned."""
        w = self.worker
        self.applied_upto = applied_upto
        for change in w.store.corrections_after(applied_upto):
            if change.seq <= w.trained_upto or change.new_class == change.old_class:
                self._apply(change, self._pixels(change))
            self.applied_upto = change.id

    def _pixels(self, change: LabelChange) -> bytes | None:
        if change.new_class is None:
            return self.worker.store.forgotten_pixels(change.id)
        try:
            return self.worker.store.sample(change.seq).pixels
        except NotFound:  # removed by retention since
            return None

    def suspect_rows(self, limit: int) -> list[dict]:
        """The memory's samples most likely mislabelled (`ReplayLearner.suspects`), with the label each was given, the
        served answer and its probability, and its value (below zero: its label disagrees with its neighbours')."""
        lr, w = self.worker.learner, self.worker
        if getattr(lr, "buffer", None) is None or len(lr.buffer) == 0:
            return []
        slots, values = lr.suspects(limit)
        keys, labels = lr.buffer.keys[slots.cpu()].tolist(), lr.buffer.labels[slots].tolist()
        return suspect_listing(lr, w.store.classes(), lr.buffer.images[slots], values,
                               [key if key >= 0 else None for key in keys], slots.tolist(), labels)

    def recent_suspect_rows(self, limit: int, recent: int) -> list[dict]:
        """The latest `recent` learned samples whose pixels the log keeps, valued as `suspect_rows` values the
        memory's (`values_to_memory`: what each would be worth to the memory now), most suspected first: the wrong
        labels the memory never kept. Their frozen pass is the cost: a batch of RECENT_BATCH at a time."""
        lr, w = self.worker.learner, self.worker
        if getattr(lr, "buffer", None) is None or len(lr.buffer) < 2:
            return []
        entries = [e for e in w.store.recent(w.trained_upto, recent) if e.seq not in lr.confirmed]
        if not entries:
            return []
        stored = []

        def batches():
            for i in range(0, len(entries), RECENT_BATCH):
                part = entries[i:i + RECENT_BATCH]
                stored.append(lr.encode(images_from_blobs([e.image for e in part], w.image_shape).to(lr.device)))
                yield stored[-1], torch.tensor([e.class_id for e in part])

        values = lr.values_to_memory(batches())
        listed = torch.argsort(values, stable=True)[:limit]  # only those listed are answered
        picked = [entries[at] for at in listed.tolist()]
        return suspect_listing(lr, w.store.classes(), torch.cat(stored)[listed.to(lr.device)], values[listed],
                               [e.seq for e in picked], [lr.buffer.slot_of(e.seq) for e in picked],
                               [e.class_id for e in picked])


def suspect_listing(learner, classes: list[str | None], stored: torch.Tensor, values: torch.Tensor, seqs: list,
                    slots: list, given: list[int]) -> list[dict]:
    """The suspects' rows: each sample's seq and memory slot, the label it was given, the served answer and its
    probability, and its value."""
    confidence, answer = torch.softmax(learner.logits(stored), 1).cpu().max(1)  # calibrated: log-probabilities
    return [{"seq": seq, "slot": slot, "label": label_of(classes, c), "answer": label_of(classes, int(a)),
             "probability": round(float(p), 4), "value": round(float(v), 5)}
            for seq, slot, c, a, p, v in zip(seqs, slots, given, answer, confidence, values.tolist())]


def sample_state(record: SampleRecord, trained_upto: int) -> str:
    """Where a sample is: waiting to be learned, learned, set aside (quarantined) or forgotten."""
    if record.forgotten is not None or record.label is None:
        return "forgotten"
    if record.quarantined:
        return "quarantined"
    return "learned" if record.seq <= trained_upto else "waiting"

