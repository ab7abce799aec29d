"""Issue 23: README claims about the command line that had no test, or only a ``--help`` one.

- ``status``, ``logs``, ``cancel`` and ``sbatch`` do not import torch when they do their real work
  (on a real run directory made by a tiny run), not only for ``--help``;
- resuming is refused, in one line with nothing changed, on a changed ``dist.strategy``,
  ``train.precision``, ``data.batch_size``, or other code (``--fn``, ``--script``);
- ``sweep summary --descending`` and ``--csv``;
- a script path with a newline is refused in one line.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from helpers import REPO, hpc, one_line_exit2, show, snapshot, write_config
from helpers import probe

# conftest's SMOKE (not imported: `conftest` is also tests/slurm/conftest.py once that one is loaded)
SMOKE = ("--set", "model.name=linear", "--set", "data.name=synthetic", "--set", "data.synthetic_size=256",
         "--set", "data.batch_size=16", "--set", "train.max_steps=4", "--set", "log.progress=lines")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A real run directory: a tiny local run on 2 processes, finished."""
    rd = tmp_path_factory.mktemp("tiny") / "run"
    p = hpc("run", str(REPO / "jobs" / "digits.yaml"), "--nproc", "2", "--run-dir", rd, *SMOKE,
            "--set", "checkpoint.every_steps=2")
    assert p.returncode == 0, show(p)
    return rd


# -- commands that do not train import no torch, doing their real work ----------------------------
def _probe(py, clean_env, tmp_path, *args) -> dict:
    res = probe(py, clean_env(), tmp_path, [str(a) for a in args])
    assert res["heavy"] == [], f"`python -m hpc_train {' '.join(map(str, args))}` imported {res['heavy'][:5]}"
    return res


@pytest.mark.procs
def test_status_of_a_real_run_imports_no_torch(py, clean_env, tmp_path, tiny_run):
    res = _probe(py, clean_env, tmp_path, "status", tiny_run)
    assert res["code"] == 0, res["stderr"]
    assert "local run: finished" in res["stdout"] and "last step 4" in res["stdout"], res["stdout"]
    assert "goodput:" in res["stdout"], res["stdout"]
    res = _probe(py, clean_env, tmp_path, "status", tiny_run, "--goodput")
    assert res["code"] == 0 and "training" in res["stdout"], res


@pytest.mark.procs
def test_logs_of_a_real_run_imports_no_torch(py, clean_env, tmp_path, tiny_run):
    res = _probe(py, clean_env, tmp_path, "logs", tiny_run, "--rank", "1")
    assert res["code"] == 0, res["stderr"]
    assert res["stdout"] == (tiny_run / "logs" / "rank-1.log").read_text() and "[rank 1]" in res["stdout"]
    res = _probe(py, clean_env, tmp_path, "logs", tiny_run, "--rank", "5")      # no such rank: one line
    assert res["code"] == 2 and "rank 5 is out of range: this run has ranks 0-1" in res["stderr"], res


@pytest.mark.procs
def test_cancel_without_a_job_fails_cleanly_and_imports_no_torch(py, clean_env, tmp_path, tiny_run):
    res = _probe(py, clean_env, tmp_path, "cancel", tiny_run)
    assert res["code"] == 2, res
    lines = [x for x in res["stderr"].splitlines() if x.strip()]
    assert len(lines) == 1 and "has no submitted job" in lines[0] and "Traceback" not in res["stderr"], res


def test_sbatch_renders_a_script_and_imports_no_torch(py, clean_env, tmp_path):
    out = tmp_path / "job.sbatch"
    res = _probe(py, clean_env, tmp_path, "sbatch", REPO / "jobs" / "digits.yaml", "--nodes", "2",
                 "--run-dir", tmp_path / "rd", "-o", out)
    assert res["code"] == 0, res["stderr"]
    text = out.read_text()
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --nodes=2" in text and "hpc_train" in text, text


