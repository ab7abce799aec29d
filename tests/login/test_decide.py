"""The requeue hook's decision (:func:`hpc_train.login.decide.decide`), as a table and as
properties. It is a pure function of typed inputs, so every case is built here as data: no
file, no process, no scheduler.

Invariants checked with hypothesis over generated exit codes, stop requests, rank records,
budgets, histories, node states (known and unknown) and time left:

1. A refusal (exit 2) is never restarted in place or requeued, and charges nothing.
2. A stop by the job's own signal (which ``srun`` never sends) is never restarted in place and
   never taken for a failure, whatever the ranks did: a preemption or time-limit stop is never
   lost because a rank died at the same moment.
3. A stop whose signal came within ``signal_lead`` + the controller's tick of the job's nominal
   end is the time limit's: requeued as a timeout (or stopped when that budget is spent).
4. No restart in place starts in the last ``signal_lead`` (+ tick) seconds before the end.
5. No decision spends more than its budget: a requeue only while its cause's budget lasts, a
   restart in place only while ``restarts_in_place`` lasts (charge included).
6. Every loop is bounded: failing again and again, a job ends after at most
   (restarts_in_place + 1) x (requeue_failure + 1) steps; failing with the same error at the
   same step (no progress), it ends at the second attempt.
7. A restart in place resumes from the run's own newest checkpoint once the job saved one,
   never from ``--resume PATH`` again, and never with ``none`` (which would move it aside).
8. Slurm's view of the nodes, when unknown (a failed or empty squeue or sinfo), never reads as
   "nodes lost": the step runs again where it ran.
9. Chosen nodes are usable nodes of the allocation, at most ``job.nodes`` of them, at least
   ``min_nodes``, each once; the recorded world size is their count times the ranks per node.
10. An earlier run that went back to the queue without the hook (a script's own ``scontrol
    requeue``) is counted once, by what sacct says of it, and only once sacct says it; a run
    already recorded is never counted again, and a refusal counts nothing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_train.errors import EXIT_STOPPED, EXIT_USAGE
from hpc_train.login.decide import AGAIN, TICK_S, USABLE, Budgets, Inputs, Nodes, decide, next_step, outside_requeues, refused
from hpc_train.login.nodes import PastRun, parse_runs
from hpc_train.records.ranks import RankRecord
from hpc_train.records.requeue import Incarnation, InPlace, Pending, Requeue, RequeueState

NOW = 100_000.0
INC = Incarnation("7", 0)


def rec(rank: int, node: str = "", ended: str | None = None, left: str | None = None) -> RankRecord:
    return RankRecord(rank, node or f"node{rank + 1}", node or f"node{rank + 1}", 100 + rank, "7", 0, 1, "L", 2,
                      NOW - 60, ended, left)


def pend(signal: str = "USR2", step: int | None = 100, ago: float = 5.0) -> Pending:
    return Pending("7", step, signal, NOW - ago, "7", 0, 1)


def nodes(allocated="node1 node2 node3", now="node1 node2 node3", states="all up", want=2, floor=2,
          batch="node1") -> Nodes:
    alloc = tuple(allocated.split())
    st_ = {h: "allocated" for h in alloc} if states == "all up" else states
    return Nodes(want, floor, alloc, batch, None if now is None else tuple(now.split()), st_,
                 "" if now is not None and st_ is not None else "squeue failed: down")


def base(**over) -> Inputs:
    i = Inputs(status=1, finished=False, inc=INC, pending=None, pending_note="",
               ranks={0: rec(0), 1: rec(1)}, ranks_per_node=1, srun_tasks_per_node=1,
               budgets=Budgets(-1, 20, 1, 3), history=RequeueState(), job_signal="USR2", signal_lead=90,
               now=NOW, nominal_end=None, newest_step=100, own_checkpoint=True, resume="latest",
               first_step_nodes=2, nodes=None)
    return replace(i, **over)


def restart(step=100, charge=1, nodes_=None, lost=(), restart_=0, world=2, before=2) -> InPlace:
    return InPlace("7", restart_, step, NOW - 100, charge, nodes_, lost, world, before)


def requeued(cause: str, restart_: int = 0, ok: bool = True) -> Requeue:
    return Requeue(f"7:{restart_}", cause, 10, NOW - 1000, ok)


# -- the table --------------------------------------------------------------------------------
TABLE = [
    # id, inputs, action, cause, exit code
    ("finished", base(finished=True), "finished", None, 0),
    ("finished outranks a failure and a stop", base(finished=True, status=1, pending=pend()), "finished", None, 0),
    ("refusal", base(status=EXIT_USAGE), "refused", None, EXIT_USAGE),
    ("refusal with a stop request", base(status=EXIT_USAGE, pending=pend()), "refused", None, EXIT_USAGE),
    # A busy directory's refusal whose srun passed on a peer's SIGKILL (9), none of its ranks begun
    ("refusal by another run's lock, srun's 9", base(status=9, ranks={0: None, 1: None},
                                                    held_by="Slurm job 3 (pid 5 on host n1)"),
     "refused", None, EXIT_USAGE),
    ("... with a stop request", base(status=9, ranks={0: None, 1: None}, pending=pend(),
                                     held_by="Slurm job 3 (pid 5 on host n1)"), "refused", None, EXIT_USAGE),
    # held by another, but a rank of this step began: its own failure, not a refusal
    ("held, a rank began", base(status=9, ranks={0: rec(0), 1: None}, held_by="Slurm job 3 (pid 5 on host n1)"),
     "in_place", "failure", AGAIN),
    ("preemption", base(status=0, pending=pend(), ranks={0: rec(0, ended="stopped"), 1: rec(1, ended="stopped")}),
     "requeue", "preemption", 0),
    ("time limit", base(status=0, pending=pend(), nominal_end=NOW + 100), "requeue", "timeout", 0),
    ("time limit, a rank died then", base(pending=pend(), nominal_end=NOW + 60), "requeue", "timeout", 0),
    ("preemption, a rank died then", base(pending=pend(), ranks={0: rec(0, ended="stopped"), 1: rec(1)}),
     "requeue", "preemption", 0),
    ("srun's SIGTERM after a rank died", base(pending=pend("TERM"), ranks={0: rec(0, ended="stopped"), 1: None}),
     "in_place", "failure", AGAIN),
    ("SIGTERM with every rank stopped is a stop", base(status=0, pending=pend("TERM"),
                                                       ranks={0: rec(0, ended="stopped"), 1: rec(1, ended="stopped")}),
     "requeue", "preemption", 0),
    ("preemption budget spent", base(status=0, pending=pend(), budgets=Budgets(0, 20, 1, 3)), "stop", "preemption",
     EXIT_STOPPED),
    ("timeout budget spent", base(status=0, pending=pend(), nominal_end=NOW + 30, budgets=Budgets(-1, 1, 1, 3),
                                  history=RequeueState(events=(requeued("timeout", 5),))), "stop", "timeout",
     EXIT_STOPPED),
    ("a failed requeue of another cause does not count", base(status=0, pending=pend(), budgets=Budgets(1, 1, 1, 3),
                                                              history=RequeueState(events=(requeued("preemption", 3, ok=False),))),
     "requeue", "preemption", 0),
    ("this incarnation was requeued already", base(status=0, pending=pend(),
                                                   history=RequeueState(events=(requeued("preemption"),))),
     "none", None, 0),
    ("a failure is restarted in place", base(), "in_place", "failure", AGAIN),
    ("a failure near the time limit is requeued", base(nominal_end=NOW + 90 + TICK_S), "requeue", "failure", 0),
    ("a failure with time to spare is restarted", base(nominal_end=NOW + 90 + TICK_S + 1), "in_place", "failure",
     AGAIN),
    ("no in-place budget", base(budgets=Budgets(-1, 20, 1, 0)), "requeue", "failure", 0),
    ("in-place budget spent", base(history=RequeueState(in_place=(restart(50), restart(80, 2)))), "requeue",
     "failure", 0),
    ("everything spent", base(status=137, budgets=Budgets(-1, 20, 0, 0)), "fail", "failure", 137),
    ("the loop's own code is never the job's", base(status=AGAIN, budgets=Budgets(-1, 20, 0, 0)), "fail", "failure", 1),
    ("a rank with no record failed", base(ranks={0: rec(0, ended="stopped"), 1: None}), "in_place", "failure", AGAIN),
    ("exit 0 and no request", base(status=0, ranks={0: rec(0, ended="returned"), 1: rec(1, ended="returned")}),
     "none", None, 0),
]


@pytest.mark.parametrize("name,inputs,action,cause,code", TABLE, ids=[t[0] for t in TABLE])
def test_the_decision_table(name, inputs, action, cause, code):
    d = decide(inputs)
    assert (d.action, d.cause, d.exit_code) == (action, cause, code), d


def test_a_restart_costs_two_only_without_progress():
    first = decide(base())
    assert first.restart.charge == 1 and "1 of 3 used" in first.message
    progress = decide(base(history=RequeueState(in_place=(restart(step=50),))))
    assert progress.restart.charge == 1 and "2 of 3 used" in progress.message
    again = decide(base(history=RequeueState(in_place=(restart(step=100),))))
    assert again.restart.charge == 2 and "3 of 3 used" in again.message and "counted twice" in again.message


@pytest.mark.parametrize("resume,own,expect", [("latest", True, "latest"), ("/ckpt/step-4", True, "latest"),
                                               ("/ckpt/step-4", False, "/ckpt/step-4"), ("none", False, "latest"),
                                               ("none", True, "latest")])
def test_a_restart_in_place_resumes_from_the_run_s_own_checkpoint(resume, own, expect):
    assert decide(base(resume=resume, own_checkpoint=own)).next_resume == expect


def test_the_failure_line_names_the_rank_and_a_withdrawn_stop():
    d = decide(base(pending=pend("TERM"), ranks={0: rec(0, ended="stopped"), 1: None}))
    assert "not a stop: rank 1 failed and srun ended the other ranks (SIGTERM)" in d.message, d.message
    assert "restarting in place from step 100" in d.message


def test_the_same_error_at_the_same_step_twice_ends_the_job():
    err = "ValueError: You set devices=2, but --ntasks-per-node=1 does not match"
    first = decide(base(ranks={0: rec(0), 1: rec(1)}, errors={0: err}, newest_step=0))
    assert first.action == "in_place" and first.restart.error == err and err in first.message
    again = decide(base(ranks={0: rec(0), 1: rec(1)}, errors={0: err}, newest_step=0,
                        history=RequeueState(in_place=(first.restart,))))
    assert again.action == "fail" and again.exit_code == 1 and err in again.final, again
    assert "the same error again at step 0" in again.final
    # Progress since (a newer checkpoint), or another error: restarted as usual.
    moved = decide(base(errors={0: err}, newest_step=5, history=RequeueState(in_place=(first.restart,))))
    other = decide(base(errors={0: "RuntimeError: CUDA error"}, newest_step=0,
                        history=RequeueState(in_place=(first.restart,))))
    assert moved.action == other.action == "in_place"


def test_progress_on_the_local_tier_alone_is_progress():
    """A run that keeps the node-local tier saves there every few steps and on the shared tier
    rarely: two failures with one error line, between which only the local tier moved, are two
    failures at different steps, each restarted in place (from the local tier's step); without
    a move on either tier, the second ends the job. A requeue names the shared tier's step."""
    err = "RuntimeError: lost a peer: rank 1 exited"
    first = decide(base(errors={0: err}, newest_step=200, local_step=205))
    assert first.action == "in_place" and first.restart.step == 205, first
    assert "restarting in place from step 205" in first.message, first.message
    again = dict(errors={0: err}, newest_step=200, history=RequeueState(in_place=(first.restart,)))
    moved = decide(base(local_step=290, **again))
    assert moved.action == "in_place" and moved.restart.charge == 1, moved
    stuck = decide(base(local_step=205, **again))
    assert stuck.action == "fail" and "the same error again at step 205" in stuck.final, stuck
    # The local tier older than the shared one (a requeue's new nodes, before their first save):
    # the shared tier's step stands.
    assert decide(base(newest_step=200, local_step=150)).restart.step == 200
    requeue = decide(base(newest_step=200, local_step=205, budgets=Budgets(-1, 20, 1, 0)))
    assert requeue.action == "requeue" and requeue.step == 200 and "failure at step 200" in requeue.message


@pytest.mark.parametrize("newest, local, told", [(200, 205, "205"), (200, 200, "200"), (200, 150, ""), (200, None, ""),
                                                 (None, 5, "5")])
def test_an_in_place_restart_tells_the_next_step_the_node_local_step_it_loads(newest, local, told):
    """Issue 49.4: the hook's typed answer carries the node-local tier's step (next_step's third
    field, HPC_TRAIN_LOCAL_STEP) when that tier serves the restart; the step's restore checks it
    against what the ranks hold instead of planning the shared tier. A requeue tells none."""
    d = decide(base(errors={0: "RuntimeError: x"}, newest_step=newest, local_step=local))
    assert d.action == "in_place" and next_step(d)[2] == told, d
    requeue = decide(base(newest_step=newest, local_step=local, budgets=Budgets(-1, 20, 1, 0)))
    assert requeue.action == "requeue" and requeue.next_local is None


def test_the_culprit_s_error_is_not_a_victim_s_lost_peer_line():
    d = decide(base(ranks={0: rec(0), 1: rec(1)},
                    errors={0: "lost a peer: rank 1 (pid 7 on node2) exited (Connection reset by peer)",
                            1: "RuntimeError: boom"}))
    assert "rank 1 failed: RuntimeError: boom" in d.message and d.restart.error == "RuntimeError: boom"


def test_spent_budgets_say_so_in_the_final_line():
    d = decide(base(status=1, budgets=Budgets(-1, 20, 1, 0), history=RequeueState(events=(requeued("failure", 4),))))
    assert d.action == "fail" and "failure budget (1) spent, not requeued" in d.final
    # the last word names the culprit's error, which status shows; the line says it once
    d = decide(base(status=1, ranks={0: rec(0), 1: rec(1)}, errors={1: "RuntimeError: boom"}, newest_step=40,
                    budgets=Budgets(-1, 20, 0, 0)))
    assert d.final == "failed at step 40: RuntimeError: boom; failure budget (0) spent, not requeued", d.final
    assert d.message.count("RuntimeError: boom") == 1, d.message
    d = decide(base(status=0, pending=pend(step=None), budgets=Budgets(0, 20, 1, 3)))
    assert d.final == "stopped by preemption at an unknown step; preemption budget (0) spent, not requeued"


# -- nodes --------------------------------------------------------------------------------------
def test_a_spare_takes_the_place_of_a_lost_node():
    d = decide(base(nodes=nodes(now="node1 node3", states={"node1": "mixed", "node2": "down*", "node3": "idle"})))
    assert d.action == "in_place" and d.restart.nodes == ("node1", "node3") and d.restart.lost == ("node2",)
    assert d.next_nodes == "--nodes=2 --ntasks=2 --nodelist=node1,node3"
    assert (d.restart.world_before, d.restart.world_size) == (2, 2)
    assert "node2 lost at step 100; next step on node1,node3" in d.message


def test_a_crashed_rank_moves_to_the_spare_and_keeps_its_node_without_one():
    crashed = {0: rec(0, ended="stopped"), 1: rec(1)}
    spare = decide(base(ranks=crashed, nodes=nodes()))
    assert spare.restart.nodes == ("node1", "node3") and spare.restart.lost == ()
    kept = decide(base(ranks=crashed, nodes=nodes("node1 node2", "node1 node2", want=2, floor=2)))
    assert kept.restart.nodes == ("node1", "node2")
    # Every rank failed (rank 0 lost its peer): the batch shell's node keeps rank 0.
    both = decide(base(ranks={0: rec(0), 1: rec(1)}, nodes=nodes()))
    assert both.restart.nodes == ("node1", "node3")


def test_a_node_lost_in_an_earlier_step_is_not_lost_again():
    earlier = RequeueState(in_place=(restart(50, nodes_=("node1", "node3"), lost=("node2",)),))
    d = decide(base(history=earlier, ranks={0: rec(0, ended="stopped"), 1: rec(1, node="node3")},
                    nodes=nodes("node1 node2 node3 node4", "node1 node3 node4",
                                {"node1": "mixed", "node2": "down*", "node3": "mixed", "node4": "idle"})))
    assert d.restart.lost == () and d.restart.nodes == ("node1", "node4"), d
    assert "lost" not in d.message


def test_a_requeued_job_starts_again_on_its_own_node_count():
    """Incarnation 0 shrank to one node; incarnation 1 started again on job.nodes=2."""
    shrunk = RequeueState(in_place=(restart(50, nodes_=("node1",), lost=("node2",), world=1),))
    d = decide(base(inc=Incarnation("7", 1), history=shrunk, nodes=nodes("node1 node2", "node1 node2", floor=1)))
    assert (d.restart.world_before, d.restart.world_size) == (2, 2) and "world size" not in d.message


def test_fewer_nodes_down_to_min_nodes_then_the_requeue():
    shrink = decide(base(ranks_per_node=2, srun_tasks_per_node=1, first_step_nodes=2,
                         ranks={r: rec(r, node=f"node{1 + r // 2}") for r in range(4)},
                         nodes=nodes("node1 node2", "node1", {"node1": "mixed", "node2": "down"}, floor=1)))
    assert shrink.next_nodes == "--nodes=1 --ntasks=1 --nodelist=node1"        # one torchrun
    assert (shrink.restart.world_before, shrink.restart.world_size) == (4, 2)
    assert "world size 4 -> 2: node2 lost" in shrink.message
    below = decide(base(nodes=nodes("node1 node2 node3", "node1", {"node1": "mixed", "node2": "down", "node3": "down*"},
                                    want=3, floor=2)))
    assert below.action == "requeue" and "1 of the allocation's 3 nodes are up" in below.message
    assert "job.min_nodes=2" in below.message


@pytest.mark.parametrize("now,states", [(None, {"node1": "mixed"}), ("node1 node2 node3", None)])
def test_an_unknown_view_of_the_nodes_runs_the_step_where_it_ran(now, states):
    placed = RequeueState(in_place=(restart(50, nodes_=("node1", "node3"), lost=("node2",)),))
    d = decide(base(history=placed, nodes=nodes(now=now, states=states)))
    assert d.action == "in_place" and d.next_nodes == "--nodes=2 --ntasks=2 --nodelist=node1,node3"
    assert d.restart.lost == () and "unknown" in d.message
    first = decide(base(nodes=nodes(now=now, states=states)))
    assert first.next_nodes == "--nodes=2 --ntasks=2"    # the first step's own arguments


# -- properties -------------------------------------------------------------------------------
SIGNALS = st.sampled_from(["USR2", "TERM", "USR1", "INT", ""])
NODE_STATES = st.sampled_from(["allocated", "mixed", "idle", "completing", "down", "down*", "drained", "idle~", "fail"])


RANK_KINDS = st.sampled_from(["missing", "silent", "finished", "stopped", "returned", "left"])


def _rank(r: int, kind: str) -> RankRecord | None:
    if kind == "missing":
        return None
    return rec(r, node=f"node{1 + r % 4}", ended=kind if kind in ("finished", "stopped", "returned") else None,
               left="stop" if kind == "left" else None)


RANKS = st.lists(RANK_KINDS, min_size=1, max_size=4).map(lambda kinds: {r: _rank(r, k) for r, k in enumerate(kinds)})
EVENTS = st.builds(Requeue, st.sampled_from(["7:0", "7:1", "7:2", "8:0"]),
                   st.sampled_from(["preemption", "timeout", "failure"]), st.one_of(st.none(), st.integers(0, 300)),
                   st.just(NOW - 500), st.booleans())
NODE_TUPLES = st.lists(st.sampled_from(["node1", "node2", "node3", "node4"]), min_size=1, max_size=3,
                       unique=True).map(tuple)
PLACES = st.builds(InPlace, st.sampled_from(["7", "8"]), st.one_of(st.none(), st.integers(0, 2)),
                   st.one_of(st.none(), st.integers(0, 300)), st.just(NOW - 200), st.integers(1, 2),
                   st.one_of(st.none(), NODE_TUPLES),
                   st.lists(st.sampled_from(["node2", "node3"]), max_size=1, unique=True).map(tuple))
HISTORIES = st.builds(lambda e, p: RequeueState(events=tuple(e), in_place=tuple(p)),
                      st.lists(EVENTS, max_size=4), st.lists(PLACES, max_size=4))
ALLOCS = [("node1", "node2", "node3", "node4")[:n] for n in range(1, 5)]


@st.composite
def node_views(draw):
    alloc = draw(st.sampled_from(ALLOCS))
    want = draw(st.integers(1, len(alloc)))
    floor = draw(st.integers(1, want))
    now = draw(st.one_of(st.none(), st.sets(st.sampled_from(alloc)).map(tuple)))
    states = draw(st.one_of(st.none(), st.lists(NODE_STATES, min_size=len(alloc), max_size=len(alloc))
                            .map(lambda ss, a=alloc: dict(zip(a, ss)))))
    return Nodes(want, floor, alloc, "node1", now or None, states, "" if now and states else "unknown")


ERRORS = st.dictionaries(st.integers(0, 3), st.sampled_from(["RuntimeError: boom", "ValueError: bad devices",
                                                            "lost a peer: rank 1 exited (Connection reset by peer)"]),
                         max_size=3)
PENDING = st.one_of(st.none(), st.builds(pend, SIGNALS, st.one_of(st.none(), st.integers(0, 300)), st.floats(0, 500)))
BUDGETS = st.builds(Budgets, st.integers(-1, 2), st.integers(-1, 2), st.integers(-1, 2), st.integers(0, 3))


@st.composite
def inputs(draw):
    return base(status=draw(st.sampled_from([0, 1, 2, 3, 75, 137, 143])), finished=draw(st.booleans()),
                inc=Incarnation("7", draw(st.integers(0, 2))), pending=draw(PENDING), ranks=draw(RANKS),
                budgets=draw(BUDGETS), history=draw(HISTORIES), job_signal=draw(st.sampled_from(["USR2", "TERM"])),
                nominal_end=draw(st.one_of(st.none(), st.floats(NOW - 100, NOW + 2000))),
                newest_step=draw(st.integers(0, 300)), own_checkpoint=draw(st.booleans()),
                local_step=draw(st.one_of(st.none(), st.integers(0, 300))),
                resume=draw(st.sampled_from(["latest", "none", "/elsewhere/checkpoints/step-4"])),
                nodes=draw(st.one_of(st.none(), node_views())), errors=draw(ERRORS),
                held_by=draw(st.one_of(st.none(), st.just("Slurm job 3 (pid 5 on host n1)"))))


PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _lead_end(i: Inputs) -> float:
    return i.signal_lead + TICK_S


@PROPS
@given(inputs())
def test_refusals_and_own_signal_stops_are_never_restarted_in_place(i):
    d = decide(i)
    if i.finished:
        assert d.action == "finished"
        return
    if refused(i):
        assert d.action == "refused" and d.restart is None and d.exit_code == EXIT_USAGE
        return
    if i.pending is not None and i.pending.signal == i.job_signal != "TERM":
        assert d.action in ("requeue", "stop", "none") and d.cause in ("preemption", "timeout", None), d


@PROPS
@given(inputs())
def test_a_time_limit_stop_is_never_lost(i):
    d = decide(i)
    # A refused step's stop request is another job's (the one holding the run directory): that
    # job's own hook keeps its stop.
    if i.finished or refused(i) or i.pending is None or i.nominal_end is None:
        return
    if i.nominal_end - i.pending.received_at <= _lead_end(i):
        assert d.action in ("requeue", "stop", "none") and d.cause in ("timeout", None), d


@PROPS
@given(inputs())
def test_no_restart_in_place_in_the_last_signal_lead_seconds(i):
    d = decide(i)
    if d.action == "in_place" and i.nominal_end is not None:
        assert i.nominal_end - i.now > _lead_end(i)


@PROPS
@given(inputs())
def test_no_decision_spends_more_than_its_budget(i):
    d = decide(i)
    if d.action == "requeue":
        budget = i.budgets.of(d.cause)
        assert budget < 0 or i.history.count(d.cause) < budget, d
    if d.action == "in_place":
        assert i.history.in_place_used() + d.restart.charge <= i.budgets.in_place, d
        assert d.restart.charge in (1, 2) and d.exit_code == AGAIN


@PROPS
@given(inputs())
def test_a_restart_in_place_never_goes_back_to_a_given_path_or_none(i):
    d = decide(i)
    if d.action == "in_place":
        assert d.next_resume != "none"
        if i.own_checkpoint:
            assert d.next_resume == "latest"


@PROPS
@given(inputs())
def test_nodes_chosen_are_usable_and_an_unknown_view_loses_none(i):
    d = decide(i)
    if d.action != "in_place" or i.nodes is None:
        return
    n = i.nodes
    if n.now is None or n.states is None:
        assert d.restart.lost == () and "unknown" in d.message
        return
    chosen = d.restart.nodes
    assert len(set(chosen)) == len(chosen) and n.floor <= len(chosen) <= n.want
    assert all(h in n.allocated and h in n.now and n.states[h] in USABLE for h in chosen)
    assert d.restart.world_size == len(chosen) * i.ranks_per_node
    assert set(d.restart.lost).isdisjoint(chosen)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3), st.integers(0, 2), st.booleans(), st.sampled_from([None, "TERM"]),
       st.sampled_from([None, "RuntimeError: boom"]))
