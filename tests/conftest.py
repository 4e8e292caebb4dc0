"""Fixtures that start real torchrelay processes on 127.0.0.1 and always end them.

Every process is started in its own session; teardown signals the whole group and then
checks that none of its processes is left.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from logins import bearer, login_as_admin as _login_as_admin  # noqa: F401 - for the tests

REPO = Path(__file__).resolve().parents[1]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def kill_group(pgid: int, grace_s: float = 5.0) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="session", autouse=True)
def relay_config_dir(tmp_path_factory):
    """The client's config dir (``relay login``'s credentials) of the whole session: never the
    user's own ``~/.config``."""
    path = tmp_path_factory.mktemp("relay-config")
    saved = os.environ.get("RELAY_CONFIG_DIR")
    os.environ["RELAY_CONFIG_DIR"] = str(path)
    yield path
    if saved is None:
        os.environ.pop("RELAY_CONFIG_DIR", None)
    else:
        os.environ["RELAY_CONFIG_DIR"] = saved


@pytest.fixture
def relay_home(tmp_path, monkeypatch):
    home = tmp_path / "relay-home"
    home.mkdir()
    monkeypatch.setenv("RELAY_HOME", str(home))
    monkeypatch.delenv("RELAY_ADDRESS", raising=False)
    return home


@contextlib.contextmanager
def serving(home: Path, args: list[str] | tuple[str, ...] = ()):
    """A real `relay server --port 0 [args]` process with ``RELAY_HOME=home``; yields its address."""
    from torchrelay.home import read_json, server_file

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RELAY_HOME": str(home)}
    env.pop("RELAY_ADDRESS", None)
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "torchrelay.client.cli.main", "server", "--port", "0", *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            info = read_json(server_file(home))
            if info and info.get("pid") == proc.pid:
                break
            assert proc.poll() is None, (home / "server.log").read_text()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        _login_as_admin(home, info["address"])
        yield info["address"]
    finally:
        kill_group(proc.pid)
        proc.wait(timeout=10)
        log.close()
        assert group_members(proc.pid) == []


@pytest.fixture
def server(relay_home):
    """A real `relay server --port 0` process; yields its address."""
    with serving(relay_home) as address:
        yield address


@pytest.fixture(scope="module")
def module_server(tmp_path_factory):
    """One real server for a whole test module (its tests must not depend on each other's rows)."""
    home = tmp_path_factory.mktemp("relay-home")
    with serving(home) as address:
        yield address


@pytest.fixture
def cluster_factory(relay_home):
    """Start an embedded cluster (server + N agents); stopped and checked at teardown."""
    from torchrelay.client.cluster import start_cluster, stop_cluster

    started = []

    def make(agents: int = 2, **kw):
        cluster = start_cluster(agents, home=relay_home, **kw)
        started.append(cluster)
        return cluster

    yield make
    for cluster in started:
        stop_cluster(cluster.home)
        for pid in cluster.pids:
            assert group_members(pid) == [], f"processes left in group {pid}"


@pytest.fixture
def launches():
    """Agent ``Launch``es a test starts; each is stopped, and checked to leave nothing, at teardown."""
    started: list = []
    yield started
    for launch in started:
        launch.stop(grace_s=2)
        assert launch.remaining_processes() == []


@pytest.fixture(scope="session", autouse=True)
def no_agent_cgroups_left():
    """Agents a test killed before they closed leave their cgroups (under this process's own);
    the next agent would sweep them, the end of the session does it for the last ones."""
    yield
    from torchrelay.agent import cgroups

    usable, _ = cgroups.cgroups_usable()
    if usable:
        cgroups.sweep_dead_agents(cgroups.detect())


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = REPO / "out" / "screenshots"


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory):
    """One headless Chromium (Debian's) per test module, driven by Playwright, with a fresh
    profile; tests open their own pages in it. Skips, saying why, without either. Not per session:
    Playwright's sync API keeps an asyncio loop running in the main thread while it lives, and a
    later test's ``asyncio.run`` then refuses to start."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[test])")
    from services.apt import ensure

    reason = ensure(["chromium"], CHROMIUM.exists, f"Chromium ({CHROMIUM})")
    if reason:
        pytest.skip(reason)
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000})
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="session")
def ceph():
    """One private Ceph (mon, memstore OSD, radosgw; tests/services/ceph.py) for the whole test
    session, shared by every file that touches S3 or CephFS; skips, with the reason, where none
    can run. A test that stops the gateway starts it again before it ends."""
    from services.ceph import CephCluster

    yield from _session_service(CephCluster)


@pytest.fixture(scope="session")
def rabbitmq(tmp_path_factory):
    """A private RabbitMQ node for the whole session (tests/services/rabbitmq.py), stopped after."""
    from tests.services.rabbitmq import RabbitMQ

    reason = RabbitMQ.unavailable()
    if reason:
        pytest.skip(reason)
    node = RabbitMQ(tmp_path_factory.mktemp("rabbitmq"))
    try:
        node.start()
        yield node
    finally:
        node.close()


# ---------------------------------------------------------------- state stores: SQLite and PostgreSQL


def _session_service(cls):
    """A test service (``tests/services``) for a session fixture: skipped with the reason where
    ``cls.unavailable()`` gives one, else started, yielded and stopped."""
    reason = cls.unavailable()
    if reason:
        pytest.skip(reason)
    made = cls()
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture(scope="session")
def postgres():
    """One private PostgreSQL for the whole session (tests/services/postgres.py); skips with the
    reason where none can run."""
    from services.postgres import PostgresServer

    yield from _session_service(PostgresServer)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty state store: a SQLite file, or a database of its own on the session's
    PostgreSQL (dropped afterwards)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'state.db'}"
        return
    server = request.getfixturevalue("postgres")
    name = f"t_{os.getpid()}_{time.monotonic_ns()}"
    server.create_database(name)
    try:
        yield server.url_of(name)
    finally:
        server.drop_database(name)
