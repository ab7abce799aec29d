"""``python -m hpc_train submit`` and :func:`submit`: send a job to Slurm through submitit.

submitit pickles the callable, writes the sbatch script, and starts the callable in every srun
task. The callable here is :class:`SlurmEntry`, which runs :func:`hpc_train.launch.worker.run_worker`
(the same on-node path as ``run`` and the rendered sbatch script), or a user's own callable
with the process group already set up.

submitit details that matter (see the shared notes): its stop signal comes from the
``SUBMITIT_PREEMPT_SIGNAL`` variable, read when submitit is imported, so the job's signal is
passed as an sbatch parameter instead (nothing is set in the caller's environment); its
handlers (rank-0-only checkpoint, then exit) are replaced by ours in the worker; it learns
state only from sacct.
Importing this module does not import torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import shlex

from hpc_train import rundir, slurm
from hpc_train.requeue import requested
from hpc_train.login import nodes, scheduler
from hpc_train.config import Config, load
from hpc_train.errors import UsageError


class SlurmEntry:
    """What submitit runs in every task. Picklable: holds only plain data or a picklable callable."""

    def __init__(self, cfg: dict[str, Any], run_dir: str, fn: Callable[..., Any] | None = None,
                 args: tuple = (), kwargs: dict[str, Any] | None = None, resume: str = "latest") -> None:
        self.cfg, self.run_dir, self.fn, self.args, self.kwargs = cfg, run_dir, fn, args, kwargs or {}
        self.resume = resume

    def __call__(self) -> Any:
        import signal

        # The node side is started by name, as a batch script starts it with `python -m
        # hpc_train worker`: the login side that pickled this entry never imports it.
        import importlib
        worker = importlib.import_module("hpc_train.launch.worker")
        lifecycle = importlib.import_module("hpc_train.lifecycle")
        exit_done, exit_now, release_group, run_worker = (lifecycle.exit_done, lifecycle.exit_now,
                                                          lifecycle.release_group, worker.run_worker)
        os.environ.setdefault(rundir.RESUME_ENV, self.resume)
        # submitit installed its own handler for its signal (rank-0-only checkpoint, then exit).
        # One component owns the stop signals: hpc_train's worker installs the job's; any other
        # that submitit took is ignored, so it cannot cut in.
        if self.cfg["job"]["signal"] != "USR2":
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        if self.fn is None:
            try:
                result = run_worker(self.cfg, self.run_dir)
            except Exception:  # noqa: BLE001 - logged by run_worker; see exit_now for why not raise
                exit_now(1)
        else:
            # A callable's own exception goes back to the submitting side's Job, as submitit does.
            result = run_worker(self.cfg, self.run_dir, target=self.fn, args=self.args, kwargs=self.kwargs)
        if requested(Path(self.run_dir)):
            # Leave without a result (as submitit itself does when it requeues): the job is
            # about to be requeued by the batch shell, and the submitting side's Job must
            # see the result of the run that finishes, not of this stopped one. Without the
            # interpreter's teardown: it delays the requeue (see exit_done).
            exit_done(0)
            raise SystemExit(0)
        # submitit now pickles the result and exits normally: the group must go first (see
        # hpc_train.node.group.shutdown; run_worker left it for a fast exit).
        release_group()
        return result


def make_executor(cfg: Config, run_dir: Path, dry_run: bool = False, header: str = "",
                  run_dir_lines: list[str] | None = None):
    """submitit's executor for this job (see :mod:`hpc_train.login.executor`), its batch script
    made of the same parts as the standalone ones (:mod:`hpc_train.login.batch`); ``header``:
    comment lines put at its top (:func:`hpc_train.login.executor.header`); ``run_dir_lines``:
    shell lines that set ``RUN_DIR`` for the hook (default: ``run_dir``; a sweep's array task
    reads its own)."""
    from hpc_train.login import batch, executor

    job = cfg.job
    ex = (executor.DryRunExecutor if dry_run else executor.Executor)(folder=str(run_dir / rundir.SUBMITIT),
                                                                      max_num_timeout=10**6)
    ex.header = header
    opts = batch.options(job)
    loop = batch.Loop(job, local_dir=batch.local_dir(cfg))
    # submitit quotes its srun line; a step's nodes after a lost node reach it through a shell
    # function named srun, which the batch shell calls instead of the program (login.nodes).
    # With job.standby, the function hands the step to the standby (login.batch.Loop).
    # ("command": the function must not call itself.)
    run = "hpc_train_step" if loop.standby else "command srun $step_nodes"
    step = [f'srun() {{ {run} "$@"; }}'] if loop.standby or nodes.guards_nodes(job) else []
    params: dict[str, Any] = dict(
        job_name=opts.pop("job-name"), nodes=opts.pop("nodes"), ntasks_per_node=opts.pop("ntasks-per-node"),
        cpus_per_task=opts.pop("cpus-per-task"), time=opts.pop("time"), signal_delay_s=job.signal_lead,
        # The srun line runs in the loop (a failed step is restarted in place: see login.hook).
        setup=[*job.setup, *loop.before(), *step, *loop.start()],
        # One dead task ends the step (so the others do not wait on it for a collective timeout).
        srun_args=["--kill-on-bad-exit=1"],
        # After srun: the hook, from the batch shell (see hpc_train.login.hook).
        teardown=["status=$?", *(run_dir_lines or [f"RUN_DIR={shlex.quote(str(run_dir))}"]), *loop.after(),
                  'exit "$status"'],
    )
    # submitit writes --signal=$SUBMITIT_PREEMPT_SIGNAL@lead, reading that variable when it is
    # imported (so setting it here would be too late, and would leak into the caller's
    # environment). The job's own signal goes in with the other options, which win.
    for key in ("partition", "account", "qos", "constraint", "mem", "exclusive"):
        if key in opts:
            params[key] = opts.pop(key)
    if "gpus-per-node" in opts:
        params["gpus_per_node"] = opts.pop("gpus-per-node")
    params["additional_parameters"] = opts     # signal, requeue, open-mode, no-kill
    ex.update_parameters(**params)
    return ex


def check_folder(rd: Path) -> None:
    """submitit puts its logs under the run directory with Slurm filename patterns (``%j``) that
    it also reads back as plain paths, so a ``%`` in the path cannot be escaped for both: refused."""
    if "%" in str(rd):
        raise UsageError(f"the run directory {rd} contains '%', which Slurm reads as a filename pattern in "
                         f"submitit's log paths; choose a path without '%' (or use `python -m hpc_train sbatch`, "
                         f"whose script escapes it)")


def dry_run_text(ex) -> str:
    """Exactly the script submitit would submit (its text does not depend on the job id)."""
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def submit(target: Config | str | os.PathLike[str] | Callable[..., Any], *args: Any,
           config: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (),
           run_dir: str | os.PathLike[str] | None = None, resume: str = "latest",
           **job: Any):
    """Submit a config (object or YAML path) or any picklable callable; returns a submitit Job
    (:class:`hpc_train.login.executor.Job`: ``result()`` is rank 0's return value).

    ``job`` keys are the config's job section (``nodes=2, partition="gpu", time="02:00:00"``).
    A callable runs in every task as ``target(*args)``, inside the task's Run: the process group
    is set up from ``config``'s ``dist`` section (a YAML path; defaults otherwise) and
    ``overrides``, stop signals are handled, and ``hpc_train.init()`` returns that Run.
    """
    scheduler.require_slurm()
    fn = target if callable(target) and not isinstance(target, Config) else None
    extra = {"job": job} if job else None
    if isinstance(target, Config):
        cfg = target
        if job:
            from hpc_train.config import from_dict
            d = cfg.to_dict()
            d["job"].update(job)
            cfg = from_dict(d)
    elif callable(target):   # that is, fn is not None
        if not job.get("name"):
            extra = {"job": {**job, "name": getattr(fn, "__name__", "fn")}}
        cfg = load(config, list(overrides), extra)
    else:
        cfg = load(target, list(overrides), extra)
    rd = Path(run_dir or cfg.resolved_run_dir()).absolute()
    cfg.run_dir = str(rd)
    check_folder(rd)
    if rd.is_dir():   # busy with a local run or a running job's rank 0: refused, nothing submitted
        rundir.RunDirLock(rd, "a submission").acquire().release()
        _refuse_active_job(rd)
    scheduler.check_resources(cfg.job)
    from hpc_train.ckpt.prelaunch import prelaunch
    from hpc_train.trainer.signature import expected
    # Only checked, not held: the job's rank 0 takes the lock when it starts.
    plan = prelaunch(rd, cfg, resume, warn=lambda m: print(f"hpc_train: warning: {m}", file=sys.stderr),
                     signature=expected(cfg) if fn is None else None, lock=rundir.RunDirLock(rd, "a submission"),
                     hold=False)
    if plan.finished:
        raise UsageError(f"{rd} holds a finished run (result.json); use another --run-dir to train again")
    from hpc_train.login.executor import header
    ex = make_executor(cfg, rd, header=header(cfg, rd, fn, args))
    entry = SlurmEntry(cfg.to_dict(), str(rd), fn, args, resume=plan.env_value())
    job_obj = ex.submit(entry)
    scheduler.record_job(rd, str(job_obj.job_id), "submitit", folder=str(rd / rundir.SUBMITIT))
    # What was submitted, beside the run it made (submitit keeps its copy as submitit/<id>_submission.sh).
    rundir.write_atomic(rd / rundir.SUBMISSION, dry_run_text(ex))
    return job_obj


def refusal(rd: Path, resume: str = "latest") -> str | None:
    """Why :func:`submit` would refuse ``rd`` now (a run or job using it, a finished run), else
    None. Changes nothing: for a dry run. A job's state is asked of squeue only where there is one."""
    from hpc_train import rundir
    from hpc_train.ckpt import store
    if rd.exists() and not rd.is_dir():
        return f"the run directory {rd} is a file, not a directory"
    try:
        check_folder(rd)
    except UsageError as e:
        return str(e)
    if not rd.is_dir():
        return None
    holder = rundir.busy(rd)
    if holder:
        return f"{rd} is in use by {holder}; wait for it to end, stop it, or use another --run-dir"
    if scheduler.job_ids(rd) and slurm.can_query():
        try:
            _refuse_active_job(rd)
        except UsageError as e:
            return str(e)
    if resume != "none" and store.is_finished(rd):
        return f"{rd} holds a finished run (result.json); use another --run-dir to train again"
    return None


def _refuse_active_job(rd: Path) -> None:
    """A run directory whose last job is still queued or running takes no second job."""
    ids = scheduler.job_ids(rd)
    if not ids:
        return
    answer = scheduler.query(ids[-1:])
    live = answer.live(ids[-1])
    if live is None:    # it may still be running: a second job would train in the same directory
        raise UsageError(f"{rd} belongs to job {ids[-1]}, and the scheduler did not say whether it is still live "
                         f"({answer.squeue_failed}); try again later, or use another --run-dir")
    if live:
        raise UsageError(f"{rd} belongs to job {ids[-1]}, which is {answer.states[ids[-1]].state}; wait for it, "
                         f"cancel it (python -m hpc_train cancel {rd}), or use another --run-dir")
