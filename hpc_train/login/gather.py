"""The requeue hook's inputs, read once: the run directory's records through their owners, the
batch shell's environment, and Slurm's view of the job. No torch here.

Everything :func:`hpc_train.login.decide.decide` needs is here and nothing is decided here.
Each source is read once per hook call; a source that cannot be read is an input too (a
damaged record is named and left out, a failed ``squeue`` or ``sinfo`` is "unknown").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from hpc_train import rundir
from hpc_train.config import Config, JobSection
from hpc_train.errors import EXIT_USAGE
from hpc_train.login import nodes
from hpc_train.login.decide import Budgets, Inputs, Nodes
from hpc_train.records import keeper as keeper_rec
from hpc_train.records import ranks as ranks_rec
from hpc_train.records import requeue as requeue_rec
from hpc_train.records import result as result_rec
from hpc_train.records.ranks import StepId
from hpc_train.records.requeue import Incarnation

BATCH_START_ENV = rundir.BATCH_START_ENV
log = logging.getLogger("hpc_train")


def target(env: Mapping[str, str]) -> str:
    """This job as ``scontrol requeue`` must name it: an array task as ARRAYJOB_TASK, never the
    whole array."""
    array = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array[0]}_{array[1]}" if all(array) else env.get("SLURM_JOB_ID", "")


def _int(env: Mapping[str, str], key: str, default: int = 0) -> int:
    n = rundir.decimal(env.get(key, ""))
    return default if n is None else n


def _job(path: Path) -> tuple[JobSection, bool, float, Config | None, str]:
    """The job section of the job's config, whether it runs a script, its straggler window, the
    config itself when it keeps the node-local tier (else None), and, when the config cannot be
    read, the defaults and why."""
    from hpc_train import config, config_local
    from hpc_train.errors import UsageError
    try:
        cfg = config.load(path)
        local = cfg if config_local.enabled(cfg.checkpoint) else None
        return cfg.job, bool(cfg.train.script), cfg.dist.straggler_window_s, local, ""
    except (UsageError, OSError) as e:
        return (JobSection(), False, config.DistSection().straggler_window_s, None,
                f"{path.name} unreadable ({str(e).splitlines()[0][:200]}): the job's defaults apply; ")


def budgets(job: JobSection) -> Budgets:
    return Budgets(job.requeue_preemption, job.requeue_timeout, job.requeue_failure, job.restarts_in_place)


def gather(run_dir: Path, status: int, env: Mapping[str, str], srun_tasks_per_node: int,
           ranks_per_node: int, config: Path | None = None) -> tuple[Inputs, requeue_rec.RequeueState]:
    """The inputs of this hook call, and the history as read (the act writes on top of it).
    ``config``: the job's config (a standalone script's own copy), else the run's config.yaml."""
    run_dir = Path(run_dir)
    job, script, window_s, local, note = _job(Path(config) if config else run_dir / rundir.CONFIG)
    inc = Incarnation(target(env), _int(env, "SLURM_RESTART_COUNT"))
    step = StepId(env.get("SLURM_JOB_ID", ""), inc.restart, _int(env, ranks_rec.ATTEMPT_ENV))
    history = requeue_rec.read(run_dir)
    pending, pending_note = _pending(run_dir, inc, step, _int(env, BATCH_START_ENV))
    note += pending_note
    allocated = tuple(nodes.expand(env.get("SLURM_JOB_NODELIST", "")))
    first = job.nodes if nodes.guards_nodes(job) else (_int(env, "SLURM_JOB_NUM_NODES") or _int(env, "SLURM_NNODES")
                                                         or len(allocated) or job.nodes)
    if not step.attempt:
        # A batch script that does not count its steps (an older one, a user's own): this step
        # is the one rank 0's record names.
        rank0, _ = ranks_rec.read(run_dir, 0)
        step = StepId(step.job, step.restart, 0, rank0.launch if rank0 is not None else "-")
    placed = [e.nodes for e in history.restarts_of(inc) if e.nodes is not None]
    world = (len(placed[-1]) if placed else first) * ranks_per_node
    finished = result_rec.finished(run_dir)
    step_ranks = ranks_rec.read_step(run_dir, step, world)
    # Who else holds the run directory (decide.refused: a step refused by its lock began no rank).
    held_by = rundir.busy(run_dir) if status not in (0, EXIT_USAGE) and not finished else None
    # Slurm is asked only when something is to be decided (a stop or a failure): one squeue, and
    # one sinfo for a job that outlives a lost node.
    asks = not finished and status != EXIT_USAGE and (pending is not None or status != 0)
    view = nodes.job_view(env.get("SLURM_JOB_ID", "")) if asks else nodes.JobView(None, None, "not asked")
    node_view = None
    if asks and nodes.guards_nodes(job):
        states, why = nodes.node_states(allocated) if view.nodes is not None and allocated else (None, view.why)
        node_view = Nodes(job.nodes, job.min_nodes or job.nodes, allocated, env.get("SLURMD_NODENAME", ""),
                          view.nodes, states, why or view.why)
    # Earlier runs that went back to the queue without a requeue of the hook's (a script's own
    # scontrol requeue ended the batch shell before the hook ran): one sacct says what they were.
    past, past_why = (nodes.past_runs(inc.target, inc.restart) if history.unrecorded(inc) and status != EXIT_USAGE
                      else ((), ""))
    newest_step, own = _newest_checkpoint(run_dir, _int(env, BATCH_START_ENV), script)
    began = [r.started for r in step_ranks.values() if r is not None and r.started is not None]
    since = min(began) if began else float(_int(env, BATCH_START_ENV))
    # The error files there are (one listing), not a stat of every rank's possible one.
    # In the order they were written: the rank that failed first is the culprit, whatever its number.
    written = {} if status in (0, EXIT_USAGE) or finished else ranks_rec.error_times(run_dir)
    said = {r: e for r in sorted(written) if r < world and (e := ranks_rec.error_line(run_dir, r, since - 1.0))}
    errors = dict(sorted(said.items(), key=lambda kv: (written[kv[0]], kv[0])))
    inputs = Inputs(
        status=status, finished=finished, inc=inc, pending=pending, pending_note=note,
        ranks=step_ranks, ranks_per_node=ranks_per_node,
        srun_tasks_per_node=srun_tasks_per_node, budgets=budgets(job), history=history, job_signal=job.signal,
        signal_lead=job.signal_lead, now=time.time(), nominal_end=view.nominal_end,
        newest_step=newest_step, own_checkpoint=own,
        resume=env.get(rundir.RESUME_ENV, "latest"), first_step_nodes=first, nodes=node_view, errors=errors,
        past_runs=past, past_why=past_why, window_s=window_s, held_by=held_by,
        local_step=_local_step(run_dir, local, env) if asks and local is not None else None)
    return inputs, history


