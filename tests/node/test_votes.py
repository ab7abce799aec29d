"""The step boundary's votes (hpc_train.node.stops.Votes): a typed record of what each rank asks
for, summed over ranks by the agreement and decoded by field name, never read by position. The
same fields on every rank whatever its tiers, so the collective's size never differs by rank."""

from __future__ import annotations

from dataclasses import fields

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_train.node.stops import Votes


@pytest.mark.parametrize("votes, encoded", [
    (Votes(), [0.0, 0.0, 0.0]),
    (Votes(stop=True), [1.0, 0.0, 0.0]),
    (Votes(timed=True), [0.0, 1.0, 0.0]),
    (Votes(local_timed=True), [0.0, 0.0, 1.0]),
    (Votes(True, True, True), [1.0, 1.0, 1.0]),
])
def test_encode_is_one_float_per_field(votes, encoded):
    assert votes.encode() == encoded
    assert Votes.decode(encoded + [2.5, 7.0]) == (votes, [2.5, 7.0])


def test_the_loop_s_sums_follow_the_votes_whatever_they_are():
    agreed, sums = Votes.decode([2.0, 0.0, 1.0, -3.0, float("inf")])
    assert agreed == Votes(stop=True, timed=False, local_timed=True)
    assert sums == [-3.0, float("inf")]


@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=64),
       st.lists(st.floats(allow_nan=False, width=32), max_size=4))
def test_summed_over_ranks_a_vote_is_carried_when_any_rank_cast_it(ranks, staged):
    """The agreement's sum of every rank's encoding decodes to the OR of each field, whatever
    the number of ranks, and leaves the loop's values as they were summed."""
    votes = [Votes(*r) for r in ranks]
    summed = [sum(col) for col in zip(*(v.encode() for v in votes))]
    agreed, rest = Votes.decode(summed + staged)
    for f in fields(Votes):
        assert getattr(agreed, f.name) == any(getattr(v, f.name) for v in votes)
    assert rest == [float(x) for x in staged]
    assert len(votes[0].encode()) == len(fields(Votes))
