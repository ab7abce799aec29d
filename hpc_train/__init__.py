"""hpc_train: take a PyTorch training job from a laptop to a multi-node Slurm cluster.

The data path, one package or module per step (docs/architecture.md is the map)::

    cli -> login (submission, batch, scheduler; the requeue hook) -> launch.worker
        -> node (session, environment, stops, group) -> lifecycle -> run (Run: the user's
        loop or the built-in trainer) -> ckpt (restore, save; the node-local tier)

Your own loop::

    run = hpc_train.init()
    state = {"model": run.wrap(model), "optim": optimizer, "step": 0}
    run.restore(state)
    ...
    if run.step_end(state): break
    run.finish({...})

Importing the package is cheap: torch is imported only when ``init()`` (or training) runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hpc_train.run import Run


def init(config: Any = None, *, run_dir: Any = None, overrides: list[str] = ()) -> Run:
    """This process's :class:`hpc_train.run.Run`: environment, process group, device,
    rank-prefixed logging and stop signals, and the run directory held for this run: a finished
    run exits at once (0, one line), a run directory in use by another process is refused (2).
    A second call returns the same Run.

    Under ``python -m hpc_train run/submit/sbatch`` the config and run directory come from the
    launcher. Elsewhere (torchrun, plain ``srun``, ``python train.py``): ``config`` (a Config or
    a YAML path, else defaults plus ``overrides``) and ``run_dir`` (else the config's, else
    ``runs/<script name>``). A process group the script already initialised is used as is.
    ``Run.close()`` runs at exit (or use ``with hpc_train.init() as run:``); after a stop the
    process exits with ``run.exit_code`` (non-zero). See :mod:`hpc_train.lifecycle`."""
    from hpc_train.lifecycle import init as _init
    return _init(config, run_dir=run_dir, overrides=overrides)


def submit(target: Any, *args: Any, **kwargs: Any):
    """Submit a config (a :class:`hpc_train.config.Config` or a YAML path) or any picklable
    callable to Slurm through submitit; returns a submitit ``Job`` whose ``result()`` is rank 0's
    return value (``results()``: every task's).

    ``hpc_train.submit("jobs/digits.yaml", nodes=2, time="01:00:00")`` trains that job;
    ``hpc_train.submit(fn, x, nodes=2, tasks_per_node=4)`` runs ``fn(x)`` on every task with the
    process group initialised; ``hpc_train.init()`` inside ``fn`` returns the task's Run, with
    the config's ``dist`` section applied and stops handled. Keyword arguments are the config's
    job section plus ``config=``, ``overrides=[...]``, ``run_dir=`` and ``resume=``. See
    :func:`hpc_train.login.submission.submit`.
    """
    from hpc_train.login.submission import submit as _submit
    return _submit(target, *args, **kwargs)
