"""Sweep files without a cluster: how points are built, and bad input refused before anything
reaches the scheduler (exit 2, one line, nothing written). The end-to-end behaviour is in
tests/slurm/test_sweeps.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc_train.node import environment
from hpc_train.login import sweep
from hpc_train.cli.main import build_parser
from hpc_train.errors import UsageError

CONFIG = str(Path(__file__).resolve().parents[2] / "jobs" / "digits.yaml")


def _recorders(tmp: Path) -> tuple[dict[str, str], Path]:
    """Scheduler commands that only record that they were called (and fail): the witness that a
    refused sweep never got as far as the scheduler. Not a stand-in for Slurm: nothing reads their output."""
    bin_dir, log = tmp / "bin", tmp / "scheduler-calls.log"
    bin_dir.mkdir()
    for name in ("sbatch", "sinfo", "scontrol", "squeue", "sacct", "srun"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho {name} >> "{log}"\nexit 1\n')
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


BAD = [
    ("empty-grid", "grid: {}\n", ("grid is empty",)),
    ("empty-values", "grid:\n  optim.lr: []\n", ("grid optim.lr must be a non-empty list",)),
    ("unknown-config-key", "grid:\n  optim.lrr: [0.1, 0.2]\n", ("point 0 (optim.lrr=0.1)", "unknown key 'optim.lrr'",
                                                                "did you mean 'lr'")),
    ("unknown-file-key", "gird:\n  optim.lr: [0.1]\n", ("unknown key 'gird'", "did you mean 'grid'")),
    ("wrong-type-grid", "grid:\n  optim.lr: [0.1, fast]\n", ("point 1 (optim.lr=fast)", "optim.lr must be a number")),
    ("wrong-type-point", "points:\n  - {train.max_steps: 1.5}\n", ("train.max_steps must be an integer",)),
    ("wrong-type-seed", "seeds: [1, -1]\n", ("point 1 (seed=-1)", "seed must be >= 0")),
    ("points-not-mappings", "points: [0.1, 0.2]\n", ("points must be a non-empty list of mappings",)),
    ("no-points", "# nothing\n", ("no points",)),
    ("repeated-point", "points:\n  - {optim.lr: 0.1}\n  - {optim.lr: 0.1}\n", ("point 1 (optim.lr=0.1) repeats point 0",)),
    ("alias", "grid:\n  optim.lr: &a [0.1]\n  optim.momentum: *a\n", ("alias *a", "not allowed")),
    ("duplicate-key", "grid:\n  optim.lr: [0.1]\n  optim.lr: [0.2]\n", ("duplicate key 'optim.lr'",)),
    ("not-a-mapping", "- optim.lr\n", ("must be a mapping",)),
]


@pytest.mark.parametrize("text,needles", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_sweep_file_is_one_line_exit_2_and_nothing_submitted(run_cli, clean_env, tmp_path, text, needles):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    env, calls = _recorders(tmp_path)
    r = run_cli("submit", CONFIG, "--sweep", path, "--run-dir", tmp_path / "sweep", env=clean_env(**env))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpc_train: error: "), r.stderr
    assert all(n in lines[0] for n in needles), lines[0]
    assert not (tmp_path / "sweep").exists()
    assert not calls.exists(), calls.read_text()


@pytest.mark.parametrize("args,needle", [
    (["--sweep", "optim.lr="], "--sweep expects section.key=v1,v2"),
    (["--sweep", "optim.lr=0.1,x"], "point 1 (optim.lr=x)"),
    (["--sweep", "nope.yaml"], "no such file"),
    (["--sweep", "s.yaml", "--sweep", "seed=1,2"], "one sweep file, or key=v1,v2 items, not both"),
])
def test_bad_sweep_argument(run_cli, clean_env, tmp_path, args, needle):
    (tmp_path / "s.yaml").write_text("seeds: [1]\n")
    env, calls = _recorders(tmp_path)
    r = run_cli("submit", CONFIG, *args, "--run-dir", tmp_path / "sweep", env=clean_env(**env), cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
    assert not calls.exists()


def test_resubmit_failed_of_a_directory_that_is_no_sweep(run_cli, tmp_path):
    r = run_cli("submit", "--resubmit-failed", tmp_path)
    assert r.returncode == 2 and "is not a sweep directory" in r.stderr, r.stderr


def test_grid_and_points_then_crossed_with_seeds():
    points = sweep.expand({"grid": {"optim": {"lr": ["0.1", "0.2"]}, "model.name": ["mlp"]},
                           "points": [{"optim.lr": "0.5", "train.max_steps": "7"}], "seeds": ["0", "1"]}, "t")
    assert [sweep.describe(p) for p in points] == [
        "optim.lr=0.1 model.name=mlp seed=0", "optim.lr=0.1 model.name=mlp seed=1",
        "optim.lr=0.2 model.name=mlp seed=0", "optim.lr=0.2 model.name=mlp seed=1",
        "optim.lr=0.5 train.max_steps=7 seed=0", "optim.lr=0.5 train.max_steps=7 seed=1"]
    assert sweep.task_name(4, points[4], 2) == "04-optim.lr=0.5,train.max_steps=7,seed=0"
    assert sweep.from_args(["optim.lr=0.1,0.2", "seed=0,1"])[1] == [
        {"optim.lr": "0.1", "seed": "0"}, {"optim.lr": "0.1", "seed": "1"},
        {"optim.lr": "0.2", "seed": "0"}, {"optim.lr": "0.2", "seed": "1"}]


def _configs(tmp_path: Path, argv: list[str], sweep_text: str):
    (tmp_path / "s.yaml").write_text(sweep_text)
    args = build_parser().parse_args(["submit", *argv, "--sweep", str(tmp_path / "s.yaml")])
    args.script_args = []
    source, points = sweep.from_args(args.sweep)
    return sweep.configs(args, points, source, tmp_path / "sweep")


def test_values_reach_the_config_as_written(tmp_path):
    # Text that YAML would read as a mapping, a comment or a number stays the text it was.
    cfgs = _configs(tmp_path, [CONFIG, "--set", "optim.lr=0.9"],
                    "points:\n  - {data.root: 'a: b #c', job.account: '0123', optim.lr: 1e-3}\n")
    c = cfgs[0]
    assert (c.data.root, c.job.account, c.optim.lr) == ("a: b #c", "0123", 0.001)
    assert c.run_dir == str(tmp_path / "sweep" / "0-data.root=a__b__c,job.account=0123,optim.lr=1e-3")


def test_points_of_a_script_sweep_are_its_config(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import hpc_train\n")
    cfgs = _configs(tmp_path, ["--script", str(script)], "grid:\n  optim.lr: [0.1, 0.2]\n")
    assert [c.optim.lr for c in cfgs] == [0.1, 0.2] and all(c.train.script == str(script) for c in cfgs)


def test_dry_run_prints_every_point_and_the_one_script(run_cli, tmp_path):
    (tmp_path / "s.yaml").write_text("grid:\n  optim.lr: [0.1, 0.2]\nseeds: [3, 4]\n")
    r = run_cli("submit", CONFIG, "--sweep", tmp_path / "s.yaml", "--array-parallelism", "2",
                "--run-dir", tmp_path / "my sweep", "--dry-run")
    assert r.returncode == 0, r.stderr
    d = tmp_path / "my sweep"
    assert [x for x in r.stdout.splitlines() if x.startswith("# task")] == [
        f"# task 0: optim.lr=0.1 seed=3 -> {d}/0-optim.lr=0.1,seed=3",
        f"# task 1: optim.lr=0.1 seed=4 -> {d}/1-optim.lr=0.1,seed=4",
        f"# task 2: optim.lr=0.2 seed=3 -> {d}/2-optim.lr=0.2,seed=3",
        f"# task 3: optim.lr=0.2 seed=4 -> {d}/3-optim.lr=0.2,seed=4"]
    assert r.stdout.count("#!/bin/bash") == 1 and "#SBATCH --array=0-3%2" in r.stdout
    # The batch shell finds its task's run dir in the map file, whose path is quoted.
    assert f"p\" '{d}/submission-1.tasks')" in r.stdout
    assert not d.exists()


def test_array_tasks_sharing_a_node_get_their_own_port_and_requeue_target():
    def task(array: str, index: int, job_id: str) -> environment.NodeEnv:
        return environment.derive({"SLURM_JOB_ID": job_id, "SLURM_ARRAY_JOB_ID": array,
                                   "SLURM_ARRAY_TASK_ID": str(index), "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                                   "SLURM_NODEID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1",
                                   "SLURM_JOB_NODELIST": "node1", "SLURM_TASKS_PER_NODE": "1"})
    # Every array task has its own SLURM_JOB_ID, unique on the cluster: deriving the port from it
    # (not from array id + index, which collides across two arrays 2 ids apart) keeps tasks apart.
    envs = [task("100", 0, "100"), task("100", 1, "101"), task("102", 0, "102"), task("102", 1, "103")]
    assert len({e.master_port for e in envs}) == 4
    assert [e.requeue_target for e in envs] == ["100_0", "100_1", "102_0", "102_1"]


def test_manifest_missing_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="not a sweep directory"):
        sweep.read_manifest(tmp_path)


def test_a_task_is_completed_only_with_its_result():
    from hpc_train.login.scheduler import JobState
    from hpc_train.login.sweep_report import TaskRow, _state
    assert _state(JobState("1_0", "COMPLETED"), finished=False) == "FAILED"   # exit 0, no result.json
    assert _state(JobState("1_0", "COMPLETED"), finished=True) == "COMPLETED"
    assert _state(JobState("1_0", "CANCELLED by 0"), finished=False) == "CANCELLED"
    assert _state(JobState("1_0", "RUNNING"), finished=True) == "RUNNING"     # still writing its last files
    assert _state(JobState("1_0", "PENDING"), finished=False) == "PENDING"    # requeued: waiting to run again
    assert _state(None, finished=False) == "UNKNOWN"

    def row(state: str, finished: bool) -> TaskRow:
        return TaskRow(0, "", "", "1_0", state, None, None, 0, finished)
    assert [row(s, False).resubmittable for s in ("FAILED", "TIMEOUT", "CANCELLED", "RUNNING", "PENDING")] == [
        True, True, True, False, False]
    assert not row("TIMEOUT", True).resubmittable
