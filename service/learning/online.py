"""Online (test-then-train, prequential) accuracy and its history.

Every labelled sample is scored by the model that is about to train on it, before the step, so
the stream itself is the test set. Samples of a class the head has never seen cannot be right;
they are counted apart (`new_class_samples`) and left out of the accuracies. Samples the model called "none of
these" (`learner.heads.calibration`) are counted apart too: of a known class a false alarm, of a new one a find.
Once a sleep's top answers (`Predictor.reads_top`), answering a batch as served costs a pass over the upper blocks, a
fifth of the ingest path: then one batch in `top_every` is scored and the others' samples are counted as unscored.
The figures are kept cumulatively, over a sliding window of the last N scored samples, and per class; their state
travels with the checkpoint (so a restart resumes them in step with the model), and a point
every few steps goes to the `history` table, which only ever grows forwards.

>>> acc = OnlineAccuracy(window=3)
>>> acc.score(predicted=[0, 1, 1, 0], labels=[0, 1, 0, 2], known=2)  # class 2 is new
>>> acc.accuracy, acc.window_accuracy, acc.new_class_samples
(0.6666666666666666, 0.6666666666666666, 1)
>>> acc.score(predicted=[0], labels=[1], known=2)
>>> acc.window_accuracy, acc.per_class()
(0.3333333333333333, {0: (1, 2), 1: (1, 2)})
>>> acc.score(predicted=[0, 1], labels=[0, 3], known=2, unknown=[True, True])
>>> acc.unknown_known, acc.unknown_new
(1, 1)
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from service.storage.db import Database
from service.storage.store import by_label

log = logging.getLogger("aser.worker")

SCHEMA = """
CREATE TABLE IF NOT EXISTS history (samples_trained INTEGER PRIMARY KEY, steps INTEGER NOT NULL, at REAL NOT NULL,
    accuracy REAL, window_accuracy REAL, new_class_samples INTEGER NOT NULL, loss REAL, step_ms REAL NOT NULL,
    received INTEGER NOT NULL, backlog INTEGER NOT NULL, per_class TEXT NOT NULL, memory TEXT NOT NULL,
    replayed_incoming_share REAL);
