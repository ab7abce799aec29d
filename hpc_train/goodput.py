"""The goodput ledger: where a run's wall time went, continuous across requeues and restarts.

``RUN_DIR/goodput.json`` holds one *segment* per start of the job's processes (rank 0 writes
it: at start, after every checkpoint save and at exit), plus the time of the first submit
(``job.json`` under Slurm; the local launcher's start otherwise). From it, the wall time since
the first submit splits exactly into:

* **training**: steps whose results were kept;
* **redone**: steps trained after the last checkpoint before a crash, trained again after the
  restart (taken from the ``metrics.jsonl`` lines the restart drops, so it is measured, not
  estimated). A graceful stop saves at its step, so a preemption redoes nothing;
* **start-up**: process start (job start under Slurm) to the first step, less the load;
* **recovery**: the same for a job step restarted in place after a failure (see
  :mod:`hpc_train.login.decide`): from the failed step's exit to the first step again;
* **checkpoint**: save time that blocked training, and the load on resume;
* **exit**: from the last step (or the stop's save) until every process has exited, as the
  local launcher or the batch shell's requeue hook sees it;
* **between runs**: pending in the queue, requeue, and any gap between one run and the next.

The parts add up to the wall time by construction; a segment that ended without writing its
end (kill -9, node loss) ends at its last ``metrics.jsonl`` line. Torch-free: ``status`` reads it.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from hpc_train import rundir
from hpc_train.errors import show
from hpc_train.records import fields

if TYPE_CHECKING:
    from hpc_train.records.requeue import InPlace

FILE = "goodput.json"    # this module is its owner: Ledger writes, read() reads
PARTS = ("training", "redone", "start-up", "recovery", "checkpoint", "exit", "between runs")


# Start-up milestones of this process (time.time()), set as they pass (see :func:`mark`); the
# ledger copies them into its segment so a restart's phases can be read back per run.
_marks: dict[str, float] = {}


def mark(name: str) -> None:
    """Record that start-up milestone ``name`` passed now (the first time only). Milestones:
    ``worker`` (hpc_train's worker entered: interpreter and launcher done), ``torch`` (torch
    imported), ``group`` (process group ready), ``restore`` (restore called: model and data
    built), ``loaded`` (checkpoint loaded). The first step is the segment's ``first_step``."""
    _marks.setdefault(name, time.time())


_gc_paused = False


def pause_gc() -> None:
    """Turn the cyclic garbage collector off for start-up (until :func:`resume_gc`), in
    processes hpc_train started (its worker), never in a user's own interpreter. Importing torch
    and ``torch._dynamo`` (DDP and every optimizer import it) creates about half a million
    long-lived objects, and the collector rescans the growing heap again and again while they
    pile up (benchmarks/preemption.py shows the start-up phases)."""
    global _gc_paused
    if gc.isenabled():
        gc.disable()
        _gc_paused = True


def resume_gc() -> None:
    """Start-up is over (the checkpoint is restored, or the user's code is about to run): what
    start-up made is frozen (``gc.freeze``: kept out of every later collection, so it is never
    rescanned), then the collector runs as usual. A full collection instead would scan it all
    once more, hundreds of thousands of objects per rank. The cost is that start-up's own
    garbage cycles are never freed: small objects (functions, tuples, types; no tensor data).
    A no-op unless :func:`pause_gc` turned the collector off."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


def process_start_time() -> float:
    """When this job incarnation started: Slurm's job start, else this process's start (so
    interpreter start-up and imports count as start-up), else now."""
    env = os.environ.get("SLURM_JOB_START_TIME") or os.environ.get(rundir.LAUNCHED_AT_ENV)
    if env:
        try:
            return float(env)
        except ValueError:
            pass
    return own_start_time()


_began: float | None = None   # a standby's go (launch.standby): its start-up counts from there


def began_at(t: float) -> None:
    """This process begins its run now, though started earlier (a standby task's go)."""
    global _began
    _began = t


def own_start_time() -> float:
    """This process's start (from /proc, 10 ms resolution), else now; a standby's go instead."""
    if _began is not None:
        return _began
    try:
        # /proc/self/stat field 22: the start, in clock ticks after boot; /proc/uptime: now, after
        # boot (10 ms resolution; /proc/stat's btime is whole seconds, too coarse to subtract).
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError):
        return time.time()


