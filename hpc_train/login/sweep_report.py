"""A sweep's live table (``status SWEEP_DIR``) and its results (``sweep summary SWEEP_DIR``). No torch.

``status`` never blocks: one pass, two scheduler calls for the whole sweep however many tasks
and resubmissions it has (``squeue -r`` and ``sacct`` over the array ids, see
:func:`scheduler.query_tasks`), then each task's own files. The state shown combines both, so a
task is COMPLETED only if it wrote ``result.json``: a task that exited 0 without finishing is
FAILED (hydra #1928 reported failed jobs as COMPLETED).
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train import rundir
from hpc_train.login import scheduler
from hpc_train.errors import UsageError
from hpc_train.logs import records
from hpc_train.records import result as result_record

# Ended without finishing: what --resubmit-failed takes. A PREEMPTED that is final was not requeued.
UNFINISHED_STATES = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                     "PREEMPTED", "REVOKED", "UNKNOWN"}
NO_ANSWER = "NO_ANSWER"   # not finished, and squeue did not answer: it may be live, never resubmitted
_TAIL_BYTES = 16384   # status reads only the end of metrics.jsonl: 100 tasks must answer in < 2 s


@dataclass
class TaskRow:
    index: int
    overrides: str
    run_dir: str
    job: str
    state: str
    step: int | None
    value: float | None       # the latest value of the metric asked for
    restarts: int
    finished: bool

    @property
    def resubmittable(self) -> bool:
        return not self.finished and self.state in UNFINISHED_STATES


MANIFEST = rundir.SWEEP_MANIFEST


def read_manifest(sweep_dir: Path) -> dict[str, Any]:
    path = Path(sweep_dir) / MANIFEST
    from hpc_train.records.io import read_json
    rec, problem = read_json(path)
    if rec is None and problem is None:
        raise UsageError(f"{sweep_dir} is not a sweep directory (no {MANIFEST}); give the --run-dir of a sweep")
    if rec is not None:
        problem = _manifest_problem(rec)
    if rec is None or problem is not None:
        raise UsageError(f"{path} {problem}; it is the sweep's index of tasks, and cannot be read without it")
    return rec


def _manifest_problem(rec: dict[str, Any]) -> str | None:
    tasks = rec.get("tasks")
    if not isinstance(tasks, list) or not isinstance(rec.get("submissions", []), list):
        return "has no list of tasks and submissions"
    for i, t in enumerate(tasks):
        if not (isinstance(t, dict) and isinstance(t.get("index"), int) and isinstance(t.get("run_dir"), str)
                and isinstance(t.get("overrides"), dict) and isinstance(t.get("jobs", []), list)
                and all(isinstance(j, str) for j in t.get("jobs", []))):
            return f"has task {i} without an index, run_dir, overrides and list of job ids"
    return None


def is_sweep(path: Path) -> bool:
    return (Path(path) / MANIFEST).exists()


def _records(run_dir: Path, tail: bool) -> list[dict[str, Any]]:
    """The run's metrics records through their one reader (:func:`hpc_train.logs.records`); with
    ``tail``, from the file's last bytes only."""
    return list(records(run_dir / rundir.METRICS, tail_bytes=_TAIL_BYTES if tail else None))


def _latest(run_dir: Path, metric: str, tail: bool) -> tuple[int | None, float | None]:
    """(last step logged, latest value of ``metric``): result.json's value when the run finished,
    else the last record of metrics.jsonl that has it."""
    recs = _records(run_dir, tail)
    step = next((r["step"] for r in reversed(recs) if isinstance(r.get("step"), int)), None)
    value = None
    done, _ = result_record.read(run_dir)
    value = done.get(metric) if done else None
    if not isinstance(value, (int, float)):
        value = next((r[metric] for r in reversed(recs) if isinstance(r.get(metric), (int, float))), None)
    return step, value


def _state(st: scheduler.JobState | None, finished: bool) -> str:
    if st is not None and not st.final:
        return st.state.split()[0]           # PENDING, RUNNING, REQUEUED, ...: live wins
    if finished:
        return "COMPLETED"
    if st is None:
        return "UNKNOWN"
    state = st.state.split()[0]              # "CANCELLED by 0" -> CANCELLED
    return "FAILED" if state == "COMPLETED" else state   # exit 0 without result.json is no success


