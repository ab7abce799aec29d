"""Issue 29.3: what ``status`` says became of a local run, decided from what the run directory
holds (:func:`hpc_train.login.outcome.decide`, a pure function), as a table of the precedences:
a live run, a finished one, a failure (and which rank caused it), a save killed before its
commit record, a stop, ranks killed without a word; and which launch each record belongs to.
The same states on real runs, with the reruns that check them: tests/login/test_status.py."""

from __future__ import annotations

import pytest

from hpc_train.login.outcome import Facts, RankError, decide
from hpc_train.records.stop import StopRecord

# ------------------------------------------------------------------
T = 1000.0     # the last launch began here
ERR1 = RankError(1, T + 5, "RuntimeError: boom")
LOST0 = RankError(0, T + 4, "lost a peer: rank 1 (pid 7 on vm) exited (Connection closed by peer)")
COMMITTED = StopRecord(4, "SIGTERM", T + 2, True, T + 3)
NOTHING_SAVED = StopRecord(None, "SIGTERM", T + 6, False)

ROWS = {
    # a live run is running, whatever else is there
    "lock held": (Facts(holder="pid 3", finished=True, launch=T, errors=(ERR1,)), "running", "running: pid 3"),
    # a finished run is finished: nothing trains it again
    "result.json beats an error": (Facts(finished=True, finished_step=8, launch=T, errors=(ERR1,)), "finished",
                                   "finished at step 8"),
    # the case: rank 1 failed, then the launcher's SIGTERM made rank 0 record a stop
    "a stop recorded after the failure": (Facts(stop=NOTHING_SAVED, stop_written=T + 6, launch=T, world=2,
                                                errors=(ERR1,)), "failed", "failed: rank 1: RuntimeError: boom"),
    "a stop of an earlier launch, then a failure": (Facts(stop=COMMITTED, stop_written=T - 30, launch=T, world=2,
                                                          errors=(ERR1,)), "failed", "failed: rank 1: RuntimeError"),
    "a stop committed, then a rank failed": (Facts(stop=COMMITTED, stop_written=T + 3, launch=T, world=2,
                                                   errors=(ERR1,)), "stopped",
                                             "stopped at step 4 by SIGTERM, checkpoint committed; then failed: rank 1: "),
    "an error from before the launch is not this launch's": (
        Facts(stop=COMMITTED, stop_written=T + 3, launch=T, world=2, errors=(RankError(1, T - 50, "old"),)),
        "stopped", "stopped at step 4 by SIGTERM, checkpoint committed"),
    # the cause, not the victim: a rank killed without a word, or one whose error is not a lost peer
    "a victim and a rank killed without a word": (Facts(launch=T, world=2, errors=(LOST0,), silent=(1,)), "failed",
                                                  "failed: rank 1 ended without a word"),
    "a victim's error written before the cause's": (Facts(launch=T, world=2, errors=(LOST0, ERR1)), "failed",
                                                    "failed: rank 1: RuntimeError: boom"),
    "only a victim's error": (Facts(launch=T, world=2, errors=(LOST0,)), "failed", "failed: rank 0: lost a peer"),
    "one rank killed, the other ended": (Facts(launch=T, world=2, silent=(0,)), "failed", "failed: rank 0 ended"),
    # a save killed before its commit record
    "an incomplete save of this launch": (Facts(launch=T, world=2, silent=(0, 1), unsaved=(5, T + 8)), "aborted",
                                          "aborted during the save of step 5"),
    "an incomplete save beside an earlier stop record": (Facts(stop=COMMITTED, stop_written=T - 30, launch=T, world=2,
                                                               silent=(0, 1), unsaved=(5, T + 8)), "aborted",
                                                         "aborted during the save of step 5"),
    "a failed save is a failure": (Facts(launch=T, world=2, errors=(ERR1,), unsaved=(5, T + 4)), "failed",
                                   "failed: rank 1"),
    "an incomplete save of an earlier launch": (Facts(stop=COMMITTED, stop_written=T + 3, launch=T, world=2,
                                                      unsaved=(5, T - 40)), "stopped", "stopped at step 4"),
    # stops
    "a script's stop: nothing saved": (Facts(stop=NOTHING_SAVED, stop_written=T + 6, launch=T, world=2), "stopped",
                                       "stopped by SIGTERM; hpc_train saved nothing"),
    "checkpoints off": (Facts(stop=StopRecord(6, "SIGUSR2", T, False), stop_written=T + 1, launch=T), "stopped",
                        "stopped at step 6 by SIGUSR2; checkpoints are off: nothing saved"),
    "an unreadable stop record": (Facts(stop_unreadable=True, stop_written=T + 1, launch=T), "stopped",
                                  "stopped (its record is unreadable)"),
    "no rank records: every record counts": (Facts(stop=COMMITTED, stop_written=T + 3), "stopped", "stopped at step 4"),
    # killed from outside, or nothing said
    "every rank killed": (Facts(stop=COMMITTED, stop_written=T - 30, launch=T, world=2, silent=(0, 1)), "killed",
                          "killed: every rank ended without a word"),
    "ended, nothing said": (Facts(launch=T, world=2), "ended", "ended without a result"),
    "never ran": (Facts(), "new", "not started"),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_the_state_is_decided_from_the_records(name):
    facts, kind, line = ROWS[name]
    state = decide(facts)
    assert (state.kind, state.line[:len(line)]) == (kind, line), state
