"""The real local Slurm cluster for the tests under tests/slurm/.

The session fixture starts ``slurm/devcluster.sh up`` (munge, slurmctld, slurmdbd with MariaDB,
three slurmd nodes in their own network namespaces: jobs use two, and
the third is a spare for the lost-node tests) and stops it at the end. Without root the
tests skip and say why; with ``CI=true`` they must run, so a missing root or a failed start fails.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from slurm_helpers import DEVCLUSTER, ROOT, Cluster, _unavailable


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    if os.geteuid() != 0:
        _unavailable("the local Slurm cluster needs root (network namespaces, daemons): "
                     "run `sudo make test` or `sudo slurm/devcluster.sh up`")
    up = subprocess.run([str(DEVCLUSTER), "up", "--nodes", "3"], capture_output=True, text=True, timeout=600)
    if up.returncode != 0:
        _unavailable(f"slurm/devcluster.sh up failed ({up.returncode}): {up.stderr[-2000:]}")
    env = dict(os.environ)
    for line in subprocess.run([str(DEVCLUSTER), "env"], capture_output=True, text=True, check=True).stdout.splitlines():
        line = line.strip().rstrip(";")
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            env[key] = subprocess.run(["bash", "-c", f"printf %s {value}"], capture_output=True, text=True,
                                      env=env).stdout
    env["PYTHONPATH"] = str(ROOT)
    for k in [k for k in env if k.startswith(("SLURM_JOB", "SLURM_STEP", "SLURM_PROCID", "RANK", "WORLD_SIZE"))]:
        env.pop(k)
    c = Cluster(env)
    try:
        c.run("sinfo", check=True)
        yield c
    finally:
        subprocess.run([str(DEVCLUSTER), "down"], capture_output=True, text=True, timeout=300)


@pytest.fixture
def slurm(cluster: Cluster) -> Cluster:
    """The cluster, drained before and after the test."""
    cluster.idle()
    yield cluster
    cluster.run("scancel", "--user=root")
    cluster.idle()