_NUMBERS = ("start", "end", "first_step", "load_s", "save_block_s", "redone_s", "redone_steps", "step_from",
            "step_to", "exited")


def _is_num(v: object) -> TypeGuard[float]:
    """A time, a duration or a step of the ledger: JSON lets outside hands write NaN, Infinity or
    1e300, which no sum (and no localtime) survives."""
    return fields.is_time(v)


def _problem(rec: dict[str, Any]) -> str | None:
    """What is wrong with a parsed ledger's fields (every field read later), if anything."""
    segs = rec.get("segments")
    if not isinstance(segs, list):
        return "has no list of segments"
    if "first_submit" in rec and not _is_num(rec["first_submit"]):
        return f"first_submit is {rec['first_submit']!r}, not a time"
    for i, seg in enumerate(segs):
        if not isinstance(seg, dict) or not _is_num(seg.get("start")):
            return f"segment {i} is not an object with a numeric start"
        bad = next((k for k in _NUMBERS if seg.get(k) is not None and not _is_num(seg[k])), None)
        if bad is not None:
            return f"segment {i}'s {bad} is {show(seg[bad], 40)}, not a time, duration or step"
        if not isinstance(seg.get("marks", {}), dict):
            return f"segment {i}'s marks is not an object"
    return None


def read(run_dir: Path) -> tuple[dict[str, Any], str | None]:
    """The ledger, checked: (record, None); an empty one when there is none; (an empty one, what
    is wrong) when ``goodput.json`` is damaged."""
    from hpc_train.records.io import read_json
    rec, problem = read_json(Path(run_dir) / FILE)
    if rec is not None:
        problem = _problem(rec)
    if rec is None or problem is not None:
        return {"segments": []}, problem
    return rec, None


def _read(run_dir: Path) -> dict[str, Any]:
    return read(run_dir)[0]


def _first_submit(run_dir: Path, fallback: float) -> float:
    from hpc_train.records import jobs
    first = jobs.first_submit(run_dir)
    return fallback if first is None else first


def dropped_steps(metrics: Path, keep_through_step: int) -> tuple[int, float, float | None]:
    """The training lines of ``metrics.jsonl`` after ``keep_through_step`` (about to be dropped
    by a resume): (how many, the wall time they span from the kept step's line, the last line's
    time). Read before the Monitor truncates the file."""
    from hpc_train.logs import records
    times: dict[int, float] = {}
    for rec in records(metrics):   # the one reader: any bytes, a line that is not a record skipped
        try:
            step, t = rec["step"], float(rec["time"])
        except (ValueError, KeyError, TypeError, OverflowError):
            continue
        if fields.is_time(t):
            times[step] = max(t, times.get(step, t))   # an eval line comes after its step's
    later = [s for s in times if s > keep_through_step]
    if not later:
        return 0, 0.0, max(times.values(), default=None)
    last = max(times[s] for s in later)
    start = times.get(keep_through_step, min(times[s] for s in later))
    return len(later), max(0.0, last - start), last


def _restarted_in_place(run_dir: Path, segments: list[object]) -> InPlace | None:
    """The in-place restart (``requeue.json``'s entry) that started this process's job step: the
    batch shell's hook recorded it after the previous segment began; None when there is none."""
    prev = segments[-1].get("start") if segments and isinstance(segments[-1], dict) else None
    if not _is_num(prev):
        return None
    from hpc_train.records import requeue
    return next((e for e in reversed(requeue.read(run_dir).in_place) if e.time > prev), None)


