"""Issues 29 and 33: what a `--script` child gets from its supervisor, as a user meets it.

- Threads like torchrun (29.1): every rank gets ``OMP_NUM_THREADS`` from ``dist.threads_per_rank``
  unless the user set it, and one line says so, once per launch.

Real processes throughout (`python -m hpc_train run`).
"""

from __future__ import annotations

import json

import pytest
from ckpt_helpers import clean_env, hpc, show

THREADS_LINE = "setting OMP_NUM_THREADS={n} for each rank (dist.threads_per_rank; tune it there, or set OMP_NUM_THREADS)"


# -- 29.1: threads ---------------------------------------------------------------------------

PRINTS_THREADS = "import os\nprint('OMP_NUM_THREADS seen:', os.environ.get('OMP_NUM_THREADS'), flush=True)\n"


@pytest.mark.parametrize("env,sets,seen,said", [
    ({}, (), "1", True),                                        # the default, as torchrun sets it
    ({}, ("dist.threads_per_rank=2",), "2", True),
    ({"OMP_NUM_THREADS": "3"}, (), "3", False),                 # the user's own value wins, silently
    ({}, ("dist.threads_per_rank=0",), "None", False),          # 0: torch's default, nothing set
])
def test_a_script_child_gets_omp_num_threads_from_threads_per_rank(tmp_path, env, sets, seen, said):
    script = tmp_path / "train.py"
    script.write_text(PRINTS_THREADS)
    rd = tmp_path / "run"
    p = hpc("run", "--script", script, "--nproc", "2", "--run-dir", rd, *(x for s in sets for x in ("--set", s)),
            env=clean_env(**env))
    assert p.returncode == 0, show(p)
    for r in (0, 1):
        assert f"OMP_NUM_THREADS seen: {seen}\n" in (rd / "logs" / f"rank-{r}.log").read_text(), show(p)
    # Once per launch (rank 0), not once per rank.
    assert p.stderr.count("setting OMP_NUM_THREADS") == (1 if said else 0), show(p)
    if said:
        assert THREADS_LINE.format(n=seen) in p.stderr, show(p)


@pytest.mark.parametrize("env,sets,omp,torch_threads", [
    ({}, ("dist.threads_per_rank=3",), "3", 3),
    ({"OMP_NUM_THREADS": "1"}, ("dist.threads_per_rank=3",), "1", 1),   # the user's value wins here too
])
def test_a_function_trains_with_the_same_threads(tmp_path, env, sets, omp, torch_threads):
    rd = tmp_path / "run"
    p = hpc("run", "--fn", "tests.plugins_for_tests:threads_report", "--run-dir", rd,
            *(x for s in sets for x in ("--set", s)), env=clean_env(**env))
    assert p.returncode == 0, show(p)
    assert json.loads((rd / "threads-rank0.json").read_text()) == {"omp": omp, "torch": torch_threads}
