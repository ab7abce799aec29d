"""``status``, ``logs`` and ``cancel``: follow jobs from the login node. No torch here.

A target is a run directory (its ``job.json`` names its jobs) or a job id (the run directory is
found among ``runs/*``). Scheduler calls are batched across every job shown (see
:mod:`hpc_train.login.scheduler`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

from hpc_train import rundir, slurm
from hpc_train.errors import UsageError
from hpc_train.login import outcome, scheduler
from hpc_train.logs import metrics_tail

if TYPE_CHECKING:
    from hpc_train.ckpt import store


def _resolve(target: str | None) -> list[tuple[Path | None, list[str]]]:
    """(run_dir, job ids) pairs for a run dir, a job id, or every run under runs/."""
    if target is None:
        # Every run under runs/: submitted ones (job.json) and local ones (config.yaml only).
        runs = sorted({p.parent for pattern in ("*/job.json", "*/config.yaml") for p in Path("runs").glob(pattern)})
        if not runs:
            raise UsageError("status: no runs under runs/; give a RUN_DIR or a JOB_ID")
        return [(r, _job_ids(r)) for r in runs]
    p = Path(target)
    if p.is_dir():
        return [(p, _job_ids(p))]
    if rundir.decimal(target.replace("_", "")) is not None:
        for rec in Path("runs").glob("*/job.json"):
            if target in scheduler.job_ids(rec.parent):
                return [(rec.parent, [target])]
        return [(None, [target])]
    raise UsageError(f"{target!r} is neither a run directory nor a Slurm job id")


def _job_ids(run_dir: Path) -> list[str]:
    """The run's jobs: job.json's (``submit``), else the Slurm job its rank 0 last ran in, as its
    record says (a rendered ``sbatch`` script, or the user's own ``srun``), so that such a run is
    shown as the job it is, with the scheduler's state, not as a local run."""
    ids = scheduler.job_ids(run_dir)
    if ids:
        return ids
    from hpc_train.records import ranks
    rec, _ = ranks.read(run_dir, 0)
    job = rec.job if rec is not None else ""
    return [job] if rundir.decimal(job, 12) is not None else []


def _budget_line(run_dir: Path, unread: list[str]) -> str:
    from hpc_train.records import requeue
    rec = requeue.read(run_dir)
    unread.extend(rec.problems)
    if not (rec.events or rec.in_place):
        return ""
    text = ", ".join(f"{k} {v}" for k, v in rec.counts.items())
    outside = [e.cause for e in rec.events if e.requeued and e.by == "outside"]
    if outside:   # a script's own scontrol requeue (Lightning's auto-requeue), seen in sacct by the hook
        text += f" ({', '.join(f'{c} {outside.count(c)}' for c in dict.fromkeys(outside))} of them requeued outside hpc_train)"
    if rec.in_place:   # restarts in the allocation (a failure, or a straggler's swap, each): see login.hook
        text += f"; restarts in place: failure {len(rec.failure_restarts())} (budget used {rec.in_place_used()})"
        swaps, slow = rec.swaps(), len(rec.in_place) - len(rec.failure_restarts())
        if slow:
            text += f", straggler {slow} ({len(swaps)} with a node swapped for a spare; none charged)"
        for e in swaps:     # a slow node swapped for a spare (issue 31)
            at = "an unknown step" if e.step is None else f"step {e.step}"
            text += f"; {e.swap[0]} swapped for {e.swap[1]} at {at} (a straggler; on {','.join(e.nodes or ())})"
        for e in rec.in_place:    # a lost node (see login.nodes): which, and the world size it left
            if e.world_before is not None and (e.lost or e.world_size != e.world_before):
                lost = ", ".join(e.lost) or "no node"
                at = "an unknown step" if e.step is None else f"step {e.step}"
                text += (f"; {lost} lost at {at} (world size {e.world_before} -> {e.world_size}, "
                         f"on {','.join(e.nodes or ())})")
    if rec.final:
        text += f"; {rec.final}"
    return f"requeues: {text}"


def _is_number(v: object) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _slowest(run_dir: Path, spread: Mapping[str, object]) -> str:
    """The slowest rank at the newest gathering of the ranks' own step times (issue 31)."""
    from hpc_train.records import ranks
    r, worst, median = spread.get("straggler_slowest_rank"), spread.get("straggler_max_s"), spread.get("straggler_median_s")
    if not (_is_number(r) and _is_number(worst) and _is_number(median)):
        return "slowest rank: unknown (the spread record is not numbers)"
    rec, _ = ranks.read(run_dir, int(r)) if 0 <= r < 1 << 20 else (None, None)
    return (f"slowest rank at step {spread['step']}: rank {int(r)} on {rec.node if rec else 'an unknown node'}, "
            f"own step time {1000 * worst:.1f} ms, median {1000 * median:.1f} ms")


def _num(v: object) -> str:
    """A logged value as status shows it: a number to 4 places, anything else as it is."""
    return f"{v:.4f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)


def _epoch(e: object) -> str:
    """The last step's epoch, as status shows it: a Trainer's is a fraction (0.0877...)."""
    return "" if e is None else f", epoch {e:.2f}" if isinstance(e, float) else f", epoch {e}"


def cmd_status(args: argparse.Namespace) -> int:
    from hpc_train.login import sweep_report
    from hpc_train.records import result
    if args.target is not None and sweep_report.is_sweep(Path(args.target)):
        return sweep_report.print_status(Path(args.target))
    pairs = _resolve(args.target)
    answer = scheduler.query([j for _, ids in pairs for j in ids])
    for run_dir, ids in pairs:
        print(f"{run_dir or '(unknown run directory)'}")
        for jid in ids[-1:] if run_dir else ids:
            print(f"  job {jid}: {_job_line(answer, jid)}")
        if run_dir is None:
            continue
        # What cannot be read is named at the end; everything else is still shown.
        unread: list[str] = []
        problem = scheduler.job_problem(run_dir)
        if problem is not None:
            unread.append(f"job.json {problem}")
        running = False
        if not ids:
            running = _local_state(run_dir, unread)
        elif not result.finished(run_dir):
            from hpc_train.ckpt import store
            newest = store.newest_complete(run_dir)
            print(f"  if it stops: {resume_point(run_dir, newest)}")
            restart = restart_point(run_dir, newest)
            if restart:
                print(f"  {restart}")
        tail = metrics_tail(run_dir)     # read from the end: a long run's file is big
        if tail.problem is not None:
            unread.append(f"{rundir.METRICS} {tail.problem}")
        last = tail.last_step
        if last is not None:
            epoch = _epoch(last.get("epoch"))
            t = last.get("time")
            ago = f" ({outcome.age(time.time() - t)} ago)" if running and isinstance(t, (int, float)) else ""
            print(f"  last step {last['step']}{epoch}, loss {_num(last['loss'])}{ago}")
        spread = tail.last_spread
        if spread is not None and not result.finished(run_dir):
            print(f"  {_slowest(run_dir, spread)}")
        if tail.last_eval is not None:
            print(f"  last eval: accuracy {_num(tail.last_eval['eval_acc'])} at step {tail.last_eval['step']}")
        if result.finished(run_dir):
            print("  finished: result.json written")
        budget = _budget_line(run_dir, unread)
        if budget:
            print(f"  {budget}")
        from hpc_train import goodput
        _, problem = goodput.read(run_dir)
        if problem is not None:
            unread.append(f"{goodput.FILE} {problem}")
        elif getattr(args, "goodput", False):
            print("  " + goodput.table(run_dir).replace("\n", "\n  "))
        else:
            line = goodput.summary_line(run_dir)
            if line:
                print(f"  {line}")
        for what in unread:
            print(f"  could not read: {what}")
    return 0


def _job_line(answer: scheduler.Answer, jid: str) -> str:
    """A job as the scheduler sees it; a query that failed makes it unknown, never ended."""
    st = answer.states.get(jid)
    if answer.live(jid) is None:
        last = f"; sacct's last record: {st.state}" if st is not None else ""
        return f"unknown, the scheduler did not answer ({answer.squeue_failed}){last}"
    if st is None:
        if answer.sacct_failed:
            return f"not in the queue (ended); its final state is unknown: {answer.sacct_failed}"
        return "not known to the scheduler (finished long ago, or another cluster)"
    extra = f", reason {st.reason}" if st.reason and st.reason != "None" else ""
    restarts = "unknown" if answer.sacct_failed else st.restarts
    return f"{st.state} on {st.nodes or '-'}, elapsed {st.elapsed or '-'}, restarts {restarts}{extra}"


def _local_state(run_dir: Path, unread: list[str]) -> bool:
    """A run without a Slurm job: what became of it (:mod:`hpc_train.login.outcome`) and what the
    same command does if run again. True while it runs."""
    from hpc_train import goodput
    facts, problems = outcome.gather(run_dir)
    unread.extend(problems)
    state = outcome.decide(facts)
    print(f"  local run: {state.line}")
    if state.kind == "running":
        from hpc_train.ckpt import store
        newest = store.newest_complete(run_dir)
        print(f"  rerun: refused while it runs (the run directory is in use); killed now: "
              f"{resume_point(run_dir, newest)}; a stop saves its step first")
        restart = restart_point(run_dir, newest)
        if restart:
            print(f"  {restart}")
        return True
    print(f"  rerun: {outcome.rerun(run_dir, goodput.steps_reported(run_dir))}")
    return False


def resume_point(run_dir: Path, newest: store.CkptInfo | None) -> str:
    """What running the job again in ``run_dir`` starts from: ``newest``, its newest complete
    checkpoint (:func:`store.newest_complete`: its size record; resume also checks its
    checksums), or nothing. A script's own snapshots are invisible to hpc_train, so for a script
    only its hpc_train checkpoints are named."""
    kept = outcome.kept_point(run_dir)
    if kept is not None:
        return kept
    if newest is not None:
        saved = newest.record.get("time")
        age = f" (checkpoint {outcome.age(time.time() - saved)} old)" if isinstance(saved, (int, float)) else ""
        return f"the same command resumes from step {newest.step}{age}"
    from hpc_train import config
    if config.runs_own_code(run_dir):
        return "no hpc_train checkpoint: the code resumes from its own checkpoints, if it keeps any"
    return "no checkpoint: a rerun starts from step 0"


def restart_point(run_dir: Path, shared: store.CkptInfo | None) -> str | None:
    """What an in-place restart (a crash, a lost node, a swap; the same allocation) starts from
    when the run keeps the node-local tier: the restore's own answer (hpc_train.ckpt.tiers) over
    the items this machine sees, judged as the restore judges them (this run, its config, its
    last start's tier ID and world size; the checksums of what it would load). A requeue lands
    on nodes that hold nothing, so it always starts from the shared tier (``shared``: its newest
    complete checkpoint, as for :func:`resume_point`). None when the run has no local tier, or
    is code of its own with no hpc_train checkpoint in either tier (it resumes from its own)."""
    from hpc_train import config, config_local
    from hpc_train.ckpt import store, tiers
    try:
        cfg = config.load(run_dir / rundir.CONFIG)
    except (UsageError, OSError):
        return None
    if not config_local.enabled(cfg.checkpoint):
        return None
    items, ident = tiers.view(run_dir, cfg)
    if not items and shared is None and (cfg.train.script or cfg.train.fn):
        return None    # code of its own with no hpc_train checkpoint: resume_point's line says it all
    held = tiers.restart(items, ident, verify=store.verify_checksums)
    ignored = tiers.not_this_runs(items, ident)
    aside = f" ({len(ignored)} other item(s) ignored: {ignored[0][1]})" if ignored else ""
    shared_step = shared.step if shared is not None else None
    on_shared = tiers.loads(tiers.Choice(), shared_step)
    if not items:
        return (f"restarted in place: the node-local tier's newest step held for every rank, if newer (its nodes' "
                f"directories are not visible from here), else {on_shared}; a requeue: {on_shared}")
    again = "the same" if not held.local or (shared_step is not None and shared_step > held.step) else on_shared
    return f"restarted in place: {tiers.loads(held, shared_step)}{aside}; a requeue: {again}"


_PIECE = 1 << 20     # how much of a log is read at a time


def _log_path(run_dir: Path, rank: int) -> Path:
    return rundir.rank_log(run_dir, rank)


def _rank_count(run_dir: Path, submitted: bool) -> int | None:
    """How many ranks the run has, as far as its files tell: one more than the highest rank with
    a log, an error record or a heartbeat, and for a submitted run at least job.nodes x tasks per
    node from its config.yaml (`run --nproc N` does not record N there). None when nothing says."""
    from hpc_train.records import ranks
    logs = run_dir / rundir.LOGS
    seen = [r for p in (logs.iterdir() if logs.is_dir() else ())
            if (r := ranks.rank_of(p.name, ".log")) is not None or (r := ranks.rank_of(p.name, ".error")) is not None]
    seen += ranks.present(run_dir)
    count = max(seen) + 1 if seen else 0
    if submitted:
        # A damaged config: the files alone say it (status names the damage).
        from hpc_train import config
        job = config.section(config.read_saved(run_dir)[0], "job")
        nodes, tasks, gpus = (job.get(k, d) for k, d in (("nodes", 1), ("tasks_per_node", 0), ("gpus_per_node", 0)))
        if all(type(v) is int and v >= 0 for v in (nodes, tasks, gpus)):
            count = max(count, nodes * (tasks or max(1, gpus)))
    return count or None


def _check_rank(run_dir: Path, rank: int, submitted: bool) -> None:
    count = _rank_count(run_dir, submitted)
    if rank < 0 or count is not None and rank >= count and (submitted or rundir.busy(run_dir) is None):
        have = "" if count is None else (f": this run has ranks 0-{count - 1}" if count > 1 else
                                          ": this run has rank 0 only")
        raise UsageError(f"logs: rank {rank} is out of range{have}")


def cmd_logs(args: argparse.Namespace) -> int:
    (run_dir, ids), = _resolve(args.target)
    if run_dir is None:
        raise UsageError(f"logs: job {args.target} is not in any run directory under runs/; give the RUN_DIR")
    # A live local run may not have started every rank yet, and records its count nowhere.
    _check_rank(run_dir, args.rank, bool(ids))
    path = _log_path(run_dir, args.rank)
    import io
    if not args.follow:
        import shutil
        f, problem = rundir.open_read(path)
        if problem is not None:
            raise UsageError(f"logs: {path} {problem}")
        if f is None:
            raise UsageError(f"logs: {path} does not exist yet (has rank {args.rank} started?)")
        with io.TextIOWrapper(f, encoding="utf-8", errors="replace", newline="") as text:
            shutil.copyfileobj(text, sys.stdout, _PIECE)    # in pieces: a long run's log is big
        return 0
    # Follow: print what exists, then poll for more until the job is final (backing off).
    pos, delay, last_query = 0, 0.2, 0.0
    try:
        while True:
            f, _ = rundir.open_read(path)    # not yet there, or not a file: nothing to show yet
            if f is not None:
                with io.TextIOWrapper(f, encoding="utf-8", errors="replace") as log:
                    log.seek(pos)
                    while chunk := log.read(_PIECE):
                        sys.stdout.write(chunk)
                        sys.stdout.flush()
                        delay = 0.2
                    pos = log.tell()
            if not ids and not chunk_pending(path, pos):
                if rundir.busy(run_dir) is None:     # a local run that ended (or never ran): all read
                    return 0
            if ids and time.monotonic() - last_query > 10:
                last_query = time.monotonic()
                st = scheduler.query(ids[-1:]).final(ids[-1])     # None while live or unknown
                if st is not None and st.state.split()[0] != "PREEMPTED":
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
    answer = scheduler.query(ids)
    unknown = [j for j in ids if answer.live(j) is None]
    if unknown:   # a job that may be live is never called ended; scancel would not get through either
        print(f"hpc_train: error: cannot tell whether job {', '.join(unknown)} is still live: "
              f"{answer.squeue_failed}; nothing cancelled", file=sys.stderr)
        return 1
    live = [j for j in ids if answer.live(j)]
    if not live:
        print(f"nothing to cancel: {', '.join(ids)} already ended")
        return 0
    out = slurm.scancel(*live)
    if not out.known:
        raise UsageError(f"{out.why}; cancel again once Slurm answers")
    print(f"cancelled {', '.join(live)}")
    return 0