class Ledger:
    """Rank 0's writer for this process's segment. Every method is cheap and never raises:
    accounting must not end a training run."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / FILE
        self.run_dir = Path(run_dir)
        started = process_start_time()
        self.rec, problem = read(self.run_dir)
        if problem is not None:    # kept, out of the way; accounting starts again from here
            import logging

            from hpc_train.rundir import set_aside
            set_aside(self.path, problem, logging.getLogger("hpc_train").warning)
        self.rec.setdefault("first_submit", _first_submit(self.run_dir, started))
        self.seg: dict[str, Any] = {"start": started, "first_step": None, "end": None, "load_s": 0.0,
                                    "save_block_s": 0.0, "redone_s": 0.0, "redone_steps": 0, "step_from": None,
                                    "step_to": None, "closed": False,
                                    "marks": {"process": round(own_start_time(), 3)}}
        restart = _restarted_in_place(self.run_dir, self.rec["segments"])
        if restart is not None:
            self.seg["in_place"] = True
            if restart.swap:    # a straggler's node swapped for a spare (issue 31): its recovery is the swap's cost
                self.seg["swap"] = " -> ".join(restart.swap)
        self.rec["segments"].append(self.seg)

    def restored(self, step: int, load_s: float) -> None:
        """After restore: the load's time, and the steps the last segment trained past ``step``
        that this one trains again (charged to the segment that trained them)."""
        self.seg["load_s"] = round(load_s, 4)
        self.seg["step_from"] = step
        mark("loaded")
        self.seg["marks"].update({k: round(v, 3) for k, v in _marks.items()})
        n, span, last = dropped_steps(self.run_dir / rundir.METRICS, step)
        prev = self.rec["segments"][-2] if len(self.rec["segments"]) > 1 else None
        if prev is not None:
            if n:
                prev["redone_steps"], prev["redone_s"] = n, round(span, 4)
            if not prev.get("closed") and last is not None:
                prev["end"] = max(prev.get("end") or 0.0, last)   # died without writing its end
        self._write()

    def step(self, step: int) -> None:
        self.seg["step_to"] = step
        if self.seg["first_step"] is None:
            self.seg["first_step"] = time.time()
            if self.seg["step_from"] is None:
                self.seg["step_from"] = step - 1
            self._write()   # once per run: the restart's last phase is on disk as soon as it ends

    def saved(self, blocked_s: float) -> None:
        self.seg["save_block_s"] = round(self.seg["save_block_s"] + blocked_s, 4)
        self.seg["end"] = time.time()
        self._write()

    def close(self) -> None:
        self.seg["end"], self.seg["closed"] = time.time(), True
        self._write()

    def _write(self) -> None:
        from hpc_train.rundir import write_atomic
        try:
            write_atomic(self.path, json.dumps(self.rec, indent=1))
        except OSError:
            pass   # a full disk is reported by the checkpoint that fails, not by the ledger

    def training_share(self) -> float | None:
        """The share of the wall time so far that was training (from memory, not the file)."""
        b = _breakdown(self.rec, time.time())
        return None if b is None or b["wall_s"] <= 0 else b["parts"]["training"] / b["wall_s"]


def exited(run_dir: Path, since: float) -> None:
    """The launcher (local) or the batch shell's hook (Slurm), once every process has exited:
    the newest segment, if it began after ``since``, ends now (the processes' own teardown, and
    a killed rank 0 that never wrote its end, count up to here). Never raises."""
    from hpc_train.rundir import write_atomic
    try:
        rec, problem = read(Path(run_dir))
        if problem is None and rec["segments"] and float(rec["segments"][-1].get("start", 0)) >= since - 1.0:
            rec["segments"][-1]["exited"] = time.time()
            write_atomic(Path(run_dir) / FILE, json.dumps(rec, indent=1))
    except (OSError, ValueError, TypeError):
        pass


def record_segment(run_dir: Path, since: float) -> None:
    """A process that ran no Run (a supervised script that never called ``init()``): record its
    segment, start to now, unless the script's own ledger wrote one after ``since``. Never raises."""
    try:
        rec = _read(Path(run_dir))
        last = rec["segments"][-1] if rec["segments"] else {}
        # Told by the writer's own process start: a segment's start is the launch's (the launcher's
        # or the Slurm job's, before ``since``), the same for a script's Run and for a step
        # restarted in place. /proc's start times have 10 ms ticks.
        began = (last.get("marks") or {}).get("process", last.get("start", 0))
        if last and float(began) >= since - 0.05:
            return
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    Ledger(Path(run_dir)).close()


