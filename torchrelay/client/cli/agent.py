"""`relay agent`: run a node agent in the foreground."""
from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path

import typer

from torchrelay.client.cli.common import fail, handle_errors, key_values


@handle_errors
def agent(address: str = typer.Option(..., "--address", envvar="RELAY_ADDRESS",
                                     help="server URL; several servers of one cluster: comma-separated"),
          name: str = typer.Option(None, help="node name (default: host name)"),
          host: str = typer.Option(None, help="address other nodes reach this node's workers at (default: "
                                   "this host's address on the route to the server); it must be on one "
                                   "of this host's interfaces, whose name the workers' gloo, TensorPipe "
                                   "and NCCL then use (the node label socket_ifname=NAME overrides)"),
          cpus: float = typer.Option(None, help="cpus to offer (default: all)"),
          gpus: int = typer.Option(None, help="gpus to offer (default: all found)"),
          gpu_type: str = typer.Option(None, "--gpu-type",
                                       help="the kind of this node's gpus, e.g. h100 (default: as nvidia-smi names them)"),
          zygote: bool | None = typer.Option(None, "--zygote/--no-zygote",
                                      help="fork one-process Python workers from a warm interpreter (default: on unless RELAY_AGENT_ZYGOTE=0)"),
          memory: str = typer.Option(None, help="memory to offer, e.g. 16GiB (default: all)"),
          work_dir: Path = typer.Option(None, help="bundle cache and launch folders (default: RELAY_HOME/agents/NAME)"),
          label: list[str] = typer.Option([], "--label", help="node label key=value (repeatable)"),
          cgroups: str = typer.Option(None, "--cgroups", envvar="RELAY_AGENT_CGROUPS",
                                      help="enforce the offer and each launch's cpu and memory with cgroups: "
                                      "auto (when root and mounted; the default), on, off"),
          cgroup_parent: str = typer.Option(None, "--cgroup-parent",
                                            help="the cgroup the agent's own goes under (default: its own)"),
          ca: str = typer.Option(None, "--ca", help="PEM file of the CA that signed an https:// server's "
                                 "certificate (default: RELAY_CA, else the system's CAs); the workers get "
                                 "it too, as RELAY_CA"),
          enroll_token: str = typer.Option(None, "--enroll-token", envvar="RELAY_ENROLL_TOKEN",
                                           help="a node enrolment token (`relay node enroll-token`); needed at the "
                                           "first start only: the agent keeps the credential it gets in its work dir")) -> None:
    """Run an agent: register with the server, start and watch this node's workers."""
    from torchrelay.agent.daemon import Agent
    from torchrelay.client.credentials import token_for
    from torchrelay.home import relay_home
    from torchrelay.spec import parse_memory

    os.environ.pop("RELAY_ENROLL_TOKEN", None)  # read (typer's envvar); not for the workers' environment
    if ca:  # the link to the server and build_worker_env read it from the environment (torchrelay.tls)
        os.environ["RELAY_CA"] = os.path.abspath(ca)
    labels = key_values(label, "--label")
    name = name or socket.gethostname()
    host = _advertised(host, address)
    try:
        node = Agent(address, name=name, host=host, cpus=cpus, gpus=gpus, gpu_type=gpu_type,
                     memory=parse_memory(memory) if memory else None,
                     work_dir=work_dir or relay_home() / "agents" / name, labels=labels, zygote=zygote,
                     cgroups=cgroups, cgroup_parent=cgroup_parent,
                     # without an enrolment token: an admin's token, as the relay CLI would send it to this
                     # server (RELAY_TOKEN, the embedded cluster's own, what `relay login` stored)
                     enroll_token=enroll_token or token_for(address))
    except ValueError as exc:
        fail(str(exc))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        node.run(stop)
    finally:
        node.close()


def _advertised(host: str | None, address: str) -> str:
    """``host`` when it is on an interface here (else exit naming it and the interfaces); without
    it, this host's address on the route to the server, said aloud."""
    from torchrelay.agent.netif import check_advertised, route_address
    from torchrelay.servers import parse_addresses

    try:
        first = parse_addresses(address)[0]
    except ValueError as exc:
        fail(str(exc))
    chosen = host is None
    if host is None:
        try:
            host = route_address(first)
        except OSError as exc:
            fail(f"cannot find this host's address on the route to {first} ({exc.strerror or exc}); give --host")
    try:
        interface = check_advertised(host)
    except ValueError as exc:
        fail(str(exc))
    if chosen:
        typer.echo(f"advertising {host} (interface {interface}, on the route to {first}); --host overrides",
                   err=True)
    return host
