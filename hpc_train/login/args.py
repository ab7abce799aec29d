"""A job's config from a command's arguments (``run``, ``submit``, ``sbatch``, ``sweep``, ``config``). Torch-free."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpc_train.errors import UsageError

# Flags that are `job.*` fields under their own names (``--nodes 2`` is ``--set job.nodes=2``).
RESOURCE_KEYS = ("nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "mem", "time", "partition",
                 "account", "qos", "constraint", "signal_lead", "exclusive")


def load(args: argparse.Namespace):
    from hpc_train import config
    extra: dict = {"run_dir": args.run_dir} if getattr(args, "run_dir", None) else {}
    job = {k: getattr(args, k) for k in RESOURCE_KEYS if getattr(args, k, None) is not None}
    if getattr(args, "job_name", None) is not None:
        job["name"] = args.job_name
    script, fn = getattr(args, "script", None), getattr(args, "fn", None)
    if args.config is None and not (script or fn):
        raise UsageError(f"{args.command}: give a job config (e.g. jobs/digits.yaml), --script PATH or --fn PKG.MOD:FN")
    if args.config is not None and str(args.config).endswith(".py"):
        _refuse_python_config(args, script)
    if script:
        from hpc_train.rundir import check_path
        check_path(Path(script).absolute(), "--script")
        path = Path(script)
        if not path.exists():
            raise UsageError(f"--script {script}: no such file")
        if not path.is_file():
            raise UsageError(f"--script {script}: is a directory, not a Python script")
        extra["train"] = {"script": str(path.absolute()), "args": list(getattr(args, "script_args", []))}
        if args.config is None and "name" not in job:
            job["name"] = path.stem
    elif getattr(args, "script_args", None):
        raise UsageError(f"arguments after `--` ({' '.join(args.script_args)}) go to a --script; there is none")
    if fn:
        extra["train"] = {"fn": fn}
        if args.config is None and "name" not in job:
            job["name"] = fn.rpartition(":")[2] or "fn"
    if job:
        extra["job"] = job
    return config.load(args.config, args.overrides, extra)


def _refuse_python_config(args: argparse.Namespace, script: str | None) -> None:
    """A ``.py`` where a job config goes is a script to run, not YAML to read (which would fail
    on its first ``:``, naming a line of Python)."""
    import shlex
    rest = list(getattr(args, "script_args", []))
    if script:
        raise UsageError(f"{args.config} is a Python script, not a job config; the arguments of --script {script} "
                         f"go after `--`: ... --script {shlex.quote(script)} -- {shlex.join([args.config, *rest])}")
    command = args.command if args.command in ("run", "submit", "sbatch") else "run"
    typed = ["python", "-m", "hpc_train", command, "--script", args.config, *(["--", *rest] if rest else [])]
    raise UsageError(f"{args.config} is a Python script, not a job config; run it with --script: {shlex.join(typed)}")


def check_plugins_light(cfg) -> None:
    """For commands that must not import torch: the plug-in modules exist (not imported)."""
    from hpc_train.plugins import check_findable
    for field, value in (("model.name", cfg.model.name), ("data.name", cfg.data.name), ("train.fn", cfg.train.fn)):
        if value and ":" in value:
            check_findable(value, field)


