"""A private PostgreSQL server for the tests: its own data dir, 127.0.0.1, a port the OS picked.

Not a test module. ``PostgresServer.unavailable()`` says why one cannot run here (a skip
reason) after trying to install Debian's ``postgresql`` when it is missing (root only).
``PostgresServer()`` runs ``initdb`` and ``pg_ctl start`` as the ``postgres`` user
(PostgreSQL refuses to run as root) in a folder of its own under the temp dir (the user must
reach it, which a test's 0700 ``tmp_path`` does not allow) and creates one database; ``url``
is its SQLAlchemy URL (psycopg 3). ``create_database(name)`` / ``drop_database(name)`` (the
latter ends its sessions first) and ``url_of(name)`` give each test a database of its own.
``restart()`` stops the server at once (immediate mode: as a crash) and starts it again on the
same port and data. ``stop()`` is ``pg_ctl stop -m immediate`` and removes the folder;
idempotent.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from .apt import ensure
from .ports import free_port

__all__ = ["PostgresServer"]


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """One PostgreSQL cluster under ``root`` (a folder the test owns); see the module docstring."""

    @staticmethod
    def unavailable() -> str | None:
        """None when a server can start here; else why not. Installs ``postgresql`` when missing."""
        try:
            import psycopg  # noqa: F401
        except ImportError:
            return "psycopg is not installed (`pip install -e '.[postgres]'`)"
        reason = ensure(["postgresql"], lambda: _bin_dir() is not None, "PostgreSQL")
        if reason:
            return reason
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                return "no `postgres` user to run PostgreSQL as (it refuses root)"
        return None

    def __init__(self, database: str = "relay") -> None:
        self.bin = _bin_dir()
        assert self.bin is not None, "call PostgresServer.unavailable() first"
        self.root = Path(tempfile.mkdtemp(prefix="relay-pg-"))
        self.data = self.root / "pgdata"
        self._as_user = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self.port = free_port()
        try:
            self._start(database)
        except BaseException:
            self.stop()
            raise

    def _start(self, database: str) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self._pg_ctl_start()
        self.create_database(database)
        self.url = self.url_of(database)

    def _pg_ctl_start(self) -> None:
        # a commit is in the WAL (the OS's page cache) before it is acknowledged, so an immediate stop
        # (``restart``) loses nothing acknowledged; fsync is off: only a crash of this machine would
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.root} "
                   "-c fsync=off -c full_page_writes=off -c max_connections=300")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "postgres.log"), "-o", options,
                  "-w", "-t", "60", "start")
        self._started = True

    def url_of(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)

    def drop_database(self, name: str) -> None:
        self._run("dropdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "--force", "--if-exists", name)

    def restart(self) -> None:
        """Stop at once (as a crash would) and start again on the same port and data."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        self._started = False
        self._pg_ctl_start()

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self._as_user, str(self.bin / tool), *args], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            log = self.root / "postgres.log"
            tail = log.read_text()[-1000:] if log.exists() else ""
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({done.returncode}): {done.stderr}{tail}")

    def stop(self) -> None:
        """Stop the server at once (immediate mode) and remove its folder. Idempotent."""
        if getattr(self, "_started", False):
            self._started = False
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
