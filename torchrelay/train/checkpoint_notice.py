"""Tell the server that a checkpoint was committed, so that it becomes a job event.

Contract:
- ``notify_commit(step, url, env=os.environ)`` posts ``CheckpointCommit`` (``{"step", "url"}``)
  to ``POST /api/v1/jobs/$RELAY_JOB_ID/checkpoints`` of the servers ``RELAY_ADDRESS`` names,
  with the worker's ``RELAY_TOKEN`` (valid for this job's attempt only: the server takes the
  attempt from it) and ``RELAY_CA`` for an https server. The checkpoint's writer calls it once
  the commit is done (``checkpoint.CheckpointStore``'s ``on_commit``; rank 0 only).
- It never raises and never fails the save: a checkpoint is committed by its manifest in the
  store whether or not the server hears of it. It tries ``ATTEMPTS`` times (each server of the
  list in turn, ``TIMEOUT_S`` each, backing off a little), logs a warning naming the step and
  the reason when it gives up, and returns whether the server took it. Posting the same commit
  again adds nothing (the server dedups by job, attempt, step and url). Outside a torchrelay job
  (no ``RELAY_ADDRESS``/``RELAY_TOKEN``/``RELAY_JOB_ID``: plain ``python`` or ``torchrun``) it
  does nothing and returns False.
- It blocks its caller for one request (a few ms on a reachable server, at most about
  ``ATTEMPTS * TIMEOUT_S`` plus the back-off when none answers): an async save's commit runs in
  its upload thread, behind training; a blocking save waits for it as for the manifest.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

import httpx

from torchrelay.servers import parse_addresses
from torchrelay.tls import verify_for
from torchrelay.wire import API_PREFIX, CheckpointCommit

log = logging.getLogger("torchrelay.train.checkpoint")

ATTEMPTS = 3
TIMEOUT_S = 2.0
_RETRY = (429, 500, 502, 503, 504)  # busy, or not the leader: another try (another server) may take it


def notify_commit(step: int, url: str, env: Mapping[str, str] | None = None) -> bool:
    """See the module contract."""
    env = os.environ if env is None else env
    job, token, addresses = env.get("RELAY_JOB_ID"), env.get("RELAY_TOKEN"), env.get("RELAY_ADDRESS")
    if not (job and token and addresses):
        return False
    body = CheckpointCommit(step=step, url=url).model_dump()
    reason = "no server answered"
    try:
        servers = parse_addresses(addresses)
    except ValueError as exc:
        servers, reason = (), str(exc)
    for attempt in range(ATTEMPTS if servers else 0):
        server = servers[attempt % len(servers)]
        try:
            reply = httpx.post(f"{server}{API_PREFIX}/jobs/{job}/checkpoints", json=body, timeout=TIMEOUT_S,
                               headers={"Authorization": f"Bearer {token}"}, verify=verify_for(server))
        except Exception as exc:  # noqa: BLE001 - a notice must never fail the save
            reason = f"{server}: {type(exc).__name__}: {exc}"
        else:
            if reply.status_code == 200:
                return True
            reason = f"{server} answered {reply.status_code}: {reply.text[:300]}"
            if reply.status_code not in _RETRY:
                break  # refused (a stale attempt's token, a bad body): trying again changes nothing
        time.sleep(0.25 * (attempt + 1) if attempt + 1 < ATTEMPTS else 0)
    log.warning("checkpoint of step %d (%s) is committed, but the server did not record it as a job event: %s",
                step, url, reason)
    return False