def _local_step(run_dir: Path, cfg: Config, env: Mapping[str, str]) -> int | None:
    """The step an in-place restart of this job would load from the node-local tier, of the
    items this node sees (on a cluster, its own node's and the copies it keeps): the restore's
    own answer (hpc_train.ckpt.tiers), so another job's or world size's leftovers, or a damaged
    item, buy no restart."""
    from hpc_train.ckpt import store, tiers
    items, ident = tiers.view(run_dir, cfg, env.get("SLURM_JOB_ID") or None)
    chosen = tiers.restart(items, ident, verify=store.verify_checksums)
    return chosen.step if chosen.local else None


def _pending(run_dir: Path, inc: Incarnation, step: StepId, batch_start: int) -> tuple[requeue_rec.Pending | None, str]:
    """The stop request this step left, if any, and a note: a damaged or an earlier step's one must not decide."""
    pending, problem = requeue_rec.read_pending(run_dir, since=batch_start)
    if problem is not None:
        # Written atomically by rank 0, so only outside hands damage it; written in this job,
        # it exists only after a stop asked for a requeue: this task's own requeue is the only
        # safe reading.
        return (requeue_rec.Pending(inc.target, None, "", None, step.job, step.restart, step.attempt),
                f"{problem}: taken as this task's stop request; ")
    if pending is not None and not pending.is_of(step):
        # The stop record outlives its step (an earlier stop's, then a failure): not this step's,
        # and nothing to say. An earlier version's requeue.pending went once acted on: one left
        # is a request a killed batch shell never handled.
        note = "" if pending.source != requeue_rec.PENDING else (
            f"{requeue_rec.PENDING} is an earlier step's (job {pending.job}, attempt {pending.attempt}): ignored; ")
        return None, note
    return pending, ""


def _newest_checkpoint(run_dir: Path, batch_start: int, script: bool) -> tuple[int | None, bool]:
    """The newest complete checkpoint's step, and whether this job saved it (saved after its
    batch shell started). Without one of hpc_train's, the built-in trainer and a loop on Run start
    from step 0; a script's step is its own business (unknown), unless its framework keeps the
    run's checkpoints where hpc_train can see them (``keeper.json``: the Trainer's newest
    complete ``checkpoint-N``, the step its rerun resumes from)."""
    from hpc_train.ckpt.store import newest_complete
    newest = newest_complete(run_dir)
    if newest is not None:
        saved_at = newest.record.get("time")
        return newest.step, isinstance(saved_at, (int, float)) and batch_start > 0 and saved_at >= batch_start
    if not script:
        return 0, False
    keeper, _problem = keeper_rec.read(run_dir)
    kept = keeper_rec.newest_complete(keeper) if keeper is not None else None
    if kept is None:
        return None, False
    try:
        own = batch_start > 0 and (kept.path / "trainer_state.json").stat().st_mtime >= batch_start
    except OSError:
        own = False
    return kept.step, own
