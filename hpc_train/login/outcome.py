"""What a local run directory says became of its run, and what the same command will do if run
again. No torch here: ``status`` reads it on the login node.

:func:`gather` reads every fact once, each record through its owner; :func:`decide` names the
run's state from them (a pure function, tested as a table); :func:`rerun` asks the pre-launch
sequence that the rerun itself runs (:func:`hpc_train.ckpt.prelaunch.predict`), read-only.

Which launch a record belongs to matters: ``stopped.json`` outlives the launch that wrote it
(a rerun that then fails or is killed leaves it in place), and under Slurm so can an error file.
The last launch is the one whose ranks' records are newest, and it began when its launcher did
(:func:`hpc_train.records.ranks.launch_start`); only what was written since says how it ended.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_train import config as config_mod
from hpc_train import rundir
from hpc_train.ckpt import prelaunch, store
from hpc_train.errors import UsageError, says_peer_lost
from hpc_train.records import ranks, result, stop
from hpc_train.records.stop import StopRecord
from hpc_train.trainer.signature import expected

# A file's mtime comes from the kernel's coarse clock, a few milliseconds behind time.time();
# where no launcher recorded its start, the first rank's start stands for it, and a rank may
# write its error just before a slower peer of the same launch writes its record. An earlier
# launch's last record is older by at least a process start (an interpreter, imports, the lock).
SLACK_S = 0.25


@dataclass(frozen=True)
class RankError:
    rank: int
    time: float           # when its error file was written
    line: str             # the error's first line


@dataclass(frozen=True)
class Facts:
    """What :func:`decide` needs, as read from a run directory at one moment."""

    holder: str | None = None                   # the lock's holder: a live run
    finished: bool = False                      # result.json
    finished_step: int | None = None
    stop: StopRecord | None = None              # stopped.json, as read
    stop_unreadable: bool = False               # stopped.json is there, damaged
    stop_written: float | None = None           # its mtime
    launch: float | None = None                 # when the last launch began; None: no rank record
    world: int = 0                              # ranks of the last launch with a record
    errors: tuple[RankError, ...] = ()          # every logs/rank-R.error
    silent: tuple[int, ...] = ()                # ranks of the last launch that said no end and left no error
    unsaved: tuple[int, float] | None = None    # (step, mtime): a step directory without its commit record,
                                                # newer than the newest complete checkpoint


@dataclass(frozen=True)
class State:
    kind: str      # running | finished | failed | aborted | stopped | killed | ended | new
    line: str


def _since(f: Facts, t: float | None) -> bool:
    """``t`` falls in the last launch (every time does when no rank left a record)."""
    return t is not None and (f.launch is None or t >= f.launch - SLACK_S)


def _failure_line(e: RankError) -> str:
    """A rank's error, said once: the supervisor's line names rank and host itself."""
    line = e.line.split("; its last lines:")[0]
    who = line if line.startswith(f"rank {e.rank} ") else f"rank {e.rank}: {line}"
    return f"{who} (its log: {rundir.LOGS}/rank-{e.rank}.log)"


def _stop_line(rec: StopRecord | None) -> str:
    if rec is None:
        return "stopped (its record is unreadable)"
    by = stop.said(rec.signal)
    if rec.checkpoint:
        return f"stopped at step {rec.steps} by {by}, checkpoint committed"
    if rec.steps is not None:
        return f"stopped at step {rec.steps} by {by}; checkpoints are off: nothing saved"
    return f"stopped by {by}; hpc_train saved nothing (the code did not reach a run.step_end after it)"


def decide(f: Facts) -> State:
    """The run's state. In order: a held lock is a live run; ``result.json`` a finished one
    (nothing trains it again). Of what the last launch wrote: a rank's error is a failure,
    unless a stop committed its checkpoint before it (then the stop is what happened, and the
    error is named after it); a stop record written after the error is the launcher ending the
    other ranks because of it. A step directory with no commit record, newer than every complete
    one, is a save that was killed. Then a stop; then ranks that ended without a word (killed:
    one of them is a failure, all of them a kill from outside)."""
    if f.holder:
        return State("running", f"running: {f.holder}")
    if f.finished:
        return State("finished", "finished" + (f" at step {f.finished_step}" if f.finished_step is not None else "")
                     + " (result.json)")
    errors = sorted((e for e in f.errors if _since(f, e.time)), key=lambda e: e.time)
    stopped = (f.stop is not None or f.stop_unreadable) and _since(f, f.stop_written)
    stop_t = (f.stop.committed_at or f.stop.received_at if f.stop is not None else None) or f.stop_written
    # The cause: an error that is not a peer's death, else a rank killed without a word, else a victim.
    cause = next((e for e in errors if not says_peer_lost(e.line)), None)
    if errors and not (stopped and f.stop is not None and f.stop.checkpoint and stop_t is not None
                       and stop_t <= errors[0].time):
        if cause is None and f.silent:
            return State("failed", f"failed: {_killed(f.silent[0])}")
        return State("failed", f"failed: {_failure_line(cause or errors[0])}")
    if f.unsaved is not None and _since(f, f.unsaved[1]):
        return State("aborted", f"aborted during the save of step {f.unsaved[0]}: killed before its commit record "
                                f"was written (a second Ctrl-C, kill -9?); {rundir.CHECKPOINTS}/step-{f.unsaved[0]} "
                                f"is incomplete")
    if stopped:
        then = f"; then failed: {_failure_line(cause or errors[0])}" if errors else ""
        return State("stopped", _stop_line(f.stop) + then)
    if f.silent and len(f.silent) < f.world:
        return State("failed", f"failed: {_killed(f.silent[0])}")
    if f.silent:
        return State("killed", "killed: every rank ended without a word, a result or a stop record (a second "
                               "Ctrl-C, kill -9, a lost machine?)")
    if f.launch is None:
        return State("new", "not started (no rank has run in it)")
    return State("ended", "ended without a result, a stop record or an error")


def _killed(rank: int) -> str:
    return (f"rank {rank} ended without a word and recorded no error: killed by a signal (kill -9, the "
            f"out-of-memory killer?) or a lost machine (its log: {rundir.LOGS}/rank-{rank}.log)")


def gather(run_dir: Path) -> tuple[Facts, list[str]]:
    """The facts of ``run_dir`` and what of them could not be read (named by ``status``)."""
    unread: list[str] = []
    holder = rundir.busy(run_dir)
    res, _ = result.read(run_dir)     # a damaged result.json still means finished
    rec, stop_problem = stop.read(run_dir)
    if stop_problem is not None:
        unread.append(f"{stop.NAME} {stop_problem}")
    launch = ranks.last_step(run_dir)
    start = ranks.launch_start(launch)
    errors = tuple(RankError(r, t, ranks.error_line(run_dir, r, 0.0) or "(an empty error file)")
                   for r, t in sorted(ranks.error_times(run_dir).items()))
    fresh = {e.rank for e in errors if start is None or e.time >= start - SLACK_S}
    silent = tuple(r.rank for r in launch if not r.said_its_end and r.rank not in fresh)
    infos = store.scan(run_dir)
    newest = next((i.step for i in infos if i.complete), -1)
    unsaved = None
    for info in infos:   # newest first
        if info.step <= newest:
            break
        if not (info.path / store.COMMIT).exists():
            try:
                unsaved = (info.step, os.stat(info.path).st_mtime)
            except OSError:
                continue
            break
    return Facts(holder=holder, finished=res is not None, finished_step=result.steps(res) if res else None,
                 stop=rec, stop_unreadable=stop_problem is not None, stop_written=stop.written_at(run_dir),
                 launch=start, world=len(launch), errors=errors, silent=silent, unsaved=unsaved), unread


def age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def kept_point(run_dir: Path, lead: str = "the same command resumes from") -> str | None:
    """What a rerun resumes from when the code's framework keeps the run's checkpoints
    (``keeper.json``: a Trainer's ``output_dir``, through hpc_train.huggingface), else None."""
    from hpc_train.records import keeper as keeper_record
    keeper, _problem = keeper_record.read(run_dir)
    if keeper is None:
        return None
    newest = keeper_record.newest_complete(keeper)
    if newest is None:
        return f"no complete checkpoint in the Trainer's output_dir {keeper.directory}: a rerun starts from step 0"
    return f"{lead} step {newest.step}: the Trainer's {newest.path} (hpc_train keeps none for it)"


def rerun(run_dir: Path, reports_steps: bool) -> str:
    """What the same command (``--resume latest``) does if run again now: resume from a step,
    start over, or be refused, and why. ``reports_steps``: the code reported steps to hpc_train
    (its own loop on ``hpc_train.init()``); a script that does not is run again from its own
    start, whatever it saved itself."""
    try:
        cfg = config_mod.load(Path(run_dir) / rundir.CONFIG)
    except UsageError:
        cfg = None   # unreadable: the rerun has nothing to compare its config with either
    try:   # reads the chosen checkpoint's checksums, as `run` does, up to a size (see predict)
        plan, verified = prelaunch.predict(run_dir, cfg, expected(cfg) if cfg is not None else None)
    except UsageError as e:
        return f"refused: {e}"
    if plan.finished:
        return f"refused: the run finished ({result.NAME}), so the same command does nothing; --resume none starts over"
    kept = kept_point(run_dir)   # the Trainer's, whatever hpc_train kept before: its resume is the one that runs
    if kept is not None:
        return kept
    if plan.source is not None:
        saved = plan.source.record.get("time")
        old = f" (checkpoint {age(time.time() - saved)} old)" if isinstance(saved, (int, float)) else ""
        unread = "" if verified else (f"; its {plan.source.size / 2**30:.1f} GiB were not read here: its "
                                      f"checksums are checked as it loads, and a damaged one falls back to the "
                                      f"one before")
        return f"the same command resumes from step {plan.source.step}{old}{unread}"
    if cfg is None:
        return (f"no hpc_train checkpoint: a rerun starts from the start ({rundir.CONFIG} cannot be read, so "
                f"whether the code keeps checkpoints of its own cannot be told)")
    if (cfg.train.script or cfg.train.fn) and not reports_steps:
        what = "script" if cfg.train.script else "function"
        return (f"the same command runs the {what} again from its start; hpc_train holds no checkpoint of it "
                f"(it resumes from what it saved itself, if anything)")
    return "no checkpoint: a rerun starts from step 0"
