"""One sample of the ingest log: what it is and where it went, its image while retained, and its correction (a
wrong label, a sample to forget); and the memory's suspects, the samples ASER's values say are most likely
mislabelled. Corrections are the worker's (`service.learning.corrections`): the route waits for them."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from service.learning.corrections import MAX_RECENT, sample_state
from service.settings import Settings
from service.storage.errors import NotFound, Unavailable
from service.storage.store import images_from_blobs
from service.web.routers.auth import Access
from service.web.routers.bodies import BodyModels
from service.web.routers.errors import error_responses
from service.web.routers.memory import png_of

# digits only in the route itself (`:int`), so that /samples/stream is never taken for a sample
SEQ = Path(..., ge=1, le=2**63 - 1, description="the sample's sequence number, as its ingest acknowledged it")


class SampleInfo(BaseModel):
    seq: int
    id: str | None = Field(description="the client's sample id, if it sent one")
    label: str | None = Field(description="its label now (None: forgotten)")
    received: float = Field(description="when it was acknowledged (Unix seconds)")
    state: str = Field(description="waiting, learned, quarantined or forgotten")
    pixels_retained: bool = Field(description="whether GET /samples/{seq}/image can answer (retention drops them)")
    in_memory: bool = Field(description="whether the replay memory holds it")


class SampleCorrection(BaseModel):
    seq: int
    label: str | None = Field(description="its label now (None: forgotten)")
    previous_label: str | None
    learned: bool = Field(description="the model had learned it: then the flags below say where it was corrected")
    in_memory: bool = Field(description="its memory slot was relabelled, or dropped")
    held_back: bool = Field(description="it was a held-back sample (never trained): moved or dropped there")
    stream_head: bool = Field(description="streaming LDA's statistics were corrected exactly")
    sleep_store: bool = Field(description="the sleep's latent store held it: relabelled there, or dropped")
    model_version: int


class Suspect(BaseModel):
    seq: int | None = Field(description="the sample's sequence number (None: a slot filled before they were kept)")
    slot: int | None = Field(description="its memory slot (None: the memory does not hold it)")
    label: str | None = Field(description="the label it was given")
    answer: str | None = Field(description="what the served model answers for it")
    probability: float
    value: float = Field(description="its mean KNN Shapley value to the (rest of the) memory: below zero, its label "
                                     "disagrees with its neighbours'")


class Suspects(BaseModel):
    model_version: int
    suspects: list[Suspect]


def router(settings: Settings, access: Access, models: BodyModels) -> APIRouter:
    api = APIRouter(tags=["samples"])

    async def worker_answer(request: Request, future):
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout=settings.snapshot_timeout_s)
        except TimeoutError:  # queued still: applied in a moment, and asking again gives the same answer
            raise Unavailable("the learner is busy; ask again shortly") from None

    @api.get("/samples/{seq:int}", response_model=SampleInfo, dependencies=[access.require("read")],
             responses=error_responses(401, 403, 404, 422))
    async def sample(request: Request, seq: int = SEQ):
        """A sample of the ingest log: its label, where it went (waiting, learned, quarantined, forgotten), whether its
        pixels are still kept and whether the replay memory holds it."""
        worker = request.app.state.runtime.worker
        record = await run_in_threadpool(worker.store.sample, seq)
        label = None if record.forgotten is not None else record.label
        return {"seq": record.seq, "id": record.sample_id, "label": label, "received": record.received,
                "state": sample_state(record, worker.trained_upto), "pixels_retained": record.pixels is not None,
                "in_memory": record.seq in worker.memory.seqs}

    @api.get("/samples/{seq:int}/image", response_class=Response, dependencies=[access.require("read")],
             responses={200: {"description": "the image as the learner received it", "content": {"image/png": {
                 "schema": {"type": "string", "format": "binary"}}}}, **error_responses(401, 403, 404, 422)})
    async def sample_image(request: Request, seq: int = SEQ):
        """The sample's image as the learner took it (after the input rule's resize), as PNG, while retained."""
        worker = request.app.state.runtime.worker
        record = await run_in_threadpool(worker.store.sample, seq)
        if record.pixels is None:
            raise NotFound(f"sample {seq}'s pixels are no longer kept")
        data = png_of(images_from_blobs([record.pixels], worker.image_shape)[0])
        return Response(data, media_type="image/png", headers={"Cache-Control": "no-cache"})

    @api.patch("/samples/{seq:int}", response_model=SampleCorrection, dependencies=[access.require("admin")],
               openapi_extra=models.relabel_body(), responses=error_responses(400, 401, 403, 404, 409, 422, 503, 507))
    async def relabel(request: Request, seq: int = SEQ):
        """Give a sample its right label (a new one makes a new class): the log changes durably, and where the model
        has learned it, the model too (streaming LDA exactly, its memory slot; the trained top learns on from the
        corrected memory). The label it already has: nothing changes (a confirmation)."""
        label = models.relabel(await request.body())
        worker = request.app.state.runtime.worker
        return answer(await worker_answer(request, worker.corrections.relabel(seq, label)), worker)

    @api.delete("/samples/{seq:int}", response_model=SampleCorrection, dependencies=[access.require("admin")],
                responses=error_responses(401, 403, 404, 422, 503, 507))
    async def forget(request: Request, seq: int = SEQ):
        """Forget one sample: its pixels leave the log, training never reads it again, and where the model learned
        it, its effect leaves (streaming LDA exactly, its memory slot). A restart or a retry of its ingest never
        brings it back; asked again, the same answer."""
        worker = request.app.state.runtime.worker
        return answer(await worker_answer(request, worker.corrections.forget(seq)), worker)

    @api.get("/suspects", response_model=Suspects, dependencies=[access.require("read")],
             responses=error_responses(401, 403, 422, 503))
    async def suspects(request: Request, limit: int = Query(20, ge=1, le=1000, description="how many"),
                       recent: int = Query(0, ge=0, le=MAX_RECENT, description=(
                           "0: the memory's samples; N: the latest N learned samples whose pixels are kept"))):
        """The samples most likely mislabelled, most suspected first: ASER's KNN Shapley value of each to the
        memory (below zero, its label disagrees with the remembered samples around it), with the served answer. The
        memory's own samples by default; with `recent`, the latest learned ones (their frozen pass is the cost)."""
        worker = request.app.state.runtime.worker
        rows = await worker_answer(request, worker.corrections.suspects(limit, recent))
        return {"model_version": worker.predictor.version, "suspects": rows}

    return api


def answer(corrected, worker) -> dict:
    return {"seq": corrected.seq, "label": corrected.label, "previous_label": corrected.previous,
            "learned": corrected.learned, "in_memory": corrected.model.in_memory,
            "held_back": corrected.model.held_back, "stream_head": corrected.model.stream_head,
            "sleep_store": corrected.model.in_sleep_store, "model_version": worker.predictor.version}
