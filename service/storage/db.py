"""The service's one SQLite database, and the one discipline for using it across threads.

- One writer connection, used only inside `write()`: a process-wide lock, then an explicit
  `BEGIN IMMEDIATE` ... `COMMIT` (or `ROLLBACK` on any error). Every write, from any thread,
  goes through it, so transactions never nest or interleave.
- One read connection per thread, used only inside `read()`: an explicit `BEGIN` ... `COMMIT`,
  so the statements of one read see one consistent snapshot (WAL lets readers run beside the
  writer without waiting).
- Statements go to the sqlite3 connections directly. sqlite-utils is used for what it is good
  at, creating and migrating the schema, and never for queries: its versions differ in how
  they wrap `query()` (4.x opens a SAVEPOINT for each one), and mixing such implicit
  transactions with explicit ones on a shared connection is what broke the service before.

>>> import tempfile, pathlib
>>> db = Database(pathlib.Path(tempfile.mkdtemp()) / "x.db")
>>> with db.write() as conn:
...     _ = conn.execute("CREATE TABLE t (x INTEGER)")
...     _ = conn.execute("INSERT INTO t VALUES (1)")
>>> with db.read() as conn:
...     conn.execute("SELECT x FROM t").fetchone()["x"]
1
>>> db.close()
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import sqlite_utils

from service.storage.errors import StorageFull

log = logging.getLogger("aser.db")

INCREMENTAL = 2  # PRAGMA auto_vacuum's value for incremental auto-vacuum


def is_disk_full(exc: BaseException) -> bool:
    """SQLite's SQLITE_FULL, or the OS's ENOSPC / EDQUOT."""
    if isinstance(exc, sqlite3.Error):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class Database:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._write_lock = threading.Lock()
        self._writer = self._connect(writer=True)
        self._readers = threading.local()
        self._all: list[sqlite3.Connection] = [self._writer]
        self._all_lock = threading.Lock()
        self.full = False  # the last write failed for want of space (logged once until one succeeds)
        self._incremental_vacuum()

    def _incremental_vacuum(self) -> None:
        """Free pages can go back to the file system (retention). Set before the first table; a
        database made before this gets one VACUUM at start-up (its size in temporary space)."""
        conn = self._writer
        if conn.execute("PRAGMA auto_vacuum").fetchone()[0] == INCREMENTAL:
            return
        log.info("storage: converting %s to incremental auto-vacuum (one VACUUM)", self.path)
        try:
            conn.execute("VACUUM")
        except sqlite3.Error as exc:  # no room for the copy, say: pages are still reused, not returned
            log.warning("storage: VACUUM failed (%s); freed pages will be reused, not returned", exc)

    def _connect(self, writer: bool = False) -> sqlite3.Connection:
        # isolation_level=None: sqlite3 opens no implicit transactions; ours are explicit
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA busy_timeout=10000")
        if not writer:
            # the file's settings are the writer's to make: a reader that set them would write, and
            # answer 500 on a full disk after a restart; it may not write at all
            conn.execute("PRAGMA query_only=ON")
            return conn
        conn.execute("PRAGMA auto_vacuum=INCREMENTAL")  # before WAL writes page 1: a new file starts with it
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")  # an acknowledged commit survives power loss
        conn.execute("PRAGMA journal_size_limit=16777216")  # the WAL shrinks back to 16 MiB after a checkpoint
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, all or nothing; durable when the block exits. A full disk
        raises StorageFull, and the transaction is rolled back whole (a failed COMMIT too)."""
        with self._write_lock, self._whole_or_nothing():
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            yield conn
            conn.execute("COMMIT")
        if self.full:
            self.full = False
            log.warning("storage: space is back, writes succeed again")

    @contextmanager
    def _whole_or_nothing(self) -> Iterator[None]:
        """Under the write lock: a failure rolls the writer's transaction back whole (a failed
        COMMIT too), and a full disk becomes StorageFull, logged once per episode."""
        try:
            yield
        except BaseException as exc:
            if self._writer.in_transaction:
                with suppress(sqlite3.Error):
                    self._writer.execute("ROLLBACK")
            if is_disk_full(exc):
                if not self.full:  # one line per episode, not one per refused request
                    self.full = True
                    log.error("storage: the disk holding %s is full; writes are refused (507) until space returns",
                              self.path)
                raise StorageFull("the disk is full: nothing was stored; send it again once space returns") from exc
            raise

    def incremental_vacuum(self, pages: int) -> None:
        """Give up to `pages` free pages back to the file system, in one short write transaction.
        (executescript: the sqlite3 module's execute steps the pragma once, freeing one page.)"""
        with self._write_lock, self._whole_or_nothing():
            self._writer.executescript(f"BEGIN IMMEDIATE; PRAGMA incremental_vacuum({int(pages)}); COMMIT;")

    def checkpoint_wal(self) -> None:
        """Copy the write-ahead log into the database and truncate it."""
        with self._write_lock, suppress(sqlite3.Error):  # readers may hold it: the next call tries again
            self._writer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """This thread's read connection, inside one read transaction (re-entrant). A read short of
        space (a sort spilling to temporary files on a full disk) raises StorageFull."""
        try:
            with self._read() as conn:
                yield conn
        except sqlite3.OperationalError as exc:
            if is_disk_full(exc):
                raise StorageFull("the disk is full: this read needs temporary space; retry once space returns") from exc
            raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        conn = getattr(self._readers, "conn", None)
        if conn is None:
            conn = self._readers.conn = self._connect()
            with self._all_lock:
                self._all.append(conn)
        if conn.in_transaction:  # a read inside a read: same snapshot
            yield conn
            return
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    @contextmanager
    def schema(self) -> Iterator[sqlite_utils.Database]:
        """sqlite-utils on the writer connection, for creating and migrating tables."""
        with self._write_lock:
            yield sqlite_utils.Database(self._writer)

    def close(self) -> None:
        with self._all_lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
