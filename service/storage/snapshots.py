"""ONNX snapshots of the learner's model, for inference clients that need nothing else.

A snapshot is the eval-mode network from uint8 RGB pixels to logits (the scaling to [0, 1]
is inside the graph), with the head cut to the classes it has learned (and not forgotten). Its format (graph I/O,
metadata keys) is `learner.formats.snapshot`'s, so `clients.onnx_client` and the replica predict
from the file alone. Files are written under a temporary name,
fsynced and renamed, then recorded in the `snapshots` table; a crash leaves no half file listed.

The export runs in a separate process (spawned, so it shares no interpreter state with the
learner): tracing runs the network, and its time and memory stay out of the learner's. The learner
thread only copies the weights between two steps; one exporter thread here feeds that process one job at a time,
kills and replaces it if it hangs or dies, and records each finished file.
"""

from __future__ import annotations

import copy
import io
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

import numpy as np
import torch
from torch import nn

from learner.formats.snapshot import INPUT_NAME, OUTPUT_NAME, UNKNOWN_OUTPUT, metadata_props
from learner.heads.calibration import Calibration
from learner.heads.head_choice import CANDIDATES, UNFITTED_POOL, reads_top, serve
from learner.methods.base import ContinualLearner
from learner.networks.backbone import ScratchBackbone, backbone_of
from service import __version__
from service.storage.db import Database
from service.storage.durable import replace_durably
from service.storage.errors import NotFound, SnapshotFailed
from service.storage.integrity import Damage, sha256_of

log = logging.getLogger("aser.snapshots")

