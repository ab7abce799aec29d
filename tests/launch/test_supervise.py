"""Issues 29 and 33: what a `--script` child gets from its supervisor, as a user meets it.

- Threads like torchrun (29.1): every rank gets ``OMP_NUM_THREADS`` from ``dist.threads_per_rank``
  unless the user set it, and one line says so, once per launch.
- A script that never joins its process group is named by its own rank (29.2).
- The job's signal, which Slurm sends to every process of the step, reaches an unmodified script
  as SIGTERM from hpc_train, not as a signal that kills it (33.1). Sent here as Slurm sends it: to
  every process of each task (each worker leads its own process group, its script inside it).

Real processes and real signals throughout (`python -m hpc_train run`, os.killpg).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import clean_env, hpc, one_line_exit2, show, start
from hpc_train.errors import EXIT_STOPPED

THREADS_LINE = "setting OMP_NUM_THREADS={n} for each rank (dist.threads_per_rank; tune it there, or set OMP_NUM_THREADS)"


def _wait_for(pred, timeout: float, what: str, p: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if p is not None and p.poll() is not None:
            raise AssertionError(f"ended before {what}:\n{p.communicate()[1][-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _finish(p: subprocess.Popen, timeout: float = 60) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


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
@pytest.mark.procs
def test_a_function_trains_with_the_same_threads(tmp_path, env, sets, omp, torch_threads):
    rd = tmp_path / "run"
    p = hpc("run", "--fn", "tests.plugins_for_tests:threads_report", "--run-dir", rd,
            *(x for s in sets for x in ("--set", s)), env=clean_env(**env))
    assert p.returncode == 0, show(p)
    assert json.loads((rd / "threads-rank0.json").read_text()) == {"omp": omp, "torch": torch_threads}


# -- 29.2: a script that never joins its process group ----------------------------------------

NEVER_JOINS = "import sys, time\ntime.sleep(float(sys.argv[1]))\nprint('trained alone', flush=True)\n"
NOT_JOINED = re.compile(r"\[rank (\d)\] .* WARNING rank \1 has not joined the process group at 127\.0\.0\.1:\d+ "
                        r"after 1 s; is the script reading the environment \(init_method='env://'\)\?")


@pytest.mark.parametrize("nproc", [2, 1])
@pytest.mark.procs
def test_a_script_that_never_joins_is_named_by_each_rank(tmp_path, nproc):
    """The deadline is lowered to 1 s (the default is joined.JOIN_WARN_S, 60 s); a single rank
    has no group to join and is never named. A warning, not a failure: the run finishes."""
    script = tmp_path / "alone.py"
    script.write_text(NEVER_JOINS)
    p = hpc("run", "--script", script, "--nproc", str(nproc), "--run-dir", tmp_path / "run", "--", "3",
            env=clean_env(HPC_TRAIN_JOIN_WARN_S="1"))
    assert p.returncode == 0, show(p)
    named = sorted(int(m.group(1)) for m in NOT_JOINED.finditer(p.stderr))
    assert named == ([0, 1] if nproc == 2 else []), show(p)
    assert p.stderr.count("has not joined") == len(named), show(p)


JOINS = """\
import os, subprocess, sys, time
from pathlib import Path
JOIN = '''
import sys, time
from pathlib import Path
import torch.distributed as dist
dist.init_process_group("gloo")
while not Path(sys.argv[1]).exists():
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
'''
if os.environ["RANK"] == "1":     # rank 1 joins from a process of its own: the script's tree counts
    sys.exit(subprocess.run([sys.executable, "-c", JOIN, sys.argv[1]]).returncode)
exec(JOIN)
"""


@pytest.mark.procs
def test_a_script_that_joined_is_seen_joined_and_never_named(tmp_path):
    """Each rank's supervisor sees the connection to MASTER_PORT (rank 0's store listens there,
    rank 1's child connects), says so at DEBUG, and from then on never names the rank."""
    script, release, rd = tmp_path / "joins.py", tmp_path / "release", tmp_path / "run"
    script.write_text(JOINS)
    p = start("run", "--script", script, "--nproc", "2", "--run-dir", rd, "--set", "log.level=DEBUG", "--", release,
              env=clean_env(HPC_TRAIN_JOIN_WARN_S="60"))
    try:
        for r in (0, 1):
            log = rd / "logs" / f"rank-{r}.log"
            _wait_for(lambda: log.exists() and f"rank {r} joined the process group at 127.0.0.1:" in log.read_text(),
                      120, f"rank {r} seen joined", p)
    finally:
        release.touch()
    q = _finish(p)
    assert q.returncode == 0, show(q)
    assert "has not joined" not in q.stderr, show(q)


# -- 33.1: the job's signal reaches an unmodified script as SIGTERM ---------------------------

