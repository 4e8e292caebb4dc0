"""torchrun on 127.0.0.1 for the tests, owned: its whole process group is killed on the way out.

Not a test module. Test files import it inside a function, because the same files also run as
torchrun worker scripts, where ``tests/`` is not on ``sys.path``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def run_torchrun(script: list[str], *, nproc: int, env: dict[str, str], cwd: Path | str,
                 timeout: float = 150) -> subprocess.CompletedProcess:
    """torchrun on 127.0.0.1 with an OS-chosen port; the whole process group is killed on the way out."""
    logs = tempfile.TemporaryDirectory(prefix="torchrun-logs-")  # else torchrun leaves /tmp/torchelastic_*
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--log-dir", logs.name, *script]
    proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        logs.cleanup()
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)
