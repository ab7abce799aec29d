"""submitit's Slurm executor and job as hpc_train submits them. Torch-free.

Two things differ from submitit's own:

* the batch script says what it runs. submitit's runs ``python -m submitit.core._submit FOLDER``,
  which names neither the user's code nor its config; :func:`header` puts the code (the script
  with its arguments, the callable, or the built-in trainer), the run directory and the resolved
  config in comments after ``#!/bin/bash``. The dry run prints that text, submitit submits it, and
  ``RUN_DIR/submission.sh`` keeps it;
* :class:`Job`'s ``result()`` is rank 0's return value for a job of several tasks, where
  submitit's raises "You should use `results()` if your job has subtasks".

Imported only when something is submitted or rendered: importing submitit takes most of a second.
"""

from __future__ import annotations

import shlex
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from hpc_train.config import Config
from hpc_train.login.batch import version


class Job(submitit.SlurmJob):
    """submitit's Slurm job (``job_id``, ``state``, ``done()``, ``wait()``, ``results()``,
    pickling), whose ``result()`` is rank 0's return value when the job has several tasks."""

    def result(self) -> Any:
        """Waits for every task; rank 0's return value (a task's exception is raised, as
        ``results()`` raises it)."""
        if self.num_tasks > 1:
            return self.results()[0]
        return super().result()


class Executor(submitit.SlurmExecutor):
    """submitit's Slurm executor with :class:`Job` and the :func:`header` in its batch script."""

    job_class = Job
    header = ""

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        text = super()._make_submission_file_text(command, uid)
        shebang, _, rest = text.partition("\n")
        return f"{shebang}\n{self.header}{rest}" if self.header else text


class DryRunExecutor(Executor):
    """Printing the script needs no cluster; submitit's constructor refuses without srun."""

    @classmethod
    def affinity(cls) -> int:
        return 1


def _comment_safe(text: str) -> str:
    """``text`` for a comment line: a line break ends a comment and starts a command, so every
    control, surrogate or line/paragraph separator character is written as its escape. (The
    config already refuses them in its values; this holds whatever reaches here.)"""
    return "".join(c if c == "\t" or unicodedata.category(c) not in ("Cc", "Cs", "Zl", "Zp")
                   else repr(c)[1:-1] for c in text)


def _code(cfg: Config, fn: Callable[..., Any] | None, args: tuple) -> str:
    if fn is not None:
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        module = getattr(fn, "__module__", None) or type(fn).__module__
        n = f"{len(args)} positional argument{'s' if len(args) != 1 else ''}" if args else "no arguments"
        return f"{module}.{name} ({n}), in every task, inside its hpc_train Run"
    if cfg.train.script:
        cmd = " ".join(shlex.quote(a) for a in ["python", cfg.train.script, *cfg.train.args])
        return f"{cmd}, in every task, under hpc_train's supervisor"
    if cfg.train.fn:
        return f"{cfg.train.fn}(), in every task, inside its hpc_train Run"
    return f"hpc_train's built-in trainer (model {cfg.model.name}, data {cfg.data.name}), in every task"


def header(cfg: Config, run_dir: Path, fn: Callable[..., Any] | None = None, args: tuple = ()) -> str:
    """Comment lines for the top of the batch script: what runs, where, with which config."""
    lines = [f"hpc_train {version()} job: python -m hpc_train status {shlex.quote(str(run_dir))}",
             f"runs: {_code(cfg, fn, args)}",
             f"run directory: {run_dir} (its submission.sh is this script)",
             "config (resolved; the run directory's config.yaml):",
             *(f"  {line}" for line in cfg.to_yaml().splitlines())]
    return "".join(f"# {_comment_safe(line)}\n" for line in lines)