def test_every_failure_loop_is_bounded(in_place, failure, progress, stop_signal, error):
    """A job whose steps all fail (with srun's SIGTERM taken for a stop by rank 0, or without;
    with an error line or none), driven through decide and the history's own transitions, with
    every scontrol succeeding."""
    history, inc, step, steps, requeues = RequeueState(), Incarnation("7", 0), 10, 0, 0
    budgets = Budgets(-1, 20, failure, in_place)
    while True:
        steps += 1
        assert steps <= (in_place + 1) * (failure + 1) + 1, (steps, history)
        pending = pend(stop_signal, step=None) if stop_signal else None
        d = decide(base(inc=inc, history=history, budgets=budgets, newest_step=step, pending=pending,
                        ranks={0: rec(0, ended="stopped"), 1: None}, errors={1: error} if error else {}))
        if d.action == "in_place":
            history = history.restarted(d.restart)
        elif d.action == "requeue":
            assert d.cause == "failure", d
            history, requeues = history.requeued(inc, d.cause, d.step, NOW, d.error), requeues + 1
            inc = Incarnation("7", inc.restart + 1)
        else:
            assert d.action == "fail", d
            break
        step += 10 if progress else 0
    if error is not None and not progress:
        assert steps <= 2, (steps, history)     # the same error at the same step: no third attempt
    elif error is None or progress:
        assert requeues == failure