"""


class OnlineAccuracy:
    def __init__(self, window: int = 1000, top_every: int = 1):
        self.window = window
        self.top_every = top_every
        self.top_batches = 0  # batches offered while the top answers: the first of every `top_every` is scored
        self.unscored = 0  # samples of known classes in the batches left unscored
        self.recent: deque[bool] = deque(maxlen=window)
        self.correct = 0
        self.scored = 0
        self.new_class_samples = 0
        self.unknown_known = 0  # samples of a known class called "none of these" (false alarms)
        self.unknown_new = 0  # samples of a class never seen before called "none of these" (finds)
        self.class_correct: dict[int, int] = {}
        self.class_scored: dict[int, int] = {}

    def score(self, predicted: Sequence[int], labels: Sequence[int], known: int,
              unknown: Sequence[bool] | None = None) -> None:
        """Count one batch: `predicted` by the model before its step; `known` classes it can answer; `unknown`:
        which it called "none of these"."""
        for guess, label, far in zip(predicted, labels, unknown if unknown is not None else [False] * len(labels)):
            if label >= known:
                self.new_class_samples += 1
                self.unknown_new += bool(far)
                continue
            self.unknown_known += bool(far)
            hit = guess == label
            self.recent.append(hit)
            self.correct += hit
            self.scored += 1
            self.class_correct[label] = self.class_correct.get(label, 0) + hit
            self.class_scored[label] = self.class_scored.get(label, 0) + 1

    def score_batch(self, predictor, encoded, labels: Sequence[int]) -> None:
        """Test-then-train: `predictor` (a `service.learning.serving.Predictor`, the model about to step) answers
        the batch, as the learner encoded it for its step (`encode_incoming`), before it trains on it."""
        known = len(predictor.classes)
        if not known:
            self.score([-1] * len(labels), labels, known)
            return
        if predictor.reads_top:
            self.top_batches += 1
            if (self.top_batches - 1) % self.top_every:
                self.pass_over(labels, known)
                return
        probabilities, scores = predictor.answers_encoded(*encoded)
        calibration = predictor.calibration
        unknown = calibration.unknown(scores).tolist() if calibration is not None else None
        self.score(probabilities.argmax(1).tolist(), labels, known, unknown)

    def pass_over(self, labels: Sequence[int], known: int) -> None:
        """Count a batch left unscored: its new classes' samples as ever, the others as unscored."""
        new = sum(label >= known for label in labels)
        self.new_class_samples += new
        self.unscored += len(labels) - new

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.scored if self.scored else None

    @property
    def window_accuracy(self) -> float | None:
        return sum(self.recent) / len(self.recent) if self.recent else None

    def per_class(self) -> dict[int, tuple[int, int]]:
        """class id -> (correct, scored)."""
        return {c: (self.class_correct[c], n) for c, n in sorted(self.class_scored.items())}

    def forget_class(self, class_id: int) -> None:
        """Drop a forgotten class's per-class figures (the totals keep what was measured)."""
        self.class_correct.pop(class_id, None)
        self.class_scored.pop(class_id, None)

    # --- persistence with the checkpoint -----------------------------------------------
    def state_dict(self) -> dict:
        return {"window": self.window, "recent": list(self.recent), "correct": self.correct, "scored": self.scored,
                "new_class_samples": self.new_class_samples, "class_correct": dict(self.class_correct),
                "unknown_known": self.unknown_known, "unknown_new": self.unknown_new,
                "class_scored": dict(self.class_scored), "top_batches": self.top_batches, "unscored": self.unscored}

    @classmethod
    def from_state(cls, state: dict | None, window: int, top_every: int = 1) -> "OnlineAccuracy":
        acc = cls(window, top_every)
        if state:
            acc.top_batches, acc.unscored = state.get("top_batches", 0), state.get("unscored", 0)
            acc.recent.extend(state["recent"])
            acc.correct, acc.scored = state["correct"], state["scored"]
            acc.new_class_samples = state["new_class_samples"]
            acc.unknown_known, acc.unknown_new = state.get("unknown_known", 0), state.get("unknown_new", 0)
            acc.class_correct = {int(k): v for k, v in state["class_correct"].items()}
            acc.class_scored = {int(k): v for k, v in state["class_scored"].items()}
        return acc

    def summary(self, classes: Sequence[str]) -> dict:
        """The figures as /status shows them, classes by label."""
        return {"accuracy": self.accuracy, "window_accuracy": self.window_accuracy, "window": self.window,
                "samples_scored": self.scored, "samples_unscored": self.unscored,
                "new_class_samples": self.new_class_samples,
                "unknown": {"known_class_samples": self.unknown_known, "new_class_samples": self.unknown_new},
                "per_class": by_label(classes, {c: {"accuracy": right / n, "samples": n}
                                                for c, (right, n) in self.per_class().items()})}


class HistoryPoint(BaseModel):
    """One point of the series (also the `GET /history` item)."""

    model_config = ConfigDict(frozen=True)

    samples_trained: int
    steps: int
    at: float = Field(description="Unix time")
    accuracy: float | None
    window_accuracy: float | None
    new_class_samples: int
    loss: float | None
    step_ms: float
    received: int
    backlog: int
    per_class: dict[str, float] = Field(description="cumulative online accuracy per class")
    memory: dict[str, int] = Field(description="replay memory: samples per class")
    lag_s: float | None = Field(None, description="age of the oldest sample not yet learned, at this point")
    samples_skipped: int | None = Field(None, description="samples skipped so far (over ASER_MAX_LAG_S)")
    samples_thinned: int | None = Field(None, description="of them, those that did not reach the memory update")
    rehearsal_steps: int | None = Field(None, description="idle rehearsal steps so far")
    replayed_incoming_share: float | None = Field(
        None, description="% of the samples replayed since the previous point whose class was in the incoming batch "
                          "(none replayed: null); under ASER_LOSS=ace a share near 0 means new classes never meet the old ones")


