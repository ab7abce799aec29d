"""benchmarks/reps.py: a repetition that really crashes (SIGABRT) is reported and counted, the
others go on, and the summary says what every figure rests on (issue 22.5)."""

from __future__ import annotations

import io
import sys

from benchmarks.reps import Reps, run_checked

PY = sys.executable
OK = [PY, "-c", "print('fine')"]
# What the hand-written baseline did: a C++ runtime's message on stderr, then abort() (SIGABRT).
CRASH = [PY, "-c", "import os, sys; sys.stderr.write('terminate called without an active exception\\n'); "
         "sys.stderr.flush(); os.abort()"]


def test_crash_is_reported_and_the_rest_goes_on():
    out = io.StringIO()
    reps = Reps(out)
    for rep in (1, 2, 3):
        reps.run("steady", rep, lambda rep=rep: (run_checked(OK, capture_output=True), float(rep))[1])
        crash_argv = CRASH if rep == 2 else OK
        reps.run("hand", rep, lambda argv=crash_argv, rep=rep: (run_checked(argv, what="hand", capture_output=True),
                                                                 10.0 * rep)[1])
        reps.run("dead", rep, lambda: run_checked(CRASH, what="dead"))
    text = out.getvalue()
    # The crash: which variant, which repetition, the signal, the last lines of its stderr.
    assert "rep 2: hand FAILED: hand: killed by SIGABRT" in text
    assert "| terminate called without an active exception" in text
    assert [f.rep for f in reps.failures if f.variant == "hand"] == [2]
    # Every repetition after the crash still ran.
    assert reps.values("hand") == [10.0, 30.0]
    assert reps.values("steady") == [1.0, 2.0, 3.0]
    # The summary's counts.
    assert reps.basis("steady") == "median of 3"
    assert reps.basis("hand") == "median of 2 (1 failed)"
    assert reps.figure("hand") == "20.0 (median of 2, 1 failed)"
    assert reps.basis("dead") == "no successful repetition (3 failed)"
    assert reps.figure("dead") == "no successful repetition (3 failed)"
    assert reps.median("dead") is None
    # One line at the end and a non-zero status.
    status = reps.finish()
    last = out.getvalue().splitlines()[-1]
    assert status == 1
    assert last.startswith("4 of 9 repetitions FAILED: ")
    assert "hand rep 2 (hand: killed by SIGABRT)" in last and "dead rep 3 (dead: killed by SIGABRT)" in last


def test_exception_reading_results_is_a_failed_rep_and_all_ok_exits_zero():
    out = io.StringIO()
    reps = Reps(out)
    reps.run("a", 1, lambda: {}["stamps"])        # a run whose results file lacks what is read
    assert "rep 1: a FAILED: KeyError: 'stamps'" in out.getvalue()
    ok = Reps(io.StringIO())
    ok.run("a", 1, lambda: 1.0)
    assert ok.finish() == 0 and ok.summary() == "all 1 repetitions succeeded"


# A rank of an mp.spawn'd set that aborts for real, as benchmarks/checkpoint.py's ranks might: its
# stderr goes to a file the way checkpoint.py's _worker sends it, and the crash report names the
# rank, the signal and the file's last lines.
SPAWN_SCRIPT = '''
import json, os, sys
from pathlib import Path
import torch.multiprocessing as mp

def worker(rank, d):
    err = os.open(Path(d) / f"rank-{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    if rank == 1:
        os.write(2, b"terminate called without an active exception\\n")
        os.abort()

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[2])
    from benchmarks.checkpoint import _crash_report
    try:
        mp.spawn(worker, args=(sys.argv[1],), nprocs=2, join=True)
        print(json.dumps(None))
    except Exception as e:
        print(json.dumps(_crash_report(e, Path(sys.argv[1]), 2)))
'''


def test_checkpoint_crash_report_names_rank_signal_and_stderr(tmp_path):
    import json
    import subprocess
    from pathlib import Path

    script = tmp_path / "spawn_abort.py"
    script.write_text(SPAWN_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([PY, str(script), str(tmp_path), str(root)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    reason, err = json.loads(r.stdout.splitlines()[-1])
    assert reason == "rank 1: killed by SIGABRT"
    assert "[rank 1]" in err and "terminate called without an active exception" in err
