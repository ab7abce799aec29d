"""The login side, torch-free: submission, sbatch scripts, the scheduler, sweeps, status/logs/cancel and the requeue hook."""
