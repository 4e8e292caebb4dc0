"""Run the server process: ``relay server`` and the embedded cluster call ``serve``.

Binds before announcing: the listening socket is created here (port 0 lets the OS pick),
then the address is written to ``<RELAY_HOME>/server.json`` and uvicorn serves on that
socket, so a client that reads the file can connect at once. Blocks until SIGTERM/SIGINT. With a
certificate and key (``relay server --tls-cert --tls-key``) it serves HTTPS (uvicorn's TLS) and
its address is ``https://``; without, plain HTTP. On SIGTERM/SIGINT the long-polls in flight
answer at once (``Notifier.close``), so the exit waits only for requests doing work.
"""
from __future__ import annotations

import hashlib
import logging
import os
import socket
import ssl
import sys
from pathlib import Path
from typing import Sequence

import uvicorn

from torchrelay.errors import InvalidSpec
from torchrelay.home import admin_token_file, relay_home, server_file, write_json
from torchrelay.server.app import create_app
from torchrelay.server.auth import Credentials
from torchrelay.server.guard import Guard
from torchrelay.server.config import load_server_config
from torchrelay.server.executors import Executor
from torchrelay.server.events.relay import EventRelay
from torchrelay.server.events.urls import parse_sink_url
from torchrelay.server.leadership import Leadership
from torchrelay.server.quotas import QuotaTable
from torchrelay.server.service import ClusterService
from torchrelay.storage import ArtifactStore, Guarantee

