"""A node's heartbeat, applied: what ``ClusterService.heartbeat``, ``touch`` and ``desired`` do.

``beat`` records the node alive, applies the launch statuses the beat carries (in order, in one
transaction, as ``ClusterService.launch_status`` would), ends the launches the agent no longer
runs (``watchdogs.forgotten_launches``) and returns the node's desired launches without waiting.
Statuses of launches unknown or not on this node are skipped (logged), so one stale entry cannot
make every later heartbeat fail. Each function blocks on one short transaction; raises NotFound
for a node that is not registered (``touch`` ignores it).
"""
from __future__ import annotations

import logging

from torchrelay.server.control import Control
from torchrelay.server.notify import Notifier
from torchrelay.server.rows import Database, live_on_node, node_assignments, node_for_reply, touch_node
from torchrelay.server.watchdogs import forgotten_launches
from torchrelay.spec import LaunchState, NodeState
from torchrelay.storage import ArtifactStore
from torchrelay.wire import Heartbeat, HeartbeatReply, LaunchStatus

_log = logging.getLogger("torchrelay.server")


def beat(db: Database, control: Control, store: ArtifactStore, notifier: Notifier, node_id: str, hb: Heartbeat,
         now: float) -> HeartbeatReply:
    """See the module docstring."""
    with db.lock:
        with db.write() as rows:
            node = rows.node_seen(node_id, now)
            held = rows.launches_with_jobs({r.launch_id for r in hb.statuses}) if hb.statuses else []
            for report in hb.statuses:
                launch = rows.launch(report.launch_id)
                if launch is None or launch.node_id != node_id:
                    _log.warning("heartbeat of node %s: status of launch %s skipped (%s)", node_id,
                                 report.launch_id, "unknown" if launch is None else f"on node {launch.node_id}")
                    continue
                control.apply_status(rows, launch, report.status, now)
            del held
            if hb.statuses:
                rows.flush()  # the Core reads below do not autoflush
            live = live_on_node(rows.conn, node_id)
            forgotten = forgotten_launches([(x.id, LaunchState(x.state)) for x in live],
                                           {r.launch_id for r in hb.launches})
            for launch_id in forgotten:
                control.launch_exited(rows, rows.launch(launch_id), LaunchStatus(
                    state="exited", succeeded=False, message="the agent no longer runs this launch"), now)
            if forgotten:
                rows.flush()
                live = live_on_node(rows.conn, node_id)
            launches = node_assignments(rows.conn, db.cache, node, live, store)
        # read once this unit's own changes are notified, and before any later change (the
        # lock is held): a change after this reply bumps past it and wakes the next long-poll
        version = notifier.version(f"node:{node_id}")
    state = NodeState.READY.value if node.state == NodeState.LOST.value else node.state
    return HeartbeatReply(version=version, node_state=state, launches=launches, statuses_taken=len(hb.statuses))


def touch(db: Database, node_id: str, now: float, heartbeat_timeout_s: float) -> None:
    """Record the node as seen at ``now``."""
    with db.lock, db.engine.begin() as conn:
        # a write per long-poll is not needed: LOST is decided at heartbeat_timeout_s scale
        touch_node(conn, node_id, now, unless_seen_after=now - heartbeat_timeout_s / 20)


def desired(db: Database, store: ArtifactStore, notifier: Notifier, node_id: str) -> HeartbeatReply:
    """The node's launches as its agent should run them, with the version they are as of."""
    version = notifier.version(f"node:{node_id}")
    with db.engine.connect() as conn:
        node = node_for_reply(conn, node_id)
        launches = node_assignments(conn, db.cache, node, live_on_node(conn, node_id), store)
    return HeartbeatReply(version=version, node_state=node.state, launches=launches)  # type: ignore[arg-type]