# -- runs requeued outside the hook (issue 33, part 2: Lightning's own scontrol requeue) ---------
def past(restart: int, state: str = "REQUEUED", elapsed: int | None = 50, limit: int | None = 180) -> PastRun:
    return PastRun(restart, state, elapsed, limit, NOW - 900 + restart)


@pytest.mark.parametrize("run,cause", [
    (past(0, elapsed=90, limit=180), "timeout"),          # 90 s left <= lead (60 here) + tick: the limit's signal
    (past(0, elapsed=10, limit=180), "preemption"),       # stopped early: a preemption, or by hand
    (past(0, "PREEMPTED", elapsed=170, limit=180), "timeout"),
    (past(0, "NODE_FAIL", elapsed=10), "failure"),
    (past(0, elapsed=10_000, limit=None), "preemption"),  # no limit: never the limit's
])
def test_a_run_requeued_outside_the_hook_is_counted_by_what_sacct_says(run, cause):
    i = base(status=0, finished=True, inc=Incarnation("7", 1), signal_lead=60, past_runs=(run,))
    d = decide(i)
    assert d.action == "finished" and [(e.key, e.cause, e.by) for e in d.seen] == [("7:0", cause, "outside")]
    assert "run 0 was requeued outside hpc_train" in d.message and f"counted as a {cause}" in d.message


