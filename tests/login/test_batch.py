"""Issue 28, point 4: one renderer of batch scripts, one pre-launch sequence.

Every batch script (submitit's for ``submit`` and sweeps, the standalone ``sbatch`` ones for
srun and torchrun) is made of the same parts (:mod:`hpc_train.login.batch`); the port is
computed in one place; a path reaching a Slurm filename pattern is escaped (or, where submitit
reads it back, refused). A plain ``sbatch`` script's job step runs the same pre-launch sequence
as ``run``, ``submit`` and ``init()``: a changed model is refused before it trains.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import hpc, show

from hpc_train.login.batch import Loop

ROOT = Path(__file__).resolve().parents[2]


def _sbatch(tmp_path: Path, *sets: str, launcher: str = "srun", rd: Path | None = None) -> str:
    out = tmp_path / f"{launcher}.sbatch"
    p = hpc("sbatch", "jobs/digits.yaml", "--run-dir", rd or tmp_path / "run", "-o", out, "--launcher", launcher,
            *(x for s in sets for x in ("--set", s)))
    assert p.returncode == 0, show(p)
    return out.read_text()


def _loop(text: str) -> list[str]:
    """The loop's own lines: from its counter to the hook's `done`."""
    lines = [ln.strip() for ln in text.splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("attempt=0"))
    end = next(i for i, ln in enumerate(lines) if ln == "done")
    # Not the lines around srun that differ by design: submitit's own srun line and its comments,
    # and where each script takes srun's status and its run directory from.
    return [ln for ln in lines[start:end + 1] if ln and "srun" not in ln and not ln.startswith(
        ("#", "status=0", "status=$?", "RUN_DIR=", "export SUBMITIT_EXECUTOR"))]


@pytest.mark.parametrize("sets", [(), ("job.nodes=2", "job.spare_nodes=1")])
def test_submitit_s_script_and_the_standalone_one_run_the_same_loop(tmp_path, sets):
    standalone = _sbatch(tmp_path, *sets)
    p = hpc("submit", "jobs/digits.yaml", "--dry-run", "--run-dir", tmp_path / "run",
            *(x for s in sets for x in ("--set", s)))
    assert p.returncode == 0, show(p)
    ours, theirs = _loop(standalone), _loop(p.stdout)
    # The same lines, but for the hook's --config (the standalone script carries its own copy).
    assert [ln.replace(' --config "$JOB_CONFIG"', "") for ln in ours] == theirs, (ours, theirs)
    # The hook's fields are read back as data (Loop.read_next), never evaluated (issue 48.5).
    assert any("requeue-hook" in ln for ln in theirs) and Loop.read_next()[0] in theirs
    for text in (standalone, p.stdout):
        assert "--signal=USR2@90" in text and "--requeue" in text and "--open-mode=append" in text
        assert ("--no-kill" in text) == bool(sets)


def test_torchrun_s_port_is_the_one_hpc_train_derives(tmp_path):
    text = _sbatch(tmp_path, launcher="torchrun")
    assert "% 40000" not in text and "-m hpc_train env --port" in text
    env = {**os.environ, "SLURM_JOB_ID": "123457", "PYTHONPATH": str(ROOT)}
    env.pop("MASTER_PORT", None)
    port = subprocess.run([sys.executable, "-m", "hpc_train", "env", "--port"], capture_output=True, text=True,
                          env=env, check=True).stdout.strip()
    sys.path.insert(0, str(ROOT))
    from hpc_train.node.environment import derive_port
    assert int(port) == derive_port({}, "123457")


def test_a_percent_in_the_run_directory_is_escaped_for_slurm_or_refused(tmp_path):
    rd = tmp_path / "lr 50%x"
    text = _sbatch(tmp_path, rd=rd)
    line = next(ln for ln in text.splitlines() if ln.startswith("#SBATCH --output="))
    assert "50%%x/slurm-%j.out" in line, line
    p = hpc("submit", "jobs/digits.yaml", "--dry-run", "--run-dir", rd)
    assert p.returncode == 2 and "contains '%'" in p.stderr and "Traceback" not in p.stderr, show(p)


def _single_task_srun(tmp_path: Path) -> str:
    """srun as a shell function that runs the real worker as one task, as Slurm would start it."""
    return ('srun() { while [ "${1#-}" != "$1" ]; do shift; done; '
            'SLURM_STEP_ID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_NTASKS=1 '
            'SLURM_STEP_NODELIST=node1 SLURM_TASKS_PER_NODE=1 MASTER_ADDR=127.0.0.1 "$@"; }\n')


@pytest.mark.procs
def test_a_plain_sbatch_script_refuses_a_changed_model_before_it_trains(tmp_path):
    """The run's checkpoints were made with one model; a script rendered with another is refused
    by its rank 0 before anything trains (exit 2: the hook restarts and requeues nothing), and the
    run's config.yaml still names the model its checkpoints hold."""
    from helpers import run, steps, write_config
    cfg = write_config(tmp_path / "job.yaml", {"checkpoint": {"every_steps": 1, "keep": 2}})
    rd = tmp_path / "run"
    first = run(cfg, rd, stop_at=2)              # stopped at step 2: the run resumes from there
    assert first.returncode != 0 and steps(rd) == [2, 1], show(first)
    before = (rd / "config.yaml").read_text()
    out = tmp_path / "changed.sbatch"
    p = hpc("sbatch", cfg, "--run-dir", rd, "-o", out, "--set", "model.hidden=64")
    assert p.returncode == 0, show(p)
    script = out.read_text()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.calls\n')
    (bin_dir / "scontrol").chmod(0o755)
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/cleanup.calls\n')   # the local tier's cleanup
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1",
           "SLURM_JOB_NUM_NODES": "1", "SLURMD_NODENAME": "node1", "PYTHONPATH": str(ROOT),
           "HOME": os.environ.get("HOME", "/root")}
    job = subprocess.run(["bash", "-c", _single_task_srun(tmp_path) + script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=env)
    assert job.returncode == 2, job.stderr[-3000:]
    assert "model.hidden: 32 -> 64" in job.stderr, job.stderr[-3000:]
    calls = (tmp_path / "scontrol.calls").read_text() if (tmp_path / "scontrol.calls").exists() else ""
    # Nothing requeued (the local tier's cleanup asks scontrol for the node count: `show job`).
    assert "refused" in job.stderr and "requeue" not in calls, (job.stderr[-3000:], calls)
    assert (rd / "config.yaml").read_text() == before
    assert steps(rd) == [2, 1] and not (rd / "result.json").exists()



@pytest.mark.procs
def test_the_torchrun_script_gives_every_rank_threads_per_rank_before_torchrun_sets_its_own(tmp_path):
    """Issue 29.1 under the torchrun launcher: torchrun sets OMP_NUM_THREADS=1 for its workers
    where it is unset (with its own warning), which the workers could not tell from the user's.
    The batch script sets dist.threads_per_rank first and says so once; a user's value wins.
    Real bash and, once, real torchrun (2 workers) with real supervised scripts."""
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('OMP_NUM_THREADS seen:', os.environ.get('OMP_NUM_THREADS'), flush=True)\n")
    out, rd = tmp_path / "torchrun.sbatch", tmp_path / "run"
    p = hpc("sbatch", "--script", script, "--launcher", "torchrun", "--run-dir", rd, "-o", out,
            "--set", "job.tasks_per_node=2", "--set", "dist.threads_per_rank=2")
    assert p.returncode == 0, show(p)
    from hpc_train.launch.local import free_port
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1",
           "SLURMD_NODENAME": "node1", "PYTHONPATH": str(ROOT), "HOME": os.environ.get("HOME", "/root"),
           "MASTER_PORT": str(free_port())}
    said = "hpc_train: setting OMP_NUM_THREADS=2 for each rank (dist.threads_per_rank;"
    # The user's own value: left as it is, nothing said (srun only shows what its command would get).
    job = subprocess.run(["bash", "-c", 'srun() { echo "srun gets OMP_NUM_THREADS=$OMP_NUM_THREADS"; exit 0; }\n'
                          + out.read_text()], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**env, "OMP_NUM_THREADS": "3"})
    assert job.returncode == 0 and "srun gets OMP_NUM_THREADS=3" in job.stdout, job.stdout + job.stderr
    assert said not in job.stderr, job.stderr
    srun = ('srun() { while [ "${1#-}" != "$1" ]; do shift; done; SLURM_STEP_ID=0 SLURM_PROCID=0 SLURM_LOCALID=0 '
            'SLURM_NODEID=0 SLURM_NTASKS=1 SLURM_STEP_NUM_NODES=1 SLURM_STEP_NODELIST=node1 SLURM_TASKS_PER_NODE=1 '
            'MASTER_ADDR=127.0.0.1 "$@"; }\n')
    job = subprocess.run(["bash", "-c", srun + out.read_text()], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env)
    assert job.returncode == 0, job.stderr[-3000:]
    for r in (0, 1):
        assert "OMP_NUM_THREADS seen: 2\n" in (rd / "logs" / f"rank-{r}.log").read_text()
    assert "Setting OMP_NUM_THREADS environment variable" not in job.stderr, job.stderr[-3000:]   # torchrun's own
    assert job.stderr.count(said) == 1, job.stderr[-3000:]


