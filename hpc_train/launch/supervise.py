"""A script (``train.script``) on one task: run it in a child process and own its stops.

Every launcher's worker for a script is this supervisor, not the script itself, so the same
rules hold whether or not the script knows hpc_train:

* the child gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and
  ``HPC_TRAIN_CONFIG``/``HPC_TRAIN_RUN_DIR`` for its ``hpc_train.init()``; it creates its own
  process group (an ``init_process_group`` of its own is fine: nothing here made one);
* its stdout and stderr go to the console and to ``logs/rank-R.log``;
* a stop signal is recorded here and passed on as SIGTERM (what torchrun sends its workers).
  A script that uses ``Run`` saves at its next step boundary and exits; one that knows nothing
  of hpc_train ends as SIGTERM ends it. Either way the stop is a clean exit of this task, and
  rank 0 asks for the requeue: the script resumes from whatever it saved;
* a script that exits non-zero fails the task, with the rank, the host and its last lines.

No torch here: the supervisor adds a process per task, and should add nothing else.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from hpc_train import rundir
from hpc_train.config import Config
from hpc_train.node import environment
from hpc_train.node.environment import NodeEnv
from hpc_train.node.stops import StopRequest

from hpc_train.errors import ScriptFailed

log = logging.getLogger("hpc_train")
TAIL_LINES = 15


def _tee(src: IO[bytes], console: IO[bytes], logfile: IO[bytes], tail: collections.deque, lock: threading.Lock) -> None:
    for line in iter(src.readline, b""):
        console.write(line)
        console.flush()
        # hpc_train's own log lines in the child ("[rank R] ...") reach the file through its
        # own handler; everything else the script prints is written here.
        if not line.startswith(b"[rank "):
            with lock:
                logfile.write(line)
                logfile.flush()
        tail.append(line.decode(errors="replace").rstrip("\n"))
    src.close()


def supervise(cfg: Config, env: NodeEnv, rd: Path, stop: StopRequest) -> dict[str, Any]:
    from hpc_train.node.stops import record_stop
    script = Path(cfg.train.script)
    if (rd / rundir.RESULT).exists():
        log.info("%s holds a finished run (result.json); not running %s again", rd, script)
        return rundir.read_json(rd / rundir.RESULT)[0] or {}   # any bytes there: no traceback
    environment.log_placement(env)
    started = time.time()
    cmd = [sys.executable, "-u", str(script), *cfg.train.args]
    log.info("running %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    lock = threading.Lock()
    logfile = rundir.open_append(rundir.rank_log(rd, env.rank), binary=True)   # never through a symlink
    threads = [threading.Thread(target=_tee, args=(pipe, out, logfile, tail, lock), daemon=True)
               for pipe, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer))]
    for t in threads:
        t.start()
    forwarded = False
    while proc.poll() is None:
        if stop.requested and not forwarded:
            forwarded = True
            log.info("%s received: passing SIGTERM to the script (pid %d)", stop.name, proc.pid)
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=10)
    logfile.close()
    code = proc.returncode
    stop.ignore_further()
    if stop.requested:
        stopped = rd / rundir.STOPPED
        handled = stopped.exists() and stopped.stat().st_mtime >= started and \
            (rundir.read_json(stopped)[0] or {}).get("checkpoint")
        if not handled:     # the script never saw the stop through run.step_end
            record_stop(cfg.job, env, rd, stop, step=None, checkpoint=False)
        log.info("the script stopped (%s; it %s)", stop.name, _how(code))
        return {"stopped": True, "exit_code": code}
    if code != 0:
        last = "\n".join(f"    {line}" for line in tail) or "    (no output)"
        msg = (f"rank {env.rank} on {os.uname().nodename}: {script} {_how(code)}; its last lines:\n{last}")
        rundir.write_atomic(rundir.rank_error(rd, env.rank), msg + "\n")
        log.error("%s", msg)
        raise ScriptFailed(msg)
    if env.rank == 0 and not (rd / rundir.RESULT).exists():
        rundir.write_json(rd / rundir.RESULT, {"script": str(script), "exit_code": 0, "world_size": env.world_size,
                                               "wall_seconds": time.time() - started})
    return {"stopped": False, "exit_code": 0}


def _how(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
