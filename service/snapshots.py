"""ONNX snapshots of the learner's model, for inference clients that need nothing else.

A snapshot is the eval-mode network from uint8 RGB pixels to logits (the scaling to [0, 1]
is inside the graph), with the head cut to the classes it has learned (and not forgotten). Its format (graph I/O,
metadata keys) is `learner.snapshot_format`'s, so `clients.onnx_client` and the replica predict
from the file alone. Files are written under a temporary name,
fsynced and renamed, then recorded in the `snapshots` table; a crash leaves no half file listed.

The export runs in a separate, long-lived process (spawned, so it shares no interpreter state
with the learner): the torch.onnx exporter traces with torch.fx and dynamo, whose global
state a training step in the same process would race. The learner thread only copies the
weights between two steps; one exporter thread here feeds that process one job at a time,
kills and replaces it if it hangs or dies, and records each finished file.
"""

from __future__ import annotations

import copy
import json
import logging
import multiprocessing
import signal
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from learner.model import ReducedResNet18, scale_pixels
from learner.snapshot_format import INPUT_NAME, OUTPUT_NAME, metadata_props

from . import __version__
from .db import Database
from .durable import replace_durably
from .errors import NotFound, SnapshotFailed

log = logging.getLogger("aser.snapshots")

class PixelsToLogits(nn.Module):
    """uint8 [n, 3, H, W] -> logits over the head rows `rows` (the classes learned and not
    forgotten), in eval mode, on a copy of `model` taken now (later training steps do not reach it).
    The head is the model's own, or a given one (`head`: weight, bias) on unit-norm features
    (`normalize`): the memory's class means, `learner.ncm.ncm_head`, as a layer of the graph."""

    def __init__(self, model: ReducedResNet18, rows: list[int],
                 head: tuple[torch.Tensor, torch.Tensor] | None = None, normalize: bool = False):
        super().__init__()
        net = copy.deepcopy(model).float().to("cpu", memory_format=torch.contiguous_format)
        weight, bias = head if head is not None else (net.head.weight, net.head.bias)
        layer = nn.Linear(net.head.in_features, len(rows))
        with torch.no_grad():
            layer.weight.copy_(weight[rows])
            layer.bias.copy_(bias[rows])
        net.head = nn.Identity()
        self.net, self.head, self.normalize = net, layer, normalize
        self.eval()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        features = self.net.features(scale_pixels(pixels))
        return self.head(nn.functional.normalize(features, dim=1) if self.normalize else features)


def export_onnx(net: PixelsToLogits, classes: list[str], path: Path, metadata: dict) -> None:
    """Write `net` as ONNX to `path`, with `classes` (its outputs, in order) and `metadata`."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # the exporter's registry chatter
    size = net.net.input_size
    example = torch.zeros(2, 3, size, size, dtype=torch.uint8)
    program = torch.onnx.export(net, (example,), dynamo=True, input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                                dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=4096)},), verbose=False)
    program.model.metadata_props.update(metadata_props(classes, size, metadata))
    tmp = path.with_suffix(".onnx.tmp")
    program.save(tmp)
    replace_durably(tmp, path)


@dataclass(frozen=True)
class ExportJob:
    """What the export process needs: a copy of the weights taken between two steps."""

    weights: dict[str, torch.Tensor]
    input_size: int
    classes: list[str]
    rows: list[int]  # the head row of each class
    path: Path
    metadata: dict
    head: tuple[torch.Tensor, torch.Tensor] | None = None  # a head other than the model's (NCM)
    normalize: bool = False  # the head takes unit-norm features


def run_export(job: ExportJob) -> int:
    """Build the network from the weights, export it to job.path; returns the file's size."""
    model = ReducedResNet18(job.weights["head.weight"].shape[0], input_size=job.input_size)
    model.load_state_dict(job.weights)
    export_onnx(PixelsToLogits(model, job.rows, job.head, job.normalize), job.classes, job.path, job.metadata)
    return job.path.stat().st_size


def _serve_exports(conn) -> None:
    """The export process: one job at a time until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    warnings.filterwarnings("ignore", category=FutureWarning)  # the exporter's deprecation chatter
    torch.set_num_threads(1)  # leave the cores to training
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        try:
            answer = (True, run_export(job) if job is not None else 0)  # None: warm up the imports
        except Exception as exc:  # reported to the parent, which fails that snapshot only
            answer = (False, f"{type(exc).__name__}: {exc}")
        try:
            conn.send(answer)
        except OSError:
            return


class ExportProcess:
    """A spawned child that runs exports; replaced after a timeout or a crash."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_exports, args=(child,), name="onnx-export", daemon=True)
        self._proc.start()
        child.close()

    def run(self, job: ExportJob | None, timeout: float) -> int:
        try:
            self._conn.send(job)
            if not self._conn.poll(timeout):
                raise SnapshotFailed(f"the export took longer than {timeout:.0f} s and was stopped")
            ok, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise SnapshotFailed(f"the export process died ({type(exc).__name__})") from exc
        if not ok:
            raise SnapshotFailed(f"the export failed: {value}")
        return value

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def stop(self) -> None:
        self._conn.close()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (id INTEGER PRIMARY KEY AUTOINCREMENT, file TEXT NOT NULL,
    created REAL NOT NULL, model_version INTEGER NOT NULL, steps INTEGER NOT NULL,
    samples_trained INTEGER NOT NULL, classes TEXT NOT NULL, size_bytes INTEGER NOT NULL, reason TEXT NOT NULL);
