"""Files the service wrote, checked when they are opened: a device's flash may lose its last writes or garble a block.

What is derived (the latent store, checkpoints, snapshots) is set aside when damaged (`Damage.set_aside`: renamed with
the reason, logged once, counted) and rebuilt from what is intact; the ingest log, the record of what was acknowledged,
never is: a damaged one is refused at start-up in one line naming the way back, `python -m service recover-log`
(`service.storage.salvage`; docs/operations.md).

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> sqlite_damage(folder / "absent.db") is None
True
>>> _ = (folder / "cut.db").write_bytes(b"SQLite format 3\\x00" + bytes(100))
>>> sqlite_damage(folder / "cut.db")
'file is not a database'
>>> damage = Damage()
>>> moved = damage.set_aside(folder / "cut.db", "file is not a database", "latent_store")
>>> moved.name.startswith("cut.db.damaged-"), (folder / "cut.db").exists(), damage.report()[0]["file"]
(True, False, 'cut.db')
"""

from __future__ import annotations

import hashlib
import logging
import re
import sqlite3
import threading
import time
import uuid
from pathlib import Path

from service.storage.errors import DamagedIngestLog

log = logging.getLogger("aser.storage")

SQLITE_SIDECARS = ("-wal", "-shm", "-journal")  # a database's other files: they go with it


def sqlite_damage(path: Path) -> str | None:
    """What is wrong with the SQLite database at `path` in SQLite's words (its quick check: every page's structure,
    not the values' meaning; 0.1 s for 200 MB), or None where it is intact or absent."""
    if not path.exists():
        return None
    try:
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            found = [row[0] for row in conn.execute("PRAGMA quick_check(3)")]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        return str(exc)
    return None if found == ["ok"] else " ".join("; ".join(found).split())  # one line


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def file_token(db) -> str:
    """The random token of a derived file (its `meta` table's `token`, made on first use): each checkpoint records it,
    so a file that is not the one the checkpoint was made with (another device's, a copy from another day) is found."""
    with db.read() as conn:
        row = conn.execute("SELECT value FROM meta WHERE key = 'token'").fetchone()
    if row is not None:
        return row["value"]
    token = uuid.uuid4().hex
    with db.write() as conn:
        conn.execute("INSERT INTO meta VALUES ('token', ?)", (token,))
    return token


def check_ingest_log(path: Path) -> None:
    """Refuse a damaged ingest log (DamagedIngestLog), naming the way back; an intact or absent one passes."""
    reason = sqlite_damage(path)
    if reason is None:
        return
    raise DamagedIngestLog(
        f"the ingest log {path} is damaged ({reason}); it is the record of every acknowledged sample, so the service "
        "does not replace it on its own: `python -m service recover-log` (the same ASER_DATA_DIR) copies every row "
        "that can still be read into a new log and sets this one aside (docs/operations.md#damaged-files)")


class Damage:
    """The derived files this run set aside, for /status and /metrics (`on_set_aside`: called with each one's kind)."""

    def __init__(self, on_set_aside=None):
        self._found: list[dict] = []
        self._lock = threading.Lock()
        self.on_set_aside = on_set_aside

    def set_aside(self, path: Path, reason: str, kind: str, rebuilt: str = "") -> Path:
        """Rename `path` (and a database's sidecar files) to `<name>.damaged-<UTC time>-<reason>`; returns the new path."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        slug = re.sub(r"[^a-z0-9]+", "-", reason.lower()).strip("-")[:40] or "damaged"
        moved = path.with_name(f"{path.name}.damaged-{stamp}-{slug}")
        for suffix in ("", *SQLITE_SIDECARS):
            source = path.with_name(path.name + suffix)
            if source.exists():
                source.replace(moved.with_name(moved.name + suffix))
        log.warning("storage: %s is damaged (%s): set aside as %s%s", path, reason, moved.name,
                    f"; {rebuilt}" if rebuilt else "")
        with self._lock:
            self._found.append({"file": path.name, "kind": kind, "reason": reason, "set_aside_as": moved.name, "at": time.time(),
                                "rebuilt": rebuilt})
        if self.on_set_aside is not None:
            self.on_set_aside(kind)
        return moved

    def report(self) -> list[dict]:
        with self._lock:
            return [dict(found) for found in self._found]
