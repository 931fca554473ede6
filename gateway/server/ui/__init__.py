"""The browser page at /ui: plain HTML, CSS and JavaScript (no build step, nothing from a
CDN) that submits a request and shows it live. The page needs no key; the API calls it
makes send the key the user types, kept in the browser's localStorage."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from gateway.server.api.errors import ApiError

DIRECTORY = Path(__file__).parent
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# Only this origin's own script and style run: model output shown by mistake as HTML
# still could not execute. Images: the preview of a file the user picked.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


def _file(name: str) -> FileResponse:
    if name not in FILES:
        raise ApiError(404, "not_found", f"no file {name} in the page")
    return FileResponse(DIRECTORY / name, media_type=FILES[name], headers=HEADERS)


@router.get("/ui")
@router.get("/ui/")
async def page() -> FileResponse:
    return _file("index.html")


@router.get("/ui/{name}")
async def asset(name: str) -> FileResponse:
    return _file(name)