_log = logging.getLogger("torchrelay.server")


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown first ends the long-polls: uvicorn waits for every request
    in flight (up to ``timeout_graceful_shutdown``), and an agent's heartbeat or a client's
    follow would hold the exit for the rest of its wait (≈ 2 s per stop, measured)."""

    def __init__(self, config: uvicorn.Config, service: ClusterService) -> None:
        super().__init__(config)
        self._service = service

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._service.notifier.close()
        await super().shutdown(sockets=sockets)


def default_db_url(home: Path) -> str:
    return f"sqlite:///{home / 'state.db'}"


def slurm_executor(*, partition: str, job_root: Path | None, store_url: str | None, python: str | None,
                   poll_interval_s: float, jobcomp: Path | None, accounting: bool) -> Executor:
    """The Slurm executor of ``relay server --slurm-partition``. Its job folders go under
    ``job_root``, else under the store when that is a local folder (``<store>/slurm``).
    Raises InvalidSpec when there is no such folder."""
    from torchrelay.server.executors.slurm import SlurmConfig, SlurmExecutor

    if job_root is None:
        local = (store_url or str(relay_home() / "store")).removeprefix("file://")
        if "://" in local:
            raise InvalidSpec(f"--slurm-dir is needed: the store {store_url!r} is not a folder the Slurm nodes "
                              "can share; give a path every node sees")
        job_root = Path(local) / "slurm"
    job_root = Path(job_root).resolve()
    job_root.mkdir(parents=True, exist_ok=True)
    # Slurm job names say which server's they are (an attempt is found again by its name): one per job folder
    cluster_id = "relay-" + hashlib.sha1(str(job_root).encode()).hexdigest()[:6]
    config = SlurmConfig(partition=partition, job_root=str(job_root), python=python or sys.executable,
                         poll_interval_s=poll_interval_s, accounting=accounting,
                         jobcomp_path=str(jobcomp) if jobcomp else None, cluster_id=cluster_id)
    return SlurmExecutor(config)


def open_checked_store(url: str, options: dict) -> ArtifactStore:
    """The artifact store, proven usable now (a scratch write) rather than at a job's first checkpoint.
    Raises StorageError."""
    store = ArtifactStore(url, options)
    store.check()
    found = store.capabilities()
    if Guarantee.CHECK_THEN_WRITE in (found.put_if_absent, found.compare_and_swap):
        _log.warning("artifact store %s has no atomic conditional write (%s): the attempt fence is a check "
                     "followed by a write (docs/checkpoints.md)", store.url, found.as_dict())
    return store


def check_tls_files(cert: Path | None, key: Path | None) -> None:
    """Raise InvalidSpec unless ``cert`` and ``key`` are both None or both load as a PEM certificate
    chain and its private key (what uvicorn would load later, after binding)."""
    if cert is None and key is None:
        return
    if cert is None or key is None:
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise InvalidSpec(f"{given} needs {missing} too: HTTPS needs the certificate and its private key")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not Path(path).is_file():
            raise InvalidSpec(f"{flag} {str(path)!r} is not a file; give a PEM file (docs/security.md, TLS)")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(str(cert), str(key))
    except ssl.SSLError as exc:
        raise InvalidSpec(f"--tls-cert {str(cert)!r} and --tls-key {str(key)!r} do not load as a PEM certificate "
                          f"and its private key ({exc.reason or exc}); docs/security.md, TLS, shows how to "
                          "make them") from None


def first_admin_name() -> str:
    import getpass

    from torchrelay.server.auth import check_user_name

    try:
        return check_user_name(os.environ.get("RELAY_ADMIN_USER") or getpass.getuser())
    except (InvalidSpec, KeyError, OSError):
        return "admin"


def announce_first_admin(credentials: Credentials, home: Path) -> None:
    """On the store's first start: make the admin user, print its token (this once) and keep it
    in ``<home>/admin.token`` (mode 0600), where the embedded cluster's client finds it. The admin
    is named after the account that started the server (``RELAY_ADMIN_USER`` names another), so
    that on one machine jobs go on carrying their submitter's login name."""
    token = credentials.bootstrap_admin(first_admin_name())
    if token is None:
        return
    path = admin_token_file(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    print(f"torchrelay: the admin token (shown this once; also in {path}, mode 0600):\n  {token}\n"
          f"  `relay login --address ADDRESS --token TOKEN` stores it for the relay CLI", flush=True)


def serve(*, host: str = "127.0.0.1", port: int = 0, db_url: str | None = None, store_url: str | None = None,
          home: Path | None = None, heartbeat_timeout_s: float = 10.0, log_level: str = "warning",
          quotas_file: Path | None = None, executors: Sequence[Executor] = (),
          config_file: Path | None = None, events: Sequence[str] = (), advertise: str | None = None,
          tls_cert: Path | None = None, tls_key: Path | None = None) -> None:
    """Serve until interrupted. Raises, before binding: InvalidSpec naming the file and entry when
    ``quotas_file`` or ``config_file`` is malformed, or naming the URL when one of ``events`` is;
    StorageError with the store's own reason when the artifact store cannot be opened, reached or
    written (a missing package, wrong credentials, a missing bucket); StoreUnavailable when the
    state store (``db_url``) cannot be reached. Raises OSError naming the address when it cannot
    bind. A sink that cannot be reached is logged and retried by its relay, never fatal
    (docs/queues.md). On PostgreSQL several servers may share one state store: one leads, the
    others answer where it is (``leadership.py``); ``advertise`` is the URL they name for this one
    (default: the address it listens on). With ``tls_cert`` and ``tls_key`` (PEM files) it serves
    HTTPS only and its address is ``https://``; InvalidSpec naming the file when they do not load."""
    check_tls_files(tls_cert, tls_key)
    quotas = QuotaTable.load(quotas_file) if quotas_file else QuotaTable()
    config = load_server_config(config_file) if config_file else None
    sink_urls = [parse_sink_url(url) for url in events]
    home = home or relay_home()
    store = open_checked_store(store_url or (config and config.store_url) or str(home / "store"),
                               config.store_options if config else {})
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    bound_port = sock.getsockname()[1]
    shown_host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    scheme = "https" if tls_cert else "http"
    address = (f"{scheme}://[{shown_host}]:{bound_port}" if ":" in shown_host
               else f"{scheme}://{shown_host}:{bound_port}")
    service = ClusterService(db_url or default_db_url(home), store,
                             heartbeat_timeout_s=heartbeat_timeout_s, quotas=quotas, executors=executors)
    access = Guard(Credentials(service.db, service.clock), service.db)
    announce_first_admin(access.credentials, home)
    leadership = Leadership(service, (advertise or address).rstrip("/"))
    app = create_app(service, lifecycle=leadership, limits=config.limits if config else None, access=access)
    leadership.guard(app)
    relays = [EventRelay(url, service.engine, active=lambda: leadership.is_leader) for url in sink_urls]
    for relay in relays:
        relay.start()
    write_json(server_file(home), {"address": address, "pid": os.getpid()})
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING))
    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_keep_alive=75,
                            timeout_graceful_shutdown=3,
                            ssl_certfile=str(tls_cert) if tls_cert else None, ssl_keyfile=str(tls_key) if tls_key else None)
    server = _Server(config, service)
    try:
        server.run(sockets=[sock])
    finally:
        for relay in relays:
            relay.stop()
        try:
            data = server_file(home).read_text()
            if str(os.getpid()) in data:
                server_file(home).unlink()
        except OSError:
            pass
