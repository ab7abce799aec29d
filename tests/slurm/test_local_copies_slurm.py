"""Issue 30 on the real local cluster: a lost node's rank restores from its buddy's copy.

job.spare_nodes=1 (3 nodes allocated, 2 used), the local tier every 5 steps (copies on: the
default checkpoint.local_replicas=1), the shared tier every 200. Rank 1's node is set DOWN and
its local directory deleted (the dev cluster's nodes share one disk; a lost node's memory is
gone). The batch shell restarts the step in place on the spare, which holds nothing of the run:
rank 1 fetches its item over the network from rank 0's node, which holds the copy, and the run
ends bitwise equal to the uninterrupted one, without reading the shared tier.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from slurm_helpers import assert_bitwise, export, losses
from test_preemption import STEPS, _assert_recovered_in_place, _host_of, _node_down, _two_node_job_at, reference  # noqa: F401

pytestmark = pytest.mark.slurm


def test_a_lost_nodes_rank_fetches_its_item_from_the_buddys_copy_bitwise(slurm, reference, tmp_path):  # noqa: F811
    run_dir = tmp_path / "job"
    job, _ = _two_node_job_at(slurm, run_dir, STEPS, 30, 300, "--set", "job.spare_nodes=1",
                              "--set", "checkpoint.local_every_steps=5")
    lost = _host_of(run_dir, 1)
    log1 = (run_dir / "logs" / "rank-1.log").read_text()
    node_dir = Path(re.search(r"local checkpoint tier: step \d+ to (\S+)/rank-1 .*; copies to rank 0", log1)[1])
    assert node_dir.name == lost, (node_dir, lost)
    with _node_down(slurm, lost):
        shutil.rmtree(node_dir, ignore_errors=True)     # the lost node's memory
        log0 = _assert_recovered_in_place(slurm, job, run_dir, STEPS)
    log1 = (run_dir / "logs" / "rank-1.log").read_text()
    fetched = re.findall(r"fetched step (\d+) of rank 1 from (\S+) \(rank 0, its copy\): ([0-9.]+) MB in ([0-9.]+)s, "
                         r"checksums match", log1)
    assert len(fetched) == 1, log1[-3000:]
    step, holder, mb, secs = fetched[0]
    assert holder not in (lost, node_dir.name), holder
    for log in (log0, log1):
        resumed = re.findall(r"resumed from step (\d+) \(\S+\), saved at world size 2 \((local|shared) tier", log)
        assert resumed[-1] == (step, "local"), resumed
    assert int(step) > 200 and int(step) % 5 == 0, step   # newer than the shared tier's 200
    ref, ref_losses = reference
    assert_bitwise(ref, export(slurm, run_dir, tmp_path / "job.pt"))
    assert losses(run_dir) == ref_losses
    print(f"lost node {lost}: rank 1 fetched step {step} from {holder}'s copy, {mb} MB in {secs} s")
