"""FastAPI app factory: the HTTP API of ``torchrelay.wire`` over a ``ClusterService``. Routes only.

``create_app(service)`` builds the app; the service's background scheduler runs for the app's
lifetime (started and stopped by the lifespan). Each route calls one service method (blocking
ones in the thread pool) or one long-poll of ``longpoll``. Errors from ``torchrelay.errors``
become ``{"error": ClassName, "detail": message}`` with the class's HTTP status. The OpenAPI
document is served at ``/api/v1/openapi.json`` (docs UI at ``/api/v1/docs``). The dashboard
(``dashboard``), ``/metrics`` (``prometheus``) and the TensorBoard export (``tensorboard``)
bring routers of their own.
"""
from __future__ import annotations

import contextlib
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from torchrelay import __version__
from torchrelay.errors import Forbidden, RelayError
from torchrelay.server import guard, longpoll, prometheus, streams, tensorboard, uploads
from torchrelay.server.auth import Credentials
from torchrelay.server.auth_routes import auth_routes
from torchrelay.server.config import UploadLimits
from torchrelay.server.dashboard import STATIC_DIR, STATIC_PREFIX, dashboard_routes
from torchrelay.server.series import SeriesCache
from torchrelay.server.service import ClusterService
from torchrelay.storage import ArtifactStore
from torchrelay.wire import (API_PREFIX, ArtifactInfo, BundleRef, CheckpointCommit, Heartbeat, HeartbeatReply,
                             JobInfo, LogBatch, LogPage, MetricBatch, MetricPage, NodeInfo, NodeRegistration,
                             RegisterReply, SeriesPage, SubmitRequest)

MAX_WAIT_S = 60.0


def create_app(service: ClusterService, lifecycle: Any = None, limits: UploadLimits | None = None,
               access: guard.Guard | None = None) -> FastAPI:
    """The server app. The scheduler thread runs while the app is served; ``lifecycle`` (an
    object with ``start``/``stop``, e.g. ``leadership.Leadership``) starts and stops it instead
    of the service itself. ``limits``: the most one upload may hold (413 past it; ``uploads``).
    Every route but ``/health`` needs a credential (``guard``); ``access`` holds the credentials
    and the rate limiter (default: over the service's store)."""
    owner = lifecycle or service
    access = access or guard.Guard(Credentials(service.db, service.clock), service.db)

    exporter = tensorboard.Exporter(service)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        owner.start()
        exporter.start()
        try:
            yield
        finally:
            exporter.stop()
            owner.stop()

    # the OpenAPI document and its docs page are routes of our own (below) so that they too need a token
    app = FastAPI(title="torchrelay", version=__version__, lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None, dependencies=[Depends(guard.authorize)])
    app.state.service = service
    app.add_middleware(uploads.BodyLimits, limits=limits or UploadLimits())
    app.state.guard = access
    _error_handlers(app)
    for routes in (_bundle_routes, _job_routes, _artifact_routes, _agent_routes, _stream_routes):
        app.include_router(routes(service))
    app.include_router(auth_routes(access.credentials))
    _schema_routes(app)

    app.include_router(dashboard_routes(service))
    prometheus.install(app, service)
    app.include_router(tensorboard.tensorboard_routes(exporter))
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="dashboard-static")
    return app


def _schema_routes(app: FastAPI) -> None:
    from fastapi.openapi.docs import get_swagger_ui_html

    @app.get(f"{API_PREFIX}/openapi.json", include_in_schema=False)
    def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get(f"{API_PREFIX}/docs", include_in_schema=False)
    def docs() -> Response:
        return get_swagger_ui_html(openapi_url=f"{API_PREFIX}/openapi.json", title="torchrelay API")


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RelayError)
    async def _relay_error(_request: Request, exc: RelayError) -> JSONResponse:
        return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=exc.http_status)

    @app.exception_handler(OverflowError)
    async def _overflow(_request: Request, exc: OverflowError) -> JSONResponse:
        # a request's integer past what the state store's 64-bit columns hold (sqlite3 raises this)
        return JSONResponse({"error": "InvalidSpec", "detail": f"invalid request: a number is out of range ({exc}); "
                             f"integers must lie within -2**63 .. 2**63-1"}, status_code=422)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{loc}: {err.get('msg')}")
        return JSONResponse({"error": "InvalidSpec", "detail": "invalid request: " + "; ".join(parts)},
                            status_code=422)


