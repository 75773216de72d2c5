"""The night's pixel store: the photos the device was sent, kept small (JPEG at the input size), for a night to train
the layers below the cut from, whatever the ingest log's retention has dropped since (`pixels.db` in the data
directory, bounded by ASER_PIXEL_STORE_MB).

Class-balanced as the latent store is: once full, a new photo evicts a random one of the largest class (its own
class's when that is among the largest), so an old class keeps its share however long the stream. Rows are named by
the sample's sequence number: a restart from a checkpoint drops those after its `trained_upto` (trained again, they
come back), a correction or a forgotten sample reaches the file at once, a forgotten class leaves it whole. The file
carries a token each checkpoint records, so one from another lineage is found, set aside and filled again from the
ingest log's retained photos, as a damaged one is (`service.storage.integrity`).

>>> import tempfile, pathlib, torch
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> smooth = torch.randint(0, 256, (8, 3, 4, 4)).float()  # photos are smooth; noise is JPEG's worst case
>>> images = torch.nn.functional.interpolate(smooth, size=32, mode="bilinear").to(torch.uint8)
>>> store = PixelStore(folder / "pixels.db", capacity_bytes=2**20)
>>> store.add([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 1, 1], images[:6])
>>> store.correct(5, 2); store.correct(6, None); store.forget_class(0); store.class_counts()
{2: 1}
>>> bool((store.read([5])[0].int() - images[4].int()).abs().float().mean() < 8)  # JPEG: close, not equal
True
>>> small = PixelStore(folder / "small.db", capacity_bytes=3 * len(encode_jpeg(images[0])))
>>> small.add(list(range(1, 9)), [0, 0, 0, 0, 0, 0, 1, 1], images)  # six of class 0 first, then two of class 1
>>> small.bytes <= small.capacity_bytes, small.class_counts()[1] >= 1
(True, True)
"""

from __future__ import annotations

import io
import logging
import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from service.storage.db import Database
from service.storage.errors import StorageFull
from service.storage.integrity import file_token

log = logging.getLogger("aser.worker")

QUALITY = 90  # JPEG quality: a 160 px photo in about 6 KB


def encode_jpeg(image: torch.Tensor) -> bytes:
    """uint8 [3, H, W] -> JPEG bytes."""
    buf = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buf, "JPEG", quality=QUALITY)
    return buf.getvalue()


def decode_jpeg(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)


class PixelStore:
    def __init__(self, path: Path, capacity_bytes: int, seed: int = 0):
        self.db = Database(path)
        with self.db.schema() as schema:
            if "pixels" not in schema.table_names():
                schema["pixels"].create({"seq": int, "class_id": int, "jpeg": bytes, "size": int}, pk="seq",
                                        not_null={"class_id", "jpeg", "size"})
                schema["meta"].create({"key": str, "value": str}, pk="key")
        self.capacity_bytes = capacity_bytes
        self.random = random.Random(seed)
        self.write_failures = 0  # steps whose photos a full disk refused
        self.token = file_token(self.db)
        self._load_index()

    def _load_index(self) -> None:
        with self.db.read() as conn:
            rows = conn.execute("SELECT seq, class_id, size FROM pixels").fetchall()
        self.by_class: dict[int, list[int]] = {}
        self.sizes: dict[int, int] = {}
        for r in rows:
            self.by_class.setdefault(r["class_id"], []).append(r["seq"])
            self.sizes[r["seq"]] = r["size"]
        self._bytes = sum(self.sizes.values())  # kept up to date by `add`: no sum over the store a step
        self._publish()

    def _publish(self) -> None:
        """What another thread may read (`summary`), replaced whole after each change on the worker's."""
        self._summary = {"samples": len(self.sizes), "bytes": self.bytes, "capacity_bytes": self.capacity_bytes,
                         "classes": self.class_counts(), "write_failures": self.write_failures}

    def summary(self) -> dict:
        """The store's counts as of its last change (safe beside the worker)."""
        return self._summary

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def bytes(self) -> int:
        return self._bytes

    def class_counts(self) -> dict[int, int]:
        return {c: len(s) for c, s in self.by_class.items() if s}

    def seqs(self) -> list[int]:
        return sorted(self.sizes)

    def add(self, seqs: list[int], labels: list[int], images: torch.Tensor) -> None:
        """Keep these photos (uint8 [n, 3, H, W]), evicting to stay within the bound; a full disk costs them alone."""
        rows = [(s, c, encode_jpeg(image)) for s, c, image in zip(seqs, labels, images.cpu(), strict=True)
                if s not in self.sizes]
        added, evicted = [], []
        total = self.bytes
        for seq, class_id, jpeg in rows:
            self.by_class.setdefault(class_id, []).append(seq)
            self.sizes[seq] = len(jpeg)
            total += len(jpeg)
            added.append((seq, class_id, jpeg, len(jpeg)))
            while total > self.capacity_bytes and len(self.sizes) > 1:
                victim = self._victim(class_id)
                total -= self.sizes.pop(victim)
                evicted.append(victim)
        self._bytes = total
        try:
            with self.db.write() as conn:
                conn.executemany("DELETE FROM pixels WHERE seq = ?", [(s,) for s in evicted])
                conn.executemany("INSERT OR REPLACE INTO pixels (seq, class_id, jpeg, size) VALUES (?, ?, ?, ?)",
                                 [row for row in added if row[0] in self.sizes])
        except StorageFull:  # the photos of this step are lost to the nights, the step is not
            self.write_failures += 1
            self._load_index()
        self._publish()

    def _victim(self, incoming: int) -> int:
        """A random photo of the largest class, the incoming one's own when it is among the largest."""
        largest = max(len(s) for s in self.by_class.values())
        classes = [incoming] if len(self.by_class[incoming]) == largest else \
            [c for c, s in self.by_class.items() if len(s) == largest]
        members = self.by_class[self.random.choice(classes)]
        return members.pop(self.random.randrange(len(members)))

    def read(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The photos of these rows, decoded (uint8 [n, 3, H, W]), and their classes."""
        with self.db.read() as conn:
            found = {r["seq"]: r for r in conn.execute(
                f"SELECT seq, class_id, jpeg FROM pixels WHERE seq IN ({','.join('?' * len(seqs))})", seqs)}
        return (torch.stack([decode_jpeg(found[s]["jpeg"]) for s in seqs]),
                torch.tensor([found[s]["class_id"] for s in seqs]))

    def truncate(self, upto: int) -> None:
        """Back to the photos of samples up to `upto` (a restart from a checkpoint: the later ones are trained again)."""
        with self.db.write() as conn:
            conn.execute("DELETE FROM pixels WHERE seq > ?", (upto,))
        self._load_index()

    def forget_class(self, class_id: int) -> None:
        with self.db.write() as conn:
            conn.execute("DELETE FROM pixels WHERE class_id = ?", (class_id,))
        self._load_index()

    def correct(self, seq: int, new_class: int | None) -> None:
        """A photo relabelled as `new_class`, or forgotten (None)."""
        with self.db.write() as conn:
            if new_class is None:
                conn.execute("DELETE FROM pixels WHERE seq = ?", (seq,))
            else:
                conn.execute("UPDATE pixels SET class_id = ? WHERE seq = ?", (new_class, seq))
        self._load_index()

    @property
    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.db.path.parent.glob(self.db.path.name + "*") if p.exists())

    def close(self) -> None:
        self.db.close()
