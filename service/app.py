"""The HTTP face of one learner: ingest (single, batch, streaming), predict, snapshots, health
and status. Routes stay thin; the work is in `inputs` (validation), `store` (the ingest log),
`worker` (the learner) and `snapshots` (ONNX export)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from fastapi import Depends, FastAPI, Query, Request, Response, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException

from .auth import check_token, require
from .inputs import InputError, decode_base64, decode_image, validate_label
from .metrics import Metrics
from .settings import Settings
from .store import IngestLog
from .worker import LearnerWorker


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        store = IngestLog(settings.database_path, (3, settings.image_size, settings.image_size))
        worker = LearnerWorker(settings, store, metrics)
        worker.start()
        app.state.store, app.state.worker, app.state.started = store, worker, time.time()
        yield
        worker.stop()

    app = FastAPI(title="ASER continual-learning service", lifespan=lifespan)
    metrics = Metrics()
    app.state.settings, app.state.metrics = settings, metrics
    # a stream's total size is unbounded; each of its messages is limited instead
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, exempt={"/samples/stream"})

    install_error_handlers(app, metrics)

    async def ingest(app, labels: list, blobs: list[bytes]) -> dict:
        """Validate, commit to the ingest log (durable on return), wake the learner."""
        images, names = await run_in_threadpool(decode_samples, labels, blobs, settings)
        seqs = await run_in_threadpool(app.state.store.append, names, images, settings.max_classes)
        app.state.worker.wakeup.set()
        metrics.samples_received.inc(len(seqs))
        return {"accepted": len(seqs), "first_seq": seqs[0], "last_seq": seqs[-1]}

    async def ingest_message(app, raw: bytes | str | InputError, n: int) -> dict:
        """One streamed message (a sample or {'samples': [...]}) -> its acknowledgement."""
        try:
            if isinstance(raw, InputError):
                raise raw
            if len(raw) > settings.max_body_bytes:
                raise InputError("body_too_large", f"a message may hold {settings.max_body_bytes} bytes", 413)
            ack = await ingest(app, *json_samples(parse_json(raw), settings))
            return {"message": n, **ack}
        except InputError as exc:
            metrics.samples_rejected.labels(exc.code).inc()
            return {"message": n, "error": exc.code, "detail": exc.detail, "status": exc.status}

    @app.post("/samples", status_code=201, dependencies=[Depends(require("write"))])
    async def post_samples(request: Request):
        """One or many labelled images: JSON (base64 images) or multipart (files + label fields)."""
        labels, blobs = await read_samples(request, settings)
        return await ingest(request.app, labels, blobs)

    @app.post("/samples/stream", dependencies=[Depends(require("write"))])
    async def stream_samples(request: Request):
        """NDJSON over one chunked request: each line a sample (or a batch); each answered by one
        NDJSON acknowledgement line, sent once that line is committed. A bad line is refused alone."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in ("application/x-ndjson", "application/jsonl"):
            raise InputError("unsupported_media_type", "stream application/x-ndjson, one JSON sample per line", 415)

        async def acks():
            n = 0
            async for line in ndjson_lines(request.stream(), settings.max_body_bytes):
                n += 1
                yield json.dumps(await ingest_message(request.app, line, n)) + "\n"

        return DuplexStream(acks(), media_type="application/x-ndjson")

    @app.websocket("/samples/ws")
    async def samples_websocket(websocket: WebSocket):
        """One long-lived connection: each text message a sample (or a batch), each answered by one
        JSON acknowledgement after its commit."""
        try:
            check_token(websocket, "write")
        except InputError as exc:
            await websocket.close(code=1008, reason=exc.detail)
            return
        await websocket.accept()
        n = 0
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                n += 1
                raw = message.get("text") if message.get("text") is not None else message.get("bytes", b"")
                await websocket.send_json(await ingest_message(websocket.app, raw, n))
        except WebSocketDisconnect:
            pass

    @app.post("/snapshots", status_code=201, dependencies=[Depends(require("admin"))])
    async def create_snapshot(request: Request):
        """Export the current model to ONNX now; answers the snapshot's record."""
        future = request.app.state.worker.request_snapshot()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout=settings.snapshot_timeout_s)
        except LookupError as exc:
            raise InputError("no_classes", str(exc), 409) from exc
        except TimeoutError as exc:
            raise InputError("snapshot_timeout", "the export did not finish in time; it may still appear "
                             "in GET /snapshots", 503) from exc

    @app.get("/snapshots", dependencies=[Depends(require("read"))])
    async def list_snapshots(request: Request):
        return {"snapshots": await run_in_threadpool(request.app.state.worker.snapshots.list)}

    @app.get("/snapshots/{snapshot_id}", dependencies=[Depends(require("read"))])
    async def download_snapshot(request: Request, snapshot_id: str):
        """The .onnx file of a snapshot (an id, or 'latest')."""
        snapshots = request.app.state.worker.snapshots
        if snapshot_id == "latest":
            row = await run_in_threadpool(snapshots.latest)
        elif snapshot_id.isdigit():
            row = await run_in_threadpool(snapshots.get, int(snapshot_id))
        else:
            raise InputError("invalid_snapshot_id", "a snapshot id is a number or 'latest'", 422)
        if row is None:
            raise InputError("not_found", f"no snapshot {snapshot_id}", 404)
        return FileResponse(snapshots.path(row), media_type="application/octet-stream", filename=row["file"],
                            headers={"X-Snapshot-Id": str(row["id"]), "X-Model-Version": str(row["model_version"])})

    @app.get("/predict", dependencies=[Depends(require("read"))])
    async def get_predict(request: Request, image: str = Query(..., description="base64url-encoded PNG or JPEG"),
                          k: int = Query(3, ge=1)):
        with metrics.predict_latency.time():
            images = await run_in_threadpool(decode_many, [decode_base64(image)], settings)
            answer = await run_in_threadpool(predict, request.app.state.worker, images, min(k, settings.max_top_k))
        return {"model_version": answer["model_version"], "steps": answer["steps"], "top": answer["results"][0]}

    @app.post("/predict", dependencies=[Depends(require("read"))])
    async def post_predict(request: Request, k: int = Query(3, ge=1)):
        blobs, k_body = await read_images(request, settings)
        with metrics.predict_latency.time():
            images = await run_in_threadpool(decode_many, blobs, settings)
            return await run_in_threadpool(predict, request.app.state.worker, images,
                                           min(k_body or k, settings.max_top_k))

    @app.get("/metrics", dependencies=[Depends(require("read"))])
    async def prometheus_metrics(request: Request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        worker: LearnerWorker = request.app.state.worker
        received = await run_in_threadpool(request.app.state.store.count)
        metrics.backlog.set(received - worker.trained)
        metrics.model_version.set(worker.predictor.version)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request):
        worker: LearnerWorker = request.app.state.worker
        if not worker.alive or worker.error is not None:
            return JSONResponse({"status": "not ready", "detail": repr(worker.error)}, status_code=503)
        return {"status": "ready"}

    @app.get("/status", dependencies=[Depends(require("read"))])
    async def status(request: Request):
        worker: LearnerWorker = request.app.state.worker
        store: IngestLog = request.app.state.store
        classes = await run_in_threadpool(store.classes)
        received = await run_in_threadpool(store.count)
        return {
            "samples_received": received,
            "samples_trained": worker.trained,
            "trained_upto": worker.trained_upto,
            "backlog": received - worker.trained,
            "classes": classes,
            "buffer": {classes[c]: n for c, n in sorted(worker.buffer_counts.items()) if c < len(classes)},
            "buffer_size": sum(worker.buffer_counts.values()),
            "model_version": worker.predictor.version,
            "steps": worker.learner.steps,
            "last_step_ms": round(1000 * worker.last_step_seconds, 2),
            "method": settings.method,
            "config": {name: getattr(settings, name) for name in ("mem_size", "batch_size", "replay_batch", "k",
                                                                  "n_candidates", "per_class", "lr", "seed")},
            "error": None if worker.error is None else repr(worker.error),
            "device": worker.device,
            "uptime_s": round(time.time() - request.app.state.started, 1),
        }

    return app


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error is a JSON body {'error': code, 'detail': ...} with its 4xx status."""

    @app.exception_handler(InputError)
    async def input_error(request: Request, exc: InputError):
        metrics.samples_rejected.labels(exc.code).inc()
        return JSONResponse({"error": exc.code, "detail": exc.detail}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse({"error": "invalid_request", "detail": jsonable(exc.errors())}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse({"error": "http_error", "detail": exc.detail}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))


def jsonable(errors) -> list:
    return [{k: (v if isinstance(v, (str, int, float, list, type(None))) else str(v)) for k, v in e.items()}
            for e in errors]


# --- request parsing ------------------------------------------------------------------------
async def read_samples(request: Request, settings: Settings) -> tuple[list, list[bytes]]:
    kind = content_kind(request)
    if kind == "json":
        return json_samples(await read_json(request), settings)
    form = await request.form(max_files=settings.max_samples_per_request + 1,
                              max_fields=settings.max_samples_per_request + 1)
    files = form_images(form, settings, "samples")
    labels = [v for v in form.getlist("label") if isinstance(v, str)]
    if len(labels) == 1 and len(files) > 1:
        labels = labels * len(files)  # one label for the whole upload
    if len(labels) != len(files):
        raise InputError("invalid_request", f"got {len(files)} images and {len(labels)} labels; "
                                            "send one label per image, or one for all", 422)
    return labels, [await f.read() for f in files]


def json_samples(body, settings: Settings) -> tuple[list, list[bytes]]:
    """{'label', 'image'} or {'samples': [...]} or a list of samples -> labels, image bytes."""
    if isinstance(body, dict) and "samples" in body:
        items = body["samples"]
    elif isinstance(body, dict):
        items = [body]
    else:
        items = body
    if not isinstance(items, list) or not items:
        raise InputError("invalid_request", "send {'label': ..., 'image': base64} or {'samples': [...]}", 400)
    check_count(len(items), settings)
    labels, blobs = [], []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "label" not in item or "image" not in item:
            raise InputError("invalid_request", f"sample {i} needs 'label' and 'image'", 422)
        labels.append(item["label"])
        blobs.append(decode_base64(item["image"], f"sample {i}'s image"))
    return labels, blobs


async def ndjson_lines(chunks: AsyncIterator[bytes], max_line: int) -> AsyncIterator[bytes | InputError]:
    """Non-empty lines of a streamed body; a line over max_line bytes becomes an InputError."""
    pending, skipping = b"", False
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if skipping:
                skipping = False
                continue
            if line.strip():
                yield line
        if len(pending) > max_line:
            if not skipping:
                yield InputError("body_too_large", f"a line may hold {max_line} bytes", 413)
            pending, skipping = b"", True
    if pending.strip() and not skipping:
        yield pending


async def read_images(request: Request, settings: Settings) -> tuple[list[bytes], int | None]:
    kind = content_kind(request)
    if kind == "json":
        body = await read_json(request)
        if not isinstance(body, dict) or not ("images" in body or "image" in body):
            raise InputError("invalid_request", "send {'images': [base64, ...]} or {'image': base64}", 400)
        items = body.get("images", [body.get("image")])
        if not isinstance(items, list) or not items:
            raise InputError("invalid_request", "'images' must be a non-empty list", 422)
        k = body.get("k")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise InputError("invalid_request", "'k' must be a positive integer", 422)
        check_count(len(items), settings)
        return [decode_base64(t, f"image {i}") for i, t in enumerate(items)], k
    form = await request.form(max_files=settings.max_samples_per_request + 1)
    return [await f.read() for f in form_images(form, settings, "predictions")], None


def form_images(form, settings: Settings, what: str) -> list[UploadFile]:
    """The 'image' files of a multipart form: at least one, at most the per-request limit."""
    files = [f for f in form.getlist("image") if isinstance(f, UploadFile)]
    if not files:
        raise InputError("invalid_request", f"multipart {what} need one or more 'image' files", 422)
    check_count(len(files), settings)
    return files


def content_kind(request: Request) -> str:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/json":
        return "json"
    if ctype == "multipart/form-data":
        return "multipart"
    raise InputError("unsupported_media_type", "send application/json or multipart/form-data", 415)


async def read_json(request: Request):
    return parse_json(await request.body())


def parse_json(body: bytes | str):
    if not body or not body.strip():
        raise InputError("empty_body", "the request body is empty", 400)
    try:
        return json.loads(body)
    except ValueError as exc:
        raise InputError("invalid_json", f"the body is not valid JSON: {exc}", 400) from exc


def check_count(n: int, settings: Settings) -> None:
    if n > settings.max_samples_per_request:
        raise InputError("too_many_samples", f"at most {settings.max_samples_per_request} per request, got {n}", 413)


def decode_samples(labels: list, blobs: list[bytes], settings: Settings) -> tuple[torch.Tensor, list[str]]:
    names = [validate_label(label, settings.max_label_length) for label in labels]
    return decode_many(blobs, settings), names


def decode_many(blobs: list[bytes], settings: Settings) -> torch.Tensor:
    images = []
    for i, blob in enumerate(blobs):
        try:
            images.append(decode_image(blob, settings.image_size, settings.max_image_bytes))
        except InputError as exc:
            raise InputError(exc.code, f"image {i}: {exc.detail}" if len(blobs) > 1 else exc.detail, exc.status) from exc
    return torch.stack(images)


def predict(worker: LearnerWorker, images: torch.Tensor, k: int) -> dict:
    predictor = worker.predictor  # one consistent model for the whole request
    if not predictor.classes:
        raise InputError("no_classes", "the model has not learned any class yet", 409)
    return {"model_version": predictor.version, "steps": predictor.steps,
            "results": top_k(predictor.probabilities(images), predictor.classes, k)}


def top_k(probs: torch.Tensor, classes, k: int) -> list[list[dict]]:
    """[n, classes] probabilities -> per image the k most likely labels with their probabilities."""
    top = torch.topk(probs, min(k, probs.shape[1]), dim=1)
    return [[{"label": classes[int(c)], "probability": round(float(p), 6)} for p, c in zip(ps, cs)]
            for ps, cs in zip(top.values, top.indices)]


class DuplexStream(StreamingResponse):
    """A streamed answer to a body that is still arriving. Starlette's StreamingResponse also
    reads `receive` to watch for a disconnect, which would swallow body chunks of a stream;
    here the body reader is the only one, and a disconnect ends it (ClientDisconnect)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.stream_response(send)
        except ClientDisconnect:
            pass


class BodyLimit:
    """Refuses bodies over max_bytes with 413, by Content-Length or while streaming."""

    def __init__(self, app, max_bytes: int, exempt: set[str] = frozenset()):
        self.app, self.max_bytes, self.exempt = app, max_bytes, exempt

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(send, int(length) if length.isdigit() else None)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise InputError("body_too_large", f"the body exceeds {self.max_bytes} bytes", 413)
            return message

        return await self.app(scope, limited, send)

    async def _refuse(self, send, length):
        body = JSONResponse({"error": "body_too_large", "detail": f"the body ({length} bytes) exceeds "
                             f"{self.max_bytes} bytes"}, status_code=413)
        await body({"type": "http"}, None, send)
