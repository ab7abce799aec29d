"""``status``, ``logs`` and ``cancel``: follow jobs from the login node. No torch here.

A target is a run directory (its ``job.json`` names its jobs) or a job id (the run directory is
found among ``runs/*``). Scheduler calls are batched across every job shown (see
:mod:`hpc_train.scheduler`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from hpc_train.login import scheduler
from hpc_train.errors import UsageError
from hpc_train.logs import read_metrics


def _resolve(target: str | None) -> list[tuple[Path | None, list[str]]]:
    """(run_dir, job ids) pairs for a run dir, a job id, or every run under runs/."""
    if target is None:
        # Every run under runs/: submitted ones (job.json) and local ones (config.yaml only).
        runs = sorted({p.parent for pattern in ("*/job.json", "*/config.yaml") for p in Path("runs").glob(pattern)})
        if not runs:
            raise UsageError("status: no runs under runs/; give a RUN_DIR or a JOB_ID")
        return [(r, scheduler.job_ids(r)) for r in runs]
    p = Path(target)
    if p.is_dir():
        return [(p, scheduler.job_ids(p))]
    if target.replace("_", "").isdigit():
        for rec in Path("runs").glob("*/job.json"):
            if target in scheduler.job_ids(rec.parent):
                return [(rec.parent, [target])]
        return [(None, [target])]
    raise UsageError(f"{target!r} is neither a run directory nor a Slurm job id")


def _budget_line(run_dir: Path) -> str:
    path = run_dir / "requeue.json"
    if not path.exists():
        return ""
    rec = json.loads(path.read_text())
    counts = ", ".join(f"{k} {v}" for k, v in rec.get("counts", {}).items())
    return f"requeues: {counts}" if counts else ""


def cmd_status(args: argparse.Namespace) -> int:
    from hpc_train.login import sweep_report
    if args.target is not None and sweep_report.is_sweep(Path(args.target)):
        return sweep_report.print_status(Path(args.target))
    pairs = _resolve(args.target)
    states = scheduler.query([j for _, ids in pairs for j in ids]) if any(ids for _, ids in pairs) else {}
    for run_dir, ids in pairs:
        print(f"{run_dir or '(unknown run directory)'}")
        for jid in ids[-1:] if run_dir else ids:
            st = states.get(jid)
            if st is None:
                print(f"  job {jid}: not known to the scheduler (finished long ago, or another cluster)")
            else:
                extra = f", reason {st.reason}" if st.reason and st.reason != "None" else ""
                print(f"  job {jid}: {st.state} on {st.nodes or '-'}, elapsed {st.elapsed or '-'}, "
                      f"restarts {st.restarts}{extra}")
        if run_dir is None:
            continue
        if not ids:
            print(f"  local run: {_local_state(run_dir)}")
        elif not (run_dir / "result.json").exists():
            print(f"  if it stops: {resume_point(run_dir)}")
        steps = [m for m in read_metrics(run_dir) if "loss" in m]
        if steps:
            last = steps[-1]
            epoch = f", epoch {last['epoch']}" if "epoch" in last else ""
            print(f"  last step {last['step']}{epoch}, loss {last['loss']:.4f}")
        evals = [m for m in read_metrics(run_dir) if "eval_acc" in m]
        if evals:
            print(f"  last eval: accuracy {evals[-1]['eval_acc']:.4f} at step {evals[-1]['step']}")
        if (run_dir / "result.json").exists():
            print("  finished: result.json written")
        budget = _budget_line(run_dir)
        if budget:
            print(f"  {budget}")
        from hpc_train import goodput
        if getattr(args, "goodput", False):
            print("  " + goodput.table(run_dir).replace("\n", "\n  "))
        else:
            line = goodput.summary_line(run_dir)
            if line:
                print(f"  {line}")
    return 0


def _local_state(run_dir: Path) -> str:
    """A run without a Slurm job: running (its lock is held), finished, stopped, or ended."""
    from hpc_train import rundir
    holder = rundir.busy(run_dir)
    if holder:
        return f"running: {holder}"
    if (run_dir / rundir.RESULT).exists():
        return "finished"
    stopped = run_dir / rundir.STOPPED
    if stopped.exists():
        try:
            rec = json.loads(stopped.read_text())
        except ValueError:
            rec = {}
        at = f" at step {rec['steps']}" if rec.get("steps") is not None else ""
        return f"stopped{at} by {rec.get('stop_signal', 'a signal')}; {resume_point(run_dir)}"
    return f"not running (ended without a result: see logs/rank-*.error); {resume_point(run_dir)}"


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def resume_point(run_dir: Path) -> str:
    """What running the job again in ``run_dir`` starts from: the newest complete checkpoint (its
    size record; resume also checks its checksums), or nothing. A script's own snapshots are
    invisible to hpc_train, so for a script only its hpc_train checkpoints are named."""
    import yaml

    from hpc_train.ckpt import store
    newest = store.newest_complete(run_dir)
    if newest is not None:
        saved = newest.record.get("time")
        age = f" (checkpoint {_age(time.time() - saved)} old)" if isinstance(saved, (int, float)) else ""
        return f"the same command resumes from step {newest.step}{age}"
    try:
        train = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("train") or {}
        own_code = bool(train.get("script") or train.get("fn"))
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        own_code = False
    if own_code:
        return "no hpc_train checkpoint: the code resumes from its own checkpoints, if it keeps any"
    return "no checkpoint: a rerun starts from step 0"


def _log_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "logs" / f"rank-{rank}.log"


def cmd_logs(args: argparse.Namespace) -> int:
    (run_dir, ids), = _resolve(args.target)
    if run_dir is None:
        raise UsageError(f"logs: job {args.target} is not in any run directory under runs/; give the RUN_DIR")
    path = _log_path(run_dir, args.rank)
    if not args.follow:
        if not path.exists():
            raise UsageError(f"logs: {path} does not exist yet (has rank {args.rank} started?)")
        sys.stdout.write(path.read_text())
        return 0
    # Follow: print what exists, then poll for more until the job is final (backing off).
    pos, delay, last_query = 0, 0.2, 0.0
    try:
        while True:
            if path.exists():
                with path.open() as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                if chunk:
                    sys.stdout.write(chunk)
                    sys.stdout.flush()
                    delay = 0.2
            if not ids and not chunk_pending(path, pos):
                from hpc_train import rundir
                if rundir.busy(run_dir) is None:     # a local run that ended (or never ran): all read
                    return 0
            if ids and time.monotonic() - last_query > 10:
                last_query = time.monotonic()
                st = scheduler.query(ids[-1:]).get(ids[-1])
                if st is not None and st.final and st.state.split()[0] != "PREEMPTED":
                    return 0
            time.sleep(delay)
            delay = min(2.0, delay * 1.5)
    except KeyboardInterrupt:
        return 0


def chunk_pending(path: Path, pos: int) -> bool:
    try:
        return path.stat().st_size > pos
    except OSError:
        return False


def cmd_cancel(args: argparse.Namespace) -> int:
    (run_dir, ids), = _resolve(args.target)
    if not ids:
        raise UsageError(f"cancel: {run_dir} has no submitted job (job.json)")
    live = [j for j, st in scheduler.query(ids).items() if not st.final]
    if not live:
        print(f"nothing to cancel: {', '.join(ids)} already ended")
        return 0
    out = subprocess.run(["scancel", *live], capture_output=True, text=True)
    if out.returncode != 0:
        raise UsageError(f"scancel failed: {out.stderr.strip()}")
    print(f"cancelled {', '.join(live)}")
    return 0
