"""Issue 29.3: ``status`` names what became of a local run (running, finished, failed, stopped,
aborted during a save) and predicts what the same command does if run again; the prediction is
then checked against what that rerun does. (The decision itself, as a table:
tests/login/test_outcome.py.)

One chain of real runs per path, each run of a chain being the rerun that checks the status
before it (and making the next state): the built-in trainer (stopped, failed, running and
aborted during a save, finished; every checkpoint damaged), a loop of the user's on
``hpc_train.init()`` (tests/scripts/own_loop.py under ``run --script``: running, stopped,
failed, finished; ``run --fn`` killed during its first save), and a script that never calls
hpc_train (tests/scripts/plain_loop.py: running, stopped, failed, finished; goodput n/a).

Faults are real: a SIGTERM to the launcher, a rank that raises or exits 2, a kill -9, a rank that
SIGSTOPs itself inside a save (tests/plugins_for_tests.py) and a second Ctrl-C.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import REPO, children, clean_env, hpc, metric_lines, show, start, write_config
from hpc_train.errors import EXIT_STOPPED

# Each chain of runs takes longer than a test should; its tests share it (module fixtures).
pytestmark = [pytest.mark.slow, pytest.mark.procs]   # every test here reads a chain of real runs

OWN_LOOP = str(REPO / "tests" / "scripts" / "own_loop.py")
PLAIN = str(REPO / "tests" / "scripts" / "plain_loop.py")


# -- shared helpers ------------------------------------------------------------------------------
def status(rd: Path) -> dict[str, str]:
    """``status RUN_DIR``: its lines by their label (``local run``, ``rerun``, ``last step``, ``goodput``)."""
    p = hpc("status", rd, timeout=60)
    assert p.returncode == 0 and "Traceback" not in p.stderr, show(p)
    out = {"text": p.stdout}
    for line in p.stdout.splitlines()[1:]:
        label, _, rest = line.strip().partition(": ")
        out.setdefault(label if not label.startswith("last step") else "last step", rest or label)
    return out


def finish(p: subprocess.Popen, timeout: float = 180) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in children(p.pid):
            os.killpg(pid, signal.SIGKILL)
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"hung: {p.args}\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def wait_until(what, p: subprocess.Popen, timeout: float = 120, why: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert p.poll() is None, f"ended before {why}: {p.communicate()[1][-4000:]}"
        assert time.monotonic() < deadline, f"{why}: not within {timeout} s"
        time.sleep(0.05)


def first_step_reported(rd: Path) -> bool:
    try:
        return any(s.get("first_step") for s in json.loads((rd / "goodput.json").read_text())["segments"])
    except (OSError, ValueError, KeyError):
        return False


def logged_past(rd: Path, step: int) -> bool:
    """metrics.jsonl holds a step after ``step``."""
    try:
        return any(json.loads(ln)["step"] > step for ln in metric_lines(rd))
    except (OSError, ValueError, KeyError):
        return False


def log_has(rd: Path, rank: int, text: str) -> bool:
    try:
        return text in (rd / "logs" / f"rank-{rank}.log").read_text()
    except OSError:
        return False


def resumed_from(p: subprocess.CompletedProcess, step: int) -> bool:
    """The rerun's own launcher said it resumes from ``step`` (its plan), and nothing else."""
    return f"resuming from step {step} (" in p.stderr and p.stderr.count("resuming from step ") == 1