class PixelsToLogits(nn.Module):
    """uint8 [n, 3, H, W] -> logits over the head rows `rows` (the classes learned and not
    forgotten), in eval mode, on a copy of `model` taken now (later training steps do not reach it).
    The pixels take the backbone's path (`pixel_module`): from scratch the scaled pixels into the
    network; on the pretrained backbone the frozen part, the latent as stored and the top (or, with
    `frozen_features`, the frozen network's own features, which a streaming head reads). The head is
    the model's own or a given one (`head`: weight, bias), on unit-norm features with `normalize`
    (the memory's class means, `learner.heads.ncm.ncm_head`). With `stream_head` and `choice` (a measured
    choice, `learner.heads.head_choice`): the frozen part once, the top's head and streaming LDA's on the
    frozen features, each class's probability from its head, renormalised; the logits are their logarithms."""

    def __init__(self, model: nn.Module, rows: list[int], head: tuple[torch.Tensor, torch.Tensor] | None = None,
                 normalize: bool = False, backbone=None, frozen_features: bool = False,
                 stream_head: tuple[torch.Tensor, torch.Tensor] | None = None, choice: list[int] | None = None,
                 pool: tuple = UNFITTED_POOL, calibrated: Calibration | None = None):
        super().__init__()
        net = copy.deepcopy(model).float().to("cpu", memory_format=torch.contiguous_format)
        weight, bias = head if head is not None else (net.head.weight, net.head.bias)
        self.head = _rows(weight, bias, rows)
        net.head = nn.Identity()
        backbone = backbone or ScratchBackbone((3, net.input_size, net.input_size))
        self.input_size = backbone.input_size
        self.chooses = choice is not None
        self.calibrated = calibrated  # the temperature and "none of these": a second output
        if calibrated is not None:  # the classes the floor spreads over, of the rows the graph answers
            live = calibrated.live if calibrated.live is not None else torch.ones(max(rows) + 1, dtype=torch.bool)
            self.register_buffer("live", live[rows].clone())
            # the classes whose rows take streaming LDA's calibrated answer (`blind_answers`), of the rows answered
            blind = None if calibrated.blind is None or choice is None else calibrated.blind[rows].clone()
            self.register_buffer("blind", blind)
        # "none of these" reads the frozen features where the learner's does (it has class means of them)
        self.reads_frozen = calibrated is not None and calibrated.means is not None and not frozen_features
        if self.chooses:
            self.stream_head = _rows(*stream_head, rows)
            self.register_buffer("choice", torch.tensor([choice[r] for r in rows], dtype=torch.long))
            weights = torch.as_tensor(pool[0], dtype=torch.float32).broadcast_to((len(choice),))
            self.register_buffer("pool_weight", weights[rows].clone())  # `HeadChoice.pool_of`
            self.pool_temperature = float(pool[1])
        # ... and the stored latent's channel means where the learner's does (`Calibration.channel_distance`)
        self.reads_channels = calibrated is not None and calibrated.parts is not None
        channels = {"channels_too": True} if self.reads_channels else {}
        # a choice that reads no top's answer (before a sleep) leaves the top out of the graph: the same answers
        self.reads_top = not self.chooses or reads_top(self.choice, self.pool_weight)
        if not self.reads_top:
            self.features = backbone.pixel_module(None, **channels)
        elif self.chooses or self.reads_frozen:
            self.features = backbone.pixel_module(net, frozen_too=True, **channels)
        else:
            self.features = backbone.pixel_module(None if frozen_features else net, **channels)
        self.normalize = normalize
        self.frozen_features = frozen_features
        self.eval()

    def forward(self, pixels: torch.Tensor):
        outputs, channels = self._features(pixels)
        logits, frozen, stream = self._logits(outputs)
        if self.calibrated is None:
            return logits
        probabilities = self.calibrated.probabilities(logits, self.live, stream, self.blind)
        return probabilities.log(), self.calibrated.unknown_score(probabilities, frozen, channels)

    def _features(self, pixels: torch.Tensor):
        """What `features` computes of the pixels, and apart from it the stored latent's channel means (or None)."""
        outputs = self.features(pixels)
        if not self.reads_channels:
            return outputs, None
        *rest, channels = outputs
        return (rest[0] if len(rest) == 1 else tuple(rest)), channels

    def _logits(self, outputs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The served logits before calibration, the frozen features where they were computed, and under a choice
        streaming LDA's logits (the logarithms of its probabilities), from `_features`' outputs."""
        if self.chooses:
            top, frozen = outputs if self.reads_top else (None, outputs)
            streaming = torch.softmax(self.stream_head(frozen), 1)
            trained = torch.softmax(self.head(top), 1) if self.reads_top else None
            served = serve(streaming, trained, self.choice, (self.pool_weight, self.pool_temperature))
            return served.clamp_min(1e-30).log(), frozen, streaming.clamp_min(1e-30).log()
        features, frozen = outputs if self.reads_frozen else (outputs, None)
        frozen = features if self.frozen_features else frozen
        return self.head(nn.functional.normalize(features, dim=1) if self.normalize else features), frozen, None


def _rows(weight: torch.Tensor, bias: torch.Tensor, rows: list[int]) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], len(rows))
    with torch.no_grad():
        layer.weight.copy_(weight[rows])
        layer.bias.copy_(bias[rows])
    return layer


def export_onnx(net: PixelsToLogits, classes: list[str], path: Path, metadata: dict) -> None:
    """Write `net` as ONNX to `path`, with `classes` (its outputs, in order) and `metadata`. The
    TorchScript tracer, as for the learner's frozen part (`learner.networks.frozen_runtime`): these networks have no
    control flow, and it exports Lite0 in 0.5 CPU s where torch.export takes 7 (the same graph's answers
    within 1e-5), which a small device pays at every new class."""
    import onnx

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    size = net.input_size
    example = torch.zeros(2, 3, size, size, dtype=torch.uint8)
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's and the legacy exporter's deprecation notes
        outputs = [OUTPUT_NAME] + [UNKNOWN_OUTPUT] * (net.calibrated is not None)
        torch.onnx.export(net, (example,), buffer, dynamo=False, input_names=[INPUT_NAME], output_names=outputs,
                          dynamic_axes={name: {0: "batch"} for name in (INPUT_NAME, *outputs)}, opset_version=17)
    model = onnx.load_from_string(buffer.getvalue())
    onnx.helper.set_model_props(model, metadata_props(classes, size, metadata))
    tmp = path.with_suffix(".onnx.tmp")
    onnx.save(model, str(tmp))
    replace_durably(tmp, path)


@dataclass(frozen=True)
class ExportJob:
    """What the export process needs: a copy of the weights taken between two steps."""

    weights: dict[str, torch.Tensor]
    backbone: dict  # the learner's `backbone.identity()`
    image_size: int
    classes: list[str]
    rows: list[int]  # the head row of each class
    path: Path
    metadata: dict
    head: tuple[torch.Tensor, torch.Tensor] | None = None  # the served head (None: the model's own)
    normalize: bool = False  # the head takes unit-norm features
    frozen_features: bool = False  # the head reads the frozen network's features (a streaming head)
    stream_head: tuple[torch.Tensor, torch.Tensor] | None = None  # a measured choice: streaming LDA's head...
    choice: list[int] | None = None  # ... and each class's head (`learner.heads.head_choice.CANDIDATES`)
    pool: tuple = UNFITTED_POOL  # ... and the pooled candidate's (weight a class, temperature)
    calibrated: Calibration | None = None  # the temperature and "none of these" (`learner.heads.calibration`)
    calibration: np.ndarray | None = None  # uint8 recent images: also an int8 variant (`quantise_snapshot`)
    min_agreement: float = 1.0  # ... kept when its top-1 agrees with the fp32 graph on this share of them


def run_export(job: ExportJob) -> dict:
    """Build the network from the weights, export it to job.path (and its int8 variant where asked
    and agreeing); returns the files' sizes and the variant's agreement."""
    backbone = backbone_of(job.backbone, (3, job.image_size, job.image_size))
    model = backbone.make_model(job.weights["head.weight"].shape[0], seed=0)
    model.load_state_dict(job.weights)
    export_onnx(PixelsToLogits(model, job.rows, job.head, job.normalize, backbone, job.frozen_features,
                               job.stream_head, job.choice, job.pool, job.calibrated), job.classes, job.path,
                job.metadata)
    done = {"size": job.path.stat().st_size, "int8": None}
    if job.calibration is not None:
        int8 = int8_path(job.path)
        agreement = quantise_snapshot(job.path, int8, job.calibration)
        if agreement >= job.min_agreement:
            done["int8"] = {"size": int8.stat().st_size, "agreement": agreement}
        else:
            int8.unlink(missing_ok=True)
            log.warning("the int8 variant agrees with fp32 on %.1f%% of %d recent images, under %.1f%%: not kept",
                        100 * agreement, len(job.calibration) // 2, 100 * job.min_agreement)
    return done


def int8_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".onnx") + ".int8.onnx")


def quantise_snapshot(fp32: Path, int8: Path, images: np.ndarray) -> float:
    """onnxruntime's static quantisation (QDQ, int8 weights per channel, uint8 activations) of the
    snapshot `fp32` into `int8`, calibrated on every second of `images` (uint8 [n, 3, H, W]); returns the
    share of the others on which the two answer the same top-1."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from learner.formats.snapshot import OnnxSnapshot

    calibrate, held_out = images[0::2], images[1::2]

    class Recent(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{INPUT_NAME: calibrate[i:i + 8]} for i in range(0, len(calibrate), 8)])

        def get_next(self):
            return next(self.batches, None)

    tmp = int8.with_suffix(".onnx.tmp")
    quantize_static(str(fp32), str(tmp), Recent(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    answers = [OnnxSnapshot(path, threads=1).logits(held_out).argmax(1) for path in (fp32, tmp)]
    agreement = float((answers[0] == answers[1]).mean())
    source, model = onnx.load(str(fp32), load_external_data=False), onnx.load(str(tmp))
    # the snapshot's own metadata (labels, input shape, ...) and the variant's, replacing the quantiser's
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in source.metadata_props}, "variant": "int8",
                                        "int8_agreement": json.dumps(agreement)})
    onnx.save(model, str(tmp))
    replace_durably(tmp, int8)
    return agreement


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
            answer = (True, run_export(job) if job is not None else {})  # None: warm up the imports
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

    def run(self, job: ExportJob | None, timeout: float) -> dict:
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
    samples_trained INTEGER NOT NULL, classes TEXT NOT NULL, size_bytes INTEGER NOT NULL, reason TEXT NOT NULL,
    int8_size_bytes INTEGER, int8_agreement REAL);