def _bundle_routes(svc: ClusterService) -> APIRouter:
    api = APIRouter(prefix=API_PREFIX)

    @api.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "version": __version__}

    @api.post("/bundles", response_model=BundleRef, status_code=201)
    async def upload_bundle(request: Request) -> BundleRef:
        """Streamed to the store (never whole in memory); named by its sha256."""
        async with uploads.spooled(request) as body:
            await run_in_threadpool(svc.put_bundle_file, body.sha256, body.path)
        return BundleRef(digest=body.sha256, size=body.size)

    @api.head("/bundles/{digest}")
    def has_bundle(digest: str) -> Response:
        return Response(status_code=200 if svc.has_bundle(digest) else 404)

    @api.get("/bundles/{digest}")
    def get_bundle(digest: str) -> Response:
        return uploads.stored_file(svc.store, ArtifactStore.bundle_key(digest), "application/gzip")

    return api


def _job_routes(svc: ClusterService) -> APIRouter:
    """What clients call about jobs (and the nodes' list)."""
    api = APIRouter(prefix=API_PREFIX)

    @api.post("/jobs", response_model=JobInfo, status_code=201)
    async def submit(body: SubmitRequest, request: Request) -> Response:
        """Returns once the job is committed; concurrent submissions share one commit."""
        info = await svc.submit_async(_owned(body.spec, request), body.bundle, guard.principal(request).name)
        # serialized once here: returning the model would have FastAPI validate it again
        return Response(content=info.model_dump_json(), media_type="application/json", status_code=201)

    @api.post("/jobs/dryrun")
    def dryrun(body: SubmitRequest, request: Request) -> dict[str, Any]:
        """What submitting the spec would do, submitting nothing: ``{"executor", "spec",
        "submission"}`` (the executor's own text, e.g. Slurm's batch script; null for the agents)."""
        return svc.dryrun(_owned(body.spec, request), guard.principal(request).name)

    @api.get("/jobs", response_model=list[JobInfo])
    def list_jobs(request: Request, state: str | None = None, limit: int = Query(100, ge=1, le=10000),
                  all: bool = Query(False, description="every user's jobs (admins only)")) -> list[JobInfo]:
        """The caller's newest jobs (``all``: everyone's, for an admin)."""
        who = guard.principal(request)
        if all and not who.admin:
            raise Forbidden(f"only an admin lists every user's jobs; you are {who.name!r}")
        return svc.list_jobs(state, limit, user=None if all else who.name)

    @api.get("/queue")
    def queue(request: Request) -> list[dict[str, Any]]:
        """Waiting jobs in scheduling order with reason and estimated start (null if unknown);
        other users' jobs (unless the caller is an admin) without their ids, names, users or reasons."""
        who = guard.principal(request)
        return [row if who.admin or row.get("user") == who.name else _redacted(row) for row in svc.queue_view()]

    @api.get("/quotas")
    def quotas() -> dict[str, Any]:
        """Per-user quotas the scheduler applies (``default`` covers users not named)."""
        return svc.quotas.to_public()

    @api.get("/jobs/{job_id}", response_model=JobInfo)
    async def get_job(job_id: str, wait: float = Query(0, ge=0, le=MAX_WAIT_S),
                      known_state: str | None = None) -> JobInfo:
        """With ``wait`` and ``known_state``: long-poll until the state differs or time passes."""
        return await longpoll.job(svc, job_id, wait, known_state)

    @api.post("/jobs/{job_id}/cancel", response_model=JobInfo)
    def cancel(job_id: str, checkpoint: bool = True) -> JobInfo:
        """SIGTERM, then SIGKILL after the job's stop_grace_s; ``checkpoint=false``: kill at once."""
        return svc.cancel(job_id, checkpoint)

    @api.get("/jobs/{job_id}/logs", response_model=LogPage)
    async def get_logs(job_id: str, after: int = Query(0, ge=0), rank: int | None = None,
                       wait: float = Query(0, ge=0, le=MAX_WAIT_S)) -> LogPage:
        return await longpoll.follow(svc, "logs", job_id, wait, lambda: svc.logs(job_id, after, rank),
                                     lambda page: bool(page.lines))

    @api.get("/jobs/{job_id}/metrics", response_model=MetricPage)
    async def get_metrics(job_id: str, after: int = Query(0, ge=0),
                          wait: float = Query(0, ge=0, le=MAX_WAIT_S)) -> MetricPage:
        return await longpoll.follow(svc, "metrics", job_id, wait, lambda: svc.metrics(job_id, after),
                                     lambda page: bool(page.points))

    @api.get("/nodes", response_model=list[NodeInfo])
    def list_nodes() -> list[NodeInfo]:
        return svc.list_nodes()

    return api


