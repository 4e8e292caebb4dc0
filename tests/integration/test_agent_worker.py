"""The worker exit hook on real processes (small scripts, no torch): what counts as returned."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

# An object only the cyclic collector frees, whose finaliser aborts: a stand-in for gloo's
# SIGABRT during interpreter teardown that happens every time. gc is disabled so that it
# cannot be collected before the script returns.
ABORT_AT_EXIT = """
import gc, os
gc.disable()
class AbortsWhenCollected:
    def __init__(self):
        self.cycle = self
    def __del__(self, _abort=os.abort):
        _abort()
AbortsWhenCollected()
"""


def run_worker(tmp_path: Path, script: str, *args: str, mode: str = "script", rank: int = 3,
               env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict | None]:
    (tmp_path / "job.py").write_text(textwrap.dedent(script))
    target = {"script": ["job.py"], "module": ["-m", "job"], "exec": ["--exec"]}[mode]
    full_env = {**os.environ, "RELAY_RANK_STATUS_DIR": str(tmp_path / "status"), "RANK": str(rank),
                **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "torchrelay.agent.worker", *target, *args], cwd=tmp_path,
                          env=full_env, capture_output=True, text=True, timeout=30, start_new_session=True)
    marker_path = tmp_path / "status" / f"rank-{rank}.json"
    marker = json.loads(marker_path.read_text()) if marker_path.exists() else None
    return proc, marker


def test_script_runs_as_main_with_its_argv_atexit_and_sys_path(tmp_path):
    proc, marker = run_worker(tmp_path, """
        import atexit, sys
        atexit.register(lambda: print("atexit ran", flush=True))
        print("main" if __name__ == "__main__" else __name__, sys.argv, sys.path[0])
    """, "--lr", "0.1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"main ['job.py', '--lr', '0.1'] {tmp_path}", "atexit ran"]
    assert marker["returned"] is True and marker["exit_code"] == 0 and marker["signal"] is None


def test_module_mode(tmp_path):
    proc, marker = run_worker(tmp_path, "import sys; print(__name__, sys.argv[1:])", "x", mode="module")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "__main__ ['x']"
    assert marker["returned"] is True


def test_exception_fails_with_code_1_and_its_traceback(tmp_path):
    proc, marker = run_worker(tmp_path, """
        def train():
            raise ValueError("loss is nan")
        train()
    """)
    assert proc.returncode == 1
    assert "ValueError: loss is nan" in proc.stderr
    assert 'File "job.py", line 3, in train' in proc.stderr
    assert "runpy" not in proc.stderr and "torchrelay" not in proc.stderr
    assert marker == {**marker, "returned": False, "exit_code": 1, "script_exit_code": 1}


@pytest.mark.parametrize("statement, code", [("sys.exit(3)", 3), ("sys.exit('bad config')", 1),
                                             ("sys.exit(0)", 0), ("sys.exit()", 0)])
def test_sys_exit_keeps_its_code(tmp_path, statement, code):
    proc, marker = run_worker(tmp_path, f"import sys\n{statement}\n")
    assert proc.returncode == code
    assert marker["returned"] is (code == 0) and marker["exit_code"] == code
    if statement == "sys.exit('bad config')":
        assert "bad config" in proc.stderr


def test_signal_before_return_fails(tmp_path):
    proc, marker = run_worker(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert proc.returncode == 128 + signal.SIGKILL
    assert marker["returned"] is False and marker["signal"] == signal.SIGKILL and marker["exit_code"] is None


def test_abort_after_return_counts_as_success(tmp_path):
    plain = subprocess.run([sys.executable, "-c", ABORT_AT_EXIT], capture_output=True, timeout=30)
    assert plain.returncode == -signal.SIGABRT  # the hazard, reproduced without the hook
    proc, marker = run_worker(tmp_path, ABORT_AT_EXIT + "print('returned', flush=True)\n")
    assert proc.returncode == 0, proc.stderr
    assert marker["returned"] is True and marker["signal"] == signal.SIGABRT
    assert "counted as success" in proc.stderr


def test_globals_are_not_finalised_before_the_script_is_recorded(tmp_path):
    # a finaliser on a module global runs at teardown under plain python; the hook never gets there
    proc, marker = run_worker(tmp_path, """
        import os
        class AbortsWhenFreed:
            def __del__(self, _abort=os.abort):
                _abort()
        keep = AbortsWhenFreed()
    """)
    assert proc.returncode == 0, proc.stderr
    assert marker["returned"] is True and marker["signal"] is None


def test_exec_mode_records_the_program_exit(tmp_path):
    (tmp_path / "job.py").write_text("")
    for shell_code, returned, code in (("exit 0", True, 0), ("exit 4", False, 4)):
        proc, marker = run_worker(tmp_path, "", "sh", "-c", shell_code, mode="exec")
        assert proc.returncode == code
        assert marker["returned"] is returned and marker["exit_code"] == code


def test_missing_program_fails_with_127(tmp_path):
    proc, marker = run_worker(tmp_path, "", "no-such-program-xyz", mode="exec")
    assert proc.returncode == 127 and "cannot start 'no-such-program-xyz'" in proc.stderr
    assert marker["returned"] is False


def test_usage_error_names_the_option(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torchrelay.agent.worker", "--frobnicate"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "unknown option '--frobnicate'" in proc.stderr


def test_output_goes_to_rank_log_files(tmp_path):
    proc, _ = run_worker(tmp_path, "import sys\nprint('out')\nprint('err', file=sys.stderr)\n",
                         env={"RELAY_LOG_DIR": str(tmp_path / "logs")})
    assert proc.returncode == 0 and proc.stdout == ""
    assert (tmp_path / "logs" / "rank-3.log").read_text() == "o out\ne err\n"


def test_output_keeps_its_order_and_partial_lines(tmp_path):
    proc, marker = run_worker(tmp_path, """
        import sys
        print("step 1")
        print("warn", file=sys.stderr, flush=True)
        print("step 2")
        sys.stdout.write("x" * 70000)
        raise RuntimeError("boom")
    """, env={"RELAY_LOG_DIR": str(tmp_path / "logs")})
    assert proc.returncode == 1 and marker["returned"] is False
    lines = (tmp_path / "logs" / "rank-3.log").read_text().splitlines()
    # the order across the two pipes is as read; within each stream it is exact
    out = [ln[2:] for ln in lines if ln.startswith("o ")]
    assert out[:2] == ["step 1", "step 2"]
    assert "".join(out[2:]) == "x" * 70000 and max(map(len, out)) <= 65536  # cut, nothing lost
    errors = [ln for ln in lines if ln.startswith("e ")]
    assert errors[0] == "e warn" and errors[1] == "e Traceback (most recent call last):"
    assert lines[-1] == "e RuntimeError: boom"


def test_sigterm_to_the_supervisor_reaches_the_script(tmp_path):
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import signal, sys, time
        def on_term(*_):
            print("got SIGTERM", flush=True)
            sys.exit(5)
        signal.signal(signal.SIGTERM, on_term)
        print("ready", flush=True)
        time.sleep(60)
    """))
    env = {**os.environ, "RELAY_RANK_STATUS_DIR": str(tmp_path / "status"), "RANK": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "torchrelay.agent.worker", "job.py"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGTERM)  # the supervisor only, as a direct kill would
        assert proc.wait(timeout=20) == 5
        assert proc.stdout.read().strip() == "got SIGTERM"
        marker = json.loads((tmp_path / "status" / "rank-0.json").read_text())
        assert marker["returned"] is False and marker["exit_code"] == 5
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group_alive(proc.pid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
