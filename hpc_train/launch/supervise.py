"""A script (``train.script``) on one task: run it in a child process and own its stops.

Every launcher's worker for a script is this supervisor, not the script itself, so the same
rules hold whether or not the script knows hpc_train:

* the child gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and
  ``HPC_TRAIN_CONFIG``/``HPC_TRAIN_RUN_DIR`` for its ``hpc_train.init()``; it creates its own
  process group (an ``init_process_group`` of its own is fine: nothing here made one);
* its stdout and stderr go to the console and to ``logs/rank-R.log``;
* it gets ``OMP_NUM_THREADS`` from ``dist.threads_per_rank`` (set by the worker: :mod:`hpc_train.threads`);
* a stop signal is recorded here and passed on as SIGTERM (what torchrun sends its workers).
  A script that uses ``Run`` saves at its next step boundary and exits; one that knows nothing
  of hpc_train ends as SIGTERM ends it. Either way the stop is a clean exit of this task, and
  rank 0 asks for the requeue: the script resumes from whatever it saved;
* the job's signal (``job.signal``), which Slurm sends to every process of the step, is ignored
  by the script from its start (``train.script_signal: term``; a disposition that survives exec):
  an unmodified script would die of it at once, before the SIGTERM it can save on. A script that
  installs a handler for it (``hpc_train.init()`` does) gets it, and the stop counts once;
  ``passthrough`` leaves the signal's default action to the script;
* a script that has not joined its process group by its first minute is named
  (:mod:`hpc_train.launch.joined`);
* a script that exits non-zero fails the task, with the rank, the host and its last lines;
* the run is finished (``result.json``, by rank 0) only once every rank's script exited 0;
* the script dies with its supervisor, and its output is drained to the log whatever becomes
  of the console.

No torch here: the supervisor adds a process per task, and should add nothing else.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from hpc_train import logs, rundir
from hpc_train.config import JobSection, TrainSection
from hpc_train.launch import framework_check, joined
from hpc_train.node import environment, liveness, watchdog
from hpc_train.node.environment import NodeEnv
from hpc_train.node import beats as beats_mod
from hpc_train.node.stops import StopRequest
from hpc_train.records import result

from hpc_train.errors import EXIT_STOPPED, ScriptFailed, signal_name

log = logging.getLogger("hpc_train")
TAIL_LINES = 15
# The supervisor shares its node's cores with the ranks: it wakes only as often as a stop must be
# passed on (a fraction of a second of Slurm's lead time) and looks under the script now and then.
POLL_S = 0.2
LOOK_EVERY_S = 5.0


def _tee(src: IO[bytes], console: IO[bytes], logfile: IO[bytes], tail: collections.deque, lock: threading.Lock,
         on_line=None) -> None:
    """Copy the script's output to the console and the rank's log, until the script closes it.
    The draining never stops while the script runs: a script whose pipe fills blocks for good."""
    for line in iter(src.readline, b""):
        if console is not None:
            try:
                console.write(line)
                console.flush()
            except (OSError, ValueError):
                # The console went away (`run ... | head`: a BrokenPipeError). Its fd now leads to
                # /dev/null, so this process's own later flushes cannot fail either; the log keeps it all.
                _drop(console)
                console = None
        # hpc_train's own log lines in the child reach the file through its own handler;
        # everything else the script prints is written here (a line of its own that starts
        # with "[rank 0]" too).
        if not logs.own_line(line):
            with lock:
                logfile.write(line)
                logfile.flush()
        text = line.decode(errors="replace").rstrip("\n")
        tail.append(text)
        if on_line is not None:
            with lock:
                on_line(text)
    src.close()


def _drop(console: IO[bytes]) -> None:
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, console.fileno())
        os.close(null)
    except (OSError, ValueError):
        pass


def supervise(train: TrainSection, job: JobSection, timeout_s: float, env: NodeEnv, rd: Path,
              stop: StopRequest, beats: Any) -> dict[str, Any]:
    """Run ``train.script`` with ``train.args`` on this task, its output to the console and the
    rank's log; a stop reaches it as SIGTERM. ``job``: its signal and the grace a stop gives;
    ``timeout_s``: how long a silent rank may take before it counts as gone. The run directory's
    lock, a finished run and the heartbeat are the lifecycle's (:mod:`hpc_train.node.session`);
    ``beats``: that heartbeat, which rank 0 reads for its peers at the end."""
    script = Path(train.script)
    environment.log_placement(env)
    started = time.time()
    if stop.requested:
        # The stop came while this process was starting: a script started now could only be
        # killed before it had its own SIGTERM handler, so it is not started at all.
        stop.ignore_further()
        return _stopped(env, rd, stop, started, None, f"{stop.name} came before the script started: "
                                                           f"not starting it")
    cmd = [sys.executable, "-u", str(script), *train.args]
    log.info("running %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_child_setup(job.signal, train.script_signal))
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    lock = threading.Lock()
    framework = framework_check.Watch(env)      # a framework's wrong settings (Lightning's devices...)
    wrong: list[str] = []

    def on_line(text: str) -> None:
        found = framework.line(text)
        if found:
            wrong.append(found)
    logfile = rundir.open_append(rundir.rank_log(rd, env.rank), binary=True)   # never through a symlink
    threads = [threading.Thread(target=_tee, args=(pipe, out, logfile, tail, lock, on_line), daemon=True)
               for pipe, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer))]
    for t in threads:
        t.start()
    forwarded = _watch(proc, job, env, stop, framework, wrong, lock)
    for t in threads:
        t.join(timeout=10)
    logfile.close()
    return _conclude(proc.returncode, forwarded, wrong, list(tail), script, timeout_s, env, rd, stop, started,
                     beats)


def _watch(proc: subprocess.Popen, job: JobSection, env: NodeEnv, stop: StopRequest,
           framework: framework_check.Watch, wrong: list[str], lock: threading.Lock) -> bool:
    """Until the script exits: pass a stop on as SIGTERM (then kill it when the stop's grace is
    over), name a rank that never joins, end the script at once for a framework's wrong setting.
    Returns whether a stop reached the script."""
    watch = joined.JoinWatch(proc.pid, env.rank, env.world_size, env.master_addr, env.master_port,
                             joined.warn_after(os.environ))
    forwarded_at: float | None = None
    started_at = time.monotonic()
    next_look = time.monotonic() + LOOK_EVERY_S
    exit_fd = _exit_fd(proc.pid)
    wake = _signal_wakeup()
    while proc.poll() is None:
        never_joined = watch.poll()
        if never_joined:
            log.warning("%s", never_joined)
        if time.monotonic() >= next_look:
            next_look = time.monotonic() + LOOK_EVERY_S
            found = framework.processes(proc.pid)
            if found:
                with lock:
                    wrong.append(found)
        if wrong:
            # SIGKILL, not SIGTERM: a framework stopped by SIGTERM saves the wrong group's state,
            # which its next start would resume from.
            _kill_tree(proc.pid)
            break
        if stop.requested and forwarded_at is None:
            forwarded_at = time.monotonic()
            log.info("%s received: passing SIGTERM to the script (pid %d, running for %.1f s)", stop.name,
                     proc.pid, forwarded_at - started_at)
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        elif forwarded_at is not None and time.monotonic() - forwarded_at > max(10, job.signal_lead):
            # The grace a stop gives (job.signal_lead: the time before Slurm's limit) is over: a
            # script that hangs in its own stop (a framework's collective with a peer that left)
            # would otherwise keep its rank, and the run, forever.
            log.error("the script did not exit %d s after SIGTERM (job.signal_lead); killing it", job.signal_lead)
            _kill_tree(proc.pid)
            forwarded_at = float("inf")
        _sleep_unless_exit(exit_fd, wake)
    exited_at = time.monotonic()
    if exit_fd is not None:
        os.close(exit_fd)
    _close_wakeup(wake)
    proc.wait()
    # A stop that reached this process before the script exited reached the script as well, or
    # would have: a launcher's SIGTERM goes to the whole process group (torchrun's workers), so
    # the script can save and exit on its own before this loop passes the stop on.
    return forwarded_at is not None or stop.came_before(exited_at)


def _exit_fd(pid: int) -> int | None:
    """A pidfd that becomes readable the moment the script exits (Linux 5.3), so its exit is
    seen at once and told apart from a stop that came just after it; None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _signal_wakeup() -> int | None:
    """The read end of a pipe that each signal this process gets writes a byte to
    (``signal.set_wakeup_fd``), so the watch passes a stop on the moment it comes instead of at
    its next poll: the ranks' scripts then end within a moment of each other, and a peer still in
    a collective is gone before it can print gloo's "Connection reset by peer" traceback. None
    off the main thread (no wakeup fd can be set there): the poll alone then."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:
        os.close(r)
        os.close(w)
        return None
    return r


def _close_wakeup(r: int | None) -> None:
    if r is not None:
        os.close(signal.set_wakeup_fd(-1))
        os.close(r)


def _sleep_unless_exit(exit_fd: int | None, wake: int | None) -> None:
    """Wait up to POLL_S, less when the script exits or a signal comes (its handler has run
    when this returns)."""
    fds = [fd for fd in (exit_fd, wake) if fd is not None]
    if not fds:
        time.sleep(POLL_S)
        return
    ready, _, _ = select.select(fds, [], [], POLL_S)
    if wake in ready:
        try:
            os.read(wake, 512)    # drained: the next wait sleeps again
        except BlockingIOError:
            pass


def _conclude(code: int, forwarded: bool, wrong: list[str], tail: list[str], script: Path,
              timeout_s: float, env: NodeEnv, rd: Path, stop: StopRequest, started: float, beats: Any) -> dict[str, Any]:
    """What the script's exit means for this task: a failure (raised, with its error file), a
    stop (recorded), or its part of a finished run (rank 0 writes result.json once every rank's
    script finished)."""
    if wrong:
        _fail(rd, env, f"rank {env.rank}: {wrong[0]}")
    stop.ignore_further()
    # A stop that came after the script's own Run finished (its result.json) only cut short what
    # the script did after finish(), or its exit; one that came once the script had ended by
    # itself never reached it. The script finished either way: no stop to record.
    finished = result.written_since(rd, started)
    late = stop.requested and (finished or (code == 0 and not forwarded))
    if late:
        log.info("%s came after the script finished: not a stop", stop.name)
    # The script's own Run recorded a stop (a signal only it got, run.request_stop()) and exited
    # with the stopped code: that is a stop too, not a failure.
    own_stop = code == EXIT_STOPPED and _stop_recorded_since(rd, started, wait_s=10.0)
    if (stop.requested and not late) or own_stop:
        return _stopped(env, rd, stop, started, code, f"the script stopped ({stop.name}; it {_how(code)})")
    if code != 0 and not (late and finished):
        from hpc_train.records.ranks import error_line, node_name
        last = "\n".join(f"    {line}" for line in tail) or "    (no output)"
        # The script's own init() recorded what it raised: that is the cause, said first.
        own = error_line(rd, env.rank, started)
        cause = f"{own} ({script} {_how(code)})" if own else f"{script} {_how(code)}"
        _fail(rd, env, f"rank {env.rank} on {node_name()}: {cause}; its last lines:\n{last}")
    watchdog.say_ended(rd, env.rank, "finished")
    # The run is finished when every rank's script is: rank 0 writes result.json only then. Were
    # it written when rank 0's own script ended, a rank failing later would leave a failed run
    # marked finished, and every rerun and requeue would do nothing.
    if env.rank == 0 and _all_finished(timeout_s, env, rd, stop, beats) and not result.finished(rd):
        result.write(rd, {"script": str(script), "exit_code": 0, "world_size": env.world_size,
                          "wall_seconds": time.time() - started})
    return {"stopped": False, "exit_code": 0}


def _stopped(env: NodeEnv, rd: Path, stop: StopRequest, started: float, code: int | None,
             line: str) -> dict[str, Any]:
    """This task ended at a stop: recorded (unless the script's own Run recorded it: a stop the
    script never saw has hpc_train's record), said in ``line``, and this rank's end said."""
    from hpc_train.node.stops import record_stop
    if stop.requested and not _stop_recorded_since(rd, started):
        record_stop(env, rd, stop, step=None, checkpoint=False)
    log.info("%s", line)
    watchdog.say_ended(rd, env.rank, "stopped")
    return {"stopped": True, "exit_code": code}


def _fail(rd: Path, env: NodeEnv, msg: str) -> None:
    """This task failed: its error file (what the launcher and the hook show), its log, raised."""
    rundir.write_atomic(rundir.rank_error(rd, env.rank), msg + "\n")
    log.error("%s", msg)
    raise ScriptFailed(msg)


def _kill_tree(pid: int) -> None:
    """SIGKILL the script and every process below it (processes it started, such as ranks of
    its own, do not die with it)."""
    for p in [*joined.descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _child_setup(job_signal: str, script_signal: str):
    """The script's ``preexec_fn``: it dies with this process (nothing of a run outlives its
    supervisor), and, unless ``passthrough``, starts with the job's signal ignored. Never SIGTERM
    (``job.signal: TERM``): that is the stop the script gets."""
    die = watchdog.die_with_parent()
    sig = getattr(signal, f"SIG{job_signal}")
    ignore = script_signal != "passthrough" and sig != signal.SIGTERM

    def setup() -> None:
        if ignore:
            signal.signal(sig, signal.SIG_IGN)   # in the child, before exec: SIG_IGN survives it
        if die is not None:
            die()
    return setup


def _stop_recorded_since(rd: Path, since: float, wait_s: float = 0.0) -> bool:
    """A stop record with a checkpoint, written since ``since`` (by the script's own Run; only its
    rank 0 writes it, so another rank's supervisor may wait for it a moment)."""
    from hpc_train.records import stop
    deadline = time.time() + wait_s
    while True:
        rec, _ = stop.written_since(rd, since)
        if rec is not None and rec.checkpoint:
            return True
        if time.time() >= deadline:
            return False
        time.sleep(0.1)


def _all_finished(timeout_s: float, env: NodeEnv, rd: Path, stop: StopRequest, reader: Any) -> bool:
    """Rank 0, its own script done: wait until every rank said how its script ended; True when
    all finished. A rank that fails ends this wait from outside (the local launcher's SIGTERM,
    ``srun --kill-on-bad-exit``); one that goes silent, its heartbeat stale, fails it here."""
    since = time.time()
    limit = liveness.heartbeat_limit(timeout_s)
    logged = False
    while True:
        ends = {r: watchdog.ended(rd, r) for r in range(env.world_size)}
        waiting = [r for r, how in ends.items() if how is None]
        if not waiting:
            return all(how == "finished" for how in ends.values())
        if stop.requested:
            return False
        if not logged:
            log.info("waiting for rank(s) %s to finish before marking the run finished", waiting)
            logged = True
        gone = beats_mod.stale(reader, waiting, limit, since)
        if gone is not None:
            host, pid = watchdog.holder(rd, gone[0])
            msg = (f"rank {gone[0]} (pid {pid} on {host}) left without finishing: its script never said it ended, "
                   f"and it has not beaten for {gone[1]:.0f}s")
            rundir.write_atomic(rundir.rank_error(rd, env.rank), msg + "\n")
            raise ScriptFailed(msg)
        time.sleep(0.1)


def _how(code: int) -> str:
    return f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
