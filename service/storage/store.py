"""The ingest log: every acknowledged sample, durably, in arrival order.

A sample's sequence number is its stream position. Class ids are given to labels in the order
they are first seen, in the same transaction as the sample, so the mapping is as durable as
the samples themselves. A sample may carry a client-chosen id: a repeated id is not stored
again, it is answered with the sequence number it got the first time (exactly-once ingest
across client retries), provided it comes with the same label and the same pixels.

A sample's label may be corrected later, or the sample forgotten (`relabel`, `forget_sample`): each change is
recorded, in order, in the same transaction (`corrections`), for the worker to apply to a model that learned the
old label. A forgotten sample keeps its row without pixels, so that a client's retry of its ingest is answered as
a duplicate instead of storing it again, and training never reads it.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from service.storage.db import Database
from service.storage.errors import NotFound, SampleIdConflict, TooManyClasses

V = TypeVar("V")


@dataclass(frozen=True)
class NewSample:
    label: str
    pixels: bytes  # raw uint8 [3, H, W], as decoded and validated
    sample_id: str | None = None


@dataclass(frozen=True)
class Stored:
    seq: int
    duplicate: bool  # the id was already stored: nothing was written


@dataclass(frozen=True)
class LogEntry:
    seq: int
    class_id: int
    image: bytes
    received: float


@dataclass(frozen=True)
class SampleRecord:
    seq: int
    class_id: int
    label: str | None  # None: its class was forgotten
    received: float
    sample_id: str | None
    pixels: bytes | None  # None once retention has dropped them, or the sample was forgotten
    quarantined: bool
    forgotten: float | None  # when the sample was forgotten on request


@dataclass(frozen=True)
class LabelChange:
    """One correction of the log, in the order made (`id`): a sample learned as `old_class` is now `new_class`,
    or forgotten (None)."""

    id: int
    seq: int
    old_class: int
    new_class: int | None
    at: float


@dataclass(frozen=True)
class Forgotten:
    class_id: int
    label: str
    at: float  # when it was forgotten
    samples_removed: int = 0


SCHEMA = """
CREATE TABLE IF NOT EXISTS classes (id INTEGER PRIMARY KEY, name TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS samples (seq INTEGER PRIMARY KEY AUTOINCREMENT,
    class_id INTEGER NOT NULL REFERENCES classes(id), image BLOB NOT NULL, received REAL NOT NULL);
CREATE TABLE IF NOT EXISTS quarantine (seq INTEGER PRIMARY KEY, error TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS corrections (id INTEGER PRIMARY KEY AUTOINCREMENT, seq INTEGER NOT NULL,
    old_class INTEGER NOT NULL, new_class INTEGER, at REAL NOT NULL, image BLOB);
"""
# what training reads: neither quarantined nor forgotten
TRAINABLE = "seq NOT IN (SELECT seq FROM quarantine) AND deleted IS NULL"


class IngestLog:
    def __init__(self, db: Database, image_shape: tuple[int, int, int]):
        self.db = db
        self.image_shape = tuple(image_shape)
        with db.schema() as schema:
            schema.executescript(SCHEMA)
            if "sample_id" not in schema["samples"].columns_dict:  # databases of earlier versions
                schema["samples"].add_column("sample_id", str)
            schema["samples"].create_index(["sample_id"], unique=True, if_not_exists=True)
            if "deleted" not in schema["samples"].columns_dict:
                schema["samples"].add_column("deleted", float)  # when one sample was forgotten on request
            if "forgotten" not in schema["classes"].columns_dict:
                schema["classes"].add_column("forgotten", float)  # when a class was forgotten on request
            # a forgotten label may come back as a new class: only live labels are unique
            schema.execute("DROP INDEX IF EXISTS idx_classes_name")
            schema.execute("CREATE UNIQUE INDEX IF NOT EXISTS idx_classes_live_name ON classes (name) "
                           "WHERE forgotten IS NULL")

    def append(self, samples: list[NewSample], max_classes: int) -> list[Stored]:
        """Commit samples (all or none); returns each one's sequence number once durable."""
        now = time.time()
        with self.db.write() as conn:
            stored: list[Stored | None] = [None] * len(samples)
            first = list(range(len(samples)))  # index of the first sample with the same id
            by_id: dict[str, int] = {}
            for i, s in enumerate(samples):
                if s.sample_id is None:
                    continue
                first[i] = by_id.setdefault(s.sample_id, i)
                if first[i] != i:
                    _same_or_conflict(samples[first[i]], s)
                else:
                    stored[i] = _already_stored(conn, s)
            new = [s for i, s in enumerate(samples) if stored[i] is None and first[i] == i]
            class_ids = _class_ids(conn, list(dict.fromkeys(s.label for s in new)), max_classes)
            for i, s in enumerate(samples):
                if first[i] != i:  # the same id earlier in this request
                    stored[i] = Stored(stored[first[i]].seq, duplicate=True)
                elif stored[i] is None:
                    seq = conn.execute("INSERT INTO samples (class_id, image, received, sample_id) "
                                       "VALUES (?, ?, ?, ?)", (class_ids[s.label], s.pixels, now, s.sample_id)).lastrowid
                    stored[i] = Stored(seq, duplicate=False)
        return stored

    def classes(self) -> list[str | None]:
        """The label of each class id (None for a forgotten class)."""
        with self.db.read() as conn:
            return [r["name"] if r["forgotten"] is None else None
                    for r in conn.execute("SELECT name, forgotten FROM classes ORDER BY id")]

    def forget(self, label: str, also: Callable[[sqlite3.Connection, int], None] | None = None) -> Forgotten:
        """Forget a class in one transaction: every sample of it leaves the log (trained or not),
        the class is marked forgotten (its label is free again), and `also(conn, class_id)` removes
        it from other tables in the same transaction. Raises NotFound for a label with no class."""
        with self.db.write() as conn:
            row = conn.execute("SELECT id FROM classes WHERE name = ? AND forgotten IS NULL", (label,)).fetchone()
            if row is None:
                raise NotFound(f"no class {label!r}")
            at = time.time()
            removed = conn.execute("DELETE FROM samples WHERE class_id = ?", (row["id"],)).rowcount
            conn.execute("DELETE FROM quarantine WHERE seq NOT IN (SELECT seq FROM samples)")
            conn.execute("UPDATE classes SET forgotten = ? WHERE id = ?", (at, row["id"]))
            if also is not None:
                also(conn, row["id"])
        return Forgotten(row["id"], label, at, removed)

    def forgotten(self) -> list[Forgotten]:
        with self.db.read() as conn:
            rows = conn.execute("SELECT id, name, forgotten FROM classes WHERE forgotten IS NOT NULL ORDER BY id")
            return [Forgotten(r["id"], r["name"], r["forgotten"]) for r in rows]

    def after(self, seq: int, limit: int) -> list[LogEntry]:
        """Up to `limit` samples with sequence number > seq, in order, without quarantined ones or those whose pixels
        retention dropped (only trained ones: a lineage started again after its checkpoint was lost)."""
        with self.db.read() as conn:
            rows = conn.execute(f"SELECT seq, class_id, image, received FROM samples WHERE seq > ? AND {TRAINABLE} "
                                "AND length(image) > 0 ORDER BY seq LIMIT ?", (seq, limit)).fetchall()
        return [LogEntry(r["seq"], r["class_id"], r["image"], r["received"]) for r in rows]

    def recent(self, upto: int, n: int) -> list[LogEntry]:
        """Up to `n` of the latest samples up to `upto` that still have their pixels (retention drops old
        ones), oldest first, without quarantined or forgotten ones."""
        with self.db.read() as conn:
            rows = conn.execute(f"SELECT seq, class_id, image, received FROM samples WHERE seq <= ? "
                                f"AND length(image) > 0 AND {TRAINABLE} ORDER BY seq DESC LIMIT ?",
                                (upto, n)).fetchall()
        return [LogEntry(r["seq"], r["class_id"], r["image"], r["received"]) for r in reversed(rows)]

    def recent_pixels(self, upto: int, n: int) -> list[bytes]:
        return [entry.image for entry in self.recent(upto, n)]

    def received(self) -> int:
        """Samples acknowledged since the log began: the last sequence number given."""
        with self.db.read() as conn:
            row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'samples'").fetchone()
        return row["seq"] if row else 0

    def pending(self, trained_upto: int) -> int:
        """Samples after `trained_upto` still to train on (the backlog)."""
        with self.db.read() as conn:
            return conn.execute(f"SELECT COUNT(*) FROM samples WHERE seq > ? AND {TRAINABLE}",
                                (trained_upto,)).fetchone()[0]

    def oldest_pending(self, trained_upto: int) -> float | None:
        """When the oldest sample after `trained_upto` arrived (None: nothing is waiting)."""
        with self.db.read() as conn:
            return conn.execute(f"SELECT MIN(received) FROM samples WHERE seq > ? AND {TRAINABLE}",
                                (trained_upto,)).fetchone()[0]

    def lag_seconds(self, trained_upto: int) -> float:
        """The age of the oldest sample after `trained_upto` (0: nothing is waiting)."""
        oldest = self.oldest_pending(trained_upto)
        return 0.0 if oldest is None else max(0.0, time.time() - oldest)

    # --- one sample: read, relabel, forget --------------------------------------------------
    def sample(self, seq: int) -> SampleRecord:
        """The sample with this sequence number; NotFound if the log holds none (never sent, or removed by
        retention after its id horizon)."""
        with self.db.read() as conn:
            r = conn.execute("SELECT s.seq, s.class_id, s.image, s.received, s.sample_id, s.deleted, c.name, "
                             "c.forgotten, q.seq IS NOT NULL AS quarantined FROM samples s JOIN classes c ON "
                             "c.id = s.class_id LEFT JOIN quarantine q ON q.seq = s.seq WHERE s.seq = ?",
                             (seq,)).fetchone()
        if r is None:
            raise NotFound(f"no sample {seq}")
        return SampleRecord(r["seq"], r["class_id"], r["name"] if r["forgotten"] is None else None, r["received"],
                            r["sample_id"], r["image"] or None, bool(r["quarantined"]), r["deleted"])

    def relabel(self, seq: int, label: str, max_classes: int) -> LabelChange | None:
        """Give a sample another label (a new one makes a class), recorded as a correction in the same
        transaction. The label it has: a confirmation, recorded once (None after). NotFound for a sample absent or
        forgotten."""
        with self.db.write() as conn:
            old = _live_sample(conn, seq)
            new = _class_ids(conn, [label], max_classes)[label]
            if new == old and conn.execute("SELECT 1 FROM corrections WHERE seq = ? AND new_class = old_class",
                                           (seq,)).fetchone() is not None:
                return None
            conn.execute("UPDATE samples SET class_id = ? WHERE seq = ?", (new, seq))
            return _record_change(conn, seq, old, new)

    def forget_sample(self, seq: int) -> LabelChange | None:
        """Forget one sample: its pixels leave the log, training never reads it again and its id keeps answering a
        retry as a duplicate; recorded as a correction. None if it was forgotten already; NotFound for a sample
        absent or of a forgotten class."""
        with self.db.write() as conn:
            row = conn.execute("SELECT deleted FROM samples WHERE seq = ?", (seq,)).fetchone()
            if row is not None and row["deleted"] is not None:
                return None  # forgotten already: asked again, the same answer
            old = _live_sample(conn, seq)
            change = _record_change(conn, seq, old, None)
            # the pixels wait in the correction until a checkpoint holds it (`settle_corrections`)
            conn.execute("UPDATE corrections SET image = (SELECT image FROM samples WHERE seq = ?) WHERE id = ?",
                         (seq, change.id))
            conn.execute("UPDATE samples SET image = X'', deleted = ? WHERE seq = ?", (change.at, seq))
            conn.execute("DELETE FROM quarantine WHERE seq = ?", (seq,))
            return change

    def corrections_after(self, change_id: int) -> list[LabelChange]:
        """The corrections recorded after `change_id`, in order."""
        with self.db.read() as conn:
            rows = conn.execute("SELECT id, seq, old_class, new_class, at FROM corrections WHERE id > ? ORDER BY id",
                                (change_id,)).fetchall()
        return [LabelChange(r["id"], r["seq"], r["old_class"], r["new_class"], r["at"]) for r in rows]

    def forgotten_pixels(self, change_id: int) -> bytes | None:
        """A forgotten sample's pixels, while no checkpoint holds its correction yet (None after)."""
        with self.db.read() as conn:
            row = conn.execute("SELECT image FROM corrections WHERE id = ?", (change_id,)).fetchone()
        return row["image"] if row is not None and row["image"] else None

    def settle_corrections(self, upto: int) -> None:
        """A checkpoint holds the corrections up to `upto`: the pixels of the samples they forgot go."""
        with self.db.write() as conn:
            conn.execute("UPDATE corrections SET image = NULL WHERE id <= ? AND image IS NOT NULL", (upto,))

    def quarantine(self, seq: int, error: str) -> None:
        """Set a sample aside for good: training on it fails every time."""
        with self.db.write() as conn:
            conn.execute("INSERT OR REPLACE INTO quarantine (seq, error, at) VALUES (?, ?, ?)", (seq, error, time.time()))

    def quarantined(self, limit: int = 20) -> tuple[int, list[dict]]:
        """How many samples are quarantined, and the latest `limit` of them."""
        with self.db.read() as conn:
            n = conn.execute("SELECT COUNT(*) FROM quarantine").fetchone()[0]
            rows = conn.execute("SELECT seq, error, at FROM quarantine ORDER BY seq DESC LIMIT ?", (limit,))
            return n, [dict(r) for r in rows]


def _live_sample(conn: sqlite3.Connection, seq: int) -> int:
    """The class id of a sample neither forgotten nor of a forgotten class; NotFound otherwise."""
    row = conn.execute("SELECT s.class_id FROM samples s JOIN classes c ON c.id = s.class_id WHERE s.seq = ? AND "
                       "s.deleted IS NULL AND c.forgotten IS NULL", (seq,)).fetchone()
    if row is None:
        raise NotFound(f"no sample {seq}")
    return row["class_id"]


def _record_change(conn: sqlite3.Connection, seq: int, old: int, new: int | None) -> LabelChange:
    at = time.time()
    change_id = conn.execute("INSERT INTO corrections (seq, old_class, new_class, at) VALUES (?, ?, ?, ?)",
                             (seq, old, new, at)).lastrowid
    return LabelChange(change_id, seq, old, new, at)


def _already_stored(conn: sqlite3.Connection, s: NewSample) -> Stored | None:
    row = conn.execute("SELECT s.seq, c.name, s.image FROM samples s JOIN classes c ON c.id = s.class_id "
                       "WHERE s.sample_id = ?", (s.sample_id,)).fetchone()
    if row is None:
        return None
    corrected = conn.execute("SELECT 1 FROM corrections WHERE seq = ?", (row["seq"],)).fetchone() is not None
    if not corrected:  # a label corrected since (or the sample forgotten) is newer than any retry of its ingest
        # retention may have dropped the pixels of a trained sample (service.storage.retention): the label decides
        _same_or_conflict(NewSample(row["name"], row["image"] or s.pixels, s.sample_id), s)
    return Stored(row["seq"], duplicate=True)


def _same_or_conflict(first: NewSample, again: NewSample) -> None:
    if first.label != again.label or first.pixels != again.pixels:
        raise SampleIdConflict(f"sample id {again.sample_id!r} was already sent with another "
                               f"{'label' if first.label != again.label else 'image'}")


def _class_ids(conn: sqlite3.Connection, labels: list[str], max_classes: int) -> dict[str, int]:
    """The class id of each label, creating the ones never seen in the order given."""
    ids = {}
    for name in labels:
        row = conn.execute("SELECT id FROM classes WHERE name = ? AND forgotten IS NULL", (name,)).fetchone()
        if row is not None:
            ids[name] = row["id"]
    new = [n for n in labels if n not in ids]
    if new:
        # forgotten classes keep their ids (never reused) but no longer count against the limit
        count, next_id = conn.execute("SELECT COUNT(*) FILTER (WHERE forgotten IS NULL), "
                                      "COALESCE(MAX(id), -1) + 1 FROM classes").fetchone()
        if count + len(new) > max_classes:
            raise TooManyClasses(f"this service holds at most {max_classes} classes")
        for offset, name in enumerate(new):
            conn.execute("INSERT INTO classes (id, name) VALUES (?, ?)", (next_id + offset, name))
            ids[name] = next_id + offset
    return ids


def label_of(classes: Sequence[str | None], class_id: int) -> str | None:
    """The label of a class id in `classes` (as `IngestLog.classes()` gives them); None for a
    forgotten class or one beyond the list (not yet trained, say)."""
    return classes[class_id] if 0 <= class_id < len(classes) else None


def by_label(classes: Sequence[str | None], by_id: dict[int, V]) -> dict[str, V]:
    """{class id: value} -> {label: value}, for the classes that have a label.

    >>> by_label(["cat", None, "dog"], {0: 5, 1: 3, 2: 4, 3: 1})
    {'cat': 5, 'dog': 4}
    """
    return {label: v for c, v in by_id.items() if (label := label_of(classes, c)) is not None}


def images_from_blobs(blobs: list[bytes], shape, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Raw uint8 image bytes as stored in SQLite -> one tensor [n, *shape] (of `dtype`: a memory slot
    on the pretrained backbone holds a latent)."""
    size = dtype.itemsize
    for d in shape:
        size *= d
    for i, b in enumerate(blobs):
        if len(b) != size:
            raise ValueError(f"stored image {i} has {len(b)} bytes, expected {size} for shape {tuple(shape)}")
    if not blobs:  # an empty memory (ASER_MEM_SIZE=0, or its classes forgotten): frombuffer refuses 0 bytes
        return torch.empty((0, *shape), dtype=dtype)
    return torch.frombuffer(bytearray(b"".join(blobs)), dtype=dtype).view(len(blobs), *shape)
