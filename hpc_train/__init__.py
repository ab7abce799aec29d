"""hpc_train: take a PyTorch training job from a laptop to a multi-node Slurm cluster.

The data path, one module per step::

    config -> submit/sbatch -> environment -> distributed -> trainer
           -> checkpoint / preemption -> requeue -> resume

Importing the package is cheap: torch is imported only on the training path.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def submit(target: Any, *args: Any, **kwargs: Any):
    """Submit a config (a :class:`hpc_train.config.Config` or a YAML path) or any picklable
    callable to Slurm through submitit; returns submitit's ``Job``.

    ``hpc_train.submit("jobs/digits.yaml", nodes=2, time="01:00:00")`` trains that job;
    ``hpc_train.submit(fn, x, nodes=2, tasks_per_node=4)`` runs ``fn(x)`` on every task with the
    process group initialised (``torch.distributed`` is ready inside ``fn``). Keyword arguments
    are the config's job section plus ``overrides=[...]``, ``run_dir=`` and ``resume=``. See
    :func:`hpc_train.submission.submit`.
    """
    from hpc_train.submission import submit as _submit
    return _submit(target, *args, **kwargs)
