"""``/metrics`` in the Prometheus text format (prometheus-client), with Kueue's kind of names.

Contract:
- ``install(app, svc)`` adds the ``GET /metrics`` route, a middleware timing every API request
  by route template, and a hook timing every scheduling cycle; each app has its own registry
  (two servers in one process never share series).
- Values about jobs and nodes are read from the state store at scrape time (blocking SQL, run
  in the thread pool), so they survive a server restart: counters are counts of rows that
  only grow (jobs, finished jobs, placement events). The admission wait histogram is fed from
  the event rows added since the previous scrape (the first scrape reads the history once).
- Metric names and labels: docs/observability.md.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Any, Iterator

from fastapi import APIRouter, FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from torchrelay.server import telemetry
from torchrelay.server.service import ClusterService
from torchrelay.spec import JobState

PREFIX = "torchrelay"
WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 12 * 3600)
CYCLE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TERMINAL = [s.value for s in JobState if s.terminal]
_PLACED = re.compile(r"^(attempt \d+ )?placed on ")  # the events control.place writes


def reason_class(reason: str | None) -> str:
    """The label of a waiting reason: its words before the first ':' (``resources: no room…`` →
    ``resources``), ``pending`` when the scheduler has not looked at the job yet. Pure."""
    if not reason:
        return "pending"
    head = reason.split(":", 1)[0].strip().lower()
    return head if head and len(head) <= 40 else "other"


class ClusterCollector:
    """Reads the store at each scrape; see the module docstring."""

    def __init__(self, svc: ClusterService):
        self.svc = svc
        # not registered: collected here, after this scrape's new events were observed
        self.admission_wait = Histogram(f"{PREFIX}_admission_wait_time_seconds",
                                        "Time from a job's (re)queueing to its placement on nodes.",
                                        buckets=WAIT_BUCKETS, registry=None)
        self._lock = threading.Lock()
        self._last_event = 0
        self._queued_at: dict[str, float] = {}
        self._admitted = 0

    def collect(self) -> Iterator[Metric]:
        now = self.svc.clock()
        with self.svc.db.read() as rows:
            counts = rows.job_counts()
            reasons = rows.waiting_reasons()
            nodes = rows.node_infos()
            running = [(info, rows.job(info.id)) for info in rows.list_jobs([JobState.RUNNING.value], 10000)]
            rates = {info.id: _step_rate(telemetry.recent_steps(rows.s, row, 20)) for info, row in running}
            self._read_events(rows)
        yield from self.admission_wait.collect()
        yield from _job_families(counts, reasons, self._admitted)
        yield from _node_families(nodes, now)
        yield from _running_families([info for info, _ in running], rates)

    def _read_events(self, rows: Any) -> None:
        with self._lock:
            while True:
                events = rows.events_after(self._last_event, None, 10000)
                for ev in events:
                    if _PLACED.match(ev.message):  # a placement (SCHEDULED, or an attempt while RESTARTING)
                        self._admitted += 1
                        queued = self._queued_at.pop(ev.job_id, None)
                        if queued is not None:
                            self.admission_wait.observe(max(0.0, ev.time - queued))
                    elif ev.state in (JobState.QUEUED, JobState.RESTARTING):
                        self._queued_at.setdefault(ev.job_id, ev.time)
                    elif ev.state.terminal:
                        self._queued_at.pop(ev.job_id, None)
                if events:
                    self._last_event = events[-1].id
                if len(events) < 10000:
                    return


def _job_families(counts: list[tuple[str, str | None, int]], reasons: list[str | None],
                  admitted: int) -> Iterator[Metric]:
    jobs = GaugeMetricFamily(f"{PREFIX}_jobs", "Jobs by state and user.", labels=["state", "user"])
    for state, user, n in counts:
        jobs.add_metric([state, user or ""], n)
    yield jobs
    pending = GaugeMetricFamily(f"{PREFIX}_pending_jobs", "Waiting jobs (QUEUED, RESTARTING) by reason.",
                                labels=["reason"])
    by_reason: dict[str, int] = {}
    for reason in reasons:
        by_reason[reason_class(reason)] = by_reason.get(reason_class(reason), 0) + 1
    for reason, n in sorted(by_reason.items()):
        pending.add_metric([reason], n)
    yield pending
    submitted = CounterMetricFamily(f"{PREFIX}_submitted_jobs", "Jobs submitted (accepted).")
    submitted.add_metric([], sum(n for _, _, n in counts))
    yield submitted
    admitted_family = CounterMetricFamily(f"{PREFIX}_admitted_jobs", "Placements of jobs on nodes (one per attempt).")
    admitted_family.add_metric([], admitted)
    yield admitted_family
    finished = CounterMetricFamily(f"{PREFIX}_finished_jobs", "Jobs that ended, by final state.", labels=["state"])
    for state in _TERMINAL:
        finished.add_metric([state], sum(n for s, _, n in counts if s == state))
    yield finished


def _node_families(nodes: list[Any], now: float) -> Iterator[Metric]:
    age = GaugeMetricFamily(f"{PREFIX}_node_heartbeat_age_seconds", "Seconds since each node's last heartbeat.",
                            labels=["node"])
    states = GaugeMetricFamily(f"{PREFIX}_nodes", "Nodes by state.", labels=["state"])
    by_state: dict[str, int] = {}
    for node in nodes:
        age.add_metric([node.name], max(0.0, now - node.last_seen))
        by_state[node.state] = by_state.get(node.state, 0) + 1
    for state, n in sorted(by_state.items()):
        states.add_metric([state], n)
    yield age
    yield states
    for resource, total, used in (("cpu", "cpus", "used_cpus"), ("gpu", "gpus", "used_gpus"),
                                  ("memory_bytes", "memory", "used_memory")):
        fam = GaugeMetricFamily(f"{PREFIX}_node_{resource}", f"Each node's {resource}: capacity and used.",
                                labels=["node", "kind"])
        for node in nodes:
            fam.add_metric([node.name, "capacity"], getattr(node, total))
            fam.add_metric([node.name, "used"], getattr(node, used))
        yield fam


def _running_families(running: list[Any], rates: dict[str, float | None]) -> Iterator[Metric]:
    labels = ["job", "name", "user"]
    step_rate = GaugeMetricFamily(f"{PREFIX}_job_step_rate", "Training steps per second of each running job "
                                  "(over its last 20 reports).", labels=labels)
    samples = GaugeMetricFamily(f"{PREFIX}_job_samples_per_second", "The samples_per_s each running job "
                                "reported last.", labels=labels)
    for info in running:
        key = [info.id, info.name, info.user or ""]
        if rates.get(info.id) is not None:
            step_rate.add_metric(key, rates[info.id])
        if isinstance(info.last_metrics.get("samples_per_s"), (int, float)):
            samples.add_metric(key, float(info.last_metrics["samples_per_s"]))
    yield step_rate
    yield samples


def _step_rate(points: list[tuple[int, float]]) -> float | None:
    """Steps per second between the first and last of ``points`` (None with fewer than two). Pure."""
    if len(points) < 2 or points[-1][1] <= points[0][1]:
        return None
    return (points[-1][0] - points[0][0]) / (points[-1][1] - points[0][1])


class _RequestTimer:
    """ASGI middleware: the latency of every request to its response's start, by route template
    (streams count until their headers go out). Unmatched paths share the label ``unmatched``."""

    def __init__(self, app: Any, histogram: Histogram):
        self.app, self.histogram = app, histogram

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()

        async def timed_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.histogram.labels(scope["method"], getattr(route, "path", "unmatched"),
                                      str(message["status"])).observe(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, timed_send)


def install(app: FastAPI, svc: ClusterService) -> CollectorRegistry:
    """Add ``GET /metrics``, the request timer and the cycle timer; returns the app's registry."""
    registry = CollectorRegistry()
    registry.register(ClusterCollector(svc))
    cycles = Histogram(f"{PREFIX}_scheduling_cycle_seconds", "Duration of each scheduling cycle (watchdogs and "
                       "placement).", buckets=CYCLE_BUCKETS, registry=registry)
    svc.control.on_cycle = cycles.observe
    requests = Histogram(f"{PREFIX}_api_request_duration_seconds", "API request latency to the response's start, "
                         "by route.", labelnames=["method", "route", "code"], buckets=REQUEST_BUCKETS, registry=registry)
    app.add_middleware(_RequestTimer, histogram=requests)
    app.include_router(metrics_routes(registry))
    return registry


def metrics_routes(registry: CollectorRegistry) -> APIRouter:
    api = APIRouter()

    @api.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """The Prometheus exposition of the server (docs/observability.md)."""
        return Response(await run_in_threadpool(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)

    return api