def refused_while_running(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    p = hpc(*argv, env=env, timeout=60)
    assert p.returncode == 2 and "is in use by" in p.stderr, show(p)
    return p


# -- the built-in trainer --------------------------------------------------------------------
@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """A 2-rank built-in run taken through every state by the same command: stopped at step 3;
    rerun, rank 1 raises at step 6; rerun, stopped at step 5 with rank 0 frozen inside that save
    (running), then a second signal (aborted during the save); rerun to its finish (step 10);
    rerun. The status before each rerun, and each rerun, are kept. Also a copy of the run as
    it was after the failure, for the damaged-checkpoints case."""
    d = tmp_path_factory.mktemp("builtin")
    cfg = write_config(d / "job.yaml", {"train": {"max_steps": 10}, "checkpoint": {"every_steps": 2, "keep": 3}})
    rd = d / "run"
    argv = ["run", str(cfg), "--nproc", "2", "--run-dir", str(rd)]
    out: dict = {"rd": rd, "argv": argv}
    out["stopped_run"] = hpc(*argv, env=clean_env(HPC_TRAIN_TEST_STOP_AT_STEP="3"))
    out["stopped"] = status(rd)
    # The stop record as if written just before the next launch began (as on a fast machine,
    # where the rerun starts within the clocks' slack of the stopped run's last write): still
    # the run before's, not what the next launch did.
    now = time.time()
    os.utime(rd / "stopped.json", (now, now))
    out["failed_run"] = hpc(*argv, env=clean_env(HPC_TRAIN_TEST_FAIL_AT="1:3"))
    out["failed"] = status(rd)
    shutil.copytree(rd, d / "after-failure", symlinks=True)
    out["after_failure"] = d / "after-failure"
    p = start(*argv, env=clean_env(HPC_TRAIN_TEST_FREEZE_IN_SAVE="1", HPC_TRAIN_TEST_STOP_AT_STEP="1"))
    try:
        wait_until(lambda: (rd / "frozen-save").exists(), p, why="rank 0 frozen inside the save of step 5")
        out["running"] = status(rd)
        out["second_run"] = refused_while_running(argv, clean_env())
        p.send_signal(signal.SIGINT)      # the second signal: the stop_at hook sent the first
        out["aborted_run"] = finish(p, timeout=60)
    finally:
        if p.poll() is None:
            for pid in children(p.pid):
                os.killpg(pid, signal.SIGKILL)
            p.kill()
    out["aborted"] = status(rd)
    out["finished_run"] = hpc(*argv)
    out["finished"] = status(rd)
    out["rerun_finished"] = hpc(*argv)
    return out


def test_builtin_stopped_resumes_where_status_said(builtin):
    st, p, rerun = builtin["stopped"], builtin["stopped_run"], builtin["failed_run"]
    assert p.returncode == EXIT_STOPPED, show(p)
    assert st["local run"] == "stopped at step 3 by SIGTERM, checkpoint committed", st["text"]
    assert st["rerun"].startswith("the same command resumes from step 3 ("), st["text"]
    assert resumed_from(rerun, 3), show(rerun)


def test_builtin_failed_names_the_rank_and_its_error_and_resumes_where_status_said(builtin):
    st, p, rerun = builtin["failed"], builtin["failed_run"], builtin["aborted_run"]
    assert p.returncode == 1, show(p)
    # The stop record of the run before is older than this launch: not what happened now.
    assert st["local run"] == ("failed: rank 1: RuntimeError: test failure: rank 1 fails at its step 3 "
                               "(its log: logs/rank-1.log)"), st["text"]
    assert st["rerun"].startswith("the same command resumes from step 4 ("), st["text"]
    assert resumed_from(rerun, 4), show(rerun)


def test_builtin_running_is_running_and_a_rerun_is_refused_meanwhile(builtin):
    st = builtin["running"]
    assert st["local run"].startswith("running: `python -m hpc_train run` (2 processes)"), st["text"]
    assert st["rerun"].startswith("refused while it runs (the run directory is in use)"), st["text"]
    assert "is in use by `python -m hpc_train run` (2 processes)" in builtin["second_run"].stderr


def test_builtin_aborted_during_a_save_is_named_and_the_rerun_skips_that_save(builtin):
    st, p, rerun = builtin["aborted"], builtin["aborted_run"], builtin["finished_run"]
    assert p.returncode == 130 and "aborted; workers killed" in p.stderr, show(p)
    assert st["local run"].startswith("aborted during the save of step 5: killed before its commit record"), st["text"]
    assert "see logs/rank-*.error" not in st["text"] and not list((builtin["rd"] / "logs").glob("*.error"))
    assert st["rerun"].startswith("the same command resumes from step 4 ("), st["text"]
    assert resumed_from(rerun, 4) and "skipping incomplete checkpoint step 5" in rerun.stderr, show(rerun)


def test_builtin_finished_is_refused_as_status_said(builtin):
    st, p, rerun = builtin["finished"], builtin["finished_run"], builtin["rerun_finished"]
    assert p.returncode == 0, show(p)
    assert st["local run"] == "finished at step 10 (result.json)", st["text"]
    assert st["rerun"] == ("refused: the run finished (result.json), so the same command does nothing; "
                           "--resume none starts over"), st["text"]
    assert rerun.returncode == 0 and "finished at step 10" in rerun.stderr and "nothing to do" in rerun.stderr
    assert "resuming" not in rerun.stderr and "starting fresh" not in rerun.stderr, show(rerun)


def test_builtin_every_checkpoint_damaged_is_refused_with_the_reruns_own_words(builtin, tmp_path):
    rd = tmp_path / "run"
    shutil.copytree(builtin["after_failure"], rd, symlinks=True)
    rng = random.Random(7)
    for ck in sorted((rd / "checkpoints").glob("step-*")):
        app = ck / "app.pt"
        data = bytearray(app.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)   # same size: only its checksum can tell
        app.write_bytes(bytes(data))
    before = sorted(str(p.relative_to(rd)) for p in rd.rglob("*"))
    st = status(rd)
    assert st["local run"].startswith("failed: rank 1: RuntimeError"), st["text"]
    assert st["rerun"].startswith("refused: ") and "none is complete and intact" in st["rerun"], st["text"]
    assert sorted(str(p.relative_to(rd)) for p in rd.rglob("*")) == before     # status moved nothing aside
    argv = [a if a != str(builtin["rd"]) else str(rd) for a in builtin["argv"]]
    rerun = hpc(*argv)
    assert rerun.returncode == 2, show(rerun)
    assert st["rerun"].removeprefix("refused: ") in rerun.stderr, (st["rerun"], show(rerun))


# -- a loop of the user's on hpc_train.init(), under run --script and run --fn ---------------
def _rank_script(launcher: int, rank: int) -> int:
    """The script process that rank ``rank``'s supervisor runs, under the launcher ``launcher``."""
    for worker in children(launcher):
        env = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            kids = children(worker)
            assert len(kids) == 1, kids
            return kids[0]
    raise AssertionError(f"no worker of rank {rank}")


@pytest.fixture(scope="module")
def own_loop(tmp_path_factory):
    """tests/scripts/own_loop.py, 2 ranks under ``run --script``, 60 steps of 0.3 s, by one
    command: running (status after 6 s of steps), then stopped by a SIGTERM; rerun, its rank 1
    killed (kill -9) once a step past the checkpoint is logged; rerun to its finish; rerun."""
    d = tmp_path_factory.mktemp("own")
    rd = d / "run"
    argv = ["run", "--script", OWN_LOOP, "--nproc", "2", "--run-dir", str(rd), "--set", "log.progress=lines",
            "--", "60", "0.3"]
    out: dict = {"rd": rd}
    p = start(*argv)
    try:
        wait_until(lambda: first_step_reported(rd), p, why="the first step")
        time.sleep(6.5)          # longer than the flush period: what status shows must be recent anyway
        out["running_at"] = time.time()
        out["running"] = status(rd)
        out["second_run"] = refused_while_running(argv, clean_env())
        p.send_signal(signal.SIGTERM)
        out["stopped_run"] = finish(p)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out["stopped"] = status(rd)
    out["stop_step"] = json.loads((rd / "stopped.json").read_text())["steps"]
    p = start(*argv)
    try:
        wait_until(lambda: logged_past(rd, out["stop_step"]), p, why="a step past the checkpoint")
        os.kill(_rank_script(p.pid, 1), signal.SIGKILL)
        out["failed_run"] = finish(p)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out["failed"] = status(rd)
    out["finished_run"] = hpc(*argv)
    out["finished"] = status(rd)
    out["goodput"] = hpc("status", rd, "--goodput").stdout
    out["rerun_finished"] = hpc(*argv)
    return out


def test_own_loop_running_shows_a_step_of_the_last_10_s(own_loop):
    st = own_loop["running"]
    assert "last step" in st, f"no step shown while it runs:\n{st['text']}"
    assert st["local run"].startswith("running: `python -m hpc_train run` (2 processes)"), st["text"]
    assert st["rerun"].startswith("refused while it runs"), st["text"]
    ago = int(st["last step"].rsplit("(", 1)[1].split(" s ago)")[0])
    assert ago <= 10, st["text"]
    shown = int(st["last step"].split(",")[0].split()[-1])
    rec = next(json.loads(ln) for ln in (own_loop["rd"] / "metrics.jsonl").read_text().splitlines()
               if json.loads(ln)["step"] == shown)
    assert own_loop["running_at"] - rec["time"] <= 10, (rec, own_loop["running_at"])


def test_own_loop_stopped_resumes_where_status_said(own_loop):
    st, n, rerun = own_loop["stopped"], own_loop["stop_step"], own_loop["failed_run"]
    assert own_loop["stopped_run"].returncode == EXIT_STOPPED, show(own_loop["stopped_run"])
    assert st["local run"] == f"stopped at step {n} by SIGTERM, checkpoint committed", st["text"]
    assert st["rerun"].startswith(f"the same command resumes from step {n} ("), st["text"]
    assert resumed_from(rerun, n) and log_has(own_loop["rd"], 0, f"resumed from step {n} "), show(rerun)


def test_own_loop_failed_names_the_killed_rank_not_a_stop(own_loop):
    st, p, rerun, n = own_loop["failed"], own_loop["failed_run"], own_loop["finished_run"], own_loop["stop_step"]
    assert p.returncode == 1 and "worker rank 1 failed" in p.stderr, show(p)
    assert st["local run"].startswith("failed: rank 1 on "), st["text"]
    assert f"{OWN_LOOP} was killed by SIGKILL (its log: logs/rank-1.log)" in st["local run"], st["text"]
    assert st["rerun"].startswith(f"the same command resumes from step {n} ("), st["text"]
    assert resumed_from(rerun, n), show(rerun)


def test_own_loop_finished_is_refused_as_status_said(own_loop):
    st, p, rerun = own_loop["finished"], own_loop["finished_run"], own_loop["rerun_finished"]
    assert p.returncode == 0, show(p)
    assert st["local run"] == "finished at step 60 (result.json)", st["text"]
    assert st["rerun"].startswith("refused: the run finished (result.json)"), st["text"]
    assert rerun.returncode == 0 and "nothing to do" in rerun.stderr and "resuming" not in rerun.stderr, show(rerun)


def test_own_loop_goodput_counts_each_launch_once_and_the_steps_it_redid(own_loop):
    """Under ``run --script`` the script's own Run keeps the ledger; its supervisor adds no second
    segment per launch, so the steps the failed launch trained past its checkpoint are charged
    to it as redone."""
    assert own_loop["finished"]["goodput"].endswith(", 3 runs)"), own_loop["finished"]["text"]
    redone = int(own_loop["goodput"].split("steps redone after a restart: ")[1].split()[0])
    assert redone >= 1 and "runs: 3;" in own_loop["goodput"], own_loop["goodput"]


def test_own_loop_killed_during_its_first_save_is_named_and_the_refusal_predicted(tmp_path):
    """The issue's double Ctrl-C during the first save, on a loop of the user's (``run --fn``):
    rank 0 stops itself inside the save of step 3, the first; then two Ctrl-Cs."""
    rd = tmp_path / "run"
    argv = ["run", "--fn", "tests.plugins_for_tests:claims_loop", "--nproc", "2", "--run-dir", str(rd),
            "--set", "train.max_steps=8"]
    p = start(*argv, env=clean_env(HPC_TEST_REQUEST_STOP_AT="0:3", HPC_TEST_SIGSTOP_IN="save",
                                   HPC_TEST_SIGSTOP_RANK="0"))
    try:
        wait_until(lambda: (rd / "frozen-save-rank0").exists(), p, why="rank 0 frozen inside its first save")
        p.send_signal(signal.SIGINT)      # the first Ctrl-C: rank 0, frozen, cannot act on it
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)      # the second: every rank is killed
        aborted = finish(p, timeout=60)
    finally:
        if p.poll() is None:
            for pid in children(p.pid):
                os.killpg(pid, signal.SIGKILL)
            p.kill()
    assert aborted.returncode == 130, show(aborted)
    st = status(rd)
    assert st["local run"].startswith("aborted during the save of step 3"), st["text"]
    assert "logs/rank-*.error" not in st["text"], st["text"]
    assert st["rerun"].startswith("refused: ") and "none is complete and intact" in st["rerun"], st["text"]
    rerun = hpc(*argv)
    assert rerun.returncode == 2 and st["rerun"].removeprefix("refused: ") in rerun.stderr, show(rerun)