class History:
    """The time series in SQLite. A point never goes behind the last one stored: after a restart
    from an older checkpoint the steps trained again add no point until they pass it.

    Bounded for months: once it holds more than `max_points`, every second point of its older half
    is dropped (the recent half keeps every point, older stretches thin out geometrically), so a
    year of points costs what 20,000 do and the dashboard's series still spans it all."""

    FORGET_BATCH = 500  # points rewritten per write transaction when a class is forgotten

    def __init__(self, db: Database, max_points: int = 20_000):
        self.db, self.max_points = db, max_points
        with db.schema() as schema:
            schema.executescript(SCHEMA)
            columns = schema["history"].columns_dict  # databases of earlier versions lack the later ones
            for name, kind in (("replayed_incoming_share", float), ("lag_s", float), ("samples_skipped", int),
                               ("samples_thinned", int), ("rehearsal_steps", int)):
                if name not in columns:
                    schema["history"].add_column(name, kind)

    def add(self, point: HistoryPoint) -> bool:
        with self.db.write() as conn:
            last = conn.execute("SELECT MAX(samples_trained) FROM history").fetchone()[0]
            if last is not None and point.samples_trained <= last:
                return False
            row = {**point.model_dump(), "per_class": json.dumps(point.per_class), "memory": json.dumps(point.memory)}
            conn.execute(f"INSERT INTO history ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                         list(row.values()))
            if conn.execute("SELECT COUNT(*) FROM history").fetchone()[0] > self.max_points:
                self._thin(conn)
        return True

    def _thin(self, conn) -> None:
        older = [r[0] for r in conn.execute("SELECT samples_trained FROM history ORDER BY samples_trained LIMIT ?",
                                            (self.max_points // 2,))]
        conn.executemany("DELETE FROM history WHERE samples_trained = ?", [(k,) for k in older[1::2]])

    def since(self, samples_trained: int, limit: int) -> list[HistoryPoint]:
        """Points after `samples_trained`, oldest first, at most `limit`."""
        with self.db.read() as conn:
            rows = conn.execute("SELECT * FROM history WHERE samples_trained > ? ORDER BY samples_trained LIMIT ?",
                                (samples_trained, limit)).fetchall()
        return [HistoryPoint(**{**dict(r), "per_class": json.loads(r["per_class"]), "memory": json.loads(r["memory"])})
                for r in rows]

    def forget_label(self, label: str) -> None:
        """Remove a forgotten class's label from every stored point: the points are found in a read
        transaction and rewritten FORGET_BATCH at a time, so ingest never waits on more than one batch."""
        key = f"%{json.dumps(label)}%"
        with self.db.read() as conn:
            rows = conn.execute("SELECT samples_trained, per_class, memory FROM history WHERE per_class LIKE ? "
                                "OR memory LIKE ?", (key, key)).fetchall()
        changed = []
        for r in rows:
            per_class, memory = json.loads(r["per_class"]), json.loads(r["memory"])
            if label in per_class or label in memory:
                per_class.pop(label, None)
                memory.pop(label, None)
                changed.append((json.dumps(per_class), json.dumps(memory), r["samples_trained"]))
        for i in range(0, len(changed), self.FORGET_BATCH):
            with self.db.write() as conn:
                conn.executemany("UPDATE history SET per_class = ?, memory = ? WHERE samples_trained = ?",
                                 changed[i:i + self.FORGET_BATCH])


class HistoryRecorder:
    """A point of the history every ASER_HISTORY_EVERY_STEPS steps, from what the worker knows then;
    the replayed samples (and the share of them of an incoming class) add up between two points. A
    failure to write a point never stops training."""

    def __init__(self, history: History, every_steps: int):
        self.history, self.every_steps = history, every_steps
        self._replayed = [0, 0.0]  # replayed samples since the last point, of them of an incoming class

    def stepped(self, worker, stats: dict) -> None:
        """After a training step of `worker` (a `LearnerWorker`) with these step statistics."""
        self._replayed[0] += stats.get("replayed", 0)
        self._replayed[1] += float(stats.get("replayed_incoming", 0))
        if worker.learner.steps % self.every_steps == 0:
            self.record(worker, stats.get("loss"))

    def record(self, worker, loss) -> None:
        learner, online, store, classes = worker.learner, worker.online, worker.store, worker.predictor.classes
        replayed, incoming = self._replayed
        point = HistoryPoint(
            samples_trained=learner.samples_seen, steps=learner.steps, at=time.time(),
            accuracy=online.accuracy, window_accuracy=online.window_accuracy,
            new_class_samples=online.new_class_samples, loss=None if loss is None else float(loss),
            step_ms=round(1000 * worker.last_step_seconds, 2), received=store.received(),
            backlog=store.pending(worker.trained_upto), lag_s=round(worker.lag_seconds(), 3),
            samples_skipped=learner.samples_skipped, samples_thinned=learner.samples_thinned,
            rehearsal_steps=learner.rehearsal_steps,
            per_class=by_label(classes, {c: right / n for c, (right, n) in online.per_class().items()}),
            memory=by_label(classes, worker.memory.class_counts()),
            replayed_incoming_share=round(100 * incoming / replayed, 2) if replayed else None)
        self._replayed = [0, 0.0]
        try:
            self.history.add(point)
        except Exception:
            log.exception("writing a history point failed; training goes on")
