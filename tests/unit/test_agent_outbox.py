"""The agent's outbox: numbered statuses and batches, what a heartbeat may carry, what is owed."""
from __future__ import annotations

import pytest

from torchrelay import wire
from torchrelay.agent.outbox import Carrier, EntryKind, Outbox

pytestmark = pytest.mark.timeout(30)


def st(state, port=None):
    return wire.LaunchStatus(state=state, master_port=port)


def log(seq, text="x"):
    return wire.LogRecord(rank=0, seq=seq, text=text)


def metric(seq):
    return wire.MetricRecord(rank=0, seq=seq, step=seq, time=1.0, values={"loss": 0.5})


def statuses(entries):
    return [(e.launch_id, e.status.state, e.status.master_port) for e in entries]


@pytest.mark.parametrize("puts, carried", [
    ([], []),
    ([("a", st("preparing"))], [("a", "preparing", None)]),                           # alone: sent
    ([("a", st("preparing")), ("a", st("running")), ("a", st("exited"))],
     [("a", "running", None), ("a", "exited", None)]),
    ([("a", st("preparing")), ("a", st("preparing", 5)), ("a", st("running", 5))], [("a", "running", 5)]),
    ([("a", st("preparing")), ("b", st("preparing")), ("a", st("running"))],          # b's is its last
     [("b", "preparing", None), ("a", "running", None)]),
    ([("a", st("running")), ("a", st("exited"))], [("a", "running", None), ("a", "exited", None)]),  # both in the history
])
def test_a_preparing_that_a_later_status_says_is_left_out(puts, carried):
    outbox = Outbox()
    for launch_id, status in puts:
        outbox.put_status(launch_id, status)
    assert statuses(outbox.take_statuses(Carrier.HEARTBEAT)) == carried


def test_sequence_numbers_follow_the_order_of_puts():
    outbox = Outbox()
    first = outbox.put_status("a", st("running"))
    outbox.put_records("a", "J", [log(0)], [metric(0)])
    last = outbox.put_status("a", st("exited"))
    assert first < last
    assert [e.kind for e in outbox.take_records()] == [EntryKind.LOGS, EntryKind.METRICS]


def test_an_exit_waits_for_the_lines_put_before_it():
    outbox = Outbox()
    outbox.put_status("a", st("running"))
    outbox.put_records("a", "J", [log(0), log(1)], [])
    outbox.put_status("a", st("exited"))
    outbox.put_status("b", st("exited"))  # another launch's exit does not wait for a's lines
    assert statuses(outbox.take_statuses(Carrier.HEARTBEAT)) == [("a", "running", None), ("b", "exited", None)]
    batches = outbox.take_records()
    assert statuses(outbox.take_statuses(Carrier.HEARTBEAT)) == []  # lines in flight: still waits
    outbox.settle(batches, delivered=True)
    assert statuses(outbox.take_statuses(Carrier.HEARTBEAT)) == [("a", "exited", None)]


def test_what_was_not_delivered_is_sent_again_and_what_was_is_gone():
    outbox = Outbox()
    outbox.put_status("a", st("running"))
    taken = outbox.take_statuses(Carrier.HEARTBEAT)
    assert outbox.take_statuses(Carrier.HEARTBEAT) == []  # in flight: not taken twice
    outbox.settle(taken, delivered=False)
    again = outbox.take_statuses(Carrier.HEARTBEAT)
    assert again == taken
    assert outbox.owes("a")
    outbox.settle(again, delivered=True)
    assert not outbox.owes("a") and len(outbox) == 0


def test_a_preparing_in_flight_is_not_dropped_by_a_later_status():
    outbox = Outbox()
    outbox.put_status("a", st("preparing", 7))
    in_flight = outbox.take_statuses(Carrier.HEARTBEAT)
    outbox.put_status("a", st("running", 7))
    outbox.settle(in_flight, delivered=False)
    assert statuses(outbox.take_statuses(Carrier.HEARTBEAT)) == [("a", "preparing", 7), ("a", "running", 7)]


@pytest.mark.parametrize("long_poll_in_flight, carrier, carries", [
    (False, Carrier.ASIDE, False),  # the next heartbeat carries them
    (True, Carrier.ASIDE, True),    # the poll may wait for seconds: a heartbeat of its own goes now
    (False, Carrier.FINAL, True),
    (False, Carrier.HEARTBEAT, True),
])
def test_a_heartbeat_aside_carries_statuses_only_while_a_long_poll_is_in_flight(long_poll_in_flight, carrier,
                                                                                carries):
    outbox = Outbox()
    if long_poll_in_flight:
        assert outbox.take_statuses(Carrier.LONG_POLL) == []
    outbox.put_status("a", st("exited"))
    assert bool(outbox.take_statuses(carrier)) is carries


def test_the_long_poll_ends():
    outbox = Outbox()
    outbox.take_statuses(Carrier.LONG_POLL)
    outbox.end_long_poll()
    outbox.put_status("a", st("exited"))
    assert outbox.take_statuses(Carrier.ASIDE) == []


def test_batches_are_taken_by_one_sender_at_a_time():
    outbox = Outbox()
    outbox.put_records("a", "J", [log(0)], [])
    first = outbox.take_records()
    outbox.put_records("a", "J", [log(1)], [])
    assert outbox.take_records() == []  # the earlier take is not settled: order first
    outbox.settle(first, delivered=False)
    assert [r.seq for e in outbox.take_records() for r in e.records] == [0, 1]


@pytest.mark.parametrize("batches, limit, kept_seqs, dropped", [
    ([[0, 1, 2]], 5, [0, 1, 2], 0),
    ([[0, 1, 2], [3, 4, 5]], 4, [2, 3, 4, 5], 2),
    ([[0, 1], [2, 3], [4]], 1, [4], 4),
])
def test_a_launch_keeps_its_newest_records_when_the_server_is_away(batches, limit, kept_seqs, dropped):
    outbox = Outbox(max_records=limit)
    total_dropped = 0
    for seqs in batches:
        total_dropped += outbox.put_records("a", "J", [log(s) for s in seqs], [])
    outbox.put_records("b", "J", [log(0)], [])  # another launch's records do not count
    kept = [r.seq for e in outbox.take_records() if e.launch_id == "a" for r in e.records]
    assert (kept, total_dropped) == (kept_seqs, dropped)


def test_no_empty_batches():
    outbox = Outbox()
    outbox.put_records("a", "J", [], [])
    assert len(outbox) == 0 and not outbox.owes("a")
