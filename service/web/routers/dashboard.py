"""The dashboard: one static page and its script and style, shipped inside the package (no CDN,
no build step). The page holds no data; it reads the API with the token the person gives it."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parents[1] / "static"


def router() -> APIRouter:
    api = APIRouter(tags=["dashboard"], include_in_schema=False)

    @api.get("/")
    @api.get("/dashboard")
    async def dashboard():
        return FileResponse(STATIC / "dashboard.html", media_type="text/html", headers={"Cache-Control": "no-cache"})

    return api


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC)
