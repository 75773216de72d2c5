"""Forgetting a class on request (a mislabelled class, a privacy request): durably first, in one
SQLite transaction (the ingest log's samples of the class, the checkpoint's memory rows, the class
marked forgotten), then in the live learner between two steps: its memory samples leave, its head
output is silenced; then, beside the worker (so that neither holds training), the snapshots holding it are deleted
once the exports in flight are done, and the history drops its label. A crash in between is harmless: a
restart applies what the log says was forgotten."""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from service.storage.store import Forgotten

log = logging.getLogger("aser.worker")


class ForgetRequests:
    def __init__(self, worker):
        self.worker = worker  # the LearnerWorker whose learner forgets
        self._pending: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, label: str) -> tuple[Forgotten, Future]:
        """Forget `label` durably now; the future is done when the live model has forgotten it too."""
        w = self.worker
        forgotten = w.store.forget(label, also=w.checkpoints.forget_rows)
        applied: Future = Future()
        self._pending.put((forgotten, applied))
        w.wakeup.set()
        return forgotten, applied

    @property
    def waiting(self) -> bool:
        return not self._pending.empty()

    def apply_pending(self) -> None:
        """On the worker's thread, between two steps."""
        w = self.worker
        while not self._pending.empty():
            forgotten, applied = self._pending.get()
            try:
                removed = w.learner.forget_class(forgotten.class_id)
                w.online.forget_class(forgotten.class_id)
                w.stores.forget_class(forgotten.class_id)
                w.publish(refresh_head=True)
                w.checkpoint()
                w.schedule.export_if_due(w.learner, w.predictor)
            except Exception as exc:  # durable already: a restart applies it from the log
                applied.set_exception(exc)
                raise
            threading.Thread(target=self._forget_beside, args=(forgotten.label, applied, removed),
                             name="forget-beside", daemon=True).start()

    def _forget_beside(self, label: str, applied: Future, removed: int) -> None:
        """Beside the worker: the snapshots that hold the class (after the exports in flight, which may take
        seconds: on the worker's thread that wait held training, and the lag bound with it) and the history."""
        w = self.worker
        try:
            w.snapshots.purge(w.store.forgotten())
        except Exception as exc:  # durable already: the next start purges them
            log.exception("removing the snapshots that hold %r failed", label)
            applied.set_exception(exc)
            return
        try:
            w.history.forget_label(label)
        except Exception:  # the history is what the dashboard draws; the forgetting itself is durable
            log.exception("removing %r from the history failed", label)
        applied.set_result(removed)