# -- resume refused on a change the checkpoint cannot load into ---------------------------------
@pytest.fixture(scope="module")
def resumable(tmp_path_factory) -> tuple[Path, Path]:
    """A run with a checkpoint, not finished: the next `run` into it resumes."""
    tmp = tmp_path_factory.mktemp("resume")
    cfg = write_config(tmp / "job.yaml", {"train": {"max_steps": 2}, "checkpoint": {"every_steps": 2}})
    rd = tmp / "run"
    p = hpc("run", cfg, "--nproc", "1", "--run-dir", rd)
    assert p.returncode == 0, show(p)
    (rd / "result.json").unlink()
    return cfg, rd


# Another code (a function, a script) is named as such, not as an empty default changed (issue 29.4).
OTHER_CODE = "holds checkpoints of the built-in trainer (model tests.plugins_for_tests:stoppable_mlp); this run is "


@pytest.mark.parametrize("args,named", [
    (("--set", "dist.strategy=allreduce"), ("dist.strategy: 'ddp' -> 'allreduce'", "checkpoints cannot load")),
    (("--set", "train.precision=bf16"), ("train.precision: 'fp32' -> 'bf16'", "checkpoints cannot load")),
    (("--set", "data.batch_size=8"), ("data.batch_size: 16 -> 8", "checkpoints cannot load")),
    (("--fn", "tests.plugins_for_tests:claims_loop"),
     (OTHER_CODE + "the function tests.plugins_for_tests:claims_loop", "--resume none")),
    (("--script", str(REPO / "jobs" / "charlm.py")), (OTHER_CODE + f"the script {REPO / 'jobs' / 'charlm.py'}",
                                                       "--resume none")),
], ids=["strategy", "precision", "batch_size", "fn", "script"])
@pytest.mark.procs
def test_resume_is_refused_on_a_change_the_checkpoint_cannot_load(resumable, args, named):
    cfg, rd = resumable
    before = snapshot(rd)
    assert len(before) > 3, before
    p = hpc("run", *args, cfg, "--nproc", "1", "--run-dir", rd)
    one_line_exit2(p, *named)
    assert snapshot(rd) == before                          # nothing written, nothing moved


# -- sweep summary ------------------------------------------------------------------------------
@pytest.fixture
def finished_sweep(tmp_path) -> tuple[Path, dict[int, float]]:
    """A sweep directory as `submit --sweep` leaves it once its tasks finished: the manifest
    (sweep.json) and, per task, a run directory with result.json and metrics.jsonl."""
    acc = {0: 0.61, 1: 0.93, 2: 0.72, 3: 0.85}
    sweep = tmp_path / "sweep"
    tasks = []
    for i, a in acc.items():
        rd = sweep / f"{i}-optim.lr={i / 10}"
        rd.mkdir(parents=True)
        (rd / "result.json").write_text(json.dumps({"acc": a, "steps": 10}))
        (rd / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1 - a}) + "\n")
        tasks.append({"index": i, "overrides": {"optim.lr": str(i / 10)}, "run_dir": str(rd), "jobs": [f"77_{i}"]})
    (sweep / "sweep.json").write_text(json.dumps({"source": "test", "created": 0, "tasks": tasks,
                                                  "submissions": [{"jobs": [t["jobs"][0] for t in tasks]}]}))
    return sweep, acc


def _printed_tasks(stdout: str) -> list[int]:
    rows = [line.split() for line in stdout.splitlines()]
    return [int(r[1]) for r in rows if len(r) > 2 and r[0].isdigit()]


