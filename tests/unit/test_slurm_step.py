"""A Slurm node's share of an attempt, from node 0's assignment and Slurm's environment (pure)."""
from __future__ import annotations

import re

import pytest

from torchrelay import wire
from torchrelay.agent.slurm_step import node_assignment

TEMPLATE = wire.LaunchAssignment(launch_id="job-3-a2-n0", job_id="job-3", attempt=2, desired="run", node_rank=0,
                                 nnodes=2, nproc_per_node=4, world_size=8, rank_offset=0, entrypoint=["python", "t.py"],
                                 bundle=None, store_url="file:///s", job_store_prefix="jobs/job-3")
IDS = ["job-3-a2-n0", "job-3-a2-n1"]
SLURM = {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3", "RELAY_MASTER_PORT": "29411"}


@pytest.mark.parametrize("node, launch_id, offset", [("0", "job-3-a2-n0", 0), ("1", "job-3-a2-n1", 4)])
def test_node_rank_offset_and_rendezvous_come_from_slurm(node, launch_id, offset):
    mine = node_assignment(TEMPLATE, IDS, {**SLURM, "SLURM_NODEID": node})
    assert (mine.launch_id, mine.node_rank, mine.rank_offset) == (launch_id, int(node), offset)
    assert (mine.master_addr, mine.master_port, mine.world_size, mine.nnodes) == ("10.1.2.3", 29411, 8, 2)


@pytest.mark.parametrize("env, words", [
    ({k: v for k, v in SLURM.items() if k != "SLURM_NODEID"}, "SLURM_NODEID"),
    ({**SLURM, "RELAY_MASTER_PORT": "x"}, "not a Slurm task"),
    ({**SLURM, "SLURM_NNODES": "3"}, "planned for 2 node(s)"),
    ({**SLURM, "SLURM_NODEID": "2"}, "SLURM_NODEID=2"),
])
def test_a_task_that_does_not_match_the_plan_is_refused_naming_why(env, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        node_assignment(TEMPLATE, IDS, env)
