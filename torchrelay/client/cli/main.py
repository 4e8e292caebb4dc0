"""The `relay` command: one module per verb, each a thin call of the SDK."""
from __future__ import annotations

import typer

from torchrelay.client.cli import (agent, auth, data, download, jobs, logs, metrics, nodes, queue, run, server, submit,
                                  tensorboard, up)

app = typer.Typer(name="relay", help="torchrelay: run PyTorch training jobs on a cluster.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def trust(ca: str = typer.Option(None, "--ca", envvar="RELAY_CA", show_envvar=True,
                                 help="PEM file of the CA that signed an https:// server's certificate "
                                 "(default: the system's CAs); agents hand it on to their workers")) -> None:
    """torchrelay: run PyTorch training jobs on a cluster."""
    import os

    if ca:  # every SDK client and agent of this process reads it from here (torchrelay.tls)
        os.environ["RELAY_CA"] = os.path.abspath(ca)


app.command("up")(up.up)
app.command("down")(up.down)
app.command("server")(server.server)
app.command("agent")(agent.agent)
app.command("submit")(submit.submit)
app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(run.run)
app.command("ls")(jobs.ls)
app.command("queue")(queue.queue)
app.command("status")(jobs.status)
app.command("cancel")(jobs.cancel)
app.command("logs")(logs.logs)
app.command("metrics")(metrics.metrics)
app.command("download")(download.download)
app.command("nodes")(nodes.nodes)
app.command("tensorboard")(tensorboard.tensorboard)
app.add_typer(data.app, name="data")
app.command("login")(auth.login)
app.command("logout")(auth.logout)
app.command("whoami")(auth.whoami)
app.add_typer(auth.user_app, name="user")
app.add_typer(auth.token_app, name="token")
app.add_typer(auth.node_app, name="node")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
