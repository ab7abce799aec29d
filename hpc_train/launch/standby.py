"""A standby task (``job.standby``): the next job step's process, started beside the running one,
with Python, torch and what a restart imports already loaded, waiting to become the next step.

A restart in place (:mod:`hpc_train.login.hook`) otherwise starts a new srun whose every task
starts an interpreter, imports torch and, under DDP, ``torch._dynamo`` before its process group
is up: most of the time from a failure to the first step again. The batch shell
(:class:`hpc_train.login.batch.Loop`) starts each step's srun line a second time, with
``--overlap`` and :data:`~hpc_train.rundir.STANDBY_ENV` set, its standard input a FIFO the shell
holds. Each of those tasks enters :func:`await_go` at the top of the worker: it imports, then
waits. When the step fails and the hook restarts it on the same nodes, the shell writes one line,
``go ATTEMPT RESUME``, which srun hands to every task: each sets ``HPC_TRAIN_ATTEMPT`` and
``HPC_TRAIN_RESUME`` from it and goes on as the step's worker, as a freshly started one would
(same ranks: the same srun line on the same nodes). A restart on other nodes (a spare), the
job's end and a shell that closes the FIFO dismiss it: it reads end-of-file and exits 0 without
a result (submitit writes none).

Before the go, the job's signals do not concern it: its time-limit signal (USR1/USR2) is
ignored, SIGTERM and SIGINT end it as they end any process (not submitit's handlers); after the go, the handlers it had are back, and the
worker installs the job's own, as in any task. The goodput ledger counts the process's start-up
from the go (its ``process`` mark), not from when it was started in advance.
"""

from __future__ import annotations

import importlib
import os
import re
import select
import signal
import sys
import time
from typing import Any

from hpc_train import goodput, rundir, threads

# What a restarted task would import before its first step: torch, DCP (its restore), and, under
# DDP, torch._dynamo (DDP's constructor reads a mode of it: the longest import of a start-up).
_ALWAYS = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.nn.parallel")
_DDP = ("torch._dynamo",)
HOLD_S = 3.0
# go ATTEMPT RESUME [LOCAL]: the shell sends no resume value with a space; LOCAL: the hook's
# node-local step, or "-" (none)
_GO = re.compile(r"go ([0-9]{1,9}) ([^\s]{1,4096})(?: ([0-9]{1,18}|-))?")


def active() -> bool:
    return os.environ.get(rundir.STANDBY_ENV) == "1"


def await_go(cfg: Any) -> float:
    """In a standby task: import, then wait for the go and take the step's settings from it;
    returns how long this process waited, from its start. Returns only with a go: end-of-file
    (a dismissal) ends the process with exit 0, a line that is not a go with exit 1, SIGTERM
    and SIGINT as they end any process."""
    os.environ.pop(rundir.STANDBY_ENV, None)   # not inherited by anything this process starts
    started = goodput.own_start_time()
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    for s in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_IGN)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)   # not submitit's handlers: a job that ends ends it
    # Not at once: a standby starts with its step (the job's first, or a restart), and its imports
    # would take CPU from that step's own start-up on a node with few cores. A go within the
    # hold is taken at once (the imports then follow it, as in any new process).
    try:
        early = bool(select.select([0], [], [], HOLD_S)[0])
    except (OSError, ValueError):   # no standard input: read below as an end-of-file
        early = True
    if not early and not cfg.train.script:   # a script's supervisor imports no torch
        threads.apply(os.environ, cfg.dist.threads_per_rank)   # before torch, as the worker does
        for name in (*_ALWAYS, *(_DDP if cfg.dist.strategy == "ddp" else ())):
            importlib.import_module(name)
    line = _read_line()
    if not line:
        _leave(0)
    m = _GO.fullmatch(line.strip())
    if m is None:
        print(f"hpc_train standby: not a go line ({line[:80]!r}); leaving", file=sys.stderr, flush=True)
        _leave(1)
    now = time.time()
    goodput.began_at(now)
    os.environ[rundir.ATTEMPT_ENV], os.environ[rundir.RESUME_ENV] = m.group(1), m.group(2)
    os.environ[rundir.LOCAL_STEP_ENV] = m.group(3) if m.group(3) not in (None, "-") else ""
    for s, h in saved.items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)
    return now - started


def _read_line() -> str:
    """One line of standard input ('' at end-of-file), read byte by byte from the descriptor so
    nothing past it is taken from the stream the worker may still read."""
    out = bytearray()
    while True:
        try:
            b = os.read(0, 1)
        except InterruptedError:
            continue
        except OSError:     # no standard input at all
            return ""
        if not b:
            return ""
        if b == b"\n":
            return out.decode("utf-8", "replace")
        out += b
        if len(out) > 8192:
            return out.decode("utf-8", "replace")


def _leave(code: int) -> None:
    """Without the interpreter's teardown, and without a result for submitit to write."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
