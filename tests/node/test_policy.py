"""The entry points' exit policy (hpc_train/node/policy.py) as a table, and its invariants.

What differs between a rank's ways in is this table and nowhere else (tests/house/test_layout.py
checks that no module of a rank's life carries a flag of its own). The behaviour each field
steers is tested where it shows: the handlers given back in a user's program and kept by a
worker (tests/node/test_stop_handlers.py), escalation (the same), the pre-launch of a plain
sbatch step (tests/slurm), the resume line (tests/cli/test_run_messages.py)."""

from __future__ import annotations

import dataclasses

import pytest

from hpc_train.advice import FLAGS, VARIABLES
from hpc_train.node.policy import POLICIES, Entry, ExitPolicy, policy

FIELDS = [f.name for f in dataclasses.fields(ExitPolicy)]
# entry: own_process, escalate, advice, prelaunch, owns_group, leaving, restore_at_finish,
#        handlers_back, resume_hint, beats_itself
TABLE = {
    Entry.TRAINER:    (True,  True,  FLAGS,     False, True,  True,  False, False, False, False),
    Entry.CODE:       (True,  True,  FLAGS,     False, True,  True,  True,  False, False, False),
    Entry.SUPERVISOR: (True,  False, FLAGS,     False, False, True,  True,  False, False, True),
    Entry.PROGRAM:    (False, True,  VARIABLES, True,  True,  False, True,  True,  True,  False),
    Entry.SCRIPT:     (False, True,  FLAGS,     False, True,  False, True,  True,  False, False),
}


def test_the_table_names_every_field_in_order():
    assert FIELDS == ["own_process", "escalate", "advice", "prelaunch", "owns_group", "leaving",
                      "restore_at_finish", "handlers_back", "resume_hint", "beats_itself"]


@pytest.mark.parametrize("entry", list(Entry), ids=lambda e: e.value)
def test_each_entry_point_s_policy(entry):
    assert tuple(getattr(policy(entry), f) for f in FIELDS) == TABLE[entry]


def test_every_entry_point_has_one_policy():
    assert set(POLICIES) == set(Entry) == set(TABLE)


@pytest.mark.parametrize("entry", list(Entry), ids=lambda e: e.value)
def test_invariants(entry):
    p = policy(entry)
    # The process is either hpc_train's (it keeps our handlers to its os._exit) or the user's
    # (the handlers found come back): never both, never neither.
    assert p.handlers_back is not p.own_process
    # Only hpc_train's own process leaves through os._exit, leaving the group to that exit.
    assert not p.leaving or p.own_process
    # Who speaks in variables has no launcher: its rank 0 prepares the run directory, and says
    # how to resume, in those words.
    assert (p.advice is VARIABLES) == p.prelaunch == p.resume_hint
    # Beats on the rank record only where no group of its own carries them.
    assert not (p.beats_itself and p.owns_group)
    # Handlers kept at finish only where hpc_train's own code runs after it to the exit.
    assert p.restore_at_finish or p.own_process


@pytest.mark.parametrize("entry", list(Entry), ids=lambda e: e.value)
def test_the_two_runtime_variants_change_one_field_each(entry):
    p = policy(entry)
    assert dataclasses.replace(p.unprepared(), prelaunch=p.prelaunch) == p and p.unprepared().prelaunch
    assert dataclasses.replace(p.group_found(), owns_group=p.owns_group) == p and not p.group_found().owns_group