def job_start(env: Mapping[str, str]) -> float:
    """This job's start (Slurm's SLURM_JOB_START_TIME where set); 0 when unknown."""
    try:
        return float(env.get("SLURM_JOB_START_TIME") or 0)
    except ValueError:
        return 0.0


def breakdown(run_dir: Path, now: float | None = None) -> dict[str, Any] | None:
    """Seconds per part (see the module docstring), the wall time and the number of runs; None
    when the run has no ledger. A segment still running counts up to ``now``."""
    return _breakdown(_read(Path(run_dir)), time.time() if now is None else now)


def _breakdown(rec: dict[str, Any], now: float) -> dict[str, Any] | None:
    segs = [s for s in rec["segments"] if isinstance(s, dict) and isinstance(s.get("start"), (int, float))]
    if not segs:
        return None
    parts = dict.fromkeys(PARTS, 0.0)
    prev_end = float(rec["first_submit"] if "first_submit" in rec else segs[0]["start"])
    first = prev_end
    for i, s in enumerate(segs):
        start = max(float(s["start"]), prev_end)
        end = s.get("end") or (now if i == len(segs) - 1 else start)
        end = max(float(end), start)
        parts["between runs"] += start - prev_end
        fs = s.get("first_step")
        fs = min(max(float(fs), start), end) if fs else end
        load = min(float(s.get("load_s") or 0.0), fs - start)
        parts["recovery" if s.get("in_place") else "start-up"] += fs - start - load
        block = min(float(s.get("save_block_s") or 0.0), end - fs)
        redone = min(float(s.get("redone_s") or 0.0), end - fs - block)
        parts["checkpoint"] += load + block
        parts["redone"] += redone
        parts["training"] += end - fs - block - redone
        gone = s.get("exited")
        if isinstance(gone, (int, float)) and gone > end:
            parts["exit"] += gone - end
            end = float(gone)
        prev_end = end
    wall = prev_end - first
    return {"wall_s": wall, "parts": parts, "runs": len(segs),
            "redone_steps": sum(int(s.get("redone_steps") or 0) for s in segs),
            "swaps": [str(s["swap"]) for s in segs if s.get("swap")],
            "stepped": any(s.get("first_step") for s in segs)}


# A run that never reported a step (a script that does not call run.step_end) has no first
# step to split start-up from training: its wall time would all read as start-up.
_NO_STEPS = ("n/a: no step was reported to hpc_train (the code never called run.step_end), so its training "
             "cannot be told from its start-up")


def _runs(b: dict[str, Any]) -> str:
    return f"{b['runs']} run{'s' if b['runs'] != 1 else ''}"


def steps_reported(run_dir: Path) -> bool:
    """Whether any start of the run reported a step (the code's ``run.step_end``)."""
    b = breakdown(run_dir)
    return b is not None and b["stepped"]


def summary_line(run_dir: Path) -> str | None:
    b = breakdown(run_dir)
    if b is None or b["wall_s"] <= 0:
        return None
    if not b["stepped"]:
        return f"goodput: {_NO_STEPS} (wall {b['wall_s']:.0f} s, {_runs(b)})"
    pct = ", ".join(f"{100 * v / b['wall_s']:.1f}% {k}" for k, v in b["parts"].items())
    return f"goodput: {pct} (wall {b['wall_s']:.0f} s, {_runs(b)})"


def table(run_dir: Path) -> str:
    b = breakdown(run_dir)
    if b is None:
        return f"{run_dir}: no {FILE} (the run has not started)"
    if not b["stepped"]:
        return f"goodput: {_NO_STEPS}\nwall {b['wall_s']:.1f} s; runs: {b['runs']}"
    rows = [f"{'part':<14}{'seconds':>10}{'share':>9}"]
    for k, v in b["parts"].items():
        rows.append(f"{k:<14}{v:>10.1f}{100 * v / max(b['wall_s'], 1e-9):>8.1f}%")
    rows.append(f"{'wall':<14}{b['wall_s']:>10.1f}{100.0:>8.1f}%")
    swaps = f"; straggler swaps: {len(b['swaps'])} ({', '.join(b['swaps'])})" if b["swaps"] else ""
    rows.append(f"runs: {b['runs']}; steps redone after a restart: {b['redone_steps']}{swaps}")
    return "\n".join(rows)
