"""``logs --rank R`` checks R against the run's ranks: a rank the run never had is bad input (one
line, exit 2, naming the ranks there are), not a log that "does not exist yet". The ranks come
from the rank files the run has written and, for a submitted run, from its config (job.nodes x
tasks per node), so a rank that has not started yet is still told apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import hpc, one_line_exit2, show


@pytest.fixture
def local_run(tmp_path: Path) -> Path:
    """A 2-rank local run that has ended (`run --nproc 2`: its config's job section is not used)."""
    rd = tmp_path / "run"
    (rd / "logs").mkdir(parents=True)
    for rank in (0, 1):
        (rd / "logs" / f"rank-{rank}.log").write_text(f"[rank {rank}] hello\n")
    (rd / "config.yaml").write_text("job:\n  nodes: 4\n")
    return rd


@pytest.mark.parametrize("rank", ["5", "2", "-1"])
def test_a_rank_the_run_never_had_is_refused_in_one_line(local_run, rank):
    p = hpc("logs", local_run, "--rank", rank)
    one_line_exit2(p, f"logs: rank {rank} is out of range: this run has ranks 0-1")
    p = hpc("logs", local_run, "--rank", rank, "-f")
    one_line_exit2(p, f"logs: rank {rank} is out of range: this run has ranks 0-1")


def test_a_rank_of_the_run_is_shown(local_run):
    p = hpc("logs", local_run, "--rank", "1")
    assert p.returncode == 0 and p.stdout == "[rank 1] hello\n", show(p)


def test_a_submitted_run_counts_its_ranks_from_its_config(tmp_path):
    """Job 5 (2 nodes x 2 tasks) is still pending: no rank has written anything yet."""
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "job.json").write_text(json.dumps({"jobs": [{"job_id": "5", "submitted": 0, "via": "sbatch"}]}))
    (rd / "config.yaml").write_text("job:\n  nodes: 2\n  tasks_per_node: 2\n")
    one_line_exit2(hpc("logs", rd, "--rank", "3"), "does not exist yet (has rank 3 started?)")
    one_line_exit2(hpc("logs", rd, "--rank", "4"), "logs: rank 4 is out of range: this run has ranks 0-3")