SAVES_ON_SIGTERM = """\
import json, os, signal, sys, time
rank, out = os.environ["RANK"], sys.argv[1]
stop, got = False, []
def on_term(signum, frame):
    global stop
    stop = True
signal.signal(signal.SIGTERM, on_term)
if rank in sys.argv[2:]:      # this rank's script handles the job's signal itself
    signal.signal(signal.SIGUSR2, lambda signum, frame: got.append("SIGUSR2"))
at_start = signal.getsignal(signal.SIGUSR2)
print("SIGUSR2 at start:", "ignored" if at_start == signal.SIG_IGN else "default" if at_start == signal.SIG_DFL
      else "handled", flush=True)
open(f"{out}/ready-{rank}", "w").close()
step = 0
while not stop:
    step += 1
    time.sleep(0.01)
with open(f"{out}/snap-{rank}.json", "w") as f:
    json.dump({"step": step, "got": got}, f)
print("saved at step", step, flush=True)
"""


def _stop_with_the_job_signal(tmp_path: Path, *sets: str, handles: str = "") -> tuple[subprocess.CompletedProcess, Path]:
    """`run --script` on 2 ranks, then SIGUSR2 (job.signal) to every process of each task, as
    Slurm sends it at a preemption or ahead of the time limit."""
    script, rd = tmp_path / "train.py", tmp_path / "run"
    script.write_text(SAVES_ON_SIGTERM)
    p = start("run", "--script", script, "--nproc", "2", "--run-dir", rd, *(x for s in sets for x in ("--set", s)),
              "--", tmp_path, *([handles] if handles else []))
    for r in (0, 1):
        _wait_for(lambda: (tmp_path / f"ready-{r}").exists(), 60, f"rank {r}'s script", p)
    for r in (0, 1):
        worker = json.loads((rd / "logs" / ".heartbeat" / f"rank-{r}").read_text())["pid"]
        os.killpg(worker, signal.SIGUSR2)     # the worker leads its process group; its script is in it
    return _finish(p), rd


def test_the_job_signal_reaches_an_unmodified_script_as_sigterm(tmp_path):
    """Rank 0's script knows nothing of SIGUSR2: it is not killed by it, and saves on the SIGTERM
    that follows. Rank 1's script handles SIGUSR2 itself: it still gets it, and the SIGTERM."""
    q, rd = _stop_with_the_job_signal(tmp_path, handles="1")
    assert q.returncode == EXIT_STOPPED, show(q)       # a stop, not a failure
    assert "killed by SIGUSR2" not in q.stderr, show(q)
    assert json.loads((tmp_path / "snap-0.json").read_text())["got"] == []
    assert json.loads((tmp_path / "snap-1.json").read_text())["got"] == ["SIGUSR2"]
    for r, at_start in ((0, "ignored"), (1, "handled")):
        log = (rd / "logs" / f"rank-{r}.log").read_text()
        assert f"SIGUSR2 at start: {at_start}" in log and "saved at step" in log, log
        assert "SIGUSR2 received: passing SIGTERM to the script" in log, log
    assert json.loads((rd / "stopped.json").read_text())["stop_signal"] == "USR2"


def test_passthrough_leaves_the_job_signal_to_the_script(tmp_path):
    """`train.script_signal: passthrough`: the script starts with the signal's default action, so
    an unmodified one dies of it (the user asked for the scheduler's signal as it comes)."""
    q, rd = _stop_with_the_job_signal(tmp_path, "train.script_signal=passthrough")
    assert q.returncode == EXIT_STOPPED, show(q)
    assert not list(tmp_path.glob("snap-*.json"))
    for r in (0, 1):
        log = (rd / "logs" / f"rank-{r}.log").read_text()
        assert "SIGUSR2 at start: default" in log and "the script stopped (SIGUSR2; it was killed by SIGUSR2)" in log, log


def test_a_bad_script_signal_is_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    one_line_exit2(hpc("run", "--script", script, "--run-dir", tmp_path / "run", "--set", "train.script_signal=ignore"),
                   "train.script_signal must be one of term, passthrough", "'ignore'")
    assert not (tmp_path / "run").exists()


def test_a_stop_that_came_before_the_script_started_does_not_start_it(tmp_path, monkeypatch, caplog):
    """The job's signal reached the worker while it was still starting (a time limit's signal
    on a slow start): a script started then could only be killed before it had a handler of its
    own, so it is not started. The stop is recorded as any stop the script never saw. The stop
    is asked for through StopRequest's public request(), which records it as the worker's
    handler records a signal; no fault is faked."""
    from hpc_train import config
    from hpc_train.launch.supervise import supervise
    from hpc_train.node import beats, environment
    from hpc_train.node.stops import StopRequest
    for k in [k for k in os.environ if k.startswith("SLURM_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")]:
        monkeypatch.delenv(k)
    script, rd = tmp_path / "train.py", tmp_path / "run"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    cfg = config.load(None, [f"train.script={script}"])
    (rd / "logs" / ".heartbeat").mkdir(parents=True)     # what the worker's session makes first
    stop = StopRequest()
    stop.request(signal.SIGUSR2)
    caplog.set_level("INFO", logger="hpc_train")
    out = supervise(cfg.train, cfg.job, cfg.dist.timeout_s, environment.current(), rd, stop, beats.FileBeats(rd, -1))
    assert out == {"stopped": True, "exit_code": None}
    assert not (tmp_path / "started").exists()
    rec = json.loads((rd / "stopped.json").read_text())
    assert rec["stop_signal"] == "USR2" and rec["checkpoint"] is False and rec["steps"] is None, rec
    assert "SIGUSR2 came before the script started: not starting it" in caplog.text


