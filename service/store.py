"""The ingest log: every acknowledged sample, durably, in arrival order (SQLite through
sqlite-utils, WAL journal, synchronous commits).

A sample's sequence number is its stream position. Class ids are given to labels in the order
they are first seen, in the same transaction as the sample, so the mapping is as durable as
the samples themselves.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import sqlite_utils
import torch


class IngestLog:
    def __init__(self, path: Path, image_shape: tuple[int, int, int]):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.image_shape = image_shape
        self._lock = threading.Lock()  # one writer at a time; readers use their own connections
        self.db = self._connect()
        with self.db.conn:
            if "classes" not in self.db.table_names():
                self.db["classes"].create({"id": int, "name": str}, pk="id")
                self.db["classes"].create_index(["name"], unique=True)
            if "samples" not in self.db.table_names():
                self.db.execute("CREATE TABLE samples (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                                "class_id INTEGER NOT NULL REFERENCES classes(id), image BLOB NOT NULL, "
                                "received REAL NOT NULL)")
        self._class_ids = {r["name"]: r["id"] for r in self.db["classes"].rows}

    def _connect(self) -> sqlite_utils.Database:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")  # an acknowledged commit survives power loss
        conn.execute("PRAGMA busy_timeout=5000")
        return sqlite_utils.Database(conn)

    def reader(self) -> "IngestLog":
        """A view with its own connection, for another thread."""
        view = object.__new__(IngestLog)
        view.path, view.image_shape, view._lock = self.path, self.image_shape, threading.Lock()
        view.db, view._class_ids = view._connect(), {}
        return view

    def append(self, labels: list[str], images: torch.Tensor, max_classes: int) -> list[int]:
        """Commit samples (all or none); returns their sequence numbers once durable."""
        from .inputs import InputError

        raw = images.contiguous().numpy()
        now = time.time()
        with self._lock:
            new = list(dict.fromkeys(n for n in labels if n not in self._class_ids))
            if len(self._class_ids) + len(new) > max_classes:
                raise InputError("too_many_classes", f"this service holds at most {max_classes} classes", 409)
            conn = self.db.conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                ids = dict(self._class_ids)
                for name in new:
                    ids[name] = conn.execute("INSERT INTO classes (id, name) VALUES (?, ?)", (len(ids), name)).lastrowid
                seqs = [conn.execute("INSERT INTO samples (class_id, image, received) VALUES (?, ?, ?)",
                                     (ids[name], raw[i].tobytes(), now)).lastrowid for i, name in enumerate(labels)]
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            self._class_ids = ids
        return seqs

    def classes(self) -> list[str]:
        return [r["name"] for r in self.db.query("SELECT name FROM classes ORDER BY id")]

    def after(self, seq: int, limit: int) -> tuple[list[int], torch.Tensor, torch.Tensor, list[float]]:
        """Up to `limit` samples with sequence number > seq, in order: (seqs, images, class ids, received)."""
        rows = list(self.db.query("SELECT seq, class_id, image, received FROM samples WHERE seq > ? "
                                  "ORDER BY seq LIMIT ?", [seq, limit]))
        if not rows:
            return [], torch.zeros((0, *self.image_shape), dtype=torch.uint8), torch.zeros(0, dtype=torch.long), []
        return ([r["seq"] for r in rows], images_from_blobs([r["image"] for r in rows], self.image_shape),
                torch.tensor([r["class_id"] for r in rows]), [r["received"] for r in rows])

    def count(self) -> int:
        return self.db["samples"].count


def images_from_blobs(blobs: list[bytes], shape) -> torch.Tensor:
    """Raw uint8 image bytes as stored in SQLite -> one tensor [n, *shape]."""
    return torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).view(len(blobs), *shape)
