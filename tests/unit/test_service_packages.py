"""tests/services/apt.py: a service's Debian packages are installed when missing, or the reason is given."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.services import apt



def test_present_needs_no_install(monkeypatch):
    monkeypatch.setattr(apt.subprocess, "run", lambda *a, **k: pytest.fail("apt-get ran"))
    assert apt.ensure(["postgresql"], lambda: True, "PostgreSQL") is None


REASON = "PostgreSQL is not installed and cannot be here (apt-get install postgresql needs root and apt-get)"


SYSTEM_PYTHON = "/usr/bin/python3"  # the venv's interpreter may lie under a folder only root can enter


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None or not os.path.exists(SYSTEM_PYTHON),
                    reason="runs a process as nobody: needs root, runuser and /usr/bin/python3")
def test_missing_without_root_gives_the_reason():
    """A real process that is not root (nobody), with a package it may not install."""
    with tempfile.TemporaryDirectory() as folder:  # apt.py needs only the standard library
        os.chmod(folder, 0o755)
        shutil.copy(apt.__file__, Path(folder, "apt_probe.py"))
        probe = "from apt_probe import ensure; print(ensure(['postgresql'], lambda: False, 'PostgreSQL'))"
        done = subprocess.run(["runuser", "-u", "nobody", "--", SYSTEM_PYTHON, "-c", probe], cwd=folder,
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == REASON


def test_missing_without_apt_get_gives_the_reason(monkeypatch):
    monkeypatch.setattr(apt.shutil, "which", lambda name: None)  # a machine that is not Debian's
    monkeypatch.setattr(apt.subprocess, "run", lambda *a, **k: pytest.fail("apt-get ran"))
    assert apt.ensure(["postgresql"], lambda: False, "PostgreSQL") == REASON


def test_a_failed_install_says_what_apt_get_said(monkeypatch):
    """Only the reporting is faked here: running apt-get for a package that does not exist would need the network."""
    calls = []

    class Done:
        returncode, stderr = 100, "E: Unable to locate package no-such-package\n"

    def run(command, **_kwargs):
        calls.append(command[:2])
        return Done()

    monkeypatch.setattr(apt.os, "geteuid", lambda: 0)
    monkeypatch.setattr(apt.shutil, "which", lambda name: "/usr/bin/apt-get")
    monkeypatch.setattr(apt.subprocess, "run", run)
    reason = apt.ensure(["no-such-package"], lambda: False, "Nothing")
    assert reason == "apt-get install no-such-package did not install Nothing: E: Unable to locate package no-such-package"
    assert calls == [["apt-get", "install"], ["apt-get", "update"], ["apt-get", "install"]]  # update only after a failure
