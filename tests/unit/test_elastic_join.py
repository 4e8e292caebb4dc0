"""Joining a running elastic group, in one process (members and joiners as threads over a real
TCPStore and real gloo groups): joiners past ``max_workers`` wait in line instead of being passed
over, and a joiner whose job ended (its store gone) exits 0 (``JobEnded``)."""
from __future__ import annotations

import datetime
import gc
import threading
import time

import pytest
import torch
import torch.distributed as dist

from torchrelay.train.elastic import PREFIX, ElasticGroup, JobEnded
from torchrelay.train.elastic_plan import Membership

pytestmark = pytest.mark.timeout(60)


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


def in_threads(*calls) -> list:
    """Run ``calls`` at once, each in a thread; what each returned (or the exception it raised)."""
    out: list = [None] * len(calls)

    def run(i, call):
        try:
            out[i] = call()
        except BaseException as exc:  # noqa: BLE001 - JobEnded is a SystemExit
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, call), daemon=True) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return out


def waiting(store: dist.Store) -> int:
    return dist.PrefixStore(PREFIX, store).add("joiners/next", 0)


def test_joiners_past_max_workers_wait_in_line():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = Membership(0, 0, (0, 1))
    members = in_threads(*(lambda m=m: ElasticGroup(client(master.port), m, first, min_workers=1, max_workers=3)
                           for m in (0, 1)))

    def join(member, wait_s=60.0):
        return ElasticGroup.join(client(master.port), member, min_workers=1, max_workers=3, wait_s=wait_s)

    def step(group):
        while waiting(master) < 2:  # both joiners registered
            time.sleep(0.01)
        assert group.all_reduce_(torch.ones(2), 4)
        group.step_done(5)
        return group.membership

    def second():
        while waiting(master) < 1:  # after joiner 5: it comes second
            time.sleep(0.01)
        return join(6, wait_s=3)  # in line behind 5 for good: it times out

    got = in_threads(lambda: step(members[0]), lambda: step(members[1]), lambda: join(5), second)
    assert got[0] == got[1] == Membership(1, 5, (0, 1, 5)) and got[2].membership == got[0]
    assert isinstance(got[3], TimeoutError)  # in line the whole time: room for one only
    assert members[0]._admitted == 1  # 6 was not passed over: the next boundary with room admits it


def test_a_joiner_whose_job_ended_exits_0():
    held = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)]
    store = client(held[0].port)

    def end_the_job():
        while waiting(store) < 1:
            time.sleep(0.01)
        held.clear()  # node 0's launch ended: its store host with it
        gc.collect()

    got = in_threads(lambda: ElasticGroup.join(store, 7, min_workers=1, max_workers=4, wait_s=20), end_the_job)
    assert isinstance(got[0], JobEnded) and got[0].code == 0, got[0]
    assert "member 7: the job ended before it was admitted; nothing to join" == str(got[0])