def test_outside_requeues_charge_the_budget_of_their_cause():
    # Run 0 was Lightning's requeue at its time limit; this run's own time-limit stop finds the
    # timeout budget (1) spent.
    i = base(status=0, pending=pend(), nominal_end=NOW + 30, inc=Incarnation("7", 1), signal_lead=60,
             budgets=Budgets(-1, 1, 1, 3), past_runs=(past(0, elapsed=170), past(1, "RUNNING")))
    d = decide(i)
    assert d.action == "stop" and d.cause == "timeout" and len(d.seen) == 1, d


def test_a_run_sacct_does_not_answer_for_is_left_for_later_and_said():
    for runs, why in ((None, "sacct did not answer: sacct failed: down"), ((), "sacct does not list them yet"),
                      ((past(0, "RUNNING"),), "sacct does not list them yet")):
        d = decide(base(status=0, finished=True, inc=Incarnation("7", 1), past_runs=runs, past_why="sacct failed: down"))
        assert d.seen == () and "1 earlier run(s) requeued outside hpc_train not counted yet" in d.message, d
        assert why in d.message


def test_parse_runs_takes_whatever_bytes_sacct_printed():
    text = ("REQUEUED|95|3|2026-11-24T06:53:12\nRESIZING|5|3|2026-11-24T06:53:12\nCANCELLED by 0|x|UNLIMITED|"
            "Unknown\n\nRUNNING|12|3|Unknown\n")
    assert parse_runs(text) == (PastRun(0, "REQUEUED", 95, 180, parse_runs(text)[0].end),
                                PastRun(1, "CANCELLED", None, None, None), PastRun(2, "RUNNING", 12, 180, None))
    assert parse_runs(text)[0].end is not None


