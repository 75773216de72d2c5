"""One bad sample must not stop learning: a sample whose batch keeps failing is tried alone on a
scratch copy of the learner and, if it fails alone, set aside for good (quarantined: recorded in the
log, skipped from then on, reported by /status); a batch that keeps failing although each of its
samples passes alone is set aside whole."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

import torch

from learner.methods.base import ContinualLearner
from service.storage.store import IngestLog, LogEntry, images_from_blobs

log = logging.getLogger("aser.worker")

SUSPECT_AFTER = 2  # failed steps a sample took part in before it is tried alone
SET_ASIDE_AFTER = 3  # ... before its batch is quarantined even though each sample passes alone


def fails_alone(scratch: ContinualLearner, learner: ContinualLearner, entry: LogEntry,
                image_shape: tuple[int, int, int]) -> str | None:
    """Train `scratch`, made a copy of `learner`, on this one sample; the error, if it fails."""
    scratch.load_state_dict(learner.state_dict())
    try:
        scratch.observe(images_from_blobs([entry.image], image_shape), torch.tensor([entry.class_id]))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


class PoisonGuard:
    """`fails_alone(entry)`: the error of a step on that sample alone (None: it passes)."""

    def __init__(self, store: IngestLog, fails_alone: Callable[[LogEntry], str | None]):
        self.store = store
        self.fails_alone = fails_alone
        self.failures: Counter[int] = Counter()  # seq -> failed steps it took part in

    def failed(self, seqs: Iterable[int]) -> None:
        """A step with these samples raised."""
        self.failures.update(seqs)

    def passed(self, seqs: Iterable[int]) -> None:
        for seq in seqs:
            self.failures.pop(seq, None)

    def set_aside(self, entries: list[LogEntry]) -> list[LogEntry]:
        """The entries of a batch without those quarantined now."""
        worst = max(self.failures.get(e.seq, 0) for e in entries)
        if worst < SUSPECT_AFTER:
            return entries
        errors = {e.seq: err for e in entries if (err := self.fails_alone(e)) is not None}
        if not errors and worst >= SET_ASIDE_AFTER:
            errors = {e.seq: f"its batch failed {worst} times" for e in entries}
        for seq, error in errors.items():
            log.error("quarantining sample %d: %s", seq, error)
            self.store.quarantine(seq, error)
            self.failures.pop(seq, None)
        return [e for e in entries if e.seq not in errors]
