"""`make demo`: an embedded cluster of 2 agents runs the digits job with 2 workers.

Starts a server and 2 agents on this machine (state in ``.relay/demo`` unless RELAY_HOME is
set), submits ``job.yaml`` (one worker on each agent), shows the job's progress, prints the
final test accuracy and where the model was saved, downloads the model, and stops the
cluster, whatever happens. Exits non-zero if the job did not succeed.
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def main() -> int:
    os.environ.setdefault("RELAY_HOME", str(REPO / ".relay" / "demo"))
    os.environ.pop("RELAY_ADDRESS", None)
    from torchrelay.client.cli.common import console
    from torchrelay.client.cli.follow import follow, print_outcome
    from torchrelay.client.cluster import start_cluster
    from torchrelay.client.sdk import RelayClient
    from torchrelay.spec import JobSpec

    began = time.monotonic()
    console.print(f"[bold]starting an embedded cluster[/] (server + 2 agents) in {os.environ['RELAY_HOME']}")
    cluster = start_cluster(2)
    try:
        with RelayClient(cluster.address) as client:
            for node in client.nodes():
                console.print(f"  node {node.name}: {node.cpus:g} cpus, {node.memory / 2**30:.1f} GiB")
            # one worker on each agent, so the demo crosses nodes as a real cluster would
            spec = JobSpec.from_yaml_text((HERE / "job.yaml").read_text(),
                                          ["nodes=2", "workers_per_node=1", "workers=2"])
            info = client.submit(spec, base_dir=HERE)
            console.print(f"[bold]submitted[/] {info.id}: {spec.entrypoint} × {spec.workers} workers",
                          soft_wrap=True)
            final = follow(client, info.id, show_logs=False)
            print_outcome(final)
            accuracy, saved = None, None
            for line in client.iter_logs(info.id, rank=0):
                if m := re.search(r"test_accuracy=([0-9.]+)", line.text):
                    accuracy = float(m.group(1))
                if m := re.search(r"model saved to (\S+)", line.text):
                    saved = m.group(1)
            if final.state.value != "SUCCEEDED":
                console.print(f"the job did not succeed; see `RELAY_HOME={os.environ['RELAY_HOME']} relay logs {info.id}`")
                return 1
            dest = REPO / ".relay" / "demo-download" / info.id
            paths = client.download(info.id, dest)
            console.print(f"[bold green]test accuracy: {accuracy}[/]")
            console.print(f"model saved to {saved}")
            console.print("downloaded with `relay download`: " + ", ".join(str(p) for p in paths))
    finally:
        cluster.stop()
        console.print(f"cluster stopped; demo took {time.monotonic() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
