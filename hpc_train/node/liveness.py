"""How long a silence may last before a watcher acts: every threshold of the watchers, in one place.
No torch here.

One notion of silence: a rank's *age* is the seconds since it last beat (:mod:`hpc_train.node.beats`:
a key in the store, a file in node memory, or its record), counted from the watcher's own start
for a rank that has not beaten yet; a rank is silent past a limit when its age is over it
(:func:`silent`). Each watcher differs only in the limit it goes by and what it does then:

==========================  ===================================  ==============================================
watcher                     silent for (the limit)               then
==========================  ===================================  ==============================================
a peer lost in a collective :data:`LOST_AFTER_S`                 that peer is named as the one lost
the local launcher          :data:`FROZEN_AFTER_S` once a peer   the silent rank is named, not the failing one
                            failed; :func:`heartbeat_limit`
                            otherwise
rank 0 of a Slurm job       :func:`heartbeat_limit`              the silent rank is named, the step ended
a Run's hang watch          :data:`FROZEN_AFTER_S`, once a step  the silent peer is named, the step ended
                            stalled (:data:`HANG_STEP_FACTOR`
                            x the p99 step, at least
                            :data:`HANG_FLOOR_S`)
==========================  ===================================  ==============================================

``docs/faults.md`` carries the same table with the figures; ``tests/node/test_liveness.py`` checks
that the two agree. The straggler watch is about speed, not silence: besides
:data:`STRAGGLER_GATHERINGS`, its thresholds are the config's (``dist.straggler_ratio``,
``dist.straggler_every_steps``, ``dist.straggler_window_s``).
"""

from __future__ import annotations

BEAT_S = 2.0             # a rank beats this often
READ_WAIT_S = 5.0        # a store read unanswered this long: the store's host is frozen or gone
# After a collective failed, a peer silent this long is the one lost: two beats missed, and a
# second for the reader's own lateness.
LOST_AFTER_S = 2 * BEAT_S + 1
# While a peer is failing or a step is stalled, a rank silent this long is frozen: three beats.
FROZEN_AFTER_S = 3 * BEAT_S
STOPPED_SETTLE_S = 0.3   # a process seen stopped twice this far apart, no context switch between
HANG_STEP_FACTOR = 10    # a step is stalled past this many times the run's recent p99 step time
HANG_WARMUP_STEPS = 20   # steps timed before that limit applies (until then: the long limit)
HANG_WINDOW_STEPS = 512  # the recent steps the p99 is taken over
HANG_FLOOR_S = 20.0      # dist.hang_floor_s 0: at least this, or the long limit when that is less
HANG_CHECK_S = 1.0       # the hang watch looks this often
STRAGGLER_GATHERINGS = 2  # a rank slow in this many gatherings in a row is named a straggler


def heartbeat_limit(timeout_s: float) -> float:
    """How old a heartbeat may get with no other sign of trouble: half of ``dist.timeout_s``, so a
    frozen rank is named before its peers' collectives time out (and blame nobody), but never
    under :data:`FROZEN_AFTER_S`. Also the hang watch's long limit (a start, a save, a restore)."""
    return max(FROZEN_AFTER_S, timeout_s / 2)


def look_every(limit_s: float) -> float:
    """How often a watcher with limit ``limit_s`` reads the beats: a tenth of it, not under a beat."""
    return max(BEAT_S, limit_s / 10)


def age(beat_age: float | None, watched_s: float) -> float:
    """A rank's silence: ``beat_age`` (None: it has not beaten yet), never more than the
    ``watched_s`` seconds the watcher has been watching (a beat from before its start counts as
    at its start: a restart's watcher does not blame a rank for the time it was being started)."""
    return watched_s if beat_age is None else min(beat_age, watched_s)


def silent(age_s: float | None, limit_s: float) -> bool:
    """Silent past the limit: a known age over ``limit_s`` (None: not known, not silent)."""
    return age_s is not None and age_s > limit_s
