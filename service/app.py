"""The HTTP face of one learner: ingest, predict, health and status. Routes stay thin; the
work is in `inputs` (validation), `store` (the ingest log) and `worker` (the learner)."""

from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager

import torch
from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from .auth import require
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
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

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

    @app.post("/samples", status_code=201, dependencies=[Depends(require("write"))])
    async def post_samples(request: Request):
        """One or many labelled images: JSON (base64 images) or multipart (files + label fields)."""
        labels, blobs = await read_samples(request, settings)
        images, names = await run_in_threadpool(decode_samples, labels, blobs, settings)
        store: IngestLog = request.app.state.store
        seqs = await run_in_threadpool(store.append, names, images, settings.max_classes)
        request.app.state.worker.wakeup.set()
        metrics.samples_received.inc(len(seqs))
        return {"accepted": len(seqs), "first_seq": seqs[0], "last_seq": seqs[-1]}

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
            "device": worker.device,
            "uptime_s": round(time.time() - request.app.state.started, 1),
        }

    return app


def jsonable(errors) -> list:
    return [{k: (v if isinstance(v, (str, int, float, list, type(None))) else str(v)) for k, v in e.items()}
            for e in errors]


# --- request parsing ------------------------------------------------------------------------
async def read_samples(request: Request, settings: Settings) -> tuple[list, list[bytes]]:
    kind = content_kind(request)
    if kind == "json":
        body = await read_json(request)
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
    body = await request.body()
    if not body:
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
    probs = predictor.probabilities(images)
    top = torch.topk(probs, min(k, probs.shape[1]), dim=1)
    results = [[{"label": predictor.classes[int(c)], "probability": round(float(p), 6)} for p, c in zip(ps, cs)]
               for ps, cs in zip(top.values, top.indices)]
    return {"model_version": predictor.version, "steps": predictor.steps, "results": results}


class BodyLimit:
    """Refuses bodies over max_bytes with 413, by Content-Length or while streaming."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
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