@given(st.text(alphabet="|\n0123456789RQUEDNIGT-:Tx ", max_size=200))
def test_parse_runs_never_fails(text):
    runs = parse_runs(text)
    assert [r.restart for r in runs] == list(range(len(runs)))


PAST = st.lists(st.builds(PastRun, st.integers(0, 3), st.sampled_from(["REQUEUED", "PREEMPTED", "NODE_FAIL",
                                                                       "RUNNING", "COMPLETED"]),
                          st.one_of(st.none(), st.integers(0, 400)), st.one_of(st.none(), st.sampled_from([60, 180]))
                          , st.one_of(st.none(), st.just(NOW - 50))), max_size=4)


@PROPS
@given(inputs(), st.one_of(st.none(), PAST.map(tuple)))
def test_an_outside_requeue_is_counted_once_and_only_when_sacct_says_it(i, runs):
    i = replace(i, past_runs=runs, inc=Incarnation("7", 3) if runs else i.inc)
    d = decide(i)
    before = {e.key for e in i.history.events if e.requeued}
    keys = [e.key for e in d.seen]
    assert len(keys) == len(set(keys)) and not before & set(keys)          # never twice, never a recorded run
    assert all(int(k.split(":")[1]) < i.inc.restart and k.startswith("7:") for k in keys)   # earlier runs only
    said = {r.restart: r for r in runs or ()}
    for e in d.seen:
        run = said[int(e.key.split(":")[1])]                                # sacct said it
        assert run.state not in ("RUNNING", "PENDING") and e.requeued and e.by == "outside"
        lead_left = run.limit_s is not None and run.elapsed_s is not None and run.limit_s - run.elapsed_s <= i.signal_lead + TICK_S
        assert (e.cause == "timeout") == (lead_left and run.state != "NODE_FAIL")
    if i.status == EXIT_USAGE and not i.finished:
        assert d.seen == ()                                                 # a refusal counts nothing


