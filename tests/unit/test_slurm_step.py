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


# a parameter-server job as a heterogeneous job: 2 worker nodes × 2, then 1 server node × 1
GROUPS = [{"role": "workers", "nodes": 2, "per_node": 2, "env": {"RELAY_GPUS_PER_WORKER": "1"}},
          {"role": "servers", "nodes": 1, "per_node": 1, "env": {"RELAY_GPUS_PER_WORKER": "0"}}]
HET_IDS = ["job-4-a1-n0", "job-4-a1-n1", "job-4-a1-n2"]
HET = TEMPLATE.model_copy(update={"nnodes": 3, "nproc_per_node": 2, "world_size": 5})


@pytest.mark.parametrize("group, node, launch_id, node_rank, offset, nproc, gpus", [
    (0, "0", "job-4-a1-n0", 0, 0, 2, "1"),
    (0, "1", "job-4-a1-n1", 1, 2, 2, "1"),
    (1, "0", "job-4-a1-n2", 2, 4, 1, "0"),  # the servers' component: its node 0 is the job's node 2, rank 4
])
def test_a_component_of_a_heterogeneous_job_takes_its_groups_share(group, node, launch_id, node_rank, offset,
                                                                    nproc, gpus):
    nnodes = str(GROUPS[group]["nodes"])
    env = {**SLURM, "SLURM_NODEID": node, "SLURM_NNODES": "9", "SLURM_STEP_NUM_NODES": nnodes}
    mine = node_assignment(HET, HET_IDS, env, GROUPS, group)
    assert (mine.launch_id, mine.node_rank, mine.rank_offset, mine.nproc_per_node) == (launch_id, node_rank, offset,
                                                                                      nproc)
    assert (mine.world_size, mine.nnodes, mine.env["RELAY_GPUS_PER_WORKER"]) == (5, 3, gpus)


@pytest.mark.parametrize("group, env, words", [
    (2, SLURM, "group 2 is not one of the attempt's 2 group(s)"),
    (1, {**SLURM, "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "2"},
     "group 1 of the attempt was planned for 1 node(s)"),
])
def test_a_task_of_a_group_that_does_not_match_the_plan_is_refused(group, env, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        node_assignment(HET, HET_IDS, env, GROUPS, group)
