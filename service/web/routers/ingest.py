"""Ingest: labelled images into the log, as one request (JSON or multipart), as an NDJSON
stream over one chunked request, or over a WebSocket. Every form acknowledges only what is
committed, and every form takes optional sample ids, so a client that retries after a lost
answer stores nothing twice."""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from service.learning.runtime import Runtime
from service.settings import Settings
from service.storage.errors import ServiceError
from service.storage.store import NewSample, Stored
from service.web.inputs import InputError, decode_base64, decode_images
from service.web.routers.auth import Access
from service.web.routers.bodies import NDJSON_TYPES, BodyModels, content_kind, ndjson_lines, read_form
from service.web.routers.errors import as_input_error, error_responses

log = logging.getLogger("aser.ingest")


class IngestAck(BaseModel):
    accepted: int = Field(description="samples of this request now in the log")
    stored: int = Field(description="of them, stored by this request")
    duplicates: int = Field(description="of them, stored earlier under the same sample id")
    first_seq: int = Field(description="the lowest sequence number among them")
    last_seq: int = Field(description="the highest sequence number among them")
    seqs: list[int] = Field(description="each sample's sequence number, in request order")


def acknowledgement(stored: list[Stored]) -> dict:
    seqs = [s.seq for s in stored]
    dup = sum(s.duplicate for s in stored)
    return {"accepted": len(seqs), "stored": len(seqs) - dup, "duplicates": dup,
            "first_seq": min(seqs), "last_seq": max(seqs), "seqs": seqs}


def to_new_samples(labels: list[str], blobs: list[bytes], ids: list, rt: Runtime) -> list[NewSample]:
    """Decode and check every image; the request is refused whole if one is bad."""
    settings = rt.settings
    pixels = decode_images(blobs, rt.image_size, settings.max_image_bytes, settings.strict_image_size)
    return [NewSample(label, image.tobytes(), sid) for label, image, sid in zip(labels, pixels, ids, strict=True)]


async def commit(rt: Runtime, labels: list[str], blobs: list[bytes], ids: list) -> dict:
    """Validate, commit to the ingest log (durable on return), wake the learner."""
    samples = await run_in_threadpool(to_new_samples, labels, blobs, ids, rt)
    stored = await run_in_threadpool(rt.store.append, samples, rt.settings.max_classes)
    rt.worker.wakeup.set()
    rt.metrics.samples_received.inc(sum(not s.duplicate for s in stored))
    return acknowledgement(stored)


async def commit_json(rt: Runtime, models: BodyModels, body: bytes | str) -> dict:
    samples = models.samples(body)
    blobs = [decode_base64(s.image, f"sample {i}'s image") for i, s in enumerate(samples)]
    return await commit(rt, [s.label for s in samples], blobs, [s.id for s in samples])


async def message_ack(rt: Runtime, models: BodyModels, raw: bytes | str | InputError, n: int) -> dict:
    """One streamed message (a sample or a batch) -> its acknowledgement, or its error; a bad
    message is refused alone and the stream goes on."""
    try:
        if isinstance(raw, InputError):
            raise raw
        if len(raw) > rt.settings.max_body_bytes:
            raise InputError("body_too_large", f"a message may hold {rt.settings.max_body_bytes} bytes", 413)
        return {"message": n, **await commit_json(rt, models, raw)}
    except (InputError, ServiceError) as exc:
        err = as_input_error(exc)
        rt.metrics.requests_rejected.labels(err.code).inc()
        return {"message": n, "error": err.code, "detail": err.detail, "status": err.status}
    except Exception:  # e.g. the disk: this message is not acknowledged, the client may resend it
        log.exception("ingest of streamed message %d failed", n)
        return {"message": n, "error": "internal_error", "detail": "not stored; send it again", "status": 500}


class DuplexStream(StreamingResponse):
    """A streamed answer to a body that is still arriving. Starlette's StreamingResponse also
    reads `receive` to watch for a disconnect, which would swallow body chunks of a stream;
    here the body reader is the only one, and a disconnect ends it (ClientDisconnect)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.stream_response(send)
        except ClientDisconnect:
            pass


def router(settings: Settings, access: Access, models: BodyModels) -> APIRouter:
    api = APIRouter(tags=["ingest"])

    @api.post("/samples", status_code=201, response_model=IngestAck, dependencies=[access.require("write")],
              openapi_extra=models.ingest_body(),
              responses=error_responses(400, 401, 403, 409, 413, 415, 422, 507))
    async def post_samples(request: Request):
        """One or many labelled images: JSON (`{label, image, id?}` or `{samples: [...]}`, images in
        base64) or multipart (`image` files, `label` fields: one for all or one per image, optional
        `id` fields). Answered once committed; a repeated sample id is stored once."""
        rt: Runtime = request.app.state.runtime
        if content_kind(request) == "json":
            return await commit_json(rt, models, await request.body())
        blobs, labels, ids = await read_form(request, models, with_labels=True)
        return await commit(rt, labels, blobs, ids)

    @api.post("/samples/stream", dependencies=[access.require("write")], openapi_extra=models.stream_body(),
              responses={200: {"description": "one acknowledgement (or error) line per input line, in order",
                               "content": {"application/x-ndjson": {"schema": {"type": "string"}}}},
                         **error_responses(401, 403, 415)})
    async def stream_samples(request: Request):
        """NDJSON over one chunked request: each line a sample (or a batch), each answered by one
        NDJSON acknowledgement line once committed; a bad line is refused alone."""
        rt: Runtime = request.app.state.runtime
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in NDJSON_TYPES:
            raise InputError("unsupported_media_type", "stream application/x-ndjson, one JSON sample per line", 415)

        async def acks():
            n = 0
            async for line in ndjson_lines(request.stream(), settings.max_body_bytes):
                n += 1
                yield json.dumps(await message_ack(rt, models, line, n)) + "\n"

        return DuplexStream(acks(), media_type="application/x-ndjson")

    @api.websocket("/samples/ws")
    async def samples_websocket(websocket: WebSocket):
        """One long-lived connection: each text message a sample (or a batch), each answered by
        one JSON acknowledgement after its commit."""
        try:
            access.check(websocket, "write")
        except InputError as exc:
            await websocket.close(code=1008, reason=exc.detail)
            return
        rt: Runtime = websocket.app.state.runtime
        await websocket.accept()
        n = 0
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                n += 1
                raw = message.get("text") if message.get("text") is not None else message.get("bytes", b"")
                await websocket.send_json(await message_ack(rt, models, raw, n))
        except WebSocketDisconnect:
            pass

    return api