def test_sweep_summary_descending_and_csv(run_cli, finished_sweep, tmp_path):
    sweep, acc = finished_sweep
    out = tmp_path / "elsewhere" / "acc.csv"
    out.parent.mkdir()
    r = run_cli("sweep", "summary", sweep, "--metric", "acc", "--descending", "--csv", out)
    assert r.returncode == 0, r.stderr
    highest_first = sorted(acc, key=lambda i: -acc[i])
    assert _printed_tasks(r.stdout) == highest_first == [1, 3, 2, 0], r.stdout
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert [int(row["task"]) for row in rows] == highest_first
    assert [float(row["acc"]) for row in rows] == [acc[i] for i in highest_first]
    assert [row["optim.lr"] for row in rows] == [str(i / 10) for i in highest_first]
    assert not (sweep / "summary.csv").exists()            # --csv: written there, not in the sweep
    # The default: lowest first, into SWEEP_DIR/summary.csv.
    r = run_cli("sweep", "summary", sweep, "--metric", "acc")
    assert r.returncode == 0, r.stderr
    assert _printed_tasks(r.stdout) == list(reversed(highest_first)), r.stdout
    with open(sweep / "summary.csv") as f:
        assert [int(row["task"]) for row in csv.DictReader(f)] == list(reversed(highest_first))


# -- a script path with a newline -------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["run", "sbatch", "submit --dry-run"])
def test_a_script_path_with_a_newline_is_refused_in_one_line(tmp_path, cmd):
    script = tmp_path / "a\nb.py"
    script.write_text("print('hello')\n")
    rd = tmp_path / "rd"
    p = hpc(*cmd.split(), "--script", script, "--run-dir", rd)
    line = one_line_exit2(p, "a\\nb.py")
    assert "single line" in line or "control characters" in line, line
    assert not rd.exists()


@pytest.mark.parametrize("setting,named", [
    ("dist.hang_timeout_s=0", "dist.hang_timeout_s='0'"),
    ("dist.hang_timeout_s=-5", "dist.hang_timeout_s='-5'"),
    ("dist.hang_timeout_s=soon", "dist.hang_timeout_s='soon'"),
    ("dist.hang_timeout_s=nan", "dist.hang_timeout_s='nan'"),
    ("dist.hang_timeout_s=9000", "(0, dist.timeout_s=600]"),
    ("dist.hang_floor_s=700", "dist.hang_floor_s=700 is above dist.timeout_s=600"),
    ("dist.hang_floor_s=-1", "dist.hang_floor_s"),
    ("dist.straggler_ratio=1", "dist.straggler_ratio=1 names every rank; valid: above 1"),
    ("dist.straggler_ratio=0.5", "dist.straggler_ratio"),
    ("dist.straggler_ratio=fast", "dist.straggler_ratio"),
    ("dist.straggler_every_steps=-1", "dist.straggler_every_steps"),
    ("dist.straggler_every_steps=ten", "dist.straggler_every_steps"),
    ("dist.straggler_window_s=0", "dist.straggler_window_s=0; valid: seconds above 0"),
    ("dist.straggler_window_s=-5", "dist.straggler_window_s"),
    ("dist.straggler_window_s=soon", "dist.straggler_window_s"),
    ("job.replace_stragglers=true", "job.replace_stragglers=true needs a spare node to swap in, but job.spare_nodes=0"),
    ("job.replace_stragglers=yes please", "job.replace_stragglers"),
])
@pytest.mark.parametrize("cmd", ["run", "sbatch"])
def test_bad_liveness_settings_are_one_line_and_nothing_is_written(tmp_path, cmd, setting, named):
    """Issue 32: a hang timeout <= 0 or not a number, or a floor above dist.timeout_s; issue 31:
    a straggler ratio <= 1 or not a number, a negative or non-numeric gathering period, a window
    <= 0 or not a number, a swap of stragglers without a spare node or with a value not a boolean."""
    rd = tmp_path / "run"
    extra = ["--nproc", "1"] if cmd == "run" else ["-o", tmp_path / "job.sbatch"]
    one_line_exit2(hpc(cmd, "jobs/digits.yaml", "--run-dir", rd, *extra, "--set", setting), named)
    assert not rd.exists() and not (tmp_path / "job.sbatch").exists()
