"""Checkpoints of the learner's lineage: weights, RNG and policy state, the replay buffer, and
`trained_upto` (the last sequence number the model has seen).

Protocol (DESIGN.md): the learner state goes to a file first (temporary name, fsync, rename);
then one SQLite transaction replaces the buffer rows and adds the checkpoint row naming that
file and `trained_upto`. A crash before the commit leaves the previous checkpoint in force
(and an orphan file, removed at the next start); after it, the new one. The buffer rows and
the file are thus always of the same lineage, and on start the learner resumes from the last
committed checkpoint and trains again on every acknowledged sample after `trained_upto`.

Each checkpoint row records its file's sha256: a file cut short, garbled or replaced by another lineage's is set
aside when it is read (`service.storage.integrity`), the rows that name it go, and the lineage starts again from
the ingest log's retained samples.
"""

from __future__ import annotations

import hashlib
import io
import time
from pathlib import Path

import torch

from learner.methods.base import ContinualLearner
from service.storage.db import Database
from service.storage.durable import write_durably
from service.storage.errors import IncompatibleCheckpoint
from service.storage.integrity import Damage, sha256_of
from service.storage.store import images_from_blobs

SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (id INTEGER PRIMARY KEY AUTOINCREMENT, file TEXT NOT NULL,
    trained_upto INTEGER NOT NULL, steps INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS buffer (slot INTEGER PRIMARY KEY, class_id INTEGER NOT NULL, image BLOB NOT NULL);
"""
VERSION_SCHEMA = ("CREATE TABLE IF NOT EXISTS version_lease "
                  "(id INTEGER PRIMARY KEY CHECK (id = 1), reserved INTEGER NOT NULL)")


class CheckpointStore:
    """`identity`: the settings that decide how the learner trains (ASER_METHOD and the like), saved
    with each checkpoint; a restore under others is refused, since it would train the lineage on
    otherwise than it was trained, or fail on weights of another form."""

    def __init__(self, db: Database, directory: Path, identity: dict[str, str] | None = None,
                 damage: Damage | None = None):
        self.db = db
        self.directory = directory
        self.identity = identity or {}
        self.damage = damage or Damage()
        self._read_ahead: tuple[str, dict] | None = None  # the file `saved_identity` read, for `restore`
        directory.mkdir(parents=True, exist_ok=True)
        with db.schema() as schema:
            schema.executescript(SCHEMA)
            if "sha256" not in schema["checkpoints"].columns_dict:  # databases of earlier versions: not checked
                schema["checkpoints"].add_column("sha256", str)

    def trained_upto(self) -> int:
        """The last committed checkpoint's trained_upto (0: none yet)."""
        row = self.latest()
        return row["trained_upto"] if row else 0

    def latest(self) -> dict | None:
        with self.db.read() as conn:
            row = conn.execute("SELECT * FROM checkpoints ORDER BY id DESC LIMIT 1").fetchone()
        return dict(row) if row else None

    def saved_identity(self) -> dict[str, str] | None:
        """The settings the last committed checkpoint was trained under (None: no checkpoint, or one
        from before they were saved)."""
        row = self.latest()
        state = None if row is None else self._read_intact(row)
        if state is None:
            return None
        self._read_ahead = (row["file"], state)  # start-up restores right after: one read of the file
        return state.get("service_extra", {}).get("identity")

    def save(self, learner: ContinualLearner, trained_upto: int, extra: dict | None = None) -> int:
        """Persist the lineage (and `extra`, the service's own state of the same moment); returns the
        checkpoint id once committed."""
        state = learner.state_dict()
        state["service_extra"] = {**(extra or {}), "identity": self.identity}
        buffer = state.pop("buffer", None)
        if buffer is not None:
            state["buffer_meta"] = {k: v for k, v in buffer.items() if k not in ("images", "labels")}
        name = f"learner-{trained_upto:012d}-{time.time_ns()}.pt"
        buf = io.BytesIO()
        torch.save(state, buf)
        write_durably(self.directory / name, buf.getvalue())
        digest = hashlib.sha256(buf.getbuffer()).hexdigest()
        try:
            with self.db.write() as conn:
                if buffer is not None:
                    conn.execute("DELETE FROM buffer")
                    images, labels = buffer["images"].numpy(), buffer["labels"].tolist()
                    conn.executemany("INSERT INTO buffer (slot, class_id, image) VALUES (?, ?, ?)",
                                     [(i, labels[i], images[i].tobytes()) for i in range(len(labels))])
                cid = conn.execute("INSERT INTO checkpoints (file, trained_upto, steps, created, sha256) "
                                   "VALUES (?, ?, ?, ?, ?)",
                                   (name, trained_upto, learner.steps, time.time(), digest)).lastrowid
        except BaseException:
            (self.directory / name).unlink(missing_ok=True)
            raise
        self._remove_files_except(name)
        return cid

    def restore(self, learner: ContinualLearner) -> tuple[int, dict]:
        """Load the last committed checkpoint into `learner`; returns its trained_upto (0: none) and
        the `extra` saved with it."""
        row = self.latest()
        state = None if row is None else self._read_intact(row)
        row = row if state is not None else None  # a damaged one is gone: the lineage starts again
        self._remove_files_except(row["file"] if row else None)
        if row is None:
            return 0, {}
        extra = state.pop("service_extra", {})
        self._check_identity(row["file"], state["method"], extra.pop("identity", None), learner)
        meta = state.pop("buffer_meta", None)
        if meta is not None:
            with self.db.read() as conn:
                rows = conn.execute("SELECT slot, class_id, image FROM buffer ORDER BY slot").fetchall()
            kept = [r["slot"] for r in rows]  # the slots of a forgotten class are gone from the rows
            for key in ("entered", "keys", "features", "feature_version", "pictures"):
                if key in meta:
                    meta[key] = meta[key][kept]
            dtype = getattr(torch, meta.get("dtype", "uint8"))  # the images, or a pretrained backbone's latents
            blobs = [r["image"] for r in rows]
            state["buffer"] = {**meta, "images": images_from_blobs(blobs, meta["image_shape"], dtype),
                               "labels": torch.tensor([r["class_id"] for r in rows], dtype=torch.long)}
        learner.load_state_dict(state)
        return row["trained_upto"], extra

    def _read_intact(self, row: dict) -> dict | None:
        """The row's checkpoint state, the one read ahead if it is that file (taken once); None where the file is
        missing or damaged, which is then set aside with every checkpoint row (the lineage starts again)."""
        ahead, self._read_ahead = self._read_ahead, None
        if ahead is not None and ahead[0] == row["file"]:
            return ahead[1]
        path = self.directory / row["file"]
        try:
            if row.get("sha256") and sha256_of(path) != row["sha256"]:
                raise ValueError("its sha256 is not the one written")
            # onto the CPU: the learner copies what it needs to its device, and its generators' states
            # must stay CPU tensors (a checkpoint written on a GPU restores on a CPU and the other way)
            state = torch.load(path, weights_only=True, map_location="cpu")
            if not isinstance(state, dict) or "method" not in state:
                raise ValueError("it holds no learner")
            return state
        except Exception as exc:  # missing, cut short, garbled: torch.load's and pickle's many errors
            reason = "missing" if not path.exists() else str(exc).splitlines()[0][:200]
            self.damage.set_aside(path, reason, "checkpoint", "the learner trains again over the ingest log's retained samples")
            with self.db.write() as conn:
                conn.execute("DELETE FROM checkpoints")
                conn.execute("DELETE FROM buffer")
            return None

    def _check_identity(self, file: str, name: str, identity: dict | None, learner: ContinualLearner) -> None:
        """`identity` is None in checkpoints from before it was saved: then the learner's name decides."""
        if name == learner.name and identity in (None, self.identity):
            return
        made = f"a {name} learner" + (f" ({_as_env(identity)})" if identity else "")
        differ = sorted(k for k in {*(identity or {}), *self.identity} if (identity or {}).get(k) != self.identity.get(k))
        raise IncompatibleCheckpoint(
            f"the checkpoint {file} is of {made}, and these settings make a {learner.name} learner "
            f"({_as_env(self.identity)}); they differ in {', '.join(differ) or 'the method'}: start with the settings "
            "it was trained with, or with an empty data directory")

    @staticmethod
    def forget_rows(conn, class_id: int) -> None:
        """In the caller's transaction: the checkpoint's memory rows of a forgotten class."""
        conn.execute("DELETE FROM buffer WHERE class_id = ?", (class_id,))

    def _remove_files_except(self, keep: str | None) -> None:
        """Old checkpoint files and orphans of interrupted saves (not those set aside as damaged)."""
        for f in self.directory.glob("learner-*.pt*"):
            if f.name != keep and ".damaged-" not in f.name:
                f.unlink(missing_ok=True)


def _as_env(settings: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items())


class VersionLease:
    """`model_version` numbers are never served twice, a crash or not. A restart goes on from the last
    checkpoint, older than what was served since; so the worker reserves numbers in SQLite ahead of
    serving them, a block at a time (one short write per `block` versions), and a restart begins
    above every reserved number.

    >>> import tempfile; from pathlib import Path
    >>> lease = VersionLease(Database(Path(tempfile.mkdtemp()) / "db.sqlite"), block=10)
    >>> lease.reserved(), lease.cover(3), lease.reserved(), lease.cover(14), lease.reserved()
    (0, None, 13, None, 24)
    """

    def __init__(self, db: Database, block: int = 1000):
        self.db, self.block = db, block
        with db.schema() as schema:
            schema.executescript(VERSION_SCHEMA)
        with db.read() as conn:
            row = conn.execute("SELECT reserved FROM version_lease").fetchone()
        self._reserved = row["reserved"] if row else 0

    def reserved(self) -> int:
        """The highest number that may have been served (0: none)."""
        return self._reserved

    def cover(self, version: int) -> None:
        """Before `version` is served: reserve up to it and a block beyond (StorageFull on a full disk)."""
        if version <= self._reserved:
            return
        with self.db.write() as conn:
            conn.execute("INSERT INTO version_lease (id, reserved) VALUES (1, ?) "
                         "ON CONFLICT (id) DO UPDATE SET reserved = excluded.reserved", (version + self.block,))
        self._reserved = version + self.block
