"""The run directory's file names, in one place, and atomic JSON writes. No torch here.

``RUN_DIR/`` holds ``config.yaml`` (the resolved config), ``logs/rank-R.log`` (and
``rank-R.error`` when a rank fails), ``metrics.jsonl``, ``tb/``, ``checkpoints/step-N/``,
``stopped.json`` (the last stop: step, signal, timeline), ``result.json`` (a finished run;
it never trains again), ``requeue.json`` (budgets used) and ``job.json`` (the Slurm job).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
RESULT = "result.json"
STOPPED = "stopped.json"
LOGS = "logs"

# What a launcher tells the processes it starts (a script's `hpc_train.init()` reads them).
CONFIG_ENV = "HPC_TRAIN_CONFIG"
RUN_DIR_ENV = "HPC_TRAIN_RUN_DIR"


def write_json(path: Path, obj: Any) -> None:
    from hpc_train.config import write_atomic
    write_atomic(Path(path), json.dumps(obj, indent=2, default=str))


def rank_log(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS / f"rank-{rank}.log"


def rank_error(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS / f"rank-{rank}.error"