def task_rows(manifest: dict[str, Any], metric: str = "loss", tail: bool = True,
              ask_scheduler: bool = True) -> tuple[list[TaskRow], str | None]:
    """One row per task, from two scheduler calls (none with ``ask_scheduler=False``: then a
    task is COMPLETED or UNFINISHED by its files alone) and each task's files; and the queries
    that did not answer, if any (an unfinished task squeue could not be asked about is
    NO_ANSWER: it may still run, so it is never resubmitted)."""
    jobs = [t["jobs"][-1] for t in manifest["tasks"] if t.get("jobs")]
    answer = scheduler.query_tasks(jobs) if ask_scheduler else scheduler.Answer()
    rows = []
    for t in manifest["tasks"]:
        run_dir = Path(t["run_dir"])
        job = t["jobs"][-1] if t.get("jobs") else ""
        st = answer.states.get(job)
        finished = result_record.finished(run_dir)
        step, value = _latest(run_dir, metric, tail)
        if not ask_scheduler:
            state = "COMPLETED" if finished else "UNFINISHED"
        elif answer.live(job) is None:
            state = "COMPLETED" if finished else NO_ANSWER
        else:
            state = _state(st, finished)
        rows.append(TaskRow(t["index"], " ".join(f"{k}={v}" for k, v in t["overrides"].items()), str(run_dir),
                            job, state, step, value, st.restarts if st else 0, finished))
    return rows, answer.failed


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.6g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines) + "\n"


def print_status(sweep_dir: Path, metric: str = "loss") -> int:
    """``python -m hpc_train status SWEEP_DIR``."""
    rows, failed = task_rows(read_manifest(sweep_dir), metric)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    print(f"sweep {sweep_dir}: {len(rows)} tasks ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})")
    sys.stdout.write(_table(
        ["task", "state", "job", "step", metric, "restarts", "overrides"],
        [[str(r.index), r.state, r.job or "-", "-" if r.step is None else str(r.step), _fmt(r.value),
          str(r.restarts), r.overrides] for r in rows]))
    if failed:
        print(f"the scheduler did not answer ({failed}): a task shown {NO_ANSWER} may still be live")
    if any(r.resubmittable for r in rows):
        print(f"resubmit the failed tasks: python -m hpc_train submit --resubmit-failed {sweep_dir}")
    return 0


def summary(sweep_dir: Path, metric: str, descending: bool, csv_path: Path | None) -> list[TaskRow]:
    """Rows sorted by ``metric`` (tasks without a value last); the CSV has one column per override key."""
    manifest = read_manifest(sweep_dir)
    # Whole files here (not a tail): an eval metric may be logged once per epoch, far back.
    # Files only, no scheduler: results stay readable when the cluster has forgotten the jobs.
    rows, _ = task_rows(manifest, metric, tail=False, ask_scheduler=False)
    sign = -1 if descending else 1
    rows.sort(key=lambda r: (r.value is None or math.isnan(r.value), sign * (r.value or 0.0), r.index))
    keys = list(dict.fromkeys(k for t in manifest["tasks"] for k in t["overrides"]))
    by_index = {t["index"]: t for t in manifest["tasks"]}
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["rank", "task", metric, "step", "state", *keys, "run_dir"])
    for n, r in enumerate(rows, 1):
        ov = by_index[r.index]["overrides"]
        w.writerow([n, r.index, "" if r.value is None else repr(r.value), "" if r.step is None else r.step, r.state,
                    *(ov.get(k, "") for k in keys), r.run_dir])
    out = csv_path or Path(sweep_dir) / "summary.csv"
    from hpc_train.rundir import write_atomic
    write_atomic(out, buf.getvalue())
    return rows


def cmd_sweep(args: argparse.Namespace) -> int:
    """``python -m hpc_train sweep summary SWEEP_DIR [--metric M] [--descending] [--csv PATH]``."""
    sweep_dir = Path(args.sweep_dir)
    csv_path = Path(args.csv) if args.csv else None
    if csv_path is not None and csv_path.is_dir():
        raise UsageError(f"--csv {csv_path} is a directory; give a file name")
    rows = summary(sweep_dir, args.metric, args.descending, csv_path)
    if all(r.value is None for r in rows):
        print(f"hpc_train: warning: no task has logged {args.metric!r} yet", file=sys.stderr)
    order = "highest" if args.descending else "lowest"
    print(f"sweep {sweep_dir}: {len(rows)} tasks by {args.metric} ({order} first)")
    sys.stdout.write(_table(["rank", "task", args.metric, "step", "state", "overrides"],
                            [[str(n), str(r.index), _fmt(r.value), "-" if r.step is None else str(r.step), r.state,
                              r.overrides] for n, r in enumerate(rows, 1)]))
    print(f"csv: {csv_path or sweep_dir / 'summary.csv'}")
    return 0
