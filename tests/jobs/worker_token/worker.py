"""A job that talks to the server with its workers' own token (RELAY_TOKEN, RELAY_ADDRESS): it saves
an artifact of its own job, reads its own job, and tries to read another's (argv[1])."""
import os
import sys

from torchrelay.client.sdk import RelayClient
from torchrelay.errors import RelayError

me = os.environ["RELAY_JOB_ID"]
with RelayClient() as c:
    print("token", os.environ["RELAY_TOKEN"], flush=True)  # a test's job: the test shows it dies with the attempt
    c.put_artifact(me, "from-worker.txt", b"written by my worker")
    print("own job", c.job(me).id, flush=True)
    for what, call in [("artifacts", lambda: c.artifacts(sys.argv[1])), ("logs", lambda: c.logs(sys.argv[1])),
                       ("submit", lambda: c.submit({"entrypoint": "python x.py"}, upload=False))]:
        try:
            call()
            print("other", what, "READ", flush=True)
        except RelayError as exc:
            print("other", what, "refused", type(exc).__name__, flush=True)
