"""The sleep's latent store on disk: `learner.memory.latent_store.LatentStore` with its codes in a SQLite file of
its own (`latents.db` in the data directory, beside the ingest log, bounded by ASER_SLEEP_STORE_MB whatever the
ingest log's retention does), so that a sleep still has the old classes after retention drops their pixels, and
the learner's memory holds only the index (a label and an arrival a sample).

It follows the lineage as checkpoints do: each row is named by its arrival (the store's count of samples added);
a checkpoint records the count, and a restart from it drops the rows that arrived after (their samples are trained
again and come back). A slot evicted after the last checkpoint stays evicted: the store is a sample of the stream,
class-balanced, not a copy of it. The file names the backbone and the latent's shape; another lineage's is emptied. It also carries a token of its own,
which each checkpoint records: a file that is not the one the checkpoint was made with (another device's, a copy from
another day) is `foreign` after the restore, and the worker sets it aside and fills a new one.
A full disk costs the rows of that step (logged, counted), never the step itself.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from learner.memory.latent_store import LatentStore, sample_bytes
from service.storage.db import Database
from service.storage.errors import StorageFull
from service.storage.integrity import file_token

log = logging.getLogger("aser.worker")


def store_capacity(megabytes: float, shape: tuple[int, ...], eight_bit_input: bool) -> int:
    """Samples that fit in `megabytes` (at least one)."""
    return max(1, int(megabytes * 2**20) // sample_bytes(shape, eight_bit_input))


class DiskLatentStore(LatentStore):
    def __init__(self, path: Path, capacity: int, shape: tuple[int, ...], eight_bit_input: bool, identity: dict,
                 seed: int = 0):
        self.db = Database(path)
        with self.db.schema() as schema:
            if "latents" not in schema.table_names():
                schema["latents"].create({"arrival": int, "class_id": int, "codes": bytes, "scales": bytes},
                                         pk="arrival", not_null={"class_id", "codes"})
                schema["meta"].create({"key": str, "value": str}, pk="key")
            if "sample_key" not in schema["latents"].columns_dict:  # a store from before it kept the samples' ids
                schema["latents"].add_column("sample_key", int)
        super().__init__(capacity, shape, eight_bit_input, seed)
        self.write_failures = 0  # steps whose rows a full disk refused
        self.foreign = False  # the restored checkpoint was made with another file
        self._claim(json.dumps({**identity, "shape": list(shape)}, sort_keys=True))
        self.token = file_token(self.db)
        self._load_index()

    def _allocate(self) -> None:
        self.codes = self.scales = None  # on disk

    def _claim(self, identity: str) -> None:
        """Empty a file another lineage wrote."""
        with self.db.read() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = 'identity'").fetchone()
        if row is not None and row["value"] == identity:
            return
        if row is not None:
            log.warning("sleep: the latent store was written by another lineage; emptied")
        with self.db.write() as conn:
            conn.execute("DELETE FROM latents")
            conn.execute("DELETE FROM meta")
            conn.execute("INSERT INTO meta VALUES ('identity', ?)", (identity,))

    def _load_index(self) -> None:
        with self.db.read() as conn:
            rows = conn.execute("SELECT arrival, class_id, sample_key FROM latents ORDER BY arrival").fetchall()
            arrived = conn.execute("SELECT value FROM meta WHERE key = 'arrived'").fetchone()
        rows = rows[-self.capacity:]
        self.size = len(rows)
        self.labels.fill_(-1)
        self.keys.fill_(-1)
        self.arrival.zero_()
        if rows:
            self.arrival[:self.size] = torch.tensor([r["arrival"] for r in rows])
            self.labels[:self.size] = torch.tensor([r["class_id"] for r in rows])
            self.keys[:self.size] = torch.tensor([-1 if r["sample_key"] is None else r["sample_key"] for r in rows])
        newest = int(self.arrival[:self.size].max()) if self.size else 0
        self.arrived = max(int(arrived["value"]) if arrived else 0, newest)

    def _put(self, slots, codes, scales, evicted) -> None:
        arrivals = self.arrival[torch.tensor(slots)].tolist()
        scale_bytes = [None if scales is None else scales[i].numpy().tobytes() for i in range(len(slots))]
        rows = [(a, int(self.labels[s]), codes[i].numpy().tobytes(), scale_bytes[i], int(self.keys[s]))
                for i, (s, a) in enumerate(zip(slots, arrivals))]
        try:
            with self.db.write() as conn:
                conn.executemany("DELETE FROM latents WHERE arrival = ?", [(a,) for a in evicted])
                conn.executemany("INSERT OR REPLACE INTO latents (arrival, class_id, codes, scales, sample_key) "
                                 "VALUES (?, ?, ?, ?, ?)", rows)
                conn.execute("INSERT OR REPLACE INTO meta VALUES ('arrived', ?)", (str(self.arrived),))
        except StorageFull:  # the rows of this step are lost, the step is not: the index follows the file
            self.write_failures += 1
            self._reload()

    def _get(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        arrivals = self.arrival[slots].tolist()
        unique = sorted(set(arrivals))
        with self.db.read() as conn:
            found = {r["arrival"]: r for r in conn.execute(
                f"SELECT arrival, codes, scales FROM latents WHERE arrival IN ({','.join('?' * len(unique))})",
                unique)}
        dtype = np.uint8 if self.eight_bit_input else np.int8
        codes = torch.from_numpy(np.stack([np.frombuffer(found[a]["codes"], dtype) for a in arrivals]).copy())
        codes = codes.view(len(arrivals), *self.shape)
        if self.eight_bit_input:
            return codes, None
        scales = np.stack([np.frombuffer(found[a]["scales"], np.float16) for a in arrivals]).copy()
        return codes, torch.from_numpy(scales)

    def truncate(self, arrived: int) -> None:
        """Back to the store as it was when `arrived` samples had been added (a restart from a checkpoint)."""
        with self.db.write() as conn:
            conn.execute("DELETE FROM latents WHERE arrival > ?", (arrived,))
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('arrived', ?)", (str(arrived),))
        self._load_index()
        self.arrived = arrived

    def forget_class(self, class_id: int) -> int:
        with self.db.write() as conn:
            removed = conn.execute("DELETE FROM latents WHERE class_id = ?", (class_id,)).rowcount
        self._reload()
        return removed

    def correct(self, key: int, new_class: int | None) -> bool:
        """As the store in memory does, on the file at once: a restart from an older checkpoint keeps the correction
        (and the service applies it again, to the same end)."""
        with self.db.write() as conn:
            if new_class is None:
                changed = conn.execute("DELETE FROM latents WHERE sample_key = ?", (key,)).rowcount
            else:
                changed = conn.execute("UPDATE latents SET class_id = ? WHERE sample_key = ?",
                                       (new_class, key)).rowcount
        self._reload()
        return changed > 0

    def _reload(self) -> None:
        arrived = self.arrived
        self._load_index()
        self.arrived = arrived

    def state_dict(self) -> dict:
        return {"on_disk": True, "arrived": self.arrived, "generator": self.generator.get_state(), "token": self.token}

    def load_state_dict(self, state: dict) -> None:
        self.foreign = state.get("token", self.token) != self.token  # checkpoints before tokens: not checked
        if not self.foreign:
            self.truncate(state["arrived"])
        self.generator.set_state(state["generator"])

    @property
    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.db.path.parent.glob(self.db.path.name + "*") if p.exists())

    def close(self) -> None:
        self.db.close()
