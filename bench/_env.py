"""What a bench's figure was measured with: the versions of the packages it depends on.

Contract: ``package_versions(names)`` maps "python" and each name to its installed version
("absent" where it is not installed), from the installed distributions' metadata, then "cpu" to
the processor's model name and core count (``/proc/cpuinfo``; the same VM's host can change
between sessions, and a ratio measured on one CPU is not another's): it imports none of the
packages and never raises. ``header_line`` is that mapping as the one line a bench
prints first; ``result_line`` is the bench's last line, ``RESULT {json}``, with the mapping
under "versions", so a figure says what it was measured with and a fresh ``make venv`` can
reproduce it (docs/design.md, "Fast paths a fresh install lacks").

    from _env import SERVER_PACKAGES, header_line, package_versions, result_line
    versions = package_versions(SERVER_PACKAGES)
    print(header_line(versions))
    ...
    print(result_line(result, versions))
"""
from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

TRAINING_PACKAGES = ("torch",)
# the server's speed depends on uvicorn's fast paths (uvloop, httptools) as much as on our code
SERVER_PACKAGES = ("torch", "uvicorn", "uvloop", "httptools", "fastapi", "sqlalchemy")


def package_versions(names: Iterable[str] = TRAINING_PACKAGES) -> dict[str, str]:
    """{"python": "3.11.9", name: version or "absent", ..., "cpu": "AMD EPYC × 2"} in the order given."""
    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    found["cpu"] = cpu_model()
    return found


def cpu_model() -> str:
    """"AMD EPYC × 2": the first ``model name`` of /proc/cpuinfo and the usable cores; "unknown" off Linux."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{names[0] if names else platform.processor() or 'unknown'} × {cores}"


def header_line(versions: dict[str, str]) -> str:
    return "versions: " + ", ".join(f"{name} {version}" for name, version in versions.items())


def result_line(result: dict[str, Any], versions: dict[str, str]) -> str:
    return "RESULT " + json.dumps({**result, "versions": versions})