# -- a script that never calls hpc_train ----------------------------------------------------
@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """tests/scripts/plain_loop.py, 2 ranks under ``run --script``, 60 steps of 0.1 s, by one
    command: running, stopped by a SIGTERM; rerun while a file exists that makes its rank 1 exit
    2 at step 3; rerun without it, to its finish; rerun."""
    d = tmp_path_factory.mktemp("plain")
    rd, mark = d / "run", d / "broken"
    argv = ["run", "--script", PLAIN, "--nproc", "2", "--run-dir", str(rd), "--", "60", "0.1",
            "--fail-while", str(mark), "--fail-at", "3"]
    out: dict = {"rd": rd}
    p = start(*argv)
    try:
        wait_until(lambda: log_has(rd, 0, "rank 0 step 3\n"), p, why="step 3")
        out["running"] = status(rd)
        p.send_signal(signal.SIGTERM)
        out["stopped_run"] = finish(p)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out["stopped"] = status(rd)
    mark.write_text("")
    out["failed_run"] = hpc(*argv)
    out["failed"] = status(rd)
    mark.unlink()
    out["finished_run"] = hpc(*argv)
    out["finished"] = status(rd)
    out["rerun_finished"] = hpc(*argv)
    return out


def _ran_from_its_start(p: subprocess.CompletedProcess, rd: Path) -> bool:
    return ("no hpc_train checkpoint to resume" in p.stderr and "resuming" not in p.stderr
            and log_has(rd, 0, "rank 0 step 1\n"))


