"""What a message tells the user to type, in the words of the path they took.

A user of ``run``, ``submit`` or ``sbatch`` speaks to hpc_train in flags (``--resume none``,
``--run-dir``); one who calls ``hpc_train.init()`` in their own program speaks in variables
(``HPC_TRAIN_RESUME=none``). A refusal's way out is said their way, from one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_train import rundir


@dataclass(frozen=True)
class Advice:
    flags: bool   # True: hpc_train's command line; False: variables around the user's own program

    def resume(self, value: str) -> str:
        """How to ask for a resume choice (``none``, a path, ``latest``)."""
        return f"--resume {value}" if self.flags else f"{rundir.RESUME_ENV}={value}"

    def other_run_dir(self) -> str:
        """How to name another run directory."""
        return "another --run-dir" if self.flags else f"another {rundir.RUN_DIR_ENV}"


FLAGS = Advice(flags=True)
VARIABLES = Advice(flags=False)
