"""A private single-host Ceph for the tests: one mon, one in-memory OSD, radosgw on 127.0.0.1.

Not a test module. ``CephCluster.unavailable()`` says why one cannot run here (a skip reason)
after trying to install Debian's ``ceph-mon ceph-osd radosgw`` when they are missing (root
only). ``CephCluster()`` builds a cluster in a temp folder of its own and blocks until its S3
endpoint answers and the bucket exists (3-5 s on 2 cores, 136 MiB resident); ``endpoint_url``,
``access_key``, ``secret_key``, ``region`` and ``bucket`` name it and ``env()`` gives them as
the ``AWS_*`` variables the AWS tools (and so the store) read. ``stop_gateway()`` and
``start_gateway()`` take the S3 endpoint away and bring it back (same port, same objects);
``mount_cephfs()`` adds a CephFS (``ceph-mds``) and mounts it with ``ceph-fuse`` (root). ``stop()`` ends every daemon it started (their
process groups, never a name) and removes the folder; idempotent.

How it is made fast and sound (Ceph 16.2 on a small host):
- every command reads ``-c <folder>/ceph.conf``, never /etc/ceph; the ``ceph`` CLI always has
  ``--connect-timeout`` and librados clients ``client mount timeout``, else a missing mon
  makes them wait 300 s;
- every entity's key and caps go into one keyring before ``ceph-mon --mkfs`` (which imports
  it), so no ``auth add`` round trips are needed;
- ``osd objectstore = memstore``: the OSD keeps objects in RAM, no disk is formatted;
- 8 PGs per pool, autoscale off and ``mon max pg per osd = 1000``: RGW makes 6-7 pools;
- ``paxos propose interval = 0.1`` (the default 1 s is paid on every map change at start);
- ``rgw gc obj min wait = 0`` and ``rgw gc processor period = 10``, else deleted objects stay
  in the OSD's RAM for hours;
- the S3 user is made with ``radosgw-admin`` before radosgw starts, and the zonegroup's API
  name is set to the region, else CreateBucket with a region is refused;
- no ``ceph-mgr`` (about 300 MB, not needed for S3).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from .apt import ensure
from .ports import free_ports

__all__ = ["CephCluster"]

PACKAGES = ("ceph-mon", "ceph-osd", "radosgw", "ceph-mds", "ceph-fuse")
TOOLS = ("ceph", "ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph-authtool", "monmaptool")
CONNECT_TIMEOUT_S = 20
START_TIMEOUT_S = 90
STOP_GRACE_S = 10


def _missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


class CephCluster:
    """One Ceph cluster with an S3 gateway; see the module docstring."""

    region = "us-east-1"

    @staticmethod
    def unavailable() -> str | None:
        """None when a cluster can start here; else why not. Installs the packages when missing."""
        try:
            import botocore  # noqa: F401
        except ImportError:
            return "botocore is not installed (`pip install -e '.[s3]'`)"
        return ensure(PACKAGES, lambda: not _missing_tools(), "Ceph")

    @staticmethod
    def cephfs_unavailable() -> str | None:
        """None when ``mount_cephfs()`` can work here (after ``unavailable()``); else why not."""
        if os.geteuid() != 0:
            return "mounting CephFS with ceph-fuse needs root"
        if not os.path.exists("/dev/fuse"):
            return "/dev/fuse is missing (no FUSE in this kernel or container)"
        missing = [tool for tool in ("ceph-mds", "ceph-fuse", "fusermount") if shutil.which(tool) is None]
        return f"{', '.join(missing)} not installed" if missing else None

    def __init__(self, bucket: str = "relay-test") -> None:
        self.root = Path(tempfile.mkdtemp(prefix="relay-ceph-"))
        self.conf = self.root / "ceph.conf"
        self.bucket = bucket
        self.access_key = "RELAYTEST" + secrets.token_hex(6).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self._daemons: list[subprocess.Popen] = []
        self.mountpoint: Path | None = None
        started = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - started

    # ------------------------------------------------------------ what a test uses

    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables that point an S3 client at this cluster."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": self.region,
                "AWS_REGION": self.region}

    def client(self):
        """A botocore S3 client for this cluster (for what the store under test must not do itself)."""
        import botocore.config
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=botocore.config.Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}))

    def add_key(self) -> tuple[str, str]:
        """A second (access key, secret) of the same S3 user: a credential of another party
        (e.g. the agents') that reaches the same bucket."""
        access, secret = "RELAYTEST" + secrets.token_hex(6).upper(), secrets.token_urlsafe(30)
        self._run("radosgw-admin", "key", "create", "--uid", "relay", "--key-type", "s3",
                  "--access-key", access, "--secret", secret)
        return access, secret

    def memory_bytes(self) -> int:
        """Resident memory of the daemons, summed (VmRSS)."""
        total = 0
        for proc in self._daemons:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        return total

    # ------------------------------------------------------------ start

    def _start(self) -> None:
        self.mon_port, self.rgw_port = free_ports(2)
        self.endpoint_url = f"http://127.0.0.1:{self.rgw_port}"
        for sub in ("mon/ceph-a", "osd/ceph-0", "rgw", "run", "log"):
            (self.root / sub).mkdir(parents=True)
        fsid = str(uuid.uuid4())
        self.conf.write_text(self._config(fsid))
        self._make_keyring()
        self._run("monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{self.mon_port}]",
                  str(self.root / "monmap"))
        self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(self.root / "monmap"),
                  "--keyring", str(self.root / "keyring"))
        self._spawn("ceph-mon", "-f", "-i", "a")
        osd_uuid = str(uuid.uuid4())
        self._ceph("osd", "new", osd_uuid, "0")
        self._run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
        self._spawn("ceph-osd", "-f", "-i", "0")
        self._run("radosgw-admin", "user", "create", "--uid", "relay", "--display-name", "relay tests",
                  "--access-key", self.access_key, "--secret", self.secret_key)
        self._run("radosgw-admin", "zonegroup", "modify", "--rgw-zonegroup", "default", "--api-name", self.region)
        self.start_gateway()
        self.client().create_bucket(Bucket=self.bucket)

    def mount_cephfs(self) -> Path:
        """A CephFS on this cluster (its pools, one ``ceph-mds``) mounted with ``ceph-fuse`` at a
        folder of its own; returns the mount point. Root only (FUSE with allow_other). Idempotent.
        ``stop()`` unmounts it before it ends the daemons."""
        if self.mountpoint is not None:
            return self.mountpoint
        for pool in ("cephfs_metadata", "cephfs_data"):
            self._ceph("osd", "pool", "create", pool, "8")
        self._ceph("fs", "new", "cephfs", "cephfs_metadata", "cephfs_data")
        (self.root / "mds" / "ceph-a").mkdir(parents=True)
        self._spawn("ceph-mds", "-f", "-i", "a")
        deadline = time.monotonic() + START_TIMEOUT_S
        while '"up:active"' not in self._ceph("fs", "dump", "--format", "json").replace(": ", ":"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the MDS did not become active in {START_TIMEOUT_S} s{self._log_tails()}")
            time.sleep(0.2)
        mountpoint = self.root / "cephfs"
        mountpoint.mkdir()
        self._fuse = self._spawn("ceph-fuse", "-f", "-n", "client.admin", "-o", "allow_other", str(mountpoint))
        while not os.path.ismount(mountpoint):
            if self._fuse.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ceph-fuse did not mount {mountpoint}{self._log_tails()}")
            time.sleep(0.1)
        self.mountpoint = mountpoint
        return mountpoint

    def _unmount(self) -> None:
        mountpoint, self.mountpoint = self.mountpoint, None
        if mountpoint is not None and os.path.ismount(mountpoint):
            subprocess.run(["fusermount", "-u", "-z", str(mountpoint)], capture_output=True, timeout=30)

    def start_gateway(self) -> None:
        """Start radosgw (again, on the same port) and block until it answers."""
        self._gateway = self._spawn("radosgw", "-f", "-n", "client.rgw.gw")
        self._wait_for_gateway()

    def stop_gateway(self) -> None:
        """End radosgw (the S3 endpoint goes away; the cluster and its objects stay). Idempotent."""
        gateway, self._gateway = getattr(self, "_gateway", None), None
        if gateway is not None:
            _end_group(gateway)
            self._daemons.remove(gateway)

    def _config(self, fsid: str) -> str:
        root = self.root
        return f"""[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{self.mon_port}]
public addr = 127.0.0.1
keyring = {root}/keyring
run dir = {root}/run
admin socket = {root}/run/$name.asok
pid file = {root}/run/$name.pid
log file = {root}/log/$name.log
log to stderr = false
err to stderr = true
client mount timeout = {CONNECT_TIMEOUT_S}
rados mon op timeout = {CONNECT_TIMEOUT_S}
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon max pg per osd = 1000
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
paxos propose interval = 0.1
[mon]
mon data = {root}/mon/$cluster-$id
mon initial members = a
[osd]
osd data = {root}/osd/$cluster-$id
osd objectstore = memstore
memstore device bytes = {2 << 30}
osd max object size = {1 << 30}
[mds]
mds data = {root}/mds/$cluster-$id
[client.rgw.gw]
rgw frontends = beast endpoint=127.0.0.1:{self.rgw_port}
rgw data = {root}/rgw
rgw thread pool size = 64
rgw init timeout = {START_TIMEOUT_S}
rgw gc obj min wait = 0
rgw gc processor period = 10
"""

    def _make_keyring(self) -> None:
        keyring = str(self.root / "keyring")
        entities = {
            "mon.": ["--cap", "mon", "allow *"],
            "client.admin": ["--cap", "mon", "allow *", "--cap", "osd", "allow *", "--cap", "mgr", "allow *",
                             "--cap", "mds", "allow *"],
            "osd.0": ["--cap", "mon", "allow profile osd", "--cap", "mgr", "allow profile osd",
                      "--cap", "osd", "allow *"],
            "client.rgw.gw": ["--cap", "mon", "allow rw", "--cap", "osd", "allow rwx", "--cap", "mgr", "allow rw"],
            "mds.a": ["--cap", "mon", "allow profile mds", "--cap", "osd", "allow *", "--cap", "mds", "allow *",
                      "--cap", "mgr", "allow profile mds"],
        }
        self._run("ceph-authtool", "--create-keyring", keyring)
        for name, caps in entities.items():
            self._run("ceph-authtool", keyring, "--gen-key", "-n", name, *caps)

    def _ceph(self, *args: str) -> str:
        return self._run("ceph", "--connect-timeout", str(CONNECT_TIMEOUT_S), *args)

    def _run(self, tool: str, *args: str) -> str:
        command = [tool, "-c", str(self.conf), *args]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{tool} {args[:3]} did not finish in {START_TIMEOUT_S} s{self._log_tails()}") from None
        if done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args[:3])} failed ({done.returncode}): "
                               f"{done.stderr.strip()[-800:]}{self._log_tails()}")
        return done.stdout

    def _spawn(self, tool: str, *args: str) -> subprocess.Popen:
        log = open(self.root / "log" / f"{tool}.out", "ab")
        with log:
            proc = subprocess.Popen([tool, "-c", str(self.conf), *args], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self._daemons.append(proc)
        return proc

    def _wait_for_gateway(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # any HTTP answer: the gateway is serving
            except OSError:
                pass
            for proc in self._daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}{self._log_tails()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"radosgw did not answer in {START_TIMEOUT_S} s{self._log_tails()}")
            time.sleep(0.1)

    def _log_tails(self) -> str:
        tails = []
        for log in sorted((self.root / "log").glob("*")) if (self.root / "log").is_dir() else ():
            text = log.read_text(errors="replace").strip()
            if text:
                tails.append(f"\n--- {log.name}\n{text[-600:]}")
        return "".join(tails)

    # ------------------------------------------------------------ stop

    def stop(self) -> None:
        """End every daemon this cluster started (its process group) and remove the folder. Idempotent."""
        self._unmount()
        daemons, self._daemons = self._daemons, []
        for proc in reversed(daemons):  # radosgw, then the OSD, then the mon
            _end_group(proc)
        shutil.rmtree(self.root, ignore_errors=True)


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of ``proc``, then SIGKILL whatever of it is left; reaps ``proc``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # each daemon leads its own session: its pid is its group id
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_GRACE_S)