# -- issue 50: a lost node is the culprit, not the first rank without an end record -----------------
LOST = dict(nodes=nodes(now="node1 node3", states={"node1": "mixed", "node2": "down*", "node3": "idle"}))


@pytest.mark.parametrize("extra, says", [
    ({}, "node2 lost at step 100; next step on node1,node3; restarting in place"),
    ({"budgets": Budgets(-1, 20, 1, 0)}, "node2 lost; not restarted in place (job.restarts_in_place=0)"),
], ids=["restarted", "requeued"])
def test_a_lost_node_is_named_and_no_rank_is_blamed(extra, says):
    d = decide(base(**LOST, **extra))
    assert d.message.startswith(says) and "rank 0 failed" not in d.message, d.message


def test_a_rank_that_said_why_is_still_named_beside_a_lost_node():
    d = decide(base(errors={1: "RuntimeError: boom"}, **LOST))
    assert d.message.startswith("rank 1 failed: RuntimeError: boom; node2 lost at step 100"), d.message


# -- issue 50: sacct --duplicates also lists older jobs that had the same id ------------------------
OLD_JOB = "COMPLETED|3000|60|2026-01-01T00:00:00\nFAILED|10|60|2026-01-02T00:00:00\n"


@pytest.mark.parametrize("text, restart, states", [
    # This job's run 0 was requeued (preempted); run 1 is the current one, listed as RUNNING.
    (OLD_JOB + "PREEMPTED|95|180|2026-02-01T00:00:00\nRUNNING|5|180|Unknown\n", 1, ["PREEMPTED", "RUNNING"]),
    # The accounting has not listed the current run yet: the last row is this job's run 0.
    (OLD_JOB + "REQUEUED|95|180|2026-02-01T00:00:00\n", 1, ["REQUEUED"]),
    # No older job: the rows are this job's runs.
    ("REQUEUED|95|180|2026-02-01T00:00:00\nRUNNING|5|180|Unknown\n", 1, ["REQUEUED", "RUNNING"]),
    # Fewer rows than runs (the accounting lags): all kept, numbered from 0.
    ("RUNNING|5|180|Unknown\n", 2, ["RUNNING"]),
    (OLD_JOB, 0, []),
], ids=["old-job-first", "current-not-listed", "no-old-job", "lagging", "first-run-not-listed"])
def test_runs_of_an_older_job_with_the_same_id_are_not_this_job_s(text, restart, states):
    runs = parse_runs(text, restart)
    assert [r.state for r in runs] == states
    assert [r.restart for r in runs] == list(range(len(states)))


