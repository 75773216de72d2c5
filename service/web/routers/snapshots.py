"""ONNX snapshots: export now, list, download."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from service.settings import Settings
from service.storage.errors import Unavailable
from service.web.inputs import InputError
from service.web.routers.auth import Access
from service.web.routers.errors import error_responses

MAX_ID = 2**63 - 1  # SQLite's largest integer: an id beyond it names no snapshot
SNAPSHOT_ID = Path(..., pattern=r"^(latest|[0-9]{1,19})$", description="a snapshot id, or 'latest'")


class Int8Variant(BaseModel):
    size_bytes: int
    agreement: float = Field(description="share of recent images on which its top-1 is the fp32 graph's")


class Snapshot(BaseModel):
    id: int
    file: str
    created: float
    model_version: int
    steps: int
    samples_trained: int
    classes: list[str]
    size_bytes: int
    reason: Literal["request", "periodic", "new classes", "sleep"]
    int8: Int8Variant | None = Field(None, description="its int8 variant (ASER_SNAPSHOT_INT8), where kept")


class SnapshotList(BaseModel):
    snapshots: list[Snapshot]


def router(settings: Settings, access: Access) -> APIRouter:
    api = APIRouter(tags=["snapshots"])

    @api.post("/snapshots", status_code=201, response_model=Snapshot, dependencies=[access.require("admin")],
              responses=error_responses(401, 403, 409, 503))
    async def create_snapshot(request: Request):
        """Export the current model to ONNX now; answers the snapshot's record."""
        future = request.app.state.runtime.worker.request_snapshot()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout=settings.snapshot_timeout_s)
        except TimeoutError as exc:
            raise Unavailable("the export did not finish in time; it may still appear in GET /snapshots") from exc

    @api.get("/snapshots", response_model=SnapshotList, dependencies=[access.require("read")],
             responses=error_responses(401, 403))
    async def list_snapshots(request: Request):
        return {"snapshots": await run_in_threadpool(request.app.state.runtime.worker.snapshots.list)}

    @api.get("/snapshots/{snapshot_id}", response_class=FileResponse, dependencies=[access.require("read")],
             responses={200: {"description": "the ONNX file", "content": {"application/octet-stream": {
                 "schema": {"type": "string", "format": "binary"}}},
                 "headers": {"X-Snapshot-Id": {"schema": {"type": "string"}},
                             "X-Model-Version": {"schema": {"type": "string"}}}},
                 **error_responses(401, 403, 404, 422)})
    async def download_snapshot(request: Request, snapshot_id: str = SNAPSHOT_ID,
                                variant: Literal["fp32", "int8"] = Query("fp32", description="the int8 variant, "
                                                                         "where the snapshot has one (404 otherwise)")):
        """The .onnx file of a snapshot (an id, or 'latest'), or its int8 variant's."""
        snapshots = request.app.state.runtime.worker.snapshots
        if snapshot_id == "latest":
            row = await run_in_threadpool(snapshots.latest)
        elif int(snapshot_id) > MAX_ID:
            raise InputError("not_found", f"no snapshot {snapshot_id}", 404)
        else:
            row = await run_in_threadpool(snapshots.get, int(snapshot_id))
        path = snapshots.path(row, variant)
        return FileResponse(path, media_type="application/octet-stream", filename=path.name,
                            headers={"X-Snapshot-Id": str(row["id"]), "X-Model-Version": str(row["model_version"])})

    return api