@pytest.mark.procs
def test_a_script_that_exits_3_by_itself_is_that_rank_s_failure(tmp_path):
    """Exit code 3 is also what a script on ``init()`` exits with after a stop (errors.EXIT_STOPPED),
    but a user's script may exit 3 for its own reasons. The supervisor reads the outcome from the
    records, not from the code: with no stop record of this launch, rank 1's exit 3 is rank 1's
    failure, named with its last lines, not a stop; rank 0 (which the launcher then stops) is not
    blamed (issue 48.2)."""
    script = tmp_path / "three.py"
    script.write_text("import os, sys, time\nprint('rank', os.environ['RANK'], 'working', flush=True)\n"
                      "if os.environ['RANK'] == '1':\n    print('giving up: exit 3', flush=True)\n    sys.exit(3)\n"
                      "time.sleep(60)\n")
    rd = tmp_path / "run"
    p = hpc("run", "--script", script, "--nproc", "2", "--run-dir", rd)
    assert p.returncode == 1, show(p)
    assert "worker rank 1 failed" in p.stderr and "exited with code 3" in p.stderr, show(p)
    assert "giving up: exit 3" in p.stderr, show(p)
    assert "worker rank 0 failed" not in p.stderr and "[rank 1]" not in _lines_with(p.stderr, "the script stopped")
    assert not (rd / "result.json").exists()


def _lines_with(text: str, what: str) -> str:
    return "\n".join(line for line in text.splitlines() if what in line)


# -- issue 51: what a script prints is in its rank's log, whatever it starts with ------------

@pytest.mark.parametrize("line, own", [
    (b"[rank 0] 12:04:05 INFO process group ready\n", True), (b"[rank 13] 00:00:00 WARNING x\n", True),
    (b"[rank 0] epoch 1 done\n", False), (b"[rank 0]\n", False), (b"[rank: 0] Seed set to 3\n", False),
    (b"[rank 0] 12:04 INFO x\n", False), (b"x [rank 0] 12:04:05 INFO x\n", False), (b"\xff\xfe\n", False),
])
def test_hpc_train_s_own_line_is_told_from_the_script_s(line, own):
    from hpc_train import logs
    assert logs.own_line(line) is own


PRINTS_RANK = """\
import os
r = os.environ["RANK"]
print(f"[rank {r}] epoch 1 done", flush=True)
print(f"plain line of rank {r}", flush=True)
"""


@pytest.mark.procs
def test_a_line_the_script_prints_with_a_rank_prefix_is_in_its_log(tmp_path):
    """A script's own "[rank N] ..." lines reached the console but were dropped from
    logs/rank-N.log (the supervisor took them for hpc_train's own, which its handler writes)."""
    script = tmp_path / "prints.py"
    script.write_text(PRINTS_RANK)
    rd = tmp_path / "run"
    p = hpc("run", "--script", script, "--nproc", "2", "--run-dir", rd)
    assert p.returncode == 0, show(p)
    for r in (0, 1):
        log = (rd / "logs" / f"rank-{r}.log").read_text()
        assert log.count(f"[rank {r}] epoch 1 done\n") == 1 and f"plain line of rank {r}\n" in log, log
        own = [ln for ln in log.splitlines() if re.match(rf"\[rank {r}\] \d\d:\d\d:\d\d [A-Z]+ ", ln)]
        assert len(own) == len(set(own)), log     # hpc_train's own lines once each
        lg = hpc("logs", rd, "--rank", str(r))
        assert f"[rank {r}] epoch 1 done" in lg.stdout, show(lg)


def test_a_signal_ends_the_supervisor_s_wait_at_once(monkeypatch):
    """Issue 51: a plain script's clean stop printed gloo's "Connection reset by peer" traceback
    from a rank whose supervisor passed the SIGTERM on at its next poll (up to 0.2 s after its
    peer's). A signal now wakes the wait, so each supervisor passes the stop on as it comes.
    With the poll made a minute long, the wait still ends right after the signal."""
    import threading
    from hpc_train.launch import supervise
    monkeypatch.setattr(supervise, "POLL_S", 60.0)
    got: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    wake = supervise._signal_wakeup()
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        t0 = time.monotonic()
        supervise._sleep_unless_exit(None, wake)
        took = time.monotonic() - t0
    finally:
        supervise._close_wakeup(wake)
        signal.signal(signal.SIGUSR1, old)
    assert got == [1] and took < 30, took
