"""Routes of the dashboard: its page and what only the pages need (checkpoint files).

The page is one HTML document whose scripts route by the URL's fragment (``#/jobs/job-3``),
so every view is served by ``GET /``. Checkpoint listings live under the API prefix like every
other read, so they carry the API's authentication.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from torchrelay.server import uploads
from torchrelay.server.service import ClusterService
from torchrelay.wire import API_PREFIX, ArtifactInfo

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_PREFIX = "/ui/static"


def dashboard_routes(svc: ClusterService) -> APIRouter:
    pages = APIRouter()
    index = (STATIC_DIR / "index.html").read_text()

    @pages.get("/", include_in_schema=False, response_class=HTMLResponse)
    def page() -> HTMLResponse:
        return HTMLResponse(index, headers={"cache-control": "no-cache"})

    api = APIRouter(prefix=API_PREFIX)

    @api.get("/jobs/{job_id}/checkpoints", response_model=list[ArtifactInfo])
    def list_checkpoints(job_id: str) -> list[ArtifactInfo]:
        """The files of the job's checkpoints (paths relative to its checkpoint folder)."""
        return svc.checkpoints(job_id)

    @api.get("/jobs/{job_id}/checkpoints/{path:path}")
    def get_checkpoint_file(job_id: str, path: str) -> Response:
        """Streamed; a path that is not plain or leaves the checkpoint folder is a 400 naming it."""
        return uploads.stored_file(svc.store, svc.checkpoint_key(job_id, path))

    pages.include_router(api)
    return pages
