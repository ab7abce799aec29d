"""Issue 21, the batch script's side of in-place recovery: a failed job step is started again in
the same allocation while ``job.restarts_in_place`` lasts (a restart without a newer checkpoint
counts twice), then the requeue and its failure budget take over, then the job ends naming the
cause. The script ``sbatch`` renders runs in a real bash with the real requeue hook; only
``srun`` and ``scontrol`` stand in for the scheduler (shell functions and a PATH entry: a job
step's exit code is what the hook sees, and a requeue must not reach the real local cluster).
The same loop end to end on Slurm: tests/slurm/test_preemption.py.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import hpc, show


def _script(tmp_path: Path, *sets: str, launcher: str = "srun") -> tuple[str, Path]:
    rd = tmp_path / "run"
    out = tmp_path / "job.sbatch"
    p = hpc("sbatch", "jobs/digits.yaml", "--run-dir", rd, "-o", out, "--launcher", launcher,
            *(x for s in sets for x in ("--set", s)))
    assert p.returncode == 0, show(p)
    return out.read_text(), rd


def _job(tmp_path: Path, script: str, fails: int, restart_count: int = 0, first: str = "",
         nodes: str = "node1") -> subprocess.CompletedProcess:
    """Run the batch script as Slurm would; its ``srun`` fails ``fails`` times in this job, then
    finishes the run (writes result.json). Every call is counted in ``srun.calls``. ``first``:
    shell run instead by the first call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\nif [ "$1" = show ]; then echo node1; else echo "$@" >> {tmp_path}/scontrol.calls; fi\n')
    scontrol.chmod(0o755)
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/cleanup.calls\n')   # the local tier's cleanup
    (bin_dir / "srun").chmod(0o755)
    srun = (f'srun() {{ n=$(( $(cat {tmp_path}/srun.calls 2>/dev/null || echo 0) + 1 )); '
            f'echo "$n" > {tmp_path}/srun.calls; '
            + (f'if [ "$n" -eq 1 ]; then {first} fi; ' if first else "")
            + f'if [ "$n" -le {fails} ]; then return 1; fi; echo "{{}}" > "$RUN_DIR/result.json"; }}\n')
    (tmp_path / "srun.calls").unlink(missing_ok=True)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": nodes,
           "SLURM_RESTART_COUNT": str(restart_count), "SLURM_JOB_START_TIME": "1"}
    return subprocess.run(["bash", "-c", srun + script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)


def _calls(tmp_path: Path, name: str) -> str:
    f = tmp_path / f"{name}.calls"
    return f.read_text() if f.exists() else ""


def test_a_failed_step_is_started_again_in_the_allocation(tmp_path):
    script, rd = _script(tmp_path)
    job = _job(tmp_path, script, fails=2)
    assert job.returncode == 0, job.stderr
    assert _calls(tmp_path, "srun").strip() == "3"          # two failed steps, then the one that finished
    assert _calls(tmp_path, "scontrol") == ""               # never through the queue
    rec = json.loads((rd / "requeue.json").read_text())
    # No checkpoint between the two failures (step 0 both times): the second counts twice.
    assert [(e["step"], e["charge"]) for e in rec["in_place"]] == [(0, 1), (0, 2)], rec
    assert rec["counts"]["failure"] == 0
    assert job.stderr.count("restarting in place from step 0") == 2, job.stderr
    st = hpc("status", rd)
    assert "restarts in place: failure 2 (budget used 3)" in st.stdout, show(st)


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_a_crash_loop_spends_the_in_place_budget_then_the_failure_budget_then_ends(tmp_path, launcher):
    script, rd = _script(tmp_path, "job.restarts_in_place=3", "job.requeue_failure=1", launcher=launcher)
    (rd / "checkpoints").mkdir(parents=True, exist_ok=True)
    keep = rd / "checkpoints" / "kept.txt"
    keep.write_text("nothing is deleted")
    first = _job(tmp_path, script, fails=99)
    # 1 + 2 (no progress) = 3 of 3: the third failure falls back to the requeue.
    assert _calls(tmp_path, "srun").strip() == "3", first.stderr
    assert first.returncode == 0, first.stderr                 # requeued: the job itself ends well
    assert _calls(tmp_path, "scontrol").split() == ["requeue", "7"]
    assert "in-place restarts spent (3 of 3 used" in first.stderr and "requeued" in first.stderr, first.stderr
    again = _job(tmp_path, script, fails=99, restart_count=1)   # the requeued job: the same crash
    assert _calls(tmp_path, "srun").strip() == "1", again.stderr
    assert again.returncode == 1, again.stderr
    last = [ln for ln in again.stderr.splitlines() if ln.startswith("hpc_train requeue-hook:")]
    assert len(last) == 1 and "failure budget (1) spent, not requeued" in last[0], again.stderr
    assert _calls(tmp_path, "scontrol").split() == ["requeue", "7"]   # no second requeue
    assert keep.read_text() == "nothing is deleted"
    assert not (rd / "result.json").exists()


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_in_place_budget_is_refused_in_one_line_and_nothing_is_written(tmp_path, value):
    rd = tmp_path / "run"
    p = hpc("sbatch", "jobs/digits.yaml", "--run-dir", rd, "-o", tmp_path / "job.sbatch",
            "--set", f"job.restarts_in_place={value}")
    assert p.returncode == 2, show(p)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "job.restarts_in_place" in lines[0] and "Traceback" not in p.stderr, show(p)
    assert not (tmp_path / "job.sbatch").exists() and not rd.exists()


def test_a_rank_that_died_is_a_failure_even_when_the_others_took_srun_s_sigterm_for_a_stop(tmp_path):
    """srun --kill-on-bad-exit ends the surviving ranks with SIGTERM, which they take for a
    preemption: rank 0 asks for a requeue. The hook sees that rank 1 of that step never said its
    work ended (its heartbeat record), withdraws the request, and restarts the step in place.
    The fake srun leaves the records a real step leaves, through the functions the ranks call:
    both ranks' records (rank 0's saying it stopped) and rank 0's stop request."""
    script, rd = _script(tmp_path, "job.nodes=2")
    records = ("import sys; from pathlib import Path; from hpc_train.records import ranks, stop; "
               "rd = Path(sys.argv[1]); ranks.begin(rd, 0, 2); ranks.begin(rd, 1, 2); ranks.say(rd, 0, ended='stopped'); "
               "s = ranks.StepId.from_env(); "
               "stop.write(rd, stop.StopRecord(0, 'TERM', None, False, request=stop.Request('7', s.job, s.restart, s.attempt)))")
    first_call = f'{shlex.quote(sys.executable)} -c "{records}" "$RUN_DIR"; return 1; '
    job = _job(tmp_path, script, fails=0, first=first_call, nodes="node[1-2]")
    assert job.returncode == 0, job.stderr
    assert _calls(tmp_path, "srun").strip() == "2" and _calls(tmp_path, "scontrol") == "", job.stderr
    assert "not a stop: rank 1 failed and srun ended the other ranks" in job.stderr, job.stderr
    rec = json.loads((rd / "requeue.json").read_text())
    assert rec["counts"]["preemption"] == 0 and rec["events"] == [] and len(rec["in_place"]) == 1, rec
    # The request stays in the stop record, naming the first step: the restarted step's hook
    # (which ended with 0 and no requeue above) did not take it for its own.
    from hpc_train.records import requeue
    assert requeue.read_pending(rd)[0].attempt == 1


# -- a lost node (job.spare_nodes, job.min_nodes): the nodes of the next step ----------------
def _nodes_job(tmp_path: Path, script: str, now: str, states: str) -> subprocess.CompletedProcess:
    """The batch script with a 3-node allocation whose first step fails; ``squeue`` answers
    the job's nodes ``now`` and ``sinfo`` the node ``states`` ("node1|allocated ..."). Every
    srun's node arguments (before ``--kill-on-bad-exit``) go to ``srun.calls``, a line per step."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("squeue", f"2026-01-01T00:00:00|UNLIMITED|{now}"), ("sinfo", states.replace(" ", "\\n"))):
        (bin_dir / name).write_text(f"#!/bin/sh\nprintf '{text}\\n'\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\n[ \"$1\" = show ] || echo \"$@\" >> {tmp_path}/scontrol.calls\n")
    (bin_dir / "scontrol").chmod(0o755)
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/cleanup.calls\n')   # the local tier's cleanup
    (bin_dir / "srun").chmod(0o755)
    srun = (f'srun() {{ a="$*"; echo "${{a%%--kill-on-bad-exit*}}" >> {tmp_path}/srun.calls; n=$(wc -l < {tmp_path}/srun.calls); '
            f'if [ "$n" -le 1 ]; then return 1; fi; echo "{{}}" > "$RUN_DIR/result.json"; }}\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]",
           "SLURM_RESTART_COUNT": "0"}
    return subprocess.run(["bash", "-c", srun + script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)


def test_a_spare_node_takes_the_place_of_a_lost_one(tmp_path):
    script, rd = _script(tmp_path, "job.nodes=2", "job.spare_nodes=1")
    assert "#SBATCH --nodes=3" in script and "#SBATCH --no-kill" in script
    job = _nodes_job(tmp_path, script, "node[1,3]", "node1|mixed node2|down* node3|idle")
    assert job.returncode == 0, job.stderr
    steps = _calls(tmp_path, "srun").splitlines()
    assert len(steps) == 2, steps
    assert steps == ["--nodes=2 --ntasks=2 ", "--nodes=2 --ntasks=2 --nodelist=node1,node3 "]  # 2 of 3
    assert "node2 lost at step 0; next step on node1,node3" in job.stderr, job.stderr
    event = json.loads((rd / "requeue.json").read_text())["in_place"][0]
    assert (event["nodes"], event["lost"], event["world_size"]) == (["node1", "node3"], ["node2"], 2), event


def test_without_a_spare_the_run_goes_on_with_fewer_nodes_down_to_min_nodes(tmp_path):
    script, rd = _script(tmp_path, "job.nodes=3", "job.min_nodes=2", launcher="torchrun")
    assert "#SBATCH --nodes=3" in script and "#SBATCH --no-kill" in script
    job = _nodes_job(tmp_path, script, "node[1,3]", "node1|mixed node2|drained node3|mixed")
    assert job.returncode == 0, job.stderr
    steps = _calls(tmp_path, "srun").splitlines()
    assert steps == ["--nodes=3 --ntasks=3 ", "--nodes=2 --ntasks=2 --nodelist=node1,node3 "]  # a torchrun a node
    assert "world size 3 -> 2: node2 lost at step 0" in job.stderr, job.stderr
    assert "node2 lost at step 0 (world size 3 -> 2, on node1,node3)" in hpc("status", rd).stdout


def test_below_min_nodes_the_failure_goes_to_the_requeue(tmp_path):
    script, _ = _script(tmp_path, "job.nodes=3", "job.min_nodes=2")
    job = _nodes_job(tmp_path, script, "node1", "node1|mixed node2|down node3|down*")
    assert len(_calls(tmp_path, "srun").splitlines()) == 1, job.stderr      # no second step
    assert _calls(tmp_path, "scontrol").split() == ["requeue", "7"]
    assert "1 of the allocation's 3 nodes are up" in job.stderr and "job.min_nodes=2" in job.stderr, job.stderr


@pytest.mark.parametrize("sets,field", [
    (["job.spare_nodes=-1"], "job.spare_nodes"), (["job.min_nodes=1.5"], "job.min_nodes"),
    (["job.nodes=2", "job.min_nodes=3"], "job.min_nodes"),
])
def test_bad_lost_node_settings_are_refused_in_one_line(tmp_path, sets, field):
    rd = tmp_path / "run"
    p = hpc("sbatch", "jobs/digits.yaml", "--run-dir", rd, "-o", tmp_path / "job.sbatch",
            *(x for s in sets for x in ("--set", s)))
    assert p.returncode == 2, show(p)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in p.stderr, show(p)
    assert not (tmp_path / "job.sbatch").exists() and not rd.exists()


def test_an_earlier_step_s_error_file_is_not_read_as_the_next_step_s(tmp_path):
    """A standby step's ranks begin within a second of the step they replace having failed.
    Step 1: rank 0 records "RuntimeError: boom" and the step fails. Step 2: both ranks begin a
    moment after that error was written, then srun kills the step (a lost node) with no error
    of its own. Its failure is not 'the same error again' (which ends the job): each rank's start
    removed the error file an earlier step left, and step 2 is restarted in place like any other
    failure. The fake srun leaves the records a real step leaves, through the functions the
    ranks call."""
    script, rd = _script(tmp_path, "job.nodes=2")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("scontrol", "srun"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/{name}.calls\n')
        (bin_dir / name).chmod(0o755)
    step = ("import os, sys; from pathlib import Path; from hpc_train import rundir; "
            "from hpc_train.records import ranks; from hpc_train.node import watchdog; "
            "rd, n = Path(sys.argv[1]), int(sys.argv[2]); err = rundir.rank_error(rd, 0); "
            "err.exists() and os.utime(err); "       # written just now, as a standby step sees it
            "[ranks.begin(rd, r, 2) for r in (0, 1)]; "
            "n == 1 and watchdog.write_error(rd, 0, 'RuntimeError: boom\\n'); "
            "n == 3 and (rd / 'result.json').write_text('{}')")
    srun = (f'srun() {{ n=$(( $(cat {tmp_path}/srun.calls 2>/dev/null || echo 0) + 1 )); '
            f'echo "$n" > {tmp_path}/srun.calls; '
            f'{shlex.quote(sys.executable)} -c "{step}" "$RUN_DIR" "$n"; [ "$n" -eq 3 ] || return 1; }}\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_RESTART_COUNT": "0", "SLURM_JOB_START_TIME": "1"}
    job = subprocess.run(["bash", "-c", srun + script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=env)
    assert job.returncode == 0 and "the same error again" not in job.stderr, job.stderr
    assert _calls(tmp_path, "srun").strip() == "3", job.stderr
    rec = json.loads((rd / "requeue.json").read_text())
    assert [e.get("error") for e in rec["in_place"]] == ["RuntimeError: boom", None], rec
