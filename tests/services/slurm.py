"""A private Slurm cluster for the tests: munge, one slurmctld and two slurmd on 127.0.0.1.

Not a test module. ``SlurmCluster.unavailable()`` says why one cannot run here (a skip reason),
after installing Debian's ``slurmctld slurmd slurm-client munge`` when missing (root only).
``SlurmCluster()`` makes a folder of its own under the temp dir with a munge key, a
``slurm.conf`` (free ports, its own state, spool, pid and log files, ``NodeName=n[1-2]
NodeAddr=127.0.0.1``, ``ProctrackType=proctrack/linuxproc``, ``JobCompType=jobcomp/filetxt``,
no accounting) and starts ``munged``, ``slurmctld`` and ``slurmd -N n1`` / ``-N n2``, each in a
session of its own, and waits until both nodes are idle. ``nodes`` names them otherwise (the
benchmark names them after host names that resolve, which torchx's rendezvous needs). ``env``
points the client commands at it (``SLURM_CONF``); never the system's Slurm or munge. ``stop_controller()`` /
``start_controller()`` stop and start slurmctld alone (an unreachable controller);
``stop()`` ends every process it started and removes the folder; idempotent.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .apt import ensure
from .ports import free_ports

__all__ = ["SlurmCluster"]

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
NODES = ("n1", "n2")
CPUS_PER_NODE = 64  # declared, not real (config_overrides): room for many small jobs at once


def _missing_daemons() -> list[str]:
    return [p for p in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(p) is None
            and not Path(f"/usr/sbin/{p}").exists()]


class SlurmCluster:
    """One private Slurm cluster under ``root``; see the module docstring."""

    partition = "debug"

    @staticmethod
    def unavailable() -> str | None:
        """None when a cluster can start here; else why not. Installs the packages when missing."""
        if os.geteuid() != 0:
            return "the test Slurm cluster runs its daemons as root (SlurmUser=root); not root here"
        return ensure(PACKAGES, lambda: not _missing_daemons(), "Slurm")

    def __init__(self, nodes: tuple[str, str] = NODES) -> None:
        self.nodes = nodes
        self.root = Path(tempfile.mkdtemp(prefix="relay-slurm-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "slurm.conf"
        self.jobcomp = self.root / "jobcomp.txt"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        try:
            self._write_config()
            self._start_munge()
            self.start_controller()
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            self._wait_idle()
        except BaseException:
            self.stop()
            raise

    # ------------------------------------------------------------ configuration

    def _write_config(self) -> None:
        ctl_port, *node_ports = free_ports(1 + len(self.nodes))
        self.ctl_port = ctl_port
        for sub in ("state", "spool", "munge"):
            (self.root / sub).mkdir(mode=0o700)
        host = socket.gethostname().split(".")[0]
        r = self.root
        nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={p} CPUs={CPUS_PER_NODE} RealMemory=16000 "
                          "State=UNKNOWN" for n, p in zip(self.nodes, node_ports))
        self.conf.write_text(f"""\
ClusterName=relaytest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=10
InactiveLimit=0
KillWait=15
MinJobAge=300
SchedulerParameters=sched_interval=2,bf_interval=1
{nodes}
PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    # ------------------------------------------------------------ processes

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        log.close()

    def _start_munge(self) -> None:
        m = self.root / "munge"
        subprocess.run(["mungekey", "--create", f"--keyfile={m}/munge.key"], check=True, capture_output=True)
        os.chmod(m / "munge.key", 0o600)
        self._spawn("munged", ["munged", "--foreground", f"--socket={m}/munge.socket", f"--key-file={m}/munge.key",
                               f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                               f"--seed-file={m}/munge.seed", "--force"])
        self._wait(lambda: (m / "munge.socket").exists(), "munged to create its socket", 20)

    def start_controller(self) -> None:
        """Start slurmctld (its saved state is kept: the jobs it knew carry on)."""
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, "slurmctld to answer", 60)

    def stop_controller(self) -> None:
        """Stop slurmctld alone (SIGTERM: it saves its state); the nodes' slurmd keep running."""
        self._end("slurmctld")

    def _end(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def _wait_idle(self) -> None:
        def idle() -> bool:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            return all(states.get(n) == "idle" for n in self.nodes)
        self._wait(idle, "both nodes to be idle", 60)

    def _wait(self, check, what: str, timeout_s: float) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while not check():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}: "
                                       f"{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}: {self.log_tail('slurmctld')}")
            time.sleep(0.2)

    def log_tail(self, name: str, chars: int = 1500) -> str:
        texts = []
        for path in (self.root / f"{name}.out", self.root / f"{name}.log"):
            if path.exists():
                texts.append(path.read_text(errors="replace")[-chars:])
        return "\n".join(texts)

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def stop(self) -> None:
        """Cancel every job, end every daemon started here, remove the folder. Idempotent."""
        if "slurmctld" in self.procs:
            self.run("scancel", "--full", "-u", "root", check=False)
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            self._end(name)
        shutil.rmtree(self.root, ignore_errors=True)