"""


class SnapshotStore:
    """Exports through the export process; lists and finds snapshots through the SQLite table."""

    def __init__(self, db: Database, directory: Path, method: str, timeout_s: float = 120.0, keep: int = 20):
        self.db = db
        self.directory = directory
        self.method = method
        self.timeout_s = timeout_s
        self.keep = keep
        directory.mkdir(parents=True, exist_ok=True)
        for orphan in directory.glob("*.onnx.tmp"):
            orphan.unlink()
        with db.schema() as schema:
            schema.executescript(SCHEMA)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onnx-export")
        self._process: ExportProcess | None = None
        self._count_changed = threading.Condition()
        self.in_flight = 0  # exports queued or running
        self.failures = 0
        try:
            self.latest_classes: tuple[str, ...] | None = tuple(self.latest()["classes"])
        except NotFound:
            self.latest_classes = None
        self._thread.submit(self._run, None)  # start the process and its imports now, not at the first export

    def submit(self, model: ReducedResNet18, classes: list[str | None], version: int, steps: int, samples: int,
               reason: str, head: tuple[torch.Tensor, torch.Tensor] | None = None, head_name: str = "softmax") -> Future:
        """Queue an export of `model` as it is now (the weights are copied here, between steps),
        with the head rows of `classes` that are not None (forgotten); the future gives the
        snapshot's row, or raises SnapshotFailed."""
        rows = [i for i, label in enumerate(classes) if label is not None]
        weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
        created = time.time()
        name = f"snapshot-{steps:09d}-v{version}-{time.time_ns()}.onnx"
        meta = {"model_version": version, "steps": steps, "samples_trained": samples, "method": self.method,
                "head": head_name, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                "service_version": __version__}
        head = None if head is None else tuple(t.detach().to("cpu", copy=True) for t in head)
        job = ExportJob(weights, model.input_size, [classes[i] for i in rows], rows, self.directory / name, meta,
                        head, normalize=head_name == "ncm")
        self._count(in_flight=1)
        return self._thread.submit(self._export, job, created, reason)

    def _run(self, job: ExportJob | None) -> int:
        if self._process is None or not self._process.alive:
            self._process = ExportProcess()
        try:
            return self._process.run(job, self.timeout_s)
        except SnapshotFailed:
            self._process.stop()
            self._process = None
            raise

    def _export(self, job: ExportJob, created: float, reason: str) -> dict:
        try:
            size = self._run(job)
            with self.db.write() as conn:
                sid = conn.execute("INSERT INTO snapshots (file, created, model_version, steps, samples_trained, "
                                   "classes, size_bytes, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                   (job.path.name, created, job.metadata["model_version"], job.metadata["steps"],
                                    job.metadata["samples_trained"], json.dumps(job.classes), size, reason)).lastrowid
                old = conn.execute("SELECT id, file FROM snapshots WHERE id <= ?", (sid - self.keep,)).fetchall()
                conn.execute("DELETE FROM snapshots WHERE id <= ?", (sid - self.keep,))
            for row in old:  # after the commit: a crash before it leaves every listed file in place
                (self.directory / row["file"]).unlink(missing_ok=True)
            self.latest_classes = tuple(job.classes)
            log.info("snapshot %d: %d classes, model version %d, %d steps (%s), %.1f MB", sid, len(job.classes),
                     job.metadata["model_version"], job.metadata["steps"], reason, size / 2**20)
            return self.get(sid)
        except BaseException:
            self._count(failures=1)
            job.path.unlink(missing_ok=True)
            log.exception("snapshot export failed")
            raise
        finally:
            self._count(in_flight=-1)

    def _count(self, in_flight: int = 0, failures: int = 0) -> None:
        with self._count_changed:
            self.in_flight += in_flight
            self.failures += failures
            self._count_changed.notify_all()

    def purge(self, forgotten: list, wait_s: float = 300.0) -> int:
        """Remove the snapshots that hold a forgotten class: those with its label made before it
        was forgotten (exports in flight finish first). Returns how many were removed."""
        with self._count_changed:
            self._count_changed.wait_for(lambda: not self.in_flight, timeout=wait_s)
        with self.db.write() as conn:
            rows = conn.execute("SELECT id, file, created, classes FROM snapshots").fetchall()
            doomed = [r for r in rows if any(f.label in json.loads(r["classes"]) and r["created"] < f.at
                                             for f in forgotten)]
            conn.executemany("DELETE FROM snapshots WHERE id = ?", [(r["id"],) for r in doomed])
        for r in doomed:  # after the commit, as in _export
            (self.directory / r["file"]).unlink(missing_ok=True)
        if doomed:
            try:
                self.latest_classes = tuple(self.latest()["classes"])
            except NotFound:
                self.latest_classes = None
        return len(doomed)

    def list(self) -> list[dict]:
        with self.db.read() as conn:
            return [self._public(r) for r in conn.execute("SELECT * FROM snapshots ORDER BY id")]

    def get(self, snapshot_id: int) -> dict:
        with self.db.read() as conn:
            row = conn.execute("SELECT * FROM snapshots WHERE id = ?", (snapshot_id,)).fetchone()
        if row is None:
            raise NotFound(f"no snapshot {snapshot_id}")
        return self._public(row)

    def latest(self) -> dict:
        with self.db.read() as conn:
            row = conn.execute("SELECT * FROM snapshots ORDER BY id DESC LIMIT 1").fetchone()
        if row is None:
            raise NotFound("no snapshot yet")
        return self._public(row)

    def path(self, row: dict) -> Path:
        return self.directory / row["file"]

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        if self._process is not None:
            self._process.stop()

    @staticmethod
    def _public(row) -> dict:
        return {"id": row["id"], "file": row["file"], "created": row["created"], "model_version": row["model_version"],
                "steps": row["steps"], "samples_trained": row["samples_trained"],
                "classes": json.loads(row["classes"]), "size_bytes": row["size_bytes"], "reason": row["reason"]}
