"""The replay memory as the learner holds it: what is in it, and each stored image."""

from __future__ import annotations

import io

from fastapi import APIRouter, Path, Request, Response
from PIL import Image
from pydantic import BaseModel, Field

from ..errors import NotFound
from ..settings import Settings
from ..worker import MemoryView
from .auth import require
from .errors import error_responses

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


def png(view: MemoryView, slot: int) -> bytes:
    if slot >= len(view.class_ids):
        raise NotFound(f"no sample in memory slot {slot} (the memory holds {len(view.class_ids)})")
    out = io.BytesIO()
    Image.fromarray(view.images[slot].permute(1, 2, 0).numpy(), "RGB").save(out, format="PNG")
    return out.getvalue()


def router(settings: Settings) -> APIRouter:
    api = APIRouter(tags=["memory"])

    @api.get("/memory", response_model=Memory, dependencies=[require(settings, "read")],
             responses=error_responses(401, 403))
    async def memory(request: Request):
        """The replay memory: samples per class, and each slot's class and when it entered."""
        worker = request.app.state.runtime.worker
        view, classes = worker.memory, worker.predictor.classes
        slots = [{"slot": i, "label": classes[c], "entered": e}
                 for i, (c, e) in enumerate(zip(view.class_ids, view.entered)) if c < len(classes)]
        return {"capacity": settings.mem_size, "size": len(view.class_ids), "model_version": worker.predictor.version,
                "per_class": {classes[c]: n for c, n in view.class_counts().items() if c < len(classes)},
                "slots": slots}

    @api.get("/memory/{slot}", response_class=Response, dependencies=[require(settings, "read")],
             responses={200: {"description": "the stored image", "content": {"image/png": {
                 "schema": {"type": "string", "format": "binary"}}}}, **error_responses(401, 403, 404, 422)})
    async def memory_image(request: Request, slot: str = SLOT):
        """The image a memory slot holds, as PNG."""
        data = png(request.app.state.runtime.worker.memory, int(slot))
        return Response(data, media_type="image/png", headers={"Cache-Control": "no-cache"})

    return api
