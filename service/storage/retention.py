"""Retention: a service that runs for months keeps the ingest log's disk bounded.

A sample's pixels are needed until a committed checkpoint has trained on it (after a crash the
worker trains again on everything past the checkpoint's `trained_upto`); the replay memory keeps
its own copies (the checkpoint's `buffer` rows). So, in the background, every
`ASER_RETAIN_EVERY_S`:

1. the pixels of samples at or before the last checkpoint's `trained_upto` are dropped once they
   are older than `ASER_RETAIN_PIXELS_S`, or, oldest first, while the database is larger than
   `ASER_RETAIN_MAX_MB`; the row stays (sequence number, class, time, sample id);
2. rows without pixels are deleted once older than `ASER_RETAIN_IDS_S`: a retry with a sample id
   is recognised (stored once) within that horizon;
3. the freed pages go back to the file system by `PRAGMA incremental_vacuum`, a few at a time.

Every step is a short write transaction of its own, so ingest never waits long behind it.
Untrained samples are never touched: a backlog that fills the disk meets the 507 answer instead.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from service.storage.db import INCREMENTAL, Database

log = logging.getLogger("aser.retention")

PURGE_BATCH = 500  # rows per transaction
VACUUM_PAGES = 256  # pages given back per transaction


@dataclass
class RetentionPolicy:
    pixels_s: float  # keep trained pixels this long (0: drop them at the next checkpoint)
    max_bytes: int  # drop trained pixels, oldest first, while the database is larger (0: no cap)
    ids_s: float  # keep the rows (sample ids) of dropped pixels this long


@dataclass
class RetentionTotals:
    pixels_dropped: int = 0
    ids_dropped: int = 0
    freed_bytes: int = 0
    runs: int = 0
    last_run: float | None = None
    errors: int = 0
    last_error: str | None = field(default=None)
    over_cap: bool = False  # the cap cannot be met: what is left is untrained samples, ids and the memory


def database_bytes(db: Database) -> int:
    """The database's size on disk, its write-ahead log included."""
    return sum(p.stat().st_size for p in (db.path, db.path.with_name(db.path.name + "-wal")) if p.exists())