def _artifact_routes(svc: ClusterService) -> APIRouter:
    """A job's artifacts: listed, streamed down, streamed up."""
    api = APIRouter(prefix=API_PREFIX)

    @api.get("/jobs/{job_id}/artifacts", response_model=list[ArtifactInfo])
    def list_artifacts(job_id: str) -> list[ArtifactInfo]:
        return svc.artifacts(job_id)

    @api.get("/jobs/{job_id}/artifacts/{path:path}")
    def get_artifact(job_id: str, path: str) -> Response:
        """Streamed; a path that is not plain or leaves the job's folder is a 400 naming it."""
        return uploads.stored_file(svc.store, svc.artifact_key(job_id, path))

    @api.put("/jobs/{job_id}/artifacts/{path:path}", response_model=ArtifactInfo)
    async def put_artifact(job_id: str, path: str, request: Request) -> ArtifactInfo:
        """Streamed to the store (never whole in memory); the path is checked before the body is read."""
        key = await run_in_threadpool(svc.artifact_key, job_id, path)
        async with uploads.spooled(request) as body:
            await run_in_threadpool(svc.store.put_file, key, body.path)
        return ArtifactInfo(path=path, size=body.size)

    return api


def _owned(spec: dict[str, Any], request: Request) -> dict[str, Any]:
    """The spec as the caller may submit it: its ``user`` is the caller's (an admin may name
    another user, whose quota and share it then counts). Raises Forbidden."""
    who = guard.principal(request)
    named = spec.get("user") if isinstance(spec, dict) else None
    if named and named != who.name and not who.admin:
        raise Forbidden(f"spec.user {named!r} is not you ({who.name!r}); only an admin submits for another user")
    return {**spec, "user": named or who.name} if isinstance(spec, dict) else spec


def _redacted(row: dict[str, Any]) -> dict[str, Any]:
    """Another user's waiting job: its place, size, priority and estimated start (what says how
    long the caller's own jobs wait), not whose it is, what or why."""
    return {**row, "id": None, "name": None, "user": None, "max_runtime_s": None, "reason": "another user's job"}


