"""ONNX snapshots of the learner's model, for inference clients that need nothing else.

A snapshot is the eval-mode network from uint8 RGB pixels to logits (the scaling to [0, 1]
is inside the graph), with the head cut to the classes it has learned. Its metadata carries
the class labels in output order, the input shape and the preprocessing, so
`clients.onnx_client` predicts from the file alone. Files are written under a temporary name,
fsynced and renamed, then recorded in the `snapshots` table; a crash leaves no half file listed.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from learner.model import ReducedResNet18, scale_pixels

from .durable import replace_durably
from .store import IngestLog

PREPROCESSING = ("RGB image resized to the input size, pixels as uint8 in NCHW order; the graph scales them "
                 "to [0, 1] itself. Outputs are logits; softmax gives class probabilities.")


class PixelsToLogits(nn.Module):
    """uint8 [n, 3, H, W] -> logits over the first `num_classes` classes, in eval mode, on a copy
    of `model` taken now (later training steps do not reach it)."""

    def __init__(self, model: ReducedResNet18, num_classes: int):
        super().__init__()
        net = copy.deepcopy(model).float().to("cpu", memory_format=torch.contiguous_format)
        head = nn.Linear(net.head.in_features, num_classes)
        with torch.no_grad():
            head.weight.copy_(net.head.weight[:num_classes])
            head.bias.copy_(net.head.bias[:num_classes])
        net.head = head
        self.net = net.eval()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.net(scale_pixels(pixels))


def export_onnx(net: PixelsToLogits, classes: list[str], path: Path, metadata: dict) -> None:
    """Write `net` as ONNX to `path`, with `classes` (its outputs, in order) and `metadata`."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # the exporter's registry chatter
    size = net.net.input_size
    example = torch.zeros(2, 3, size, size, dtype=torch.uint8)
    program = torch.onnx.export(net, (example,), dynamo=True, input_names=["pixels"], output_names=["logits"],
                                dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=4096)},), verbose=False)
    props = {"labels": json.dumps(classes), "input_name": "pixels", "input_shape": json.dumps([3, size, size]),
             "input_dtype": "uint8", "color": "RGB", "layout": "NCHW", "output_name": "logits",
             "preprocessing": PREPROCESSING, **{k: json.dumps(v) if not isinstance(v, str) else v
                                               for k, v in metadata.items()}}
    program.model.metadata_props.update(props)
    tmp = path.with_suffix(".onnx.tmp")
    program.save(tmp)
    replace_durably(tmp, path)


class SnapshotStore:
    """Exports in a background thread; lists and finds snapshots through the SQLite table."""

    def __init__(self, log_store: IngestLog, directory: Path, method: str):
        self.db = log_store.db
        self.lock = log_store._lock
        self.directory = directory
        self.method = method
        directory.mkdir(parents=True, exist_ok=True)
        for orphan in directory.glob("*.onnx.tmp"):
            orphan.unlink()
        with self.db.conn:
            self.db.execute("CREATE TABLE IF NOT EXISTS snapshots (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                            "file TEXT NOT NULL, created REAL NOT NULL, model_version INTEGER NOT NULL, "
                            "steps INTEGER NOT NULL, samples_trained INTEGER NOT NULL, classes TEXT NOT NULL, "
                            "size_bytes INTEGER NOT NULL, reason TEXT NOT NULL)")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onnx-export")

    def submit(self, model: ReducedResNet18, classes: list[str], version: int, steps: int, samples: int,
               reason: str) -> Future:
        """Queue an export of `model` as it is now; the future gives the snapshot's row."""
        net = PixelsToLogits(model, len(classes))
        return self._executor.submit(self._export, net, list(classes), version, steps, samples, reason)

    def _export(self, net, classes, version, steps, samples, reason) -> dict:
        created = time.time()
        name = f"snapshot-{steps:09d}-v{version}-{time.time_ns()}.onnx"
        meta = {"model_version": version, "steps": steps, "samples_trained": samples, "method": self.method,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))}
        export_onnx(net, classes, self.directory / name, meta)
        size = (self.directory / name).stat().st_size
        with self.lock:  # autocommit: one INSERT is one transaction
            sid = self.db.execute("INSERT INTO snapshots (file, created, model_version, steps, samples_trained, "
                                  "classes, size_bytes, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                  [name, created, version, steps, samples, json.dumps(classes), size, reason]).lastrowid
        return self.get(sid)

    def list(self) -> list[dict]:
        return [self._public(r) for r in self.db.query("SELECT * FROM snapshots ORDER BY id")]

    def get(self, snapshot_id: int) -> dict | None:
        rows = list(self.db.query("SELECT * FROM snapshots WHERE id = ?", [snapshot_id]))
        return self._public(rows[0]) if rows else None

    def latest(self) -> dict | None:
        rows = list(self.db.query("SELECT * FROM snapshots ORDER BY id DESC LIMIT 1"))
        return self._public(rows[0]) if rows else None

    def path(self, row: dict) -> Path:
        return self.directory / row["file"]

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    @staticmethod
    def _public(row: dict) -> dict:
        return {"id": row["id"], "file": row["file"], "created": row["created"], "model_version": row["model_version"],
                "steps": row["steps"], "samples_trained": row["samples_trained"],
                "classes": json.loads(row["classes"]), "size_bytes": row["size_bytes"], "reason": row["reason"]}
