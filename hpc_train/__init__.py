"""hpc_train: take a PyTorch training job from a laptop to a multi-node Slurm cluster.

The data path, one module per step::

    config -> submit/sbatch -> environment -> distributed -> trainer
           -> checkpoint / preemption -> requeue -> resume

Importing the package is cheap: torch is imported only on the training path.
"""

__version__ = "0.1.0"