def _stream_routes(svc: ClusterService) -> APIRouter:
    """Server-sent event streams (``streams``) and downsampled metric series (``series``)."""
    api = APIRouter(prefix=API_PREFIX)
    shared = streams.SharedReads()
    cache = SeriesCache(svc.db)
    LastEventId = Header(None, alias="last-event-id", description="resume after this row id (SSE reconnect)")
    After = Query(0, ge=0, description="start after this row id (a first connect; Last-Event-ID wins)")

    async def stream(feed: streams.Feed, last_event_id: str | None, after: int) -> StreamingResponse:
        start = streams.start_id(last_event_id, after)
        return StreamingResponse(streams.follow(svc, feed, start, shared), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    @api.get("/jobs/{job_id}/logs/stream", response_class=StreamingResponse)
    async def stream_logs(job_id: str, rank: int | None = None, after: int = After,
                          last_event_id: str | None = LastEventId) -> StreamingResponse:
        """The job's log lines as they come (SSE, ``event: logs``); ends with ``event: end``."""
        seq, _ = await run_in_threadpool(svc.job_state, job_id)
        return await stream(streams.log_feed(svc, job_id, seq, rank), last_event_id, after)

    @api.get("/jobs/{job_id}/metrics/stream", response_class=StreamingResponse)
    async def stream_metrics(job_id: str, after: int = After,
                             last_event_id: str | None = LastEventId) -> StreamingResponse:
        """The job's metric points as they come (SSE, ``event: metrics``); ends with ``event: end``."""
        seq, _ = await run_in_threadpool(svc.job_state, job_id)
        return await stream(streams.metric_feed(svc, job_id, seq), last_event_id, after)

    @api.get("/jobs/{job_id}/events/stream", response_class=StreamingResponse)
    async def stream_job_events(job_id: str, after: int = After,
                                last_event_id: str | None = LastEventId) -> StreamingResponse:
        """The job's events (state changes, restarts, notes) as they come; ends with ``event: end``."""
        seq, _ = await run_in_threadpool(svc.job_state, job_id)
        return await stream(streams.event_feed(svc, job_id, seq), last_event_id, after)

    @api.get("/events/stream", response_class=StreamingResponse)
    async def stream_events(request: Request, after: int = After, last_event_id: str | None = LastEventId,
                            tail: int | None = Query(None, ge=0, description="start with the newest `tail` events "
                                                     "(instead of `after`; a reconnect's Last-Event-ID wins)")
                            ) -> StreamingResponse:
        """Every job's events as they come (SSE, ``event: events``); never ends. A user who is not an
        admin gets their own jobs' only."""
        if tail is not None:
            after = max(0, await run_in_threadpool(svc.last_event_id) - tail)
        who = guard.principal(request)
        return await stream(streams.event_feed(svc, None, None, None if who.admin else who.name), last_event_id, after)

    @api.get("/jobs/{job_id}/series", response_model=SeriesPage)
    def series(job_id: str, keys: str | None = Query(None, description="comma-separated metric keys (all)"),
               rank: int | None = None, points: int = 1000, start: float | None = None,
               end: float | None = None) -> Response:
        """Metric series downsampled to ``points`` each (LTTB keeping every bucket's min, max,
        first and last); ``start``/``end`` (steps) zoom, at full resolution when few enough."""
        wanted = [k for k in keys.split(",") if k] if keys else None
        page = cache.page(job_id, wanted, rank, points, start, end)
        # serialized once here: returning the model would have FastAPI validate 100,000 floats again
        return Response(content=page.model_dump_json(), media_type="application/json")

    return api


def _agent_routes(svc: ClusterService) -> APIRouter:
    """What agents call: registration, heartbeats, launch statuses, logs and metrics."""
    api = APIRouter(prefix=API_PREFIX)

    @api.post("/nodes/register", response_model=RegisterReply)
    def register(body: NodeRegistration, request: Request) -> RegisterReply:
        """With an enrolment token (or an admin's): a node and its own credential (``credential``,
        given this once). With a node credential: that node again (after an agent restart)."""
        who, creds = guard.principal(request), request.app.state.guard.credentials
        if who.kind == "node":
            if body.node_id not in (None, who.node_id):
                raise Forbidden(f"this node's credential is for node {who.node_id}, not {body.node_id}")
            return svc.register(body.model_copy(update={"node_id": who.node_id}))
        if body.node_id is not None and not who.admin:
            # an enrolment token makes a new node: taking over a known one (its launches, their
            # worker tokens) needs that node's own credential, or an admin's
            body = body.model_copy(update={"node_id": None})
        reply = svc.register(body)
        creds.revoke_node(reply.node_id)  # one credential per node: an enrolment again ends the last one
        _, credential = creds.create_token("node", node_id=reply.node_id, label=body.name)
        return reply.model_copy(update={"credential": credential})

    @api.post("/nodes/{node_id}/heartbeat", response_model=HeartbeatReply)
    async def heartbeat(node_id: str, body: Heartbeat, request: Request) -> HeartbeatReply:
        reply = await longpoll.heartbeat(svc, node_id, body)
        creds = request.app.state.guard.credentials
        for launch in reply.launches:  # an HMAC each: nothing stored, nothing read
            launch.worker_token = creds.worker_token(launch.job_id, launch.attempt)
        return reply

    @api.post("/jobs/{job_id}/logs")
    def post_logs(job_id: str, body: LogBatch, request: Request) -> dict[str, Any]:
        """A node's batch of its own launch's log lines (``guard.check_launch``)."""
        guard.check_launch(request.app.state.guard, guard.principal(request), job_id, body.launch_id)
        return {"ok": True, "added": svc.ingest_logs(job_id, body)}

    @api.post("/jobs/{job_id}/metrics")
    def post_metrics(job_id: str, body: MetricBatch, request: Request) -> dict[str, Any]:
        """A node's (or its worker's) batch of its own launch's metric points (``guard.check_launch``)."""
        guard.check_launch(request.app.state.guard, guard.principal(request), job_id, body.launch_id)
        return {"ok": True, "added": svc.ingest_metrics(job_id, body)}

    @api.post("/jobs/{job_id}/checkpoints")
    def post_checkpoint(job_id: str, body: CheckpointCommit, request: Request) -> dict[str, Any]:
        """A checkpoint the job's workers committed, posted by rank 0 with its worker token (the
        attempt is the token's): a job event, and a ``checkpoint`` event on the events feed."""
        who = guard.principal(request)
        return {"ok": True, "added": svc.checkpoint_committed(job_id, who.attempt, body.step, body.url)}

    return api
