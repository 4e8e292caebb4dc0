"""Pure parts of the agent: command building, environment, exit classification, tailing."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from torchrelay import wire
from torchrelay.agent import worker
from torchrelay.agent.commands import build_torchrun_command, build_worker_env
from torchrelay.agent.daemon import Agent
from torchrelay.agent.resources import detect_launcher_labels
from torchrelay.agent.exits import classify_exit, describe_rank, exit_message
from torchrelay.agent.output import LaunchOutput, LineTailer, parse_metric_line
from torchrelay.agent.resources import parse_nvidia_smi_list
from torchrelay.agent.target import (TargetKind, UsageError, WorkerTarget, target_of_entrypoint,
                                     target_of_worker_argv)

pytestmark = pytest.mark.timeout(30)


def assignment(**overrides) -> wire.LaunchAssignment:
    data = dict(launch_id="L1", job_id="J1", attempt=2, desired="run", node_rank=1, nnodes=2,
                nproc_per_node=2, world_size=4, rank_offset=2, entrypoint=["python", "train.py", "--lr", "0.1"],
                bundle=None, env={"RELAY_STRATEGY": '{"kind": "ddp"}'}, store_url="/tmp/store",
                job_store_prefix="jobs/J1")
    data.update(overrides)
    return wire.LaunchAssignment(**data)


# ---------------------------------------------------------------- entrypoints and commands


@pytest.mark.parametrize("entrypoint, expected", [
    (["python", "train.py", "--lr", "1"], ["train.py", "--lr", "1"]),
    (["python3", "train.py"], ["train.py"]),
    (["python3.11", "sub/train.py"], ["sub/train.py"]),
    (["/usr/bin/python3", "train.py"], ["train.py"]),
    (["python", "-u", "train.py", "-u"], ["train.py", "-u"]),
    (["python", "-m", "pkg.mod", "--x"], ["-m", "pkg.mod", "--x"]),
    (["python3", "-u", "-m", "pkg"], ["-m", "pkg"]),
    (["python", "-c", "print(1)"], ["--exec", "python", "-c", "print(1)"]),
    (["python"], ["--exec", "python"]),
    (["python", "-m"], ["--exec", "python", "-m"]),
    (["bash", "run.sh"], ["--exec", "bash", "run.sh"]),
    (["./train"], ["--exec", "./train"]),
    (["pythonista", "x.py"], ["--exec", "pythonista", "x.py"]),
])
def test_worker_argv(entrypoint, expected):
    assert target_of_entrypoint(entrypoint).worker_argv() == expected


@pytest.mark.parametrize("entrypoint, expected", [
    (["python", "train.py", "-x"], WorkerTarget(kind=TargetKind.SCRIPT, target="train.py", args=("-x",))),
    (["python3", "-u", "-m", "pkg"], WorkerTarget(kind=TargetKind.MODULE, target="pkg")),
    (["python", "-c", "print(1)", "a"],
     WorkerTarget(kind=TargetKind.CODE, target="print(1)", args=("a",), interpreter="/venv/bin/python")),
    (["python", "-u", "-c", "pass"],  # flags before -c: a program, started as it is
     WorkerTarget(kind=TargetKind.PROGRAM, target="/venv/bin/python", args=("-u", "-c", "pass"))),
    (["bash", "x.sh"], WorkerTarget(kind=TargetKind.PROGRAM, target="bash", args=("x.sh",))),
])
def test_target_of_entrypoint(entrypoint, expected):
    assert target_of_entrypoint(entrypoint, "/venv/bin/python") == expected


def test_worker_argv_runs_unhosted_python_with_the_given_interpreter():
    assert target_of_entrypoint(["python3", "-c", "print(1)"], "/venv/bin/python").worker_argv() == \
        ["--exec", "/venv/bin/python", "-c", "print(1)"]
    assert target_of_entrypoint(["bash", "x.sh"], "/venv/bin/python").worker_argv() == ["--exec", "bash", "x.sh"]


@pytest.mark.parametrize("entrypoint", [[], [""]])
def test_worker_argv_refuses_empty(entrypoint):
    with pytest.raises(ValueError, match="entrypoint .* is empty"):
        target_of_entrypoint(entrypoint)


@pytest.mark.parametrize("target", [
    WorkerTarget(kind=TargetKind.SCRIPT, target="t.py", args=("a",)),
    WorkerTarget(kind=TargetKind.MODULE, target="pkg.mod"),
    WorkerTarget(kind=TargetKind.PROGRAM, target="bash", args=("-c", "x")),
])
def test_the_worker_reads_back_the_target_it_was_given(target):
    assert target_of_worker_argv(target.worker_argv()) == target


def test_torchrun_command_static_rendezvous_through_the_hook():
    cmd = build_torchrun_command(assignment(), master_addr="10.0.0.5", master_port=29511, python="/py",
                                 log_dir=Path("/run/l-1/torchrun"))
    assert cmd[:3] == ["/py", "-m", "torch.distributed.run"]
    options = dict(zip(cmd[3:19:2], cmd[4:19:2]))
    assert options == {"--nnodes": "2", "--node-rank": "1", "--nproc-per-node": "2",
                       "--master-addr": "10.0.0.5", "--master-port": "29511", "--max-restarts": "0",
                       "--shutdown-timeout": "10", "--log-dir": "/run/l-1/torchrun"}
    assert cmd[19:] == ["-m", "torchrelay.agent.worker", "train.py", "--lr", "0.1"]


def test_torchrun_command_for_a_program_execs_it_under_the_supervisor():
    cmd = build_torchrun_command(assignment(entrypoint=["bash", "go.sh"]), master_addr="h", master_port=1,
                                 log_dir="l")
    assert cmd[-4:] == ["torchrelay.agent.worker", "--exec", "bash", "go.sh"]


@pytest.mark.parametrize("addr, port, message", [
    ("", 29500, "master_addr '' is empty"),
    ("h", 0, "master_port 0 is not a TCP port"),
    ("h", 70000, "master_port 70000 is not a TCP port"),
])
def test_torchrun_command_refuses_bad_rendezvous(addr, port, message):
    with pytest.raises(ValueError, match=message):
        build_torchrun_command(assignment(), master_addr=addr, master_port=port, log_dir="l")


@pytest.mark.parametrize("base, job_env, expected_omp", [
    ({}, {}, "1"),
    ({"OMP_NUM_THREADS": "4"}, {}, "4"),
    ({"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "2"}, "2"),
])
def test_worker_env(tmp_path, base, job_env, expected_omp):
    a = assignment(env={"FOO": "bar", **job_env})
    env = build_worker_env(a, base_env={"PATH": "/bin", **base}, run_dir=tmp_path, relay_address="http://s:1")
    assert env["OMP_NUM_THREADS"] == expected_omp
    assert env["PATH"] == "/bin" and env["FOO"] == "bar"
    assert env["RELAY_JOB_ID"] == "J1" and env["RELAY_ATTEMPT"] == "2" and env["RELAY_LAUNCH_ID"] == "L1"
    assert env["RELAY_ADDRESS"] == "http://s:1"
    assert env["RELAY_STORE_URL"] == "/tmp/store" and env["RELAY_JOB_STORE_PREFIX"] == "jobs/J1"
    assert env["RELAY_METRICS_DIR"] == str(tmp_path / "metrics")
    assert env["RELAY_RANK_STATUS_DIR"] == str(tmp_path / "status")
    assert env["RELAY_LOG_DIR"] == str(tmp_path / "logs")
    assert env["RELAY_LAUNCH_DIR"] == str(tmp_path)  # with RELAY_LAUNCH_ID: how the agent finds them


def test_job_env_cannot_override_relay_variables(tmp_path):
    env = build_worker_env(assignment(env={"RELAY_JOB_ID": "other"}), base_env={}, run_dir=tmp_path,
                           relay_address="")
    assert env["RELAY_JOB_ID"] == "J1"


def test_the_agents_own_credentials_never_reach_its_workers(tmp_path):
    base = {"PATH": "/bin", "RELAY_ENROLL_TOKEN": "rle_secret", "RELAY_TOKEN": "rlu_operators"}
    env = build_worker_env(assignment(), base_env=base, run_dir=tmp_path, relay_address="http://s:1")
    assert "RELAY_ENROLL_TOKEN" not in env and "RELAY_TOKEN" not in env and env["PATH"] == "/bin"


@pytest.mark.parametrize("store_options, base, expected", [
    ({}, {}, None),
    ({}, {"RELAY_STORE_OPTIONS": '{"region": "stale"}'}, None),        # only what the server says now
    ({"endpoint_url": "http://rgw:1", "region": "r"}, {"AWS_SECRET_ACCESS_KEY": "node's own"},
     {"endpoint_url": "http://rgw:1", "region": "r"}),
])
def test_store_options_from_the_server_credentials_from_the_node(tmp_path, store_options, base, expected):
    env = build_worker_env(assignment(store_options=store_options), base_env=base, run_dir=tmp_path,
                           relay_address="")
    assert (json.loads(env["RELAY_STORE_OPTIONS"]) if "RELAY_STORE_OPTIONS" in env else None) == expected
    assert env.get("AWS_SECRET_ACCESS_KEY") == base.get("AWS_SECRET_ACCESS_KEY")


@pytest.mark.parametrize("base, node, job_env, expected", [
    ({}, {"GLOO_SOCKET_IFNAME": "eth0"}, {}, "eth0"),                       # the node's transports
    ({"GLOO_SOCKET_IFNAME": "lo"}, {"GLOO_SOCKET_IFNAME": "eth0"}, {}, "eth0"),
    ({}, {"GLOO_SOCKET_IFNAME": "eth0"}, {"GLOO_SOCKET_IFNAME": "ib0"}, "ib0"),  # a job's env wins
])
def test_the_nodes_transport_env_sits_between_its_environment_and_the_jobs(tmp_path, base, node, job_env, expected):
    env = build_worker_env(assignment(env=job_env), base_env=base, run_dir=tmp_path, relay_address="", node_env=node)
    assert env["GLOO_SOCKET_IFNAME"] == expected


@pytest.mark.parametrize("base, job_env, granted, expected", [
    ({}, {}, None, None),                                               # a node without gpus: untouched
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, {}, None, "0,1"),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "2", "2"),  # the agent's grant wins
    ({}, {}, "", ""),                                                   # a cpu launch on a gpu node
])
def test_cuda_visible_devices_is_what_the_agent_granted(tmp_path, base, job_env, granted, expected):
    env = build_worker_env(assignment(env=job_env), base_env=base, run_dir=tmp_path, relay_address="",
                           cuda_visible_devices=granted)
    assert env.get("CUDA_VISIBLE_DEVICES") == expected


# ---------------------------------------------------------------- the worker's pure parts


@pytest.mark.parametrize("argv, kind, target, args", [
    (["train.py", "a"], TargetKind.SCRIPT, "train.py", ("a",)),
    (["-m", "pkg.mod", "a"], TargetKind.MODULE, "pkg.mod", ("a",)),
    (["-mpkg.mod"], TargetKind.MODULE, "pkg.mod", ()),
    (["--exec", "bash", "-c", "x"], TargetKind.PROGRAM, "bash", ("-c", "x")),
])
def test_parse_target(argv, kind, target, args):
    assert target_of_worker_argv(argv) == WorkerTarget(kind=kind, target=target, args=args)


@pytest.mark.parametrize("argv, message", [
    ([], "no script given"), (["-m"], "-m needs a module"), (["--exec"], "--exec needs a program"),
    (["--bogus", "x.py"], "unknown option '--bogus'"),
])
def test_parse_target_refuses(argv, message):
    with pytest.raises(UsageError, match=message):
        target_of_worker_argv(argv)


@pytest.mark.parametrize("code, expected", [
    (None, 0), (0, 0), (3, 3), (True, 1), (False, 0), (-1, 255), (256, 0), ("a message", 1),
])
def test_exit_code_of_system_exit(code, expected):
    assert worker.exit_code_of(SystemExit(code)) == expected


@pytest.mark.parametrize("script_marker, code, sig, exec_mode, returned, supervisor_code", [
    ({"returned": True, "exit_code": 0}, 0, None, False, True, 0),       # clean
    ({"returned": True, "exit_code": 0}, None, 6, False, True, 0),       # abort after return: success
    ({"returned": False, "exit_code": 3}, 3, None, False, False, 3),     # sys.exit(3)
    ({"returned": False, "exit_code": 1}, 1, None, False, False, 1),     # exception
    (None, None, 9, False, False, 137),                                  # killed before returning
    (None, None, 6, False, False, 134),                                  # aborted before returning
    (None, 0, None, False, False, 1),                                    # os._exit(0) mid-script
    (None, 0, None, True, True, 0),                                      # --exec program exits 0
    (None, 2, None, True, False, 2),                                     # --exec program exits 2
    (None, None, 15, True, False, 143),                                  # --exec program SIGTERMed
])
def test_final_marker_and_supervisor_code(script_marker, code, sig, exec_mode, returned, supervisor_code):
    marker = worker.final_marker(script_marker, code, sig, exec_mode=exec_mode)
    assert marker["returned"] is returned
    assert (marker["exit_code"], marker["signal"]) == (code, sig)
    assert worker.supervisor_exit_code(marker) == supervisor_code


def test_rank_log_tags_lines_and_keeps_read_order(tmp_path, monkeypatch):
    monkeypatch.setattr(worker, "MAX_LINE_BYTES", 16)
    log = worker.RankLog(str(tmp_path / "rank-0.log"))
    log.feed("o", b"step 1\nste")
    log.feed("o", b"p 2\n")
    log.feed("e", b"progress 10%")  # no newline yet
    log.feed("o", b"step 3\n")      # stdout speaks: stderr's rest is written first
    log.feed("e", b"0123456789abcdef0123XY")
    log.note("said by the supervisor")
    log.feed("e", b"Z")
    log.close()
    assert (tmp_path / "rank-0.log").read_text().splitlines() == [
        "o step 1", "o step 2", "e progress 10%", "o step 3", "e 0123456789abcdef",
        "e said by the supervisor", "e 0123XYZ"]


# ---------------------------------------------------------------- exit classification


def m(returned, code=None, sig=None, ended_at=None):
    return {"returned": returned, "exit_code": code, "signal": sig, "ended_at": ended_at}


@pytest.mark.parametrize("markers, succeeded, order", [
    ({0: m(True, 0), 1: m(True, 0)}, True, [0, 1]),
    ({0: m(True, None, 6), 1: m(True, 0)}, True, [0, 1]),                 # teardown abort after return
    ({0: m(True, 0), 1: m(False, 3, None, 5.0)}, False, [1, 0]),
    ({0: m(False, None, 15, 9.0), 1: m(False, 1, None, 5.0)}, False, [1, 0]),  # root cause first
    ({0: m(False, None, 15), 1: m(False, 1, None, 5.0)}, False, [1, 0]),  # unknown time sorts last
    ({0: m(True, 0)}, False, [1, 0]),                                      # rank 1 left no record
    ({}, False, [0, 1]),                                                   # torchrun never started them
])
def test_classify_exit(markers, succeeded, order):
    lines = {0: [f"l{i}" for i in range(30)], 1: ["only"]}
    ranks, ok = classify_exit(range(2), markers, lines)
    assert ok is succeeded
    assert [r.rank for r in ranks] == order
    by_rank = {r.rank: r for r in ranks}
    assert by_rank[0].last_lines == [f"l{i}" for i in range(10, 30)]
    assert by_rank[1].last_lines == ["only"]
    for rank, exit_ in by_rank.items():
        marker = markers.get(rank, {})
        assert (exit_.exit_code, exit_.signal) == (marker.get("exit_code"), marker.get("signal"))


def test_classify_exit_of_no_ranks_is_not_success():
    assert classify_exit(range(0), {}, {}) == ([], False)


@pytest.mark.parametrize("exit_, text", [
    (wire.RankExit(rank=1, exit_code=3), "rank 1: exit code 3"),
    (wire.RankExit(rank=0, signal=9), "rank 0: signal 9 (SIGKILL)"),
    (wire.RankExit(rank=2, returned=True, exit_code=0), "rank 2: returned"),
    (wire.RankExit(rank=2, returned=True, signal=6), "rank 2: returned (then signal 6 during shutdown)"),
    (wire.RankExit(rank=4), "rank 4: no exit record"),
])
def test_describe_rank(exit_, text):
    assert describe_rank(exit_).startswith(text)


OK0, FAIL1 = wire.RankExit(rank=0, returned=True, exit_code=0), wire.RankExit(rank=1, exit_code=3)
NO_RECORD = [wire.RankExit(rank=0), wire.RankExit(rank=1)]


@pytest.mark.parametrize("exits, succeeded, started, stopped, expected", [
    ([OK0], True, True, False, "all 1 ranks returned"),
    ([], False, False, True, "stopped before torchrun started"),
    ([FAIL1, OK0], False, True, False, "rank 1: exit code 3"),
    ([FAIL1, OK0], False, True, True, "stopped: rank 1: exit code 3"),
    (NO_RECORD, False, True, False,  # torchrun itself died: its own last lines are quoted
     "rank 0: no exit record (never started or killed with its supervisor); rank 1: no exit record "
     "(never started or killed with its supervisor); torchrun exited with 1: bad | worse"),
])
def test_exit_message(exits, succeeded, started, stopped, expected):
    assert exit_message(exits, succeeded=succeeded, started=started, stopped=stopped,
                        unstarted="stopped before torchrun started", first_process="torchrun", returncode=1,
                        launcher_tail=["bad", "worse"]) == expected


# ---------------------------------------------------------------- tailing


def test_line_tailer_sends_complete_lines_and_the_rest_at_the_end(tmp_path):
    path = tmp_path / "f.log"
    tailer = LineTailer(path)
    assert tailer.read() == []  # not there yet
    path.write_bytes(b"one\ntw")
    assert tailer.read() == ["one"]
    with open(path, "ab") as fh:
        fh.write(b"o\r\nthr\xffee")
    assert tailer.read() == ["two"]
    assert tailer.read(final=True) == ["thr\ufffdee"]
    assert tailer.read(final=True) == []


def test_launch_output_keeps_every_line_in_the_log_and_the_last_non_blank_ones_for_a_failure(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-0.log").write_bytes(b"o step 1\ne rank 0 warns\no rank 0 gives up\ne \ne   \n")
    output = LaunchOutput(tmp_path, [0], attempt=1)
    records, _ = output.read(final=True)
    assert [(r.stream, r.text) for r in records] == [("stdout", "step 1"), ("stderr", "rank 0 warns"),
                                                      ("stdout", "rank 0 gives up"), ("stderr", ""),
                                                      ("stderr", "  ")]
    assert list(output.last_lines[0]) == ["step 1", "rank 0 warns", "rank 0 gives up"]


def test_line_tailer_cuts_endless_lines(tmp_path, monkeypatch):
    monkeypatch.setattr("torchrelay.agent.output.MAX_LINE_BYTES", 4)
    path = tmp_path / "f.log"
    path.write_bytes(b"abcdefghij")
    tailer = LineTailer(path)
    assert tailer.read() == ["abcd", "efgh"]
    assert tailer.read(final=True) == ["ij"]


@pytest.mark.parametrize("line, expected", [
    ('{"step": 3, "time": 1.5, "values": {"loss": 0.25, "acc": 1}}',
     wire.MetricRecord(rank=1, seq=7, step=3, time=1.5, values={"loss": 0.25, "acc": 1.0})),
    ('{"step": 3, "time": 1.5}', None),
    ('{"step": "x", "time": 1.5, "values": {}}', None),
    ('{"step": 1, "time": 1.5, "values": {"loss": "nan?"}}', None),
    ('{"step": 1, "time": 1.5, "values": [1]}', None),
    ("not json", None),
    ("[]", None),
])
def test_parse_metric_line(line, expected):
    assert parse_metric_line(line, rank=1, seq=7) == expected


# ---------------------------------------------------------------- daemon's pure parts


@pytest.mark.parametrize("text, expected", [
    ("", (0, None)),
    ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-5678)\n",
     (2, "NVIDIA H100 80GB HBM3")),
    ("No devices found.\n", (0, None)),
    ("GPU 0: Tesla T4 (UUID: GPU-a)\n  MIG 1g.5gb Device 0: (UUID: MIG-b)\n", (1, "Tesla T4")),
])
def test_parse_nvidia_smi_list(text, expected):
    assert parse_nvidia_smi_list(text) == expected


@pytest.mark.parametrize("kwargs, message", [
    (dict(address="127.0.0.1:8765", name="n"), "address '127.0.0.1:8765' is not a URL"),
    (dict(address="http://h:1", name=""), "name '' is empty"),
])
def test_agent_refuses_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Agent(work_dir=tmp_path, cpus=1, gpus=0, memory=1, **kwargs)


def test_agent_registration_uses_given_or_detected_resources(tmp_path):
    agent = Agent("http://127.0.0.1:1/", name="n1", host="10.1.2.3", cpus=3, gpus=0, memory=2**30,
                  work_dir=tmp_path, labels={"zone": "a"})
    try:
        reg = agent.registration()
        assert (reg.name, reg.address, reg.cpus, reg.gpus, reg.memory, reg.labels) == \
            ("n1", "10.1.2.3", 3.0, 0, 2**30, {"zone": "a", **detect_launcher_labels()})
        detected = Agent("http://127.0.0.1:1", name="n2", work_dir=tmp_path)
        assert detected.cpus >= 1 and detected.memory > 0 and detected.gpus >= 0
        detected.close()
    finally:
        agent.close()


def test_agent_module_does_not_import_torch():
    # the daemon must stay light: torch is imported by workers, never by the agent
    import subprocess

    code = "import sys, torchrelay.agent.daemon, torchrelay.agent.worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().lower()) is False


@pytest.mark.parametrize("gpus, gpu_type, expected", [
    (2, "h100", (2, "h100")),
    (1, None, (1, None)),
    (0, None, (0, None)),
])
def test_agent_offers_the_given_gpus_and_type(tmp_path, gpus, gpu_type, expected):
    node = Agent("http://127.0.0.1:1", name="n", gpus=gpus, gpu_type=gpu_type, work_dir=tmp_path, zygote=False)
    assert (node.gpus, node.gpu_type) == expected


def test_agent_refuses_a_gpu_type_without_gpus(tmp_path):
    with pytest.raises(ValueError, match=r"gpu_type 'h100'.*0 gpus.*--gpus N"):
        Agent("http://127.0.0.1:1", name="n", gpus=0, gpu_type="h100", work_dir=tmp_path, zygote=False)