def test_script_running_and_stopped_and_its_goodput_is_na(plain):
    assert plain["running"]["local run"].startswith("running: "), plain["running"]["text"]
    st = plain["stopped"]
    assert plain["stopped_run"].returncode == EXIT_STOPPED, show(plain["stopped_run"])
    assert st["local run"].startswith("stopped by SIGTERM; hpc_train saved nothing"), st["text"]
    assert st["rerun"] == ("the same command runs the script again from its start; hpc_train holds no checkpoint "
                           "of it (it resumes from what it saved itself, if anything)"), st["text"]
    assert st["goodput"].startswith("n/a: no step was reported to hpc_train"), st["text"]
    assert "% training" not in st["text"], st["text"]
    assert _ran_from_its_start(plain["failed_run"], plain["rd"]), show(plain["failed_run"])


def test_script_failed_is_named_as_a_failure_not_a_stop(plain):
    st, p = plain["failed"], plain["failed_run"]
    assert p.returncode == 1 and "worker rank 1 failed" in p.stderr, show(p)
    assert st["local run"] == f"failed: rank 1 on {os.uname().nodename}: {PLAIN} exited with code 2 " \
                              f"(its log: logs/rank-1.log)", st["text"]
    assert "stopped" not in st["local run"], st["text"]
    assert st["rerun"].startswith("the same command runs the script again from its start"), st["text"]
    assert _ran_from_its_start(plain["finished_run"], plain["rd"]), show(plain["finished_run"])