class Retention:
    def __init__(self, db: Database, policy: RetentionPolicy, every_s: float, checkpointed_upto, on_run=None):
        self.db, self.policy, self.every_s = db, policy, every_s
        self.checkpointed_upto = checkpointed_upto  # () -> the last committed checkpoint's trained_upto
        self.totals = RetentionTotals()
        self._pixels_from = 0  # no row below this sequence number holds pixels
        self.on_run = on_run  # called with the figures of each run (metrics)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="retention", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.run_once()
            except Exception as exc:  # a full disk, say: the next run tries again
                self.totals.errors += 1
                self.totals.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("retention run failed: %s", self.totals.last_error)

    def run_once(self, now: float | None = None) -> dict:
        """One pass of the three steps; returns what it did."""
        now = time.time() if now is None else now
        before = database_bytes(self.db)
        upto = self.checkpointed_upto()
        dropped = self._drop_pixels(upto, "received < ?", (now - self.policy.pixels_s,))
        if self.policy.max_bytes:
            dropped += self._drop_pixels_over_cap(upto)
            self._note_cap(database_bytes(self.db))
        ids = self._delete_rows(upto, now - self.policy.ids_s)
        self._vacuum()
        done = {"pixels_dropped": dropped, "ids_dropped": ids, "freed_bytes": max(0, before - database_bytes(self.db))}
        t = self.totals
        t.pixels_dropped, t.ids_dropped, t.freed_bytes = (t.pixels_dropped + dropped, t.ids_dropped + ids,
                                                          t.freed_bytes + done["freed_bytes"])
        t.runs, t.last_run = t.runs + 1, now
        if self.on_run is not None:
            self.on_run(done)
        return done

    def _drop_pixels(self, upto: int, condition: str, args: tuple, limit: int | None = None) -> int:
        """Drop the image of trained samples matching `condition`, oldest first, in batches. The rows
        are found in read transactions, from a cursor below which no row holds pixels (months of
        id-only rows are never scanned again), and changed by key in short write transactions. A row
        is deleted and written again without pixels: emptying the blob in place would leave each page
        holding its one shrunken row, so no page would ever come free."""
        dropped = 0
        while limit is None or dropped < limit:
            batch = PURGE_BATCH if limit is None else min(PURGE_BATCH, limit - dropped)
            with self.db.read() as conn:
                self._pixels_from = conn.execute("SELECT MIN(seq) FROM samples WHERE seq >= ? AND length(image) > 0",
                                                 (self._pixels_from,)).fetchone()[0] or self._pixels_from
                rows = conn.execute(f"SELECT seq, class_id, received, sample_id FROM samples WHERE seq >= ? AND "
                                    f"seq <= ? AND length(image) > 0 AND {condition} ORDER BY seq LIMIT ?",
                                    (self._pixels_from, upto, *args, batch)).fetchall()
            with self.db.write() as conn:
                for r in rows:  # by key; a row forgotten since the read is not written back
                    if conn.execute("DELETE FROM samples WHERE seq = ? AND length(image) > 0", (r["seq"],)).rowcount:
                        conn.execute("INSERT INTO samples (seq, class_id, image, received, sample_id) "
                                     "VALUES (?, ?, X'', ?, ?)", tuple(r))
            dropped += len(rows)
            if len(rows) < batch:
                break
        return dropped

    def _drop_pixels_over_cap(self, upto: int) -> int:
        """Oldest trained pixels first, while the database's pages in use exceed the cap."""
        dropped = 0
        while True:
            with self.db.read() as conn:
                page = conn.execute("PRAGMA page_size").fetchone()[0]
                used = page * (conn.execute("PRAGMA page_count").fetchone()[0]
                               - conn.execute("PRAGMA freelist_count").fetchone()[0])
                average = conn.execute("SELECT AVG(length(image)) FROM (SELECT image FROM samples WHERE seq <= ? "
                                       "AND length(image) > 0 ORDER BY seq LIMIT 100)", (upto,)).fetchone()[0]
            if used <= self.policy.max_bytes or not average:
                return dropped
            n = self._drop_pixels(upto, "1", (), limit=max(1, int((used - self.policy.max_bytes) / average) + 1))
            if n == 0:
                return dropped
            dropped += n

    def _note_cap(self, size: int) -> None:
        """Say once per episode when the cap cannot be met: nothing trained is left to drop (the cap
        is below what the untrained backlog, the ids within their horizon and the memory need)."""
        over = size > self.policy.max_bytes
        if over and not self.totals.over_cap:
            log.warning("storage: the database (%.1f MB) stays above ASER_RETAIN_MAX_MB (%.1f MB): only untrained "
                        "samples, sample ids within ASER_RETAIN_IDS_S and the memory are left; ingest goes on",
                        size / 2**20, self.policy.max_bytes / 2**20)
        self.totals.over_cap = over

    def _delete_rows(self, upto: int, before: float) -> int:
        """Rows past the ids' horizon, found in read transactions and deleted by key."""
        deleted, after = 0, 0
        while True:
            with self.db.read() as conn:
                seqs = [r[0] for r in conn.execute(
                    "SELECT seq FROM samples WHERE seq > ? AND seq <= ? AND length(image) = 0 AND received < ? AND "
                    "seq NOT IN (SELECT seq FROM quarantine) ORDER BY seq LIMIT ?", (after, upto, before, PURGE_BATCH))]
            if seqs:
                with self.db.write() as conn:
                    conn.executemany("DELETE FROM samples WHERE seq = ? AND length(image) = 0", [(q,) for q in seqs])
                deleted, after = deleted + len(seqs), seqs[-1]
            if len(seqs) < PURGE_BATCH:
                return deleted

    def _vacuum(self) -> None:
        """Give free pages back to the file system (a database without incremental auto-vacuum
        reuses them for new samples instead: it stops growing, it does not shrink)."""
        free = None
        while True:
            with self.db.read() as conn:
                if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != INCREMENTAL:
                    return
                before, free = free, conn.execute("PRAGMA freelist_count").fetchone()[0]
            if free == 0 or free == before:
                break
            self.db.incremental_vacuum(VACUUM_PAGES)
        self.db.checkpoint_wal()  # and the write-ahead log back to its size limit
