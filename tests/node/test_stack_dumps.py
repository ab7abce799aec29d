"""The rank that asks a Slurm job step for its tasks' stacks is itself one of those tasks: from
then on it takes no dump signal. faulthandler's dump of every thread, from a signal handler,
reads the other threads' frames without the GIL, and crashed the asking rank 0 (SIGSEGV) while
its own thread ran the scancel call; the step's error then named rank 0 instead of the rank
that hung. A real process, real signals: its dump signal works until it asks, then a thread
busy in Python beside 300 more dump signals neither crashes it nor writes a dump."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = r"""
import os, sys, threading, time
from pathlib import Path
from hpc_train.node import watchdog
log = Path(sys.argv[1])
watchdog.enable_stack_dumps(log)
os.kill(os.getpid(), watchdog.DUMP_SIGNAL)          # before asking: a dump, as every task writes
time.sleep(0.2)
before = log.read_text().count("most recent call first")
os.environ["PATH"] = "/nonexistent"                 # no scancel here: only this process's own side
watchdog.ask_step_for_stacks("1.0")

def busy():
    while True:
        sorted(str(i) for i in range(50))
threading.Thread(target=busy, daemon=True).start()
for _ in range(300):
    os.kill(os.getpid(), watchdog.DUMP_SIGNAL)
    time.sleep(0.001)
time.sleep(0.2)
print(before, log.read_text().count("most recent call first"))
"""


def test_the_asking_rank_takes_no_dump_signal_after_it_asks(tmp_path):
    log = tmp_path / "rank-0.log"
    p = subprocess.run([sys.executable, "-c", CHILD, str(log)], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr
    before, after = map(int, p.stdout.split())
    assert before >= 1, "the dump signal wrote no stack before the ask"
    assert after == before, "a dump signal after the ask still wrote a stack"


def test_a_program_on_init_writes_its_stack_on_the_dump_signal_and_lives(tmp_path):
    """A hang's stack request reaches every task of a Slurm step, a user's program on ``init()``
    included: it writes its stacks to its stderr and goes on (it died of the signal before, a
    real-time signal's default action, and the frozen rank's stack was never written)."""
    child = ("import os, time, hpc_train\n"
             "from hpc_train.node import watchdog\n"
             f"run = hpc_train.init(run_dir={str(tmp_path / 'run')!r})\n"
             "os.kill(os.getpid(), watchdog.DUMP_SIGNAL)\n"
             "time.sleep(0.2)\n"
             "print('alive')\n")
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0 and p.stdout.strip() == "alive", p.stderr[-2000:]
    assert "most recent call first" in p.stderr, p.stderr[-2000:]