"""


class SnapshotStore:
    """Exports through the export process; lists and finds snapshots through the SQLite table.
    `keep_exporter`: the export process stays between exports (its imports take seconds), or ends
    after each (the pretrained backbone's: a process holding torch, the exporter and Lite0 costs some
    360 MB between exports that seldom come, results/pretrained/service-soak-lite0.json)."""

    def __init__(self, db: Database, directory: Path, method: str, timeout_s: float = 120.0, keep: int = 20,
                 keep_exporter: bool = True, damage: Damage | None = None):
        self.db = db
        self.directory = directory
        self.method = method
        self.timeout_s = timeout_s
        self.keep = keep
        self.keep_exporter = keep_exporter
        directory.mkdir(parents=True, exist_ok=True)
        for orphan in directory.glob("*.onnx.tmp"):
            orphan.unlink()
        with db.schema() as schema:
            schema.executescript(SCHEMA)
            if "int8_size_bytes" not in schema["snapshots"].columns_dict:  # databases of earlier versions
                schema["snapshots"].add_column("int8_size_bytes", int)
                schema["snapshots"].add_column("int8_agreement", float)
            if "sha256" not in schema["snapshots"].columns_dict:
                schema["snapshots"].add_column("sha256", str)
        self.damage = damage or Damage()
        self.lost_latest = self._set_aside_damaged()  # the worker exports again once it has a model
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onnx-export")
        self._process: ExportProcess | None = None
        self._count_changed = threading.Condition()
        self.in_flight = 0  # exports queued or running
        self.failures = 0
        try:
            self.latest_classes: tuple[str, ...] | None = tuple(self.latest()["classes"])
        except NotFound:
            self.latest_classes = None
        if keep_exporter:
            self._thread.submit(self._run, None)  # start the process and its imports now, not at the first export

    def submit(self, learner: ContinualLearner, classes: list[str | None], version: int, steps: int, samples: int,
               reason: str, head: tuple[torch.Tensor, torch.Tensor] | None = None, head_name: str = "softmax",
               calibration: np.ndarray | None = None, min_agreement: float = 1.0,
               chosen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               calibrated: Calibration | None = None) -> Future:
        """Queue an export of `learner`'s served network as it is now (the weights are copied here,
        between steps), with the head rows of `classes` that are not None (forgotten) of `head` (the
        served head; None: the network's own), and with `calibration` images an int8 variant kept
        where it agrees (`run_export`); with `chosen` (streaming LDA's weight and bias, each class's head) the
        measured choice beside `head`; with `calibrated` the temperature inside the graph and its "none of these"
        score a second output; the future gives the snapshot's row, or raises SnapshotFailed."""
        rows = [i for i, label in enumerate(classes) if label is not None]
        model = learner.serving_model
        weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
        created = time.time()
        name = f"snapshot-{steps:09d}-v{version}-{time.time_ns()}.onnx"
        meta = {"model_version": version, "steps": steps, "samples_trained": samples, "method": self.method,
                "backbone": learner.backbone.name, "head": head_name, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                "service_version": __version__}
        head = None if head is None else tuple(t.detach().to("cpu", copy=True) for t in head)
        if chosen is not None:  # which head answers each class, by label, in the metadata too
            meta["head_choice"] = {classes[i]: CANDIDATES[int(chosen[2][i])] for i in rows}
            measured = learner.head_choice
            weighed = rows if measured.pool_classes is None else [i for i in measured.pool_classes if i in rows]
            meta["head_pool"] = {**dict(zip(("weight", "temperature"), measured.pool)),
                                 "classes": [classes[i] for i in weighed]}
        if calibrated is not None:  # what the second output's score is measured against
            meta["calibration"] = calibrated.summary()
        job = ExportJob(weights, learner.backbone.identity(), learner.image_shape[1], [classes[i] for i in rows], rows,
                        self.directory / name, meta, head, normalize=head_name == "ncm",
                        frozen_features=head_name == "slda", calibration=calibration,
                        min_agreement=min_agreement,
                        stream_head=None if chosen is None else
                        tuple(t.detach().to("cpu", copy=True) for t in chosen[:2]),
                        choice=None if chosen is None else chosen[2].tolist(),
                        pool=UNFITTED_POOL if chosen is None else learner.head_choice.pool_of(learner.num_classes),
                        calibrated=calibrated)
        self._count(in_flight=1)
        return self._thread.submit(self._export, job, created, reason)

    def _run(self, job: ExportJob | None) -> dict:
        if self._process is None or not self._process.alive:
            self._process = ExportProcess()
        try:
            return self._process.run(job, self.timeout_s)
        except SnapshotFailed:
            self._stop_process()
            raise
        finally:
            if not self.keep_exporter and self._process is not None:
                self._stop_process()

    def _stop_process(self) -> None:
        self._process.stop()
        self._process = None

    def _export(self, job: ExportJob, created: float, reason: str) -> dict:
        try:
            done = self._run(job)
            size, int8, digest = done["size"], done["int8"] or {}, sha256_of(job.path)
            with self.db.write() as conn:
                sid = conn.execute("INSERT INTO snapshots (file, created, model_version, steps, samples_trained, "
                                   "classes, size_bytes, reason, int8_size_bytes, int8_agreement, sha256) "
                                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                   (job.path.name, created, job.metadata["model_version"], job.metadata["steps"],
                                    job.metadata["samples_trained"], json.dumps(job.classes), size, reason,
                                    int8.get("size"), int8.get("agreement"), digest)).lastrowid
                old = conn.execute("SELECT id, file FROM snapshots WHERE id <= ?", (sid - self.keep,)).fetchall()
                conn.execute("DELETE FROM snapshots WHERE id <= ?", (sid - self.keep,))
            for row in old:  # after the commit: a crash before it leaves every listed file in place
                self._remove_files(row["file"])
            self.latest_classes = tuple(job.classes)
            log.info("snapshot %d: %d classes, model version %d, %d steps (%s), %.1f MB%s", sid, len(job.classes),
                     job.metadata["model_version"], job.metadata["steps"], reason, size / 2**20,
                     f", int8 {int8['size'] / 2**20:.1f} MB agreeing on {100 * int8['agreement']:.1f}%" if int8 else "")
            return self.get(sid)
        except BaseException:
            self._count(failures=1)
            self._remove_files(job.path.name)
            log.exception("snapshot export failed")
            raise
        finally:
            self._count(in_flight=-1)

    def _set_aside_damaged(self) -> bool:
        """Each listed snapshot whose file is missing, of another size or (where recorded) another sha256 is set aside
        and unlisted, its int8 variant with it; an int8 variant alone damaged is unlisted alone. Returns whether the
        latest was."""
        with self.db.read() as conn:
            rows = conn.execute("SELECT * FROM snapshots ORDER BY id").fetchall()
        damaged, int8_damaged = [], []
        for row in rows:
            path = self.directory / row["file"]
            if reason := _file_damage(path, row["size_bytes"], row["sha256"]):
                self.damage.set_aside(path, reason, "snapshot", "unlisted; the model is exported again")
                int8_path(path).unlink(missing_ok=True)
                damaged.append(row["id"])
            elif row["int8_size_bytes"] is not None and (reason := _file_damage(int8_path(path),
                                                                               row["int8_size_bytes"])):
                self.damage.set_aside(int8_path(path), reason, "snapshot", "the snapshot is served without its int8 variant")
                int8_damaged.append(row["id"])
        if damaged or int8_damaged:
            with self.db.write() as conn:
                conn.executemany("DELETE FROM snapshots WHERE id = ?", [(i,) for i in damaged])
                conn.executemany("UPDATE snapshots SET int8_size_bytes = NULL, int8_agreement = NULL WHERE id = ?",
                                 [(i,) for i in int8_damaged])
        return bool(rows) and rows[-1]["id"] in damaged

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
            self._remove_files(r["file"])
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

    def path(self, row: dict, variant: str = "fp32") -> Path:
        """A snapshot's file, or its int8 variant's (NotFound where it has none)."""
        if variant == "fp32":
            return self.directory / row["file"]
        if row["int8"] is None:
            raise NotFound(f"snapshot {row['id']} has no int8 variant (ASER_SNAPSHOT_INT8 was off, or it did not agree)")
        return int8_path(self.directory / row["file"])

    def _remove_files(self, name: str) -> None:
        for path in (self.directory / name, int8_path(self.directory / name)):
            path.unlink(missing_ok=True)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        if self._process is not None:
            self._process.stop()

    @staticmethod
    def _public(row) -> dict:
        return {"id": row["id"], "file": row["file"], "created": row["created"], "model_version": row["model_version"],
                "steps": row["steps"], "samples_trained": row["samples_trained"],
                "classes": json.loads(row["classes"]), "size_bytes": row["size_bytes"], "reason": row["reason"],
                "int8": None if row["int8_size_bytes"] is None else
                {"size_bytes": row["int8_size_bytes"], "agreement": row["int8_agreement"]}}


def _file_damage(path: Path, size: int, sha256: str | None = None) -> str | None:
    """What is wrong with a snapshot file against its row (None: nothing)."""
    if not path.exists():
        return "missing"
    if path.stat().st_size != size:
        return f"{path.stat().st_size} bytes where {size} were written"
    if sha256 is not None and sha256_of(path) != sha256:
        return "its sha256 is not the one written"
    return None
