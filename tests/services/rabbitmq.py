"""A private RabbitMQ node for the tests: its own node name, data folder, cookie and ports.

Not a test module. ``RabbitMQ.unavailable()`` installs Debian's rabbitmq-server when missing (root;
tests/services/apt.py), then says why one cannot run here (a skip reason), or None.
``RabbitMQ(root)`` prepares a node under ``root``: node name ``relay-<random>@localhost``,
``RABBITMQ_MNESIA_BASE``/logs/config in ``root``, ``HOME`` in ``root`` (so its own Erlang
cookie), AMQP on 127.0.0.1 and a port picked free, Erlang distribution on 127.0.0.1 only with
an ``epmd`` of its own (own port, loopback, in the node's process group), so nothing listens
beyond this machine and no system node or epmd is touched.
``start()`` starts it and waits until AMQP answers; ``kill()`` SIGKILLs the node (and its
epmd); ``stop()`` ends it with SIGTERM (SIGKILL after a grace); ``start()`` again restarts it on
the same data and port. ``close()``: stop and forget. Every process runs in a session the
object owns.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .apt import ensure
from .ports import free_ports

__all__ = ["RabbitMQ"]


def _server_binary() -> str:
    """The server script itself: Debian's ``/usr/sbin/rabbitmq-server`` wrapper would switch to
    the ``rabbitmq`` user, which cannot enter a test's own folder."""
    direct = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
    return str(direct) if direct.exists() else "rabbitmq-server"


class RabbitMQ:
    @staticmethod
    def unavailable() -> str | None:
        try:
            import pika  # noqa: F401
        except ImportError:
            return "pika is not installed (the channels extra: make venv)"
        return ensure(["rabbitmq-server"], lambda: shutil.which(_server_binary()) is not None
                      and shutil.which("epmd") is not None, "RabbitMQ (rabbitmq-server and Erlang's epmd)")

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port, self.dist_port, self.epmd_port = free_ports(3)
        self.node = f"relay-{secrets.token_hex(4)}@localhost"
        (self.root / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\nloopback_users = none\n"
            "log.console = false\nlog.file.level = warning\n")
        (self.root / "enabled_plugins").write_text("[].\n")
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root),
            "RABBITMQ_NODENAME": self.node, "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.root / "log"), "RABBITMQ_CONFIG_FILE": str(self.root / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1", "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port), "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }
        (self.root / ".erlang.cookie").write_text(secrets.token_hex(16))
        os.chmod(self.root / ".erlang.cookie", 0o400)
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"
        self._epmd: subprocess.Popen | None = None
        self._proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> None:
        if self._epmd is None or self._epmd.poll() is not None:
            self._epmd = subprocess.Popen(["epmd", "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                                          env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)
        log = open(self.root / "server.out", "ab")
        self._proc = subprocess.Popen([_server_binary()], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                out = (self.root / "server.out").read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"RabbitMQ node {self.node} did not start: {out}")
            time.sleep(0.2)

    def _answers(self) -> bool:
        import pika

        try:
            pika.BlockingConnection(pika.URLParameters(self.url + "?connection_attempts=1&socket_timeout=1")).close()
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def _end(self, sig: int, grace: float) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        # the Erlang VM may have left children of its own in the group (erl_child_setup)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """The broker dies at once (SIGKILL), as in a crash; its data stays for ``start``."""
        self._end(signal.SIGKILL, 5)

    def stop(self) -> None:
        self._end(signal.SIGTERM, 30)

    def close(self) -> None:
        self.stop()
        epmd, self._epmd = self._epmd, None
        if epmd is not None:
            try:
                os.killpg(epmd.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            epmd.wait(10)
