"""The replay memory as the learner holds it (what is in it, each stored image), and forgetting
a class on request."""

from __future__ import annotations

import asyncio
import io

from fastapi import APIRouter, Path, Request, Response
from PIL import Image
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from service.learning.serving import MemoryView
from service.settings import Settings
from service.storage.errors import NotFound
from service.storage.store import by_label, label_of
from service.web.routers.auth import Access
from service.web.routers.errors import error_responses

SLOT = Path(..., pattern=r"^[0-9]{1,9}$", description="a memory slot, 0 .. size - 1")


class Slot(BaseModel):
    slot: int
    label: str
    entered: int = Field(description="samples trained when the sample entered this slot")


class Memory(BaseModel):
    capacity: int
    size: int
    model_version: int = Field(description="the weights this view of the memory goes with")
    per_class: dict[str, int]
    slots: list[Slot]


class ForgottenClass(BaseModel):
    label: str
    class_id: int
    samples_removed: int = Field(description="samples of the class deleted from the ingest log")
    memory_removed: int | None = Field(description="samples removed from the replay memory (None: the live "
                                       "learner had not applied it in time; it is durable and applied soon)")


def png(view: MemoryView, slot: int) -> bytes:
    if slot >= len(view.class_ids):
        raise NotFound(f"no sample in memory slot {slot} (the memory holds {len(view.class_ids)})")
    return png_of(view.images[slot])


def png_of(pixels) -> bytes:
    """uint8 [3, H, W] pixels as PNG bytes."""
    out = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).numpy(), "RGB").save(out, format="PNG")
    return out.getvalue()


def router(settings: Settings, access: Access) -> APIRouter:
    api = APIRouter(tags=["memory"])

    @api.get("/memory", response_model=Memory, dependencies=[access.require("read")],
             responses=error_responses(401, 403))
    async def memory(request: Request):
        """The replay memory: samples per class, and each slot's class and when it entered."""
        worker = request.app.state.runtime.worker
        published = worker.published  # read once: the model and the memory of one step
        view, classes = published.memory, published.predictor.classes
        slots = [{"slot": i, "label": label, "entered": e} for i, (c, e) in enumerate(zip(view.class_ids, view.entered))
                 if (label := label_of(classes, c)) is not None]
        return {"capacity": settings.mem_size, "size": len(view.class_ids), "model_version": published.predictor.version,
                "per_class": by_label(classes, view.class_counts()),
                "slots": slots}

    @api.get("/memory/{slot}", response_class=Response, dependencies=[access.require("read")],
             responses={200: {"description": "the stored image", "content": {"image/png": {
                 "schema": {"type": "string", "format": "binary"}}}}, **error_responses(401, 403, 404, 422)})
    async def memory_image(request: Request, slot: str = SLOT):
        """The image a memory slot holds, as PNG."""
        data = png(request.app.state.runtime.worker.memory, int(slot))
        return Response(data, media_type="image/png", headers={"Cache-Control": "no-cache"})

    @api.delete("/classes/{label:path}", response_model=ForgottenClass, dependencies=[access.require("admin")],
                responses=error_responses(401, 403, 404, 422, 507))
    async def forget_class(request: Request, label: str):
        """Forget a class for good: every sample of it leaves the ingest log (trained or not) and
        the replay memory, the model stops predicting it, snapshots holding it are deleted, and
        a restart never brings it back. The label sent again later starts a new class."""
        forgotten, applied = await run_in_threadpool(request.app.state.runtime.worker.forgetting.submit, label)
        try:
            removed = await asyncio.wait_for(asyncio.wrap_future(applied), timeout=settings.snapshot_timeout_s)
        except Exception:  # durable already; the worker applies it after its restart or in a moment
            removed = None
        return {"label": label, "class_id": forgotten.class_id, "samples_removed": forgotten.samples_removed,
                "memory_removed": removed}

    return api