def _no_eval(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if not ln.lstrip().startswith("#") and "eval" in ln.split()]


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_no_batch_script_evaluates_the_hook_s_output(tmp_path, launcher):
    assert not _no_eval(_sbatch(tmp_path, launcher=launcher))
    p = hpc("submit", "jobs/digits.yaml", "--dry-run", "--run-dir", tmp_path / "run")
    assert p.returncode == 0 and "requeue-hook" in p.stdout and not _no_eval(p.stdout), show(p)


def test_the_hook_s_fields_reach_the_next_step_as_data(tmp_path):
    """The loop of login/batch.py in bash, with the hook (run once in a subshell, as ``$(...)``
    does: it marks its first call in a file) and srun as shell functions: the fields
    the hook prints (here hostile ones) reach the next step as values, and nothing in them runs."""
    from hpc_train.config import load
    from hpc_train.login.batch import Loop
    from hpc_train.login.decide import AGAIN, NEXT_FIELDS
    assert NEXT_FIELDS == ("resume", "nodes", "local")
    loop = Loop(load("jobs/digits.yaml", []).job, python="hook")
    m = tmp_path / "pwned"
    hostile = f"/ckpt/$(touch {m}1)`touch {m}2`; touch {m}3"
    script = "\n".join([
        f'hook() {{ if [ ! -e hooked ]; then : > hooked; printf "%s\\n%s\\n%s\\n" {shlex.quote(hostile)} '
        f'"--nodes=1 --nodelist=n2" 6; return {AGAIN}; fi; return 0; }}',
        'srun() { printf "%s|%s|%s\\n" "$HPC_TRAIN_RESUME" "${HPC_TRAIN_LOCAL_STEP-unset}" "$*" >> steps; }',
        'RUN_DIR=.', *loop.before(), *loop.start(), f"{loop.srun()} train", "status=$?",
        *[ln for ln in loop.after() if "SLURM_JOB_NUM_NODES" not in ln], 'echo "end $status"'])
    ran = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PATH": os.environ["PATH"]})
    assert ran.returncode == 0 and ran.stdout.strip().endswith("end 0"), (ran.stdout, ran.stderr, script)
    steps = (tmp_path / "steps").read_text().splitlines()
    # the hook's node-local step (login/decide.py's next_local) travels as the third field
    assert steps == ["|unset|train", f"{hostile}|6|--nodes=1 --nodelist=n2 train"], script
    assert not list(tmp_path.glob("pwned*"))
