"""Issue 28: the requeue hook's bugs, each as the batch shell meets it.

The script ``sbatch`` renders runs in a real bash with the real hook. The run directory holds
the records a job step leaves: each rank's record (``logs/.heartbeat/rank-R``), rank 0's stop
request (``requeue.pending``) and the run's ``requeue.json``. They are laid down here as JSON,
as a step (or, for damaged ones, outside hands) leaves them. Only the scheduler stands in:
``srun`` is a shell function (its exit code is the step's; its calls are counted), and
``scontrol``, ``squeue`` and ``sinfo`` are scripts on PATH, so that a fault the local cluster
cannot be made to show on demand (a controller that does not answer, a job near its time limit,
a node that went down two steps ago) is an input, and no requeue reaches a real cluster.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import hpc, show

JOB = "7"


def _script(tmp_path: Path, *sets: str, launcher: str = "srun") -> tuple[str, Path]:
    rd = tmp_path / "run"
    out = tmp_path / "job.sbatch"
    p = hpc("sbatch", "jobs/digits.yaml", "--run-dir", rd, "-o", out, "--launcher", launcher,
            *(x for s in sets for x in ("--set", s)))
    assert p.returncode == 0, show(p)
    (rd / "logs" / ".heartbeat").mkdir(parents=True, exist_ok=True)
    return out.read_text(), rd


def _rank(rd: Path, rank: int, node: str, world: int, ended: str | None = None, restart: int = 0,
          attempt: int = 1, job: str = JOB) -> None:
    """Rank ``rank``'s record of the first step of job ``job``, as that rank writes it at start
    (and with ``ended`` when it said how its work ended)."""
    rec = {"rank": rank, "host": node, "node": node, "pid": 1000 + rank, "job": job, "restart": restart,
           "attempt": attempt, "world_size": world, "started": time.time() - 30,
           "launch": f"{job}/0/{restart}/{attempt}"}
    if ended:
        rec["ended"] = ended
    (rd / "logs" / ".heartbeat" / f"rank-{rank}").write_text(json.dumps(rec))


def _pending(rd: Path, cause: str, signal: str, step: int = 40, target: object = JOB, restart: int = 0) -> None:
    """Rank 0's stop request after its stop's checkpoint (the signal it got, the cause it saw)."""
    (rd / "requeue.pending").write_text(json.dumps({
        "target": target, "cause": cause, "step": step, "signal": signal, "received_at": time.time() - 5,
        "job": JOB, "restart": restart, "attempt": 1}))


def _stopped(rd: Path, signal: str, step: int = 40) -> None:
    (rd / "stopped.json").write_text(json.dumps({"stopped": True, "steps": step, "stop_signal": signal,
                                                 "stop_received_at": time.time() - 5, "checkpoint": True}))


def _tool(bin_dir: Path, name: str, body: str) -> None:
    (bin_dir / name).write_text("#!/bin/bash\n" + body)
    (bin_dir / name).chmod(0o755)


def _job(tmp_path: Path, script: str, *, statuses: list[int], nodes: str = "node[1-2]", restart: int = 0,
         job: str = JOB, now: str | None = None, states: str | None = None, squeue_fails: bool = False,
         sinfo_fails: bool = False, scontrol_fails: bool = False, minutes_left: float | None = None,
         each: str = "", requeue_ends_the_step: bool = False) -> subprocess.CompletedProcess:
    """Run the batch script as Slurm would. Its ``srun`` returns ``statuses[n]`` at its n-th call,
    and the call after the last finishes the run (result.json). Each call's node arguments go to
    ``srun.calls``; ``scontrol``'s to ``scontrol.calls``. ``squeue`` answers the job's nodes
    ``now`` and, with ``minutes_left``, a start and time limit that leave that much; ``sinfo``
    answers ``states`` ("node1|mixed node2|down"); ``*_fails``: the command fails as it does
    when the controller is down; ``each``: shell run by every srun call first;
    ``requeue_ends_the_step``: ``scontrol requeue`` kills its caller (the hook) with SIGKILL as it
    returns, as the controller's end of the requeued batch step can (a fake: on the real cluster
    that race cannot be made to go one way)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    down = 'echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2; exit 1\n'
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 3600 + 60 * (minutes_left or 0)))
    _tool(bin_dir, "squeue", down if squeue_fails else
          f'echo "$@" >> {tmp_path}/squeue.calls\n'
          f'limit="{start}|{"60" if minutes_left is not None else "UNLIMITED"}"\n'
          f'case "$*" in *%S*%N*) [ "$3" = {job} ] && echo "$limit|{now or nodes}";; '
          f'*%N*) [ "$3" = {job} ] && echo {now or nodes};; *%S*) [ "$3" = {job} ] && echo "$limit";; esac\n')
    _tool(bin_dir, "sinfo", down if sinfo_fails else f"printf '{(states or '').replace(' ', chr(92) + 'n')}\\n'\n")
    # `scontrol show job` is the local tier's cleanup asking for the node count (not logged: the
    # tests count what the hook asks of Slurm); the cleanup's own srun is the program on PATH
    # (`command srun`), which logs to cleanup.calls and never reaches a real cluster.
    _tool(bin_dir, "scontrol", f'[ "$1" = show ] || echo "$@" >> {tmp_path}/scontrol.calls\n'
          + ('echo "scontrol: error: Unable to contact slurm controller" >&2; exit 1\n' if scontrol_fails else "")
          + ('[ "$1" = requeue ] && kill -KILL $PPID\n' if requeue_ends_the_step else ""))
    _tool(bin_dir, "srun", f'echo "$@" >> {tmp_path}/cleanup.calls\n')
    srun = (f'srun() {{ a="$*"; echo "${{a%%--kill-on-bad-exit*}}" >> {tmp_path}/srun.calls; '
            f'n=$(wc -l < {tmp_path}/srun.calls); s=({" ".join(map(str, statuses))}); {each} '
            f'if [ "$n" -le {len(statuses)} ]; then return "${{s[$((n-1))]}}"; fi; '
            f'echo "{{}}" > "$RUN_DIR/result.json"; }}\n')
    for name in ("srun", "scontrol", "squeue"):
        (tmp_path / f"{name}.calls").unlink(missing_ok=True)
    n_nodes = len(__import__("hostlist").expand_hostlist(nodes))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": nodes,
           "SLURM_JOB_NUM_NODES": str(n_nodes), "SLURM_NNODES": str(n_nodes), "SLURMD_NODENAME": "node1",
           "SLURM_RESTART_COUNT": str(restart), "SLURM_JOB_START_TIME": str(int(time.time()) - 60),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(["bash", "-c", srun + script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)


def _calls(tmp_path: Path, name: str) -> list[str]:
    f = tmp_path / f"{name}.calls"
    return f.read_text().splitlines() if f.exists() else []


def _hook_lines(job: subprocess.CompletedProcess) -> str:
    return "\n".join(ln for ln in job.stderr.splitlines() if ln.startswith("hpc_train requeue-hook:"))


def _requeue(rd: Path) -> dict:
    return json.loads((rd / "requeue.json").read_text())


def _no_traceback(job: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in job.stderr, job.stderr


# -- the stop request and the records ---------------------------------------------------------
def test_a_stop_request_whose_target_is_not_a_string_requeues_this_job_without_a_crash(tmp_path):
    script, rd = _script(tmp_path, "job.nodes=2")
    _rank(rd, 0, "node1", 2, ended="stopped")
    _rank(rd, 1, "node2", 2, ended="stopped")
    _stopped(rd, "USR2")
    _pending(rd, "preemption", "USR2", target=["7", "8"])
    job = _job(tmp_path, script, statuses=[0])
    _no_traceback(job)
    assert _calls(tmp_path, "scontrol") == [f"requeue {JOB}"], job.stderr
    assert job.returncode == 0, job.stderr


_WRITE_STOP = (f"{shlex.quote(sys.executable)} -c \"import sys; from pathlib import Path; "
               "from hpc_train.records import ranks, stop; s = ranks.StepId.from_env(); "
               "stop.write(Path(sys.argv[1]), stop.StopRecord(40, 'USR2', None, True, "
               "request=stop.Request(s.job, s.job, s.restart, s.attempt)))\" \"$RUN_DIR\"; ")


def test_the_stop_record_s_request_decides_its_own_step_and_not_the_next_incarnation_s(tmp_path):
    """One stop record: rank 0's request rides in stopped.json (no requeue.pending), names its
    step, and stays. The preemption's step is requeued from it; the next incarnation, which
    fails, is restarted in place: the old request, still there, is not taken for its own."""
    script, rd = _script(tmp_path, "job.nodes=2")
    _rank(rd, 0, "node1", 2, ended="stopped")
    _rank(rd, 1, "node2", 2, ended="stopped")
    job = _job(tmp_path, script, statuses=[0], each=f'[ "$n" = 1 ] && {_WRITE_STOP}')
    assert _calls(tmp_path, "scontrol") == [f"requeue {JOB}"], job.stderr
    assert _requeue(rd)["counts"]["preemption"] == 1, _requeue(rd)
    assert not (rd / "requeue.pending").exists()
    assert json.loads((rd / "stopped.json").read_text())["request"]["restart"] == 0

    _rank(rd, 0, "node1", 2, restart=1)
    _rank(rd, 1, "node2", 2, restart=1)
    again = _job(tmp_path, script, statuses=[1], restart=1)
    assert _calls(tmp_path, "scontrol") == [], again.stderr
    assert len(_calls(tmp_path, "srun")) == 2, again.stderr          # restarted in place, then finished
    assert _requeue(rd)["counts"]["preemption"] == 1 and len(_requeue(rd)["in_place"]) == 1, _requeue(rd)
    assert "earlier step" not in _hook_lines(again), again.stderr     # an old stop record is no news


@pytest.mark.parametrize("written", ["during the job", "before it"])
def test_a_damaged_stop_record_is_a_request_only_when_this_job_wrote_it(tmp_path, written):
    """Damaged by outside hands, the stop record's request is unknown: written during this job, it
    exists because a stop asked for a requeue, so this job is requeued; older than the batch
    shell, it is an earlier job's, and a step that ended cleanly asks for nothing."""
    script, rd = _script(tmp_path, "job.nodes=2")
    _rank(rd, 0, "node1", 2, ended="stopped")
    _rank(rd, 1, "node2", 2, ended="stopped")
    damage = f"echo '{{\"stopped\": true, \"request\": 5}}' > \"$RUN_DIR/stopped.json\"; "
    if written == "before it":
        (rd / "stopped.json").write_text('{"stopped": true, "request": 5}')
        os.utime(rd / "stopped.json", (time.time() - 3600, time.time() - 3600))
    job = _job(tmp_path, script, statuses=[0], each=f'[ "$n" = 1 ] && {damage}' if written != "before it" else "")
    _no_traceback(job)
    if written == "during the job":
        assert _calls(tmp_path, "scontrol") == [f"requeue {JOB}"], job.stderr
        assert "stopped.json request is 5, not an object: taken as this task's stop request" in job.stderr, job.stderr
    else:
        assert _calls(tmp_path, "scontrol") == [] and len(_calls(tmp_path, "srun")) == 1, job.stderr
        assert "no requeue requested" in _hook_lines(job), job.stderr


def test_a_request_an_earlier_version_left_in_requeue_pending_is_still_acted_on_and_removed(tmp_path):
    """A run directory of an earlier version: the request in requeue.pending, beside a stop record
    without one. Acted on as before, and removed once acted on (it names no later step)."""
    script, rd = _script(tmp_path, "job.nodes=2")
    _rank(rd, 0, "node1", 2, ended="stopped")
    _rank(rd, 1, "node2", 2, ended="stopped")
    _stopped(rd, "SIGUSR2")       # the earlier version's form of the signal
    _pending(rd, "preemption", "SIGUSR2")
    job = _job(tmp_path, script, statuses=[0])
    assert _calls(tmp_path, "scontrol") == [f"requeue {JOB}"], job.stderr
    assert _requeue(rd)["counts"]["preemption"] == 1, _requeue(rd)
    assert not (rd / "requeue.pending").exists()


def test_a_rank_that_died_before_writing_anything_is_a_failure_not_a_preemption(tmp_path):
    """Rank 1 died before its record existed (its interpreter failed at start); srun's SIGTERM
    made rank 0 stop and ask for a requeue. That is rank 1's failure: restarted in place. Taken
    for a preemption (unlimited budget), every incarnation would be requeued again, forever."""
    script, rd = _script(tmp_path, "job.nodes=2")
    _rank(rd, 0, "node1", 2, ended="stopped")
    _stopped(rd, "TERM")
    _pending(rd, "preemption", "TERM")
    job = _job(tmp_path, script, statuses=[1])
    assert _calls(tmp_path, "scontrol") == [], job.stderr
    assert len(_calls(tmp_path, "srun")) == 2, job.stderr            # restarted in place, then finished
    assert "rank 1" in _hook_lines(job), job.stderr
    assert _requeue(rd)["counts"].get("preemption", 0) == 0, _requeue(rd)


def test_a_time_limit_stop_is_requeued_even_when_a_rank_dies_at_the_same_moment(tmp_path):
    """The time-limit signal reached every rank; rank 1 died during the stop. Withdrawn and
    restarted in place, the job would run into its time limit and end TIMEOUT, never requeued."""
    script, rd = _script(tmp_path, "job.nodes=2")
    _rank(rd, 0, "node1", 2, ended="stopped")
    _rank(rd, 1, "node2", 2)                        # never said its work ended: it died
    _stopped(rd, "USR2")
    _pending(rd, "timeout", "USR2")
    job = _job(tmp_path, script, statuses=[1], minutes_left=1)
    assert _calls(tmp_path, "scontrol") == [f"requeue {JOB}"], job.stderr
    assert len(_calls(tmp_path, "srun")) == 1, job.stderr
    assert _requeue(rd)["counts"]["timeout"] == 1, _requeue(rd)


def test_a_preemption_with_a_rank_dying_at_the_same_moment_is_requeued_from_the_request_a_step_leaves(
        tmp_path, monkeypatch):
    """Rank 0's request as its own writer leaves it (stops.record_stop, after a real
    StopRequest got the job's signal), not as laid down by hand: the preemption's USR2 reached
    every rank and rank 1 died during the stop. It is still the preemption, requeued once, not
    a failure restarted in place (the writer once stored "SIGUSR2", which never equals
    job.signal, so any rank's death turned the stop into a failure)."""
    import signal
    from types import SimpleNamespace

    from hpc_train.node.stops import StopRequest, record_stop
    from hpc_train import rundir
    script, rd = _script(tmp_path, "job.nodes=2")
    _rank(rd, 0, "node1", 2, ended="stopped")
    _rank(rd, 1, "node2", 2)                        # never said its work ended: it died
    _stopped(rd, "USR2")
    for k, v in {"SLURM_JOB_ID": JOB, "SLURM_RESTART_COUNT": "0", rundir.ATTEMPT_ENV: "1"}.items():
        monkeypatch.setenv(k, v)
    stop = StopRequest()
    stop._record(signal.SIGUSR2)                    # what its handler records when the signal comes
    record_stop(SimpleNamespace(rank=0, job_id=JOB, requeue_target=JOB), rd, stop, 40, True)
    job = _job(tmp_path, script, statuses=[1])
    assert _calls(tmp_path, "scontrol") == [f"requeue {JOB}"], job.stderr
    assert len(_calls(tmp_path, "srun")) == 1, job.stderr
    assert _requeue(rd)["counts"] == {"preemption": 1, "timeout": 0, "failure": 0}, _requeue(rd)


def test_no_restart_in_place_starts_in_the_last_signal_lead_seconds(tmp_path):
    """A step started after the time-limit signal would never get it: the job would be killed at
    its limit mid-step, with nothing saved and no requeue. The failure goes to the requeue."""
    script, rd = _script(tmp_path, "job.nodes=2")        # job.signal_lead: 90 s
    _rank(rd, 0, "node1", 2)
    _rank(rd, 1, "node2", 2)
    job = _job(tmp_path, script, statuses=[1], minutes_left=1)
    assert len(_calls(tmp_path, "srun")) == 1, job.stderr
    assert _calls(tmp_path, "scontrol") == [f"requeue {JOB}"], job.stderr
    assert "in place" in _hook_lines(job) and "time limit" in _hook_lines(job), job.stderr


def test_a_refused_duplicate_job_touches_nothing_of_the_run_it_was_refused(tmp_path):
    """Job 8 was submitted into job 7's run directory; its rank 0 was refused (exit 2: the run
    directory is in use). Nothing of job 7's records may change, and job 8 is not requeued."""
    script, rd = _script(tmp_path, "job.nodes=2")
    _rank(rd, 0, "node1", 2)
    _rank(rd, 1, "node2", 2)
    state = {"counts": {"preemption": 1, "timeout": 0, "failure": 0},
             "events": [{"key": "7:0", "cause": "preemption", "step": 10, "time": time.time() - 99, "requeued": True}]}
    (rd / "requeue.json").write_text(json.dumps(state))
    before = (rd / "requeue.json").read_bytes()
    job = _job(tmp_path, script, statuses=[2], job="8")
    assert job.returncode == 2, job.stderr
    assert _calls(tmp_path, "scontrol") == [] and len(_calls(tmp_path, "srun")) == 1, job.stderr
    assert (rd / "requeue.json").read_bytes() == before
    assert not (rd / "requeue.pending").exists()


def test_a_failed_scontrol_requeue_charges_nothing(tmp_path):
    script, rd = _script(tmp_path, "job.nodes=2", "job.restarts_in_place=0", "job.requeue_failure=1")
    _rank(rd, 0, "node1", 2)
    _rank(rd, 1, "node2", 2)
    job = _job(tmp_path, script, statuses=[1], scontrol_fails=True)
    assert _calls(tmp_path, "scontrol") == [f"requeue {JOB}"], job.stderr
    assert "NOT requeued" in _hook_lines(job), job.stderr
    rec = _requeue(rd) if (rd / "requeue.json").exists() else {"counts": {}}
    assert rec["counts"].get("failure", 0) == 0, rec
    # The same job fails again: its budget is whole, so this time the requeue goes through.
    job = _job(tmp_path, script, statuses=[1])
    assert _calls(tmp_path, "scontrol") == [f"requeue {JOB}"] and "requeued" in _hook_lines(job), job.stderr
    assert _requeue(rd)["counts"]["failure"] == 1


def test_a_requeue_is_counted_even_when_it_ends_the_hook_at_once(tmp_path):
    """Slurm's requeue ends the batch step, the hook in it, as soon as the controller acts: the
    count must be on disk before ``scontrol requeue`` returns (a benchmark's requeue went
    uncounted when the hook wrote it after)."""
    script, rd = _script(tmp_path, "job.nodes=2", "job.restarts_in_place=0", "job.requeue_failure=2")
    _rank(rd, 0, "node1", 2)
    _rank(rd, 1, "node2", 2)
    _job(tmp_path, script, statuses=[1], requeue_ends_the_step=True)
    assert _calls(tmp_path, "scontrol") == [f"requeue {JOB}"]
    rec = _requeue(rd)
    assert rec["counts"]["failure"] == 1 and rec["events"][-1]["requeued"] is True, rec


@pytest.mark.parametrize("damage", ["count", "charge"])
def test_negative_counts_and_charges_in_requeue_json_buy_no_extra_budget(tmp_path, damage):
    """Outside hands wrote a negative count (or an in-place charge below zero): it must not be
    taken as budget left. Job 7 was requeued once for a failure already (its budget is 1)."""
    script, rd = _script(tmp_path, "job.nodes=2", "job.restarts_in_place=2", "job.requeue_failure=1")
    _rank(rd, 0, "node1", 2, restart=1)
    _rank(rd, 1, "node2", 2, restart=1)
    t = time.time()
    state = {"counts": {"preemption": 0, "timeout": 0, "failure": -5 if damage == "count" else 1},
             "events": [{"key": "7:0", "cause": "failure", "step": 0, "time": t - 99, "requeued": True}],
             "in_place": [{"job": "7", "restart": 1, "step": 0, "time": t - 50, "charge": 2}]
             + ([{"job": "7", "restart": 1, "step": 0, "time": t - 40, "charge": -3}] if damage == "charge" else [])}
    (rd / "requeue.json").write_text(json.dumps(state))
    job = _job(tmp_path, script, statuses=[1], restart=1)
    _no_traceback(job)
    assert len(_calls(tmp_path, "srun")) == 1, job.stderr         # in-place budget spent (2 of 2 used)
    assert _calls(tmp_path, "scontrol") == [], job.stderr         # failure budget spent (1 of 1)
    assert "failure budget (1) spent" in _hook_lines(job), job.stderr


# -- nodes: a lost node, a crashed rank, Slurm's view ---------------------------------------
def test_an_in_place_list_that_is_not_a_list_is_set_aside_and_named_not_a_crash(tmp_path):
    script, rd = _script(tmp_path, "job.nodes=2", "job.spare_nodes=1")
    _rank(rd, 0, "node1", 2)
    _rank(rd, 1, "node2", 2)
    (rd / "requeue.json").write_text(json.dumps({"counts": {"failure": 0}, "events": [], "in_place": 5}))
    job = _job(tmp_path, script, statuses=[1], nodes="node[1-3]",
               states="node1|mixed node2|mixed node3|idle")
    _no_traceback(job)
    assert len(_calls(tmp_path, "srun")) == 2, job.stderr
    assert "in_place" in job.stderr and "requeue.json" in job.stderr, job.stderr   # named
    assert list(rd.glob("requeue.json.damaged-*")), sorted(p.name for p in rd.iterdir())


def test_a_requeued_job_s_world_size_is_its_own_not_its_previous_incarnation_s(tmp_path):
    """Incarnation 0 went on with one node after losing one (job.min_nodes=1); the requeued
    job (restart 1) started again on job.nodes=2. Its failed step had world size 2."""
    script, rd = _script(tmp_path, "job.nodes=2", "job.min_nodes=1")
    _rank(rd, 0, "node1", 2, restart=1)
    _rank(rd, 1, "node2", 2, restart=1)
    state = {"counts": {"preemption": 1, "timeout": 0, "failure": 0},
             "events": [{"key": "7:0", "cause": "preemption", "step": 10, "time": time.time() - 99, "requeued": True}],
             "in_place": [{"job": "7", "restart": 0, "step": 5, "time": time.time() - 200, "charge": 1,
                           "nodes": ["node1"], "lost": ["node2"], "world_size": 1, "world_before": 2}]}
    (rd / "requeue.json").write_text(json.dumps(state))
    job = _job(tmp_path, script, statuses=[1], restart=1, states="node1|mixed node2|mixed")
    assert len(_calls(tmp_path, "srun")) == 2, job.stderr
    assert "world size 1 ->" not in job.stderr, job.stderr
    event = _requeue(rd)["in_place"][-1]
    assert (event["world_before"], event["world_size"]) == (2, 2), event


def test_a_node_lost_earlier_is_not_lost_again_and_a_crashed_rank_moves_to_a_free_spare(tmp_path):
    """node2 was lost at the first failure (the step went on on node1,node3). Now rank 1
    crashed on node3, a healthy node: it moves to the spare node4; node2 is not lost again."""
    script, rd = _script(tmp_path, "job.nodes=2", "job.spare_nodes=2")
    _rank(rd, 0, "node1", 2)
    _rank(rd, 1, "node3", 2)
    state = {"counts": {"preemption": 0, "timeout": 0, "failure": 0}, "events": [],
             "in_place": [{"job": "7", "restart": 0, "step": 5, "time": time.time() - 200, "charge": 1,
                           "nodes": ["node1", "node3"], "lost": ["node2"], "world_size": 2, "world_before": 2}]}
    (rd / "requeue.json").write_text(json.dumps(state))
    job = _job(tmp_path, script, statuses=[1], nodes="node[1-4]", now="node[1,3-4]",
               states="node1|mixed node2|down* node3|mixed node4|idle")
    steps = _calls(tmp_path, "srun")
    assert len(steps) == 2 and "--nodelist=node1,node4" in steps[1], (steps, job.stderr)
    assert "node2 lost" not in _hook_lines(job), job.stderr
    assert _requeue(rd)["in_place"][-1]["lost"] == [], _requeue(rd)


@pytest.mark.parametrize("which", ["squeue", "sinfo"])
def test_a_scheduler_that_does_not_answer_is_unknown_not_every_node_gone(tmp_path, which):
    """squeue or sinfo failed (the controller is busy or down): the nodes' fate is unknown, so
    the step starts again where it ran, instead of the job giving up on every node."""
    script, rd = _script(tmp_path, "job.nodes=2", "job.spare_nodes=1")
    _rank(rd, 0, "node1", 2)
    _rank(rd, 1, "node2", 2)
    job = _job(tmp_path, script, statuses=[1], nodes="node[1-3]", states="node1|mixed node2|mixed node3|idle",
               squeue_fails=which == "squeue", sinfo_fails=which == "sinfo")
    _no_traceback(job)
    assert len(_calls(tmp_path, "srun")) == 2 and _calls(tmp_path, "scontrol") == [], job.stderr
    assert "did not answer" in _hook_lines(job) or "unknown" in _hook_lines(job), job.stderr
    assert "0 of the allocation" not in job.stderr, job.stderr


def test_squeue_is_asked_about_this_job(tmp_path):
    """With two jobs on the cluster, squeue's answer about another job must not be taken for
    this one's nodes (the fake squeue answers only for the id it is asked about)."""
    script, rd = _script(tmp_path, "job.nodes=2", "job.spare_nodes=1")
    _rank(rd, 0, "node1", 2)
    _rank(rd, 1, "node2", 2)
    job = _job(tmp_path, script, statuses=[1], nodes="node[1-3]", now="node[1,3]",
               states="node1|mixed node2|down node3|idle")
    assert any(f"-j {JOB} " in c for c in _calls(tmp_path, "squeue")), _calls(tmp_path, "squeue")
    steps = _calls(tmp_path, "srun")
    assert len(steps) == 2 and "--nodelist=node1,node3" in steps[1], (steps, job.stderr)


def test_torchrun_world_sizes_count_ranks_not_nodes(tmp_path):
    """One torchrun per node starting two workers each: losing one of two nodes takes the
    world from 4 ranks to 2, in the hook's line and in requeue.json."""
    script, rd = _script(tmp_path, "job.nodes=2", "job.tasks_per_node=2", "job.min_nodes=1", launcher="torchrun")
    for r in range(4):
        _rank(rd, r, f"node{1 + r // 2}", 4)
    job = _job(tmp_path, script, statuses=[1], now="node1", states="node1|mixed node2|down")
    assert len(_calls(tmp_path, "srun")) == 2, job.stderr
    assert "world size 4 -> 2" in _hook_lines(job), job.stderr
    event = _requeue(rd)["in_place"][-1]
    assert (event["world_before"], event["world_size"]) == (4, 2), event


# -- --resume PATH and the steps restarted in place ---------------------------------------------
@pytest.mark.procs
def test_an_in_place_restart_after_resume_path_goes_on_from_the_run_s_own_checkpoint(tmp_path):
    """A job submitted with ``--resume PATH`` saved its own checkpoints past PATH, then its step
    failed. The step restarted in place resumes from the run's own newest checkpoint: going back
    to PATH would move that work aside and train it again. Real workers, one task each step."""
    src = tmp_path / "src"
    base = ["--set", "data.name=synthetic", "--set", "data.synthetic_size=256", "--set", "data.batch_size=16",
            "--set", "log.progress=lines", "--set", "log.tensorboard=false", "--set", "train.eval=false",
            "--set", "checkpoint.every_steps=2", "--set", "checkpoint.async_save=false"]
    model = "model.name=tests.plugins_for_tests:fail_while_marked"   # tiny_model unless told to fail
    p = hpc("run", "jobs/digits.yaml", "--run-dir", src, *base, "--set", model, "--set", "train.max_steps=4")
    assert p.returncode == 0, show(p)
    rd = tmp_path / "run"
    sets = [*base[1::2], model, "train.max_steps=10"]
    render = (f"import sys; from pathlib import Path; from hpc_train.config import load; "
              f"from hpc_train.login.sbatch import SbatchScript; "
              f"cfg = load('jobs/digits.yaml', {sets!r}); cfg.run_dir = {str(rd)!r}; "
              f"sys.stdout.write(SbatchScript(cfg, Path({str(rd)!r}), resume={str(src / 'checkpoints' / 'step-4')!r})"
              f".materialize())")
    root = Path(__file__).resolve().parents[2]
    script = subprocess.run([sys.executable, "-c", render], capture_output=True, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)}, check=True).stdout
    marker = tmp_path / "fail-now"
    marker.write_text("")
    # One real task per step: the worker reads its rank from Slurm's variables, as under srun.
    srun = (f'srun() {{ n=$(( $(cat {tmp_path}/steps 2>/dev/null || echo 0) + 1 )); echo $n > {tmp_path}/steps; '
            f'[ "$n" -ge 2 ] && rm -f {marker}; while [ "${{1#-}}" != "$1" ]; do shift; done; '
            f'SLURM_STEP_ID=$((n-1)) SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_NTASKS=1 '
            f'SLURM_STEP_NODELIST=node1 SLURM_TASKS_PER_NODE=1 MASTER_ADDR=127.0.0.1 "$@"; }}\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "scontrol", f'[ "$1" = show ] || echo "$@" >> {tmp_path}/scontrol.calls\n')
    _tool(bin_dir, "srun", f'echo "$@" >> {tmp_path}/cleanup.calls\n')     # the local tier's cleanup
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": JOB, "SLURM_JOB_NODELIST": "node1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURMD_NODENAME": "node1", "SLURM_RESTART_COUNT": "0",
           "PYTHONPATH": str(root), "HPC_TEST_FAIL_MARKER": str(marker), "HPC_TEST_FAIL_RUN": "run",
           "HPC_TEST_FAIL_AT_STEP": "4", "HOME": os.environ.get("HOME", "/root")}
    job = subprocess.run(["bash", "-c", srun + script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env)
    assert (rd / "result.json").exists(), job.stderr[-3000:]
    assert (tmp_path / "steps").read_text().strip() == "2", job.stderr[-3000:]
    log = (rd / "logs" / "rank-0.log").read_text()
    resumed = [ln for ln in log.splitlines() if "resumed from" in ln]
    assert len(resumed) == 2, resumed
    assert "src" in resumed[0] and str(rd / "checkpoints") in resumed[1], (resumed, _hook_lines(job))
    assert not list((rd / "checkpoints").glob("*.skipped*")), sorted(p.name for p in (rd / "checkpoints").iterdir())


def test_the_same_start_up_error_twice_ends_the_job_with_it(tmp_path):
    """Every step dies at start-up with the same error (Lightning's devices/tasks mismatch, say):
    the second time, with no checkpoint since, there is no third attempt, in place or through the
    queue; the job ends failed with the error's line, and status shows it."""
    script, rd = _script(tmp_path, "job.nodes=2")
    err = "ValueError: You set devices=2, but the number of tasks per node configured (1) does not match"
    each = (f'mkdir -p "$RUN_DIR/logs"; printf "%s\\n\\ntraceback\\n" "{err}" > "$RUN_DIR/logs/rank-0.error";')
    job = _job(tmp_path, script, statuses=[1, 1, 1, 1], each=each)
    assert len(_calls(tmp_path, "srun")) == 2 and _calls(tmp_path, "scontrol") == [], job.stderr
    assert job.returncode == 1, job.stderr
    last = _hook_lines(job).splitlines()[-1]
    assert "the same error again at step 0" in last and err in last, job.stderr
    status = hpc("status", rd)
    assert err in status.stdout, show(status)


def test_a_run_the_script_requeued_itself_is_counted_by_its_cause_at_the_next_hook(tmp_path):
    """Issue 33 (2): run 0 ended in Lightning's own ``scontrol requeue`` at its time limit, which
    ended the batch shell before the hook ran. Run 1 finishes; its hook sees run 0 in sacct (ran
    170 s of a 3-minute limit) and counts it as the time limit's, once, through the real writer;
    ``status`` says so."""
    script, rd = _script(tmp_path, "job.nodes=2", "job.signal_lead=30")
    (tmp_path / "bin").mkdir()
    _tool(tmp_path / "bin", "sacct", f'printf "%s\\n" "$*" >> {tmp_path}/sacct.calls\n'
          'printf "REQUEUED|170|3|2026-11-24T06:53:12\\nRUNNING|40|3|Unknown\\n"\n')
    job = _job(tmp_path, script, statuses=[], restart=1)
    _no_traceback(job)
    assert job.returncode == 0, job.stderr
    assert "run 0 was requeued outside hpc_train" in _hook_lines(job) and "counted as a timeout" in _hook_lines(job)
    assert _calls(tmp_path, "sacct") == [f"-n -P -X --duplicates -j {JOB} -o State,ElapsedRaw,TimelimitRaw,End"]
    rec = _requeue(rd)
    assert rec["counts"] == {"preemption": 0, "timeout": 1, "failure": 0}, rec
    assert [(e["key"], e["by"], e["step"]) for e in rec["events"]] == [(f"{JOB}:0", "outside", None)]
    again = _job(tmp_path, script, statuses=[], restart=1)     # the hook run again counts nothing twice
    assert _requeue(rd)["counts"]["timeout"] == 1 and "outside" not in _hook_lines(again), again.stderr
    st = hpc("status", rd)
    assert "timeout 1" in st.stdout and "(timeout 1 of them requeued outside hpc_train)" in st.stdout, show(st)
