"""Long-polls: answer at once when there is news, else wait on a notifier key and read again.

Each function runs on the server's event loop; the service's blocking reads run in the
thread pool (``anyio.to_thread``), never on the loop. A wait ends when the key is bumped
(``ClusterService`` lists the keys) or when its time is up, and the answer is read afresh.
"""
from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

from anyio.to_thread import run_sync

from torchrelay.server.service import ClusterService
from torchrelay.wire import Heartbeat, HeartbeatReply, JobInfo, LogPage, MetricPage

Page = TypeVar("Page", LogPage, MetricPage)


async def job(svc: ClusterService, job_id: str, wait: float, known_state: str | None) -> JobInfo:
    """The job; with ``wait`` and ``known_state``, once its state differs or ``wait`` s pass
    (a bump of its key ends the wait either way). Raises NotFound."""
    info = await run_sync(svc.get_job, job_id)
    if wait and known_state == info.state.value:
        key = f"job:{info.id.removeprefix('job-')}"
        seen = svc.notifier.version(key)
        # Read again now that the version is taken: a change committed between the first read
        # and ``seen`` bumped the key before we looked, and no later bump would end the wait
        # (``relay wait`` then answered up to its poll, 10 s, late).
        info = await run_sync(svc.get_job, job_id)
        if known_state == info.state.value:
            await svc.notifier.wait(key, seen, wait)
            info = await run_sync(svc.get_job, job_id)
    return info


async def follow(svc: ClusterService, kind: str, job_id: str, wait: float, fetch: Callable[[], Page],
                 has_news: Callable[[Page], bool]) -> Page:
    """``fetch()`` once it has news, the job ended, or ``wait`` s passed (``kind``: "logs" or
    "metrics", whose key is bumped when they grow). Raises NotFound."""
    seq, _ = await run_sync(svc.job_state, job_id)
    key = f"{kind}:{seq}"
    version = svc.notifier.version(key)
    page = await run_sync(fetch)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while not (has_news(page) or page.job_state.terminal or svc.notifier.closed) and loop.time() < deadline:
        version = await svc.notifier.wait(key, version, deadline - loop.time())
        page = await run_sync(fetch)
    return page


async def heartbeat(svc: ClusterService, node_id: str, body: Heartbeat) -> HeartbeatReply:
    """Apply the heartbeat, then answer at once when the node's desired launches differ from
    the version the agent knows, else once they change or the wait passes. The node counts as
    seen at the start of its heartbeat, so the wait stays well inside the heartbeat timeout,
    and again at its end."""
    reply = await run_sync(svc.heartbeat, node_id, body)
    wait = min(body.wait_s, svc.heartbeat_timeout_s / 3)
    if wait and reply.version == body.known_version:
        await svc.notifier.wait(f"node:{node_id}", reply.version, wait)
        await run_sync(svc.touch, node_id)
        taken = reply.statuses_taken  # the statuses were applied before the wait
        reply = await run_sync(svc.desired, node_id)
        reply.statuses_taken = taken
    return reply
