"""One bad sample must not stop learning: a sample whose batch keeps failing is tried alone on a
scratch copy of the learner and, if it fails alone, set aside for good (quarantined: recorded in the
log, skipped from then on, reported by /status); a batch that keeps failing although each of its
samples passes alone is set aside whole."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

from .store import IngestLog, LogEntry

log = logging.getLogger("aser.worker")

SUSPECT_AFTER = 2  # failed steps a sample took part in before it is tried alone
SET_ASIDE_AFTER = 3  # ... before its batch is quarantined even though each sample passes alone


class PoisonGuard:
    def __init__(self, store: IngestLog):
        self.store = store
        self.failures: Counter[int] = Counter()  # seq -> failed steps it took part in

    def failed(self, seqs: Iterable[int]) -> None:
        """A step with these samples raised."""
        self.failures.update(seqs)

    def passed(self, seqs: Iterable[int]) -> None:
        for seq in seqs:
            self.failures.pop(seq, None)

    def set_aside(self, entries: list[LogEntry], fails_alone: Callable[[LogEntry], str | None]) -> list[LogEntry]:
        """The entries of a batch without those quarantined now; `fails_alone(entry)` is the error of
        a step on that sample alone (None: it passes)."""
        worst = max(self.failures.get(e.seq, 0) for e in entries)
        if worst < SUSPECT_AFTER:
            return entries
        errors = {e.seq: err for e in entries if (err := fails_alone(e)) is not None}
        if not errors and worst >= SET_ASIDE_AFTER:
            errors = {e.seq: f"its batch failed {worst} times" for e in entries}
        for seq, error in errors.items():
            log.error("quarantining sample %d: %s", seq, error)
            self.store.quarantine(seq, error)
            self.failures.pop(seq, None)
        return [e for e in entries if e.seq not in errors]
