"""The requeue hook's decision after a straggler stop (issue 31.3): rank 0 ended the step, its
checkpoint committed, to swap a slow rank's node for a spare. A table and properties over the
pure :func:`hpc_train.login.decide.decide`, built as data as in tests/login/test_decide.py.

Invariants checked with hypothesis over generated swap requests, histories with earlier swaps
and failures, node views (known and unknown), budgets and time left:

1. A straggler stop with every rank stopped cleanly is restarted in place (never requeued),
   charging nothing, unless the time limit is within ``signal_lead`` + the tick: then it is the
   limit's stop (requeued as a timeout, or stopped when that budget is spent).
2. A swap keeps the world size; its nodes are usable nodes of the allocation, each once, with
   the slow node out and a node that was not in the step in its place; every other node stays.
3. At most one swap per ``dist.straggler_window_s``: no two swaps of the history closer.
4. Where no swap can be made, the step runs again where it ran (no node arguments change).
5. A rank that failed at the same moment makes it a failure's decision, with the failure's
   budget and node choice.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_decide import NOW, PROPS, TICK_S, base, inputs, nodes, rec, restart

from hpc_train.errors import EXIT_STOPPED
from hpc_train.login.decide import AGAIN, USABLE, Budgets, decide
from hpc_train.records.requeue import InPlace, Pending, RequeueState

STOPPED = {0: rec(0, ended="stopped"), 1: rec(1, ended="stopped")}


def slow(node: str = "node2", rank: int = 1, step: int | None = 100, ago: float = 5.0) -> Pending:
    return Pending("7", step, "straggler", NOW - ago, "7", 0, 1, node, rank)


def swapped(out: str, into: str, ago: float, nodes_=("node1", "node3"), step: int = 50) -> InPlace:
    return InPlace("7", 0, step, NOW - ago, 0, nodes_, (), 2, 2, None, "straggler", (out, into))


def swap(**over):
    return base(**{"status": EXIT_STOPPED, "pending": slow(), "ranks": STOPPED, "nodes": nodes(), **over})


# -- the table --------------------------------------------------------------------------------
TABLE = [
    # id, inputs, swap recorded, the next step's nodes (None: where it ran)
    ("the slow node goes, the spare comes", swap(), ("node2", "node3"), ("node1", "node3")),
    ("no in-place budget left: a swap charges none", swap(budgets=Budgets(-1, 20, 1, 0),
                                                          history=RequeueState(in_place=(restart(50), restart(80, 2)))),
     ("node2", "node3"), ("node1", "node3")),
    ("a swap within the window is refused", swap(history=RequeueState(in_place=(swapped("node3", "node2", 100,
                                                                                          ("node1", "node2")),))),
     (), None),
    ("a swap past the window is made", swap(window_s=60, history=RequeueState(
        in_place=(swapped("node3", "node2", 100, ("node1", "node2")),))), ("node2", "node3"), ("node1", "node3")),
    ("the spare is down", swap(nodes=nodes(states={"node1": "allocated", "node2": "allocated", "node3": "down*"})),
     (), None),
    ("the spare left the job", swap(nodes=nodes(now="node1 node2")), (), None),
    ("Slurm's view is unknown", swap(nodes=nodes(now=None)), (), None),
    ("no spare nodes configured", swap(nodes=None), (), None),
    ("the slow node is not the step's", swap(pending=slow("node4")), (), None),
    ("rank 0's own node may go (the batch shell stays)", swap(pending=slow("node1", 0)), ("node1", "node3"),
     ("node2", "node3")),
    ("after a restart moved the step, its nodes count", swap(pending=slow("node3"), history=RequeueState(
        in_place=(restart(50, nodes_=("node1", "node3")),))), ("node3", "node2"), ("node1", "node2")),
    ("a node swapped out before is the last choice", swap(
        pending=slow("node3"), nodes=nodes("node1 node2 node3 node4", "node1 node2 node3 node4"),
        history=RequeueState(in_place=(swapped("node2", "node3", 1000),))), ("node3", "node4"), ("node1", "node4")),
]


@pytest.mark.parametrize("name,inputs_,swap_,chosen", TABLE, ids=[t[0] for t in TABLE])
def test_the_swap_table(name, inputs_, swap_, chosen):
    d = decide(inputs_)
    assert (d.action, d.cause, d.exit_code) == ("in_place", "straggler", AGAIN), d
    assert d.restart.swap == swap_ and d.restart.charge == 0 and d.restart.cause == "straggler", d
    assert d.restart.world_size == d.restart.world_before == 2, d
    assert d.next_resume == "latest" and d.step == 100, d
    if chosen is None:
        assert d.next_nodes is None and "not swapped" in d.message, d
    else:
        assert d.restart.nodes == chosen, d
        assert d.next_nodes == f"--nodes=2 --ntasks=2 --nodelist={','.join(chosen)}", d
        assert f"{swap_[0]} swapped for {swap_[1]}" in d.message, d.message


def test_a_straggler_stop_near_the_time_limit_is_the_limit_s():
    d = decide(swap(nominal_end=NOW + 90 + TICK_S))
    assert (d.action, d.cause) == ("requeue", "timeout"), d


def test_a_rank_that_failed_at_the_swap_makes_it_a_failure():
    d = decide(swap(ranks={0: rec(0, ended="stopped"), 1: None}, status=1))
    assert (d.action, d.cause) == ("in_place", "failure") and d.restart.charge == 1 and not d.restart.swap, d


def test_a_failure_after_a_swap_at_the_same_step_costs_one():
    history = RequeueState(in_place=(swapped("node2", "node3", 10, step=100),))
    d = decide(base(history=history, newest_step=100, nodes=nodes()))
    assert d.action == "in_place" and d.restart.charge == 1, d


# -- properties -------------------------------------------------------------------------------
SWAPS = st.lists(st.builds(swapped, st.sampled_from(["node1", "node2", "node3", "node4"]),
                           st.sampled_from(["node1", "node2", "node3", "node4"]), st.floats(0, 1000)), max_size=3)


@st.composite
def swap_inputs(draw):
    i = draw(inputs())
    history = replace(i.history, in_place=i.history.in_place + tuple(draw(SWAPS)))
    ranks = STOPPED if draw(st.booleans()) else i.ranks
    pending = slow(draw(st.sampled_from(["node1", "node2", "node3", "node4"])), draw(st.integers(0, 3)),
                   draw(st.one_of(st.none(), st.integers(0, 300))), draw(st.floats(0, 500)))
    # Half the time a healthy allocation with spares (the generic views rarely leave one usable).
    healthy = nodes(*[" ".join(f"node{k}" for k in range(1, draw(st.integers(3, 4)) + 1))] * 2)
    view = healthy if draw(st.booleans()) else i.nodes
    return replace(i, finished=False, status=draw(st.sampled_from([EXIT_STOPPED, 0, 1, 143])), pending=pending,
                   ranks=ranks, history=history, nodes=view, window_s=draw(st.sampled_from([10.0, 300.0, 5000.0])))


def _clean(i) -> bool:
    return all(r is not None and r.said_its_end for r in i.ranks.values()) or i.status == 0


@PROPS
@given(swap_inputs())
def test_a_clean_straggler_stop_is_restarted_in_place_charging_nothing_or_is_the_limit_s(i):
    d = decide(i)
    if not _clean(i):
        assert d.cause != "straggler", d           # a failure (or the limit's stop) decides
        return
    if i.nominal_end is not None and i.nominal_end - i.now <= i.signal_lead + TICK_S:
        assert d.action in ("requeue", "stop", "none") and d.cause in ("timeout", None), d
        return
    assert (d.action, d.cause, d.exit_code) == ("in_place", "straggler", AGAIN), d
    assert d.restart.charge == 0 and d.restart.world_size == d.restart.world_before, d


@PROPS
@given(swap_inputs())
def test_a_swap_keeps_the_world_and_puts_a_usable_spare_in_the_slow_node_s_place(i):
    d = decide(i)
    if d.cause != "straggler":
        return
    if not d.restart.swap:
        assert d.next_nodes is None, d            # where it ran
        return
    out, into = d.restart.swap
    n, chosen = i.nodes, d.restart.nodes
    placed = [e.nodes for e in i.history.restarts_of(i.inc) if e.nodes is not None]
    before = placed[-1] if placed else n.allocated[:i.first_step_nodes]
    assert out == i.pending.swap and out in before and into not in before, d
    assert len(chosen) == len(before) and len(set(chosen)) == len(chosen), d
    assert set(chosen) == set(before) - {out} | {into}, d
    assert all(h in n.allocated and h in n.now and n.states[h] in USABLE for h in chosen), d


@PROPS
@given(swap_inputs())
def test_at_most_one_swap_per_window(i):
    d = decide(i)
    if d.cause == "straggler" and d.restart.swap:
        assert all(d.restart.time - e.time >= i.window_s for e in i.history.swaps()), d