def test_an_older_job_s_row_is_never_charged_as_this_job_s_requeue():
    """Run 0 of this job hit its time limit (elapsed = limit) and was requeued outside the hook;
    the older job's first row, a short FAILED run, must not be taken for it."""
    text = "FAILED|10|60|2026-01-02T00:00:00\nREQUEUED|10740|180|2026-02-01T00:00:00\nRUNNING|5|180|Unknown\n"
    i = base(status=0, pending=None, inc=Incarnation("7", 1), past_runs=parse_runs(text, 1))
    seen, _ = outside_requeues(i)
    assert [(e.key, e.cause) for e in seen] == [("7:0", "timeout")]


def test_the_rank_that_failed_first_is_named_not_the_lowest_rank():
    """Rank 3's error file was written before rank 1's (gather passes them oldest first): rank 3
    is the culprit, whatever its number; a victim's lost-peer line never is."""
    ranks = {r: rec(r, node=f"node{1 + r // 2}") for r in range(4)}
    first = decide(base(ranks=ranks, ranks_per_node=2, errors={3: "RuntimeError: first", 1: "RuntimeError: later"}))
    assert "rank 3 failed: RuntimeError: first" in first.message, first.message
    victim = decide(base(ranks=ranks, ranks_per_node=2,
                         errors={0: "rank 0: lost its peer rank 2 (connection closed by peer)", 2: "OOM"}))
    assert "rank 2 failed: OOM" in victim.message, victim.message
