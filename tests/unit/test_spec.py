"""Spec validation and the job state table: tables of cases."""
import pytest

from torchrelay.errors import Conflict, InvalidSpec
from torchrelay.spec import (TRANSITIONS, JobSpec, JobState, apply_override, can_transition, check_transition,
                             parse_memory)

GOOD = """
name: digits
workdir: .
entrypoint: python train.py --epochs 3
workers: 4
resources: {cpu: 1, gpu: 0, memory: 2GiB}
strategy: {kind: ddp}
checkpoint: {every_steps: 100, keep: 3}
max_restarts: 3
priority: 0
"""


def test_design_example_parses():
    spec = JobSpec.from_yaml_text(GOOD)
    assert spec.workers == 4 and spec.resources.memory == 2 * 2**30
    assert spec.argv == ["python", "train.py", "--epochs", "3"]
    assert spec.checkpoint.every_steps == 100 and spec.max_restarts == 3
    assert JobSpec.parse(spec.to_public()) == spec  # round trip


@pytest.mark.parametrize("text, needle", [
    ("entrypoint: a\nfoo: 1", "unknown key 'foo'"),
    ("entrypoint: a\nqueue: default", "unknown key 'queue'"),  # accepted once, never read: dropped
    ("workers: 2", "entrypoint: Field required"),
    ("entrypoint: ''", "entrypoint is empty"),
    ("entrypoint: 'python \"unterminated'", "not a valid command line"),
    ("entrypoint: a\nworkers: 0", "workers"),
    ("entrypoint: a\nstrategy: {kind: zz}", "unknown strategy 'zz'"),
    ("entrypoint: a\nstrategy: {kind: ddp, every: 3}", "strategy.every: unknown key 'every'"),
    ("entrypoint: a\nstrategy: {kind: local_sgd, every: 0}", "strategy.every"),
    ("entrypoint: a\nresources: {memory: 2XB}", "resources.memory: '2XB' is not a size"),
    ("entrypoint: a\nresources: {cpus: 2}", "unknown key 'cpus'"),
    ("entrypoint: a\nnodes: 2", "nodes and workers_per_node go together"),
    ("entrypoint: a\nnodes: 2\nworkers_per_node: 2\nworkers: 3", "workers=3 does not equal"),
    ("entrypoint: a\nname: 'has space'", "name 'has space'"),
    ("entrypoint: a\nstrategy: {kind: parameter_server, mode: sync, staleness: 2}", "staleness=2 only applies"),
    ("- a\n- b", "mapping"),
    ("entrypoint: [unclosed", "not valid YAML"),
])
def test_bad_specs_name_the_field(text, needle):
    with pytest.raises(InvalidSpec) as err:
        JobSpec.from_yaml_text(text)
    assert needle in str(err.value)


@pytest.mark.parametrize("value, expected", [
    (1024, 1024), ("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("1.5Gi", int(1.5 * 2**30)), ("0", 0), ("7 kib", 7168),
])
def test_parse_memory(value, expected):
    assert parse_memory(value) == expected


@pytest.mark.parametrize("value", ["lots", "-1", "2XB", True, -5])
def test_parse_memory_rejects(value):
    with pytest.raises(InvalidSpec):
        parse_memory(value)


def test_shape_nodes_times_workers():
    spec = JobSpec.parse({"entrypoint": "x", "nodes": 2, "workers_per_node": 3})
    assert spec.workers == 6


@pytest.mark.parametrize("override, path, value", [
    ("workers=8", ["workers"], 8),
    ("strategy.kind=local_sgd", ["strategy", "kind"], "local_sgd"),
    ("env.FOO=bar", ["env", "FOO"], "bar"),
    ("resources.memory=1GiB", ["resources", "memory"], "1GiB"),
])
def test_overrides(override, path, value):
    data = apply_override({"entrypoint": "x", "strategy": {"kind": "ddp"}}, override)
    for p in path:
        data = data[p]
    assert data == value


S = JobState
LEGAL = [(S.QUEUED, S.SCHEDULED), (S.SCHEDULED, S.RUNNING), (S.RUNNING, S.RESTARTING), (S.RESTARTING, S.RUNNING),
         (S.RUNNING, S.SUCCEEDED), (S.RUNNING, S.FAILED), (S.RUNNING, S.CANCELLING), (S.CANCELLING, S.CANCELLED),
         (S.QUEUED, S.CANCELLED), (S.RUNNING, S.QUEUED)]
ILLEGAL = [(S.QUEUED, S.RUNNING), (S.SUCCEEDED, S.RUNNING), (S.FAILED, S.QUEUED), (S.CANCELLED, S.RUNNING),
           (S.CANCELLING, S.RUNNING), (S.QUEUED, S.SUCCEEDED), (S.SCHEDULED, S.CANCELLED)]


@pytest.mark.parametrize("a, b", LEGAL)
def test_legal_transitions(a, b):
    assert can_transition(a, b)
    check_transition("job-1", a, b)


@pytest.mark.parametrize("a, b", ILLEGAL)
def test_illegal_transitions_raise_naming_states(a, b):
    with pytest.raises(Conflict) as err:
        check_transition("job-7", a, b)
    assert "job-7" in str(err.value) and a.value in str(err.value) and b.value in str(err.value)


def test_terminal_states_have_no_exit():
    for state in (S.SUCCEEDED, S.FAILED, S.CANCELLED):
        assert state.terminal and not TRANSITIONS[state]


def test_a_stored_spec_with_a_retired_key_still_loads():
    stored = {"name": "old", "entrypoint": "python t.py", "queue": "default"}
    assert JobSpec.from_stored(stored).name == "old"
    with pytest.raises(InvalidSpec, match="queue"):
        JobSpec.parse(stored)
