"""The pure parts of MPI jobs: host names, mpirun's argv, the hand-off, a rank's environment,
the scheduling label and reason, the server's record of the world (tables of cases)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from torchrelay.agent import mpi
from torchrelay.server.assignment import mpi_world, with_daemons
from torchrelay.server.scheduling import MPI_HINT, job_labels, submission_probe, queued_job, waiting_reason
from torchrelay.spec import JobSpec
from torchrelay.wire import MPIRUN_LABEL


@pytest.mark.parametrize("node_rank, host", [(0, "localhost"), (1, "node1.relay.invalid"), (12, "node12.relay.invalid")])
def test_host_names_round_trip(node_rank, host):
    assert mpi.host_of(node_rank) == host
    if node_rank:
        assert mpi.node_rank_of(host) == node_rank


@pytest.mark.parametrize("host", ["localhost", "node0.relay.invalid", "node1", "nodex.relay.invalid", "vm"])
def test_other_host_names_are_refused_naming_them(host):
    with pytest.raises(ValueError, match=repr(host)):
        mpi.node_rank_of(host)


def test_mpirun_command_lists_every_node_with_its_slots_and_our_shell():
    argv = mpi.mpirun_command(slots=[2, 1, 3], python="/py", worker_argv=["train.py", "--x"], as_root=True)
    assert argv[:4] == ["mpirun", "--allow-run-as-root", "-np", "6"]
    assert argv[argv.index("--host") + 1] == "localhost:2,node1.relay.invalid:1,node2.relay.invalid:3"
    mca = dict(zip(argv[1::1], argv[2::1]))
    assert mca["plm_rsh_agent"] == "/py -m torchrelay.agent.mpi_rsh"
    assert argv[-5:] == ["/py", "-m", "torchrelay.agent.mpi_rank", "train.py", "--x"]
    assert "--allow-run-as-root" not in mpi.mpirun_command(slots=[1], python="/py", worker_argv=["a.py"])


@pytest.mark.parametrize("slots, python, match", [
    ([], "/py", "slots"), ([2, 0], "/py", "slots"), ([1], "/my python/bin/python", "spaces")])
def test_mpirun_command_refuses(slots, python, match):
    with pytest.raises(ValueError, match=match):
        mpi.mpirun_command(slots=slots, python=python, worker_argv=["a.py"])


@pytest.mark.parametrize("addr, loopback", [("127.0.0.1", True), ("localhost", True), ("10.1.2.3", False)])
def test_open_mpi_settings_on_loopback_and_across_hosts(addr, loopback):
    env = mpi.mpirun_env(addr)
    assert env["OMPI_MCA_pml"] == "ob1" and env["OMPI_MCA_hwloc_base_binding_policy"] == "none"
    assert ("OMPI_MCA_btl_tcp_if_include" in env) is loopback
    node = mpi.node_env(addr, "/tmp/s", daemon=True)
    assert node["OMPI_MCA_orte_tmpdir_base"] == "/tmp/s" and (mpi.SHM_DIR_VAR in node) is loopback
    assert node.get(mpi.SHM_DIR_VAR, mpi.shm_dir("/tmp/s")).endswith("/s")
    assert "OMPI_MCA_orte_tmpdir_base" not in mpi.node_env(addr, "/tmp/s", daemon=False)


def test_session_dirs_are_short_and_differ_per_launch(tmp_path):
    a, b = mpi.session_dir(tmp_path / ("x" * 150) / "n0"), mpi.session_dir(tmp_path / "n1")
    assert a != b and len(a) < 40 and a == mpi.session_dir(tmp_path / ("x" * 150) / "n0")


OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}


@pytest.mark.parametrize("node, expect", [
    ({"RELAY_RANK_OFFSET": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, {"RANK": "3", "LOCAL_RANK": "1"}),
    ({"RELAY_RANK_OFFSET": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "placed rank 3"),  # wrong node
    ({"RELAY_RANK_OFFSET": "2", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"}, "world 6"),  # wrong world
    ({"RELAY_RANK_OFFSET": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1"}, "local rank 1"),
])
def test_rank_env_from_open_mpi(node, expect):
    if isinstance(expect, str):
        with pytest.raises(ValueError, match=expect):
            mpi.rank_env({**OMPI, **node})
    else:
        got = mpi.rank_env({**OMPI, **node, mpi.SHM_DIR_VAR: "/tmp/s"})
        assert {k: got[k] for k in expect} == expect and got["ROLE_RANK"] == "3"
        assert got["OMPI_MCA_btl_vader_backing_directory"] == "/tmp/s"


def test_rank_env_outside_mpirun_says_so():
    with pytest.raises(ValueError, match="not started by Open MPI"):
        mpi.rank_env({"RANK": "0"})


def test_remote_shell_hands_the_daemon_over_atomically_and_refuses_other_hosts(tmp_path):
    env = {"RELAY_LAUNCH_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    ok = subprocess.run([sys.executable, "-m", "torchrelay.agent.mpi_rsh", "node2.relay.invalid", " orted", "-mca",
                         "ess", '"env"'], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert mpi.read_handoffs(tmp_path) == {2: 'orted -mca ess "env"'}
    assert json.loads(mpi.handoff_path(tmp_path, 2).read_text())["node_rank"] == 2
    assert [p.name for p in (tmp_path / "mpi").iterdir()] == ["daemon-2.json"]  # no temporary left
    bad = subprocess.run([sys.executable, "-m", "torchrelay.agent.mpi_rsh", "elsewhere", "orted"], env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "'elsewhere'" in bad.stderr


def spec(**kw) -> JobSpec:
    return JobSpec.parse({"entrypoint": "python a.py", **kw})


@pytest.mark.parametrize("kw, labels", [
    ({}, ()),
    ({"launcher": "mpirun"}, (MPIRUN_LABEL,)),
    ({"launcher": "mpirun", "labels": {"zone": "a"}}, (MPIRUN_LABEL, ("zone", "a"))),
    ({"launcher": "mpirun", "labels": {"relay.mpirun": "custom"}}, (("relay.mpirun", "custom"),)),
])
def test_an_mpirun_job_asks_for_open_mpi_nodes(kw, labels):
    s = spec(**kw)
    assert job_labels(s) == tuple(sorted(labels))
    probe = submission_probe(s, queued_job(1, s))
    assert MPIRUN_LABEL not in probe.labels  # taken at submission; waits with its reason instead


@pytest.mark.parametrize("launcher, reason, hinted", [
    ("mpirun", "unschedulable: 1 workers of 1 cpu with labels {...} do not fit", True),
    ("mpirun", "resources", False), ("torchrun", "unschedulable: x", False)])
def test_waiting_reason_of_an_mpirun_job_names_open_mpi(launcher, reason, hinted):
    got = waiting_reason(reason, spec(launcher=launcher))
    assert got.startswith(reason) and (MPI_HINT in got) is hinted


def test_launcher_must_be_known():
    with pytest.raises(Exception, match="launcher"):
        spec(launcher="srun")


def test_the_servers_record_of_an_mpi_world():
    from types import SimpleNamespace as NS
    world = mpi_world((NS(nproc=2), NS(nproc=1)))
    assert world == {"slots": [2, 1], "daemons": {}}
    later = with_daemons(with_daemons(world, {1: "orted a"}), {2: "orted b"})
    assert later == {"slots": [2, 1], "daemons": {"1": "orted a", "2": "orted b"}}
    assert with_daemons(None, {1: "orted"}) is None