def test_script_finished_is_refused_as_status_said(plain):
    st, p, rerun = plain["finished"], plain["finished_run"], plain["rerun_finished"]
    assert p.returncode == 0, show(p)
    assert st["local run"] == "finished (result.json)", st["text"]
    assert st["rerun"].startswith("refused: the run finished (result.json)"), st["text"]
    assert rerun.returncode == 0 and "nothing to do" in rerun.stderr, show(rerun)


@pytest.mark.parametrize("code", ["train.script=train.py", "train.fn=pkg.mod:main"])
def test_status_of_own_code_without_hpc_train_checkpoints_names_no_tier_restart(tmp_path, capsys, code):
    """Issue 51: status of a plain script said "the code resumes from its own checkpoints", then
    "restarted in place: the node-local tier's newest step ..., else step 0; a requeue: step 0"."""
    from unittest import mock

    from hpc_train import config, slurm
    from hpc_train.cli.main import main
    from hpc_train.records import jobs
    rd = tmp_path / "run"
    config.write(config.load(None, [code]), rd)
    jobs.append(rd, "7", "submit", print)      # a Slurm job; its state unknown here (squeue fails)
    with mock.patch.object(slurm, "_call", return_value=slurm.Reply(None, "squeue is not on PATH")):
        assert main(["status", str(rd)]) == 0
    out = capsys.readouterr().out
    assert "resumes from its own checkpoints" in out and "restarted in place" not in out, out


def test_a_run_of_a_plain_sbatch_script_is_shown_as_its_slurm_job_not_a_local_run(tmp_path, capsys, monkeypatch):
    """A run whose directory has no job.json (a rendered sbatch script, or the user's own srun)
    was labelled "local run:" with a local rerun's advice; its rank 0's record names its job."""
    from unittest import mock

    from hpc_train import config, slurm
    from hpc_train.cli.main import main
    from hpc_train.records import ranks
    rd = tmp_path / "run"
    config.write(config.load(None, []), rd)
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    ranks.begin(rd, 0, 2)
    asked: list[list[str]] = []

    def squeue_fails(argv, *a, **k):
        asked.append(list(argv))
        return slurm.Reply(None, "squeue is not on PATH")
    with mock.patch.object(slurm, "_call", side_effect=squeue_fails):
        assert main(["status", str(rd)]) == 0
    out = capsys.readouterr().out
    assert "job 4711: unknown, the scheduler did not answer" in out and "local run" not in out, out
    assert any("4711" in " ".join(map(str, argv)) for argv in asked), asked
    # A local launch's record names no job: still a local run.
    monkeypatch.delenv("SLURM_JOB_ID")
    ranks.begin(rd, 0, 2)
    with mock.patch.object(slurm, "_call", side_effect=squeue_fails):
        assert main(["status", str(rd)]) == 0
    assert "local run:" in capsys.readouterr().out
