"""A stateless inference replica: answers /predict from the learner's latest ONNX snapshot.

It keeps nothing on disk. Every ASER_REPLICA_POLL_S it asks the learner at
ASER_REPLICA_SOURCE for its snapshot list; a newer snapshot is downloaded into memory, loaded
with onnxruntime and swapped in whole, so a request is answered by one snapshot from start to
end. Not ready (503) until the first snapshot is loaded. Same request and answer formats as
the learner's /predict, plus the snapshot id that answered.

    ASER_REPLICA_SOURCE=http://learner:8000 ASER_PORT=8001 python -m service.replica
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from learner.formats.snapshot import OnnxSnapshot, top_k
from service.metrics import Metrics
from service.settings import Settings
from service.storage.errors import NoSnapshotYet
from service.web.guard import WebPageGuard, allowed_hosts
from service.web.inputs import decode_base64, decode_images
from service.web.routers.auth import Access
from service.web.routers.bodies import IMAGE_QUERY, K_QUERY, BodyModels, predict_request_images
from service.web.routers.errors import BodyLimit, install_error_handlers

log = logging.getLogger("aser.replica")


@dataclass(frozen=True)
class LoadedSnapshot:
    id: int
    classifier: OnnxSnapshot  # its input shape gives the image size it takes


class SnapshotFollower:
    """Keeps the newest snapshot of the learner loaded."""

    def __init__(self, settings: Settings):
        self.settings = settings
        token = settings.replica_source_token
        headers = {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}
        self.http = httpx.Client(base_url=settings.replica_source.rstrip("/"), headers=headers, timeout=60)
        self.current: LoadedSnapshot | None = None
        self.last_error: str | None = None

    def refresh(self) -> bool:
        """Load the learner's latest snapshot if it is newer than ours; returns whether it swapped."""
        try:
            listing = self.http.get("/snapshots")
            listing.raise_for_status()
            snapshots = listing.json()["snapshots"]
            if not snapshots or (self.current and snapshots[-1]["id"] <= self.current.id):
                return False
            latest = snapshots[-1]["id"]
            int8 = self.settings.replica_int8 and snapshots[-1].get("int8") is not None
            body = self.http.get(f"/snapshots/{latest}", params={"variant": "int8"} if int8 else None)
            body.raise_for_status()
            clf = OnnxSnapshot(body.content, threads=self.settings.replica_threads or None)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("snapshot refresh failed: %s", self.last_error)
            return False
        self.current = LoadedSnapshot(latest, clf)
        self.last_error = None
        log.info("serving snapshot %d (model version %s%s)", latest, clf.info.model_version, ", int8" if int8 else "")
        return True


def create_replica_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    follower = SnapshotFollower(settings)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async def follow():
            while True:
                await run_in_threadpool(follower.refresh)
                await asyncio.sleep(settings.replica_poll_s)

        task = asyncio.create_task(follow())
        yield
        task.cancel()

    app = FastAPI(title="ASER inference replica", lifespan=lifespan)
    app.state.settings, app.state.follower, app.state.started = settings, follower, time.time()
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, read_timeout_s=settings.body_timeout_s,
                       deadline_s=settings.body_deadline_s)
    app.add_middleware(WebPageGuard, hosts=allowed_hosts(settings.allowed_hosts, settings.host))
    install_error_handlers(app, metrics)
    models, access = BodyModels(settings), Access(settings)

    def answer(blobs: list[bytes], k: int) -> dict:
        snap = follower.current  # one snapshot for the whole request
        if snap is None:
            raise NoSnapshotYet("no snapshot loaded yet")
        pixels = decode_images(blobs, snap.classifier.info.input_shape[1], settings.max_image_bytes,
                               settings.strict_image_size)
        probs, scores, unknown = snap.classifier.answers(pixels)
        return {"snapshot_id": snap.id, "model_version": snap.classifier.info.model_version,
                "results": top_k(probs, snap.classifier.info.labels, min(k, settings.max_top_k)),
                "unknown": unknown.tolist(),
                "unknown_score": [None] * len(unknown) if scores is None else [round(float(s), 4) for s in scores]}

    @app.get("/predict", dependencies=[access.require("read")])
    async def get_predict(image: str = IMAGE_QUERY, k: int = K_QUERY):
        with metrics.predict_latency.time():
            result = await run_in_threadpool(answer, [decode_base64(image)], k)
        return {"snapshot_id": result["snapshot_id"], "model_version": result["model_version"],
                "top": result["results"][0], "unknown": result["unknown"][0],
                "unknown_score": result["unknown_score"][0]}

    @app.post("/predict", dependencies=[access.require("read")])
    async def post_predict(request: Request, k: int = K_QUERY):
        blobs, k_body = await predict_request_images(request, models)
        with metrics.predict_latency.time():
            return await run_in_threadpool(answer, blobs, k_body or k)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        if follower.current is None:
            return JSONResponse({"status": "not ready", "detail": follower.last_error or "no snapshot yet"},
                                status_code=503)
        return {"status": "ready"}

    @app.get("/status", dependencies=[access.require("read")])
    async def status():
        snap = follower.current
        return {"source": settings.replica_source, "snapshot_id": snap and snap.id,
                "model_version": snap and snap.classifier.info.model_version,
                "variant": snap and snap.classifier.info.metadata.get("variant", "fp32"),
                "classes": snap.classifier.info.labels if snap else [], "last_error": follower.last_error,
                "uptime_s": round(time.time() - app.state.started, 1)}

    @app.get("/metrics", dependencies=[access.require("read")])
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def main() -> int:
    from service.__main__ import serve

    return serve(create_replica_app, "service.replica")


if __name__ == "__main__":
    sys.exit(main())
