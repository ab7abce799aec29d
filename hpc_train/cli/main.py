"""Command line. Commands that do not train must not import torch (a test checks it)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import NoReturn

from hpc_train.errors import EXIT_USAGE, UsageError
from hpc_train.login.args import load


class _Parser(argparse.ArgumentParser):
    commands: Mapping[str, argparse.ArgumentParser] = {}   # a parser's subcommands, by name

    def __init__(self, *args, **kwargs) -> None:
        # A prefix is never an option: `--np 2` taken for `--nproc 2` is a guess made silently,
        # and it would make a script's own `--n` mean something else on every hpc_train update.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # argparse's own exit code is 2 too; keep one line
        raise UsageError(f"{self.prog}: {message}")

    def print_help(self, file=None) -> None:
        # argparse's own ignores a failed write: a closed stdout must reach main() (exit 141).
        (file or sys.stdout).write(self.format_help())


def _add_config_args(p: argparse.ArgumentParser, targets: bool = False) -> None:
    if targets:
        p.add_argument("config", nargs="?", default=None,
                       help="a job config, e.g. jobs/digits.yaml (optional with --script/--fn: then it gives the "
                            "job, dist and checkpoint sections)")
        g = p.add_mutually_exclusive_group()
        g.add_argument("--script", metavar="PATH", help="run this Python script on every task (torchrun's "
                       "variables set); its arguments follow `--`")
        g.add_argument("--fn", metavar="PKG.MOD:FN", help="call this function on every task (it calls "
                       "hpc_train.init() for its Run)")
    else:
        p.add_argument("config", help="a job config, e.g. jobs/digits.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable); e.g. --set optim.lr=0.01")
    p.add_argument("--run-dir", help="where logs, metrics and checkpoints go (default: runs/<job.name>)")


def _add_resume_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", default="latest", metavar="latest|none|PATH",
                   help="latest: continue from the newest complete checkpoint in the run directory (default); "
                        "none: start from scratch (checkpoints already there are moved aside to "
                        "checkpoints.old-<time>/, never deleted); PATH: a checkpoint directory")


def _add_resource_args(p: argparse.ArgumentParser) -> None:
    """Scheduler flags; each is a --set job.<key> under another name (the command line wins)."""
    g = p.add_argument_group("resources (override the config's job section)")
    for flag, typ, helptext in (
            ("--nodes", int, "nodes"), ("--tasks-per-node", int, "tasks per node (default: GPUs per node, else 1)"),
            ("--gpus-per-node", int, "GPUs per node"), ("--cpus-per-task", int, "CPUs per task"),
            ("--mem", str, "memory per node, e.g. 16G"), ("--time", str, "time limit, e.g. 01:30:00"),
            ("--partition", str, "partition"), ("--account", str, "account"), ("--qos", str, "QOS"),
            ("--constraint", str, "node features"), ("--signal-lead", int, "seconds before the time limit "
                                                      "that the stop signal is sent (default 90)"),
            ("--job-name", str, "job name")):
        g.add_argument(flag, type=typ, default=None, help=helptext)
    g.add_argument("--exclusive", action="store_true", default=None, help="whole nodes")




def build_parser() -> _Parser:
    ap = _Parser(prog="python -m hpc_train",
                 description="Take a PyTorch training job from a laptop to a multi-node Slurm cluster.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    ap.commands = sub.choices

    p = sub.add_parser("run", help="train on this machine with N local processes (no Slurm)")
    _add_config_args(p, targets=True)
    p.add_argument("--nproc", type=int, default=1, help="worker processes (default 1)")
    _add_resume_arg(p)

    for name, helptext in (("submit", "submit the job to Slurm through submitit"),
                           ("sbatch", "render a standalone sbatch script (submit it yourself)")):
        p = sub.add_parser(name, help=helptext)
        _add_config_args(p, targets=True)
        _add_resource_args(p)
        if name == "submit":
            p.add_argument("--dry-run", action="store_true", help="print the sbatch script; submit nothing")
            p.add_argument("--wait", action="store_true", help="block until the job ends; exit code follows it")
            p.add_argument("--sweep", action="append", default=[], metavar="SWEEP.yaml|SECTION.KEY=V1,V2,...",
                           help="one array job, one task per point: a sweep file (grid:, points:, seeds:) or "
                                "key=values items (repeatable: the cartesian product); --run-dir names the "
                                "sweep directory, each task gets its own run directory in it")
            p.add_argument("--array-parallelism", type=int, default=256, help="array tasks running at once")
            p.add_argument("--resubmit-failed", metavar="SWEEP_DIR", default=None,
                           help="resubmit the tasks of a sweep that failed, were cancelled or timed out "
                                "unfinished; they resume from their last checkpoint")
            _add_resume_arg(p)
        else:
            p.add_argument("-o", "--output", help="write the script here instead of stdout")
            p.add_argument("--launcher", choices=("srun", "torchrun"), default="srun",
                           help="srun: one task per GPU/CPU slot (default); torchrun: one torchrun per node")

    p = sub.add_parser("status", help="state, nodes, restarts, last step and loss of a run, job or sweep")
    p.add_argument("target", nargs="?", default=None, help="RUN_DIR, SWEEP_DIR or JOB_ID (default: runs/*)")
    p.add_argument("--goodput", action="store_true",
                   help="where the wall time since the first submit went, as a table (goodput.json)")
    p = sub.add_parser("sweep", help="results of a sweep")
    sw = p.add_subparsers(dest="sweep_command", metavar="ACTION", parser_class=_Parser, required=True)
    p.commands = sw.choices
    s = sw.add_parser("summary", help="every task's metric, sorted, on the console and as CSV")
    s.add_argument("sweep_dir")
    s.add_argument("--metric", default="loss", help="result.json's value, else the last logged one (default: loss)")
    s.add_argument("--descending", action="store_true", help="highest first (for accuracies)")
    s.add_argument("--csv", metavar="PATH", help="where the CSV goes (default: SWEEP_DIR/summary.csv)")
    p = sub.add_parser("logs", help="show (or follow) a run's per-rank log")
    p.add_argument("target", help="RUN_DIR or JOB_ID")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("-f", "--follow", action="store_true")
    p = sub.add_parser("cancel", help="cancel a run's Slurm job")
    p.add_argument("target", help="RUN_DIR or JOB_ID")

    p = sub.add_parser("ckpt", help="list, verify or export checkpoints")
    ck = p.add_subparsers(dest="ckpt_command", metavar="ACTION", parser_class=_Parser, required=True)
    p.commands = ck.choices
    c = ck.add_parser("list", help="step, time, size, completeness, world size")
    c.add_argument("run_dir")
    c = ck.add_parser("verify", help="check every checkpoint's files against its commit record "
                                          "(sizes, checksums, DCP metadata); exit 1 if any is bad")
    c.add_argument("run_dir")
    c = ck.add_parser("export", help="a consolidated model state_dict for torch.load(weights_only=True)")
    c.add_argument("run_dir")
    c.add_argument("out")
    c.add_argument("--step", type=int, default=None, help="default: the newest complete checkpoint")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    c.add_argument("--key", metavar="NAME", default=None,
                   help="the state key of the module to export (default: the only module in the checkpoint)")

    p = sub.add_parser("config", help="print the resolved config without running anything")
    _add_config_args(p)

    p = sub.add_parser("env", help="print this process's derived rank/world/rendezvous (srun it to debug)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--port", action="store_true", help="only the rendezvous port this job's ranks use (for a "
                   "batch script that starts torchrun itself)")

    p = sub.add_parser("requeue-hook", help="(internal) run by batch scripts after srun: issue the requeue")
    p.add_argument("run_dir")
    p.add_argument("status", type=int)
    p.add_argument("--tasks-per-node", type=int, default=1, help="srun tasks per node of a step")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node of a step (default: --tasks-per-node; torchrun starts several per task)")
    p.add_argument("--config", default=None, help="the job's config (default: RUN_DIR/config.yaml)")

    p = sub.add_parser("worker", help="(internal) one task's entry point, started by run/srun")
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir")
    return ap


def cmd_config(args: argparse.Namespace) -> int:
    print(load(args).to_yaml(), end="")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    import os

    from hpc_train.node import environment
    if args.port:   # the one formula (environment.derive_port), also in a batch shell that is no task
        print(environment.derive_port(os.environ, os.environ.get("SLURM_JOB_ID")))
        return 0
    env = environment.current()
    if args.json:
        print(env.to_json())
    else:
        for k, v in env.to_dict().items():
            print(f"{k:17s} {','.join(v) if isinstance(v, tuple) else v}")
    return 0


def check_plugins(cfg) -> None:
    """Resolve every import path now, before a worker starts or a job is queued."""
    from hpc_train.plugins import resolve
    for field, value in (("model.name", cfg.model.name), ("data.name", cfg.data.name), ("train.fn", cfg.train.fn)):
        if value and ":" in value:
            resolve(value, field)


def check_backend(cfg) -> None:
    """``run`` trains here, so a backend this machine cannot provide is a usage error now, not a
    traceback in every worker. (``submit``/``sbatch`` must not check: the login node has no GPU.)"""
    if cfg.dist.backend == "nccl":
        import torch
        if not torch.cuda.is_available():
            raise UsageError("config: dist.backend=nccl needs CUDA devices and none are visible on this machine; "
                             "use dist.backend=gloo (or auto, which picks nccl when GPUs exist)")


def cmd_run(args: argparse.Namespace) -> int:
    from hpc_train import rundir
    from hpc_train.launch import local as launch
    if args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    cfg = load(args)
    launch.check_nproc(args.nproc, cfg.dist.backend)
    check_plugins(cfg)
    check_backend(cfg)
    from hpc_train.config import check_launch
    from hpc_train.node import precision
    check_launch(cfg.dist.strategy, args.nproc)   # run: every process is on this node
    precision.check_here(cfg.train.precision, cfg.dist.backend)
    port = launch.rendezvous_port()   # a bad MASTER_PORT fails here, before anything is written
    run_dir = cfg.resolved_run_dir().absolute()
    cfg.run_dir = str(run_dir)
    # One run per directory, held for the run (a second run would resume from this one's
    # checkpoints and move its newer saves aside).
    lock = rundir.RunDirLock(run_dir, f"`python -m hpc_train run` ({args.nproc} processes)")
    try:
        from hpc_train.ckpt.prelaunch import prelaunch
        from hpc_train.trainer.signature import expected

        def warn(m: str) -> None:
            print(f"hpc_train: warning: {m}", file=sys.stderr)
        plan = prelaunch(run_dir, cfg, args.resume, warn=warn, signature=expected(cfg), lock=lock)
        if plan.finished:
            from hpc_train.node.session import finished_line, finished_result
            print(finished_line(run_dir, finished_result(run_dir) or {}, "`--resume none`"), file=sys.stderr)
            return 0
        from hpc_train.login import outcome
        kept = outcome.kept_point(run_dir, "resuming from") if cfg.train.script and args.resume == "latest" else None
        print(f"hpc_train: run directory {run_dir} ({args.nproc} process{'es' if args.nproc > 1 else ''}); "
              f"{kept or plan.describe(_own_code(cfg))}", file=sys.stderr)
        return launch.launch(args.nproc, run_dir / rundir.CONFIG, run_dir, resume=plan.env_value(), port=port,
                             hang_s=cfg.dist.timeout_s, lock_fd=lock.fd, script=bool(cfg.train.script),
                             local_dir=cfg.checkpoint.local_dir)
    finally:
        lock.release()


def _own_code(cfg) -> str:
    """The user's code when it is not the built-in trainer ("" when it is)."""
    return "the script" if cfg.train.script else "the function" if cfg.train.fn else ""


def cmd_worker(args: argparse.Namespace) -> int:
    from hpc_train.launch import worker
    return worker.main(["--config", args.config] + (["--run-dir", args.run_dir] if args.run_dir else []))


def _lazy(target: str):
    """A handler that lives in another module, imported only when its command runs."""
    def handler(args: argparse.Namespace) -> int:
        import importlib
        module, fn = target.split(":")
        return getattr(importlib.import_module(module), fn)(args)
    return handler


COMMANDS = {"run": cmd_run, "config": cmd_config, "env": cmd_env, "worker": cmd_worker,
            "submit": _lazy("hpc_train.cli.submit:cmd_submit"), "sbatch": _lazy("hpc_train.login.sbatch:cmd_sbatch"),
            "status": _lazy("hpc_train.login.jobs:cmd_status"), "logs": _lazy("hpc_train.login.jobs:cmd_logs"),
            "cancel": _lazy("hpc_train.login.jobs:cmd_cancel"),
            "sweep": _lazy("hpc_train.login.sweep_report:cmd_sweep"), "ckpt": _lazy("hpc_train.cli.ckpt:cmd_ckpt"),
            "requeue-hook": _lazy("hpc_train.login.hook:cmd_requeue_hook")}


def _leaf(ap: _Parser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command that was typed (``ckpt export``'s, not ``ckpt``'s)."""
    p = ap.commands.get(args.command, ap) if args.command else ap
    action = getattr(args, f"{args.command}_command", None) if args.command else None
    return p.commands.get(action, p) if action and isinstance(p, _Parser) else p


def main(argv: list[str] | None = None) -> int:
    """Run one command. A reader of stdout that went away (``status | head -1``) ends it quietly,
    as it ends ``cat``: exit status 141 (128 + SIGPIPE), nothing on stderr."""
    try:
        try:
            return _main(argv)
        finally:
            # Output still buffered meets the closed pipe here, not in the interpreter's final flush.
            if sys.stdout is not None:
                sys.stdout.flush()
    except BrokenPipeError:
        # Python's recipe (its signal docs, "Note on SIGPIPE"): stdout goes to devnull, so that the
        # final flush of what is still buffered cannot fail again and print a traceback.
        import os
        import signal
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _stdout_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has closed it (poll says POLLERR), as
    opposed to some other pipe that broke (a worker's): that one is an error to report."""
    import select
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):    # no real stdout (an io.StringIO under a test)
        return False


def _main(argv: list[str] | None) -> int:
    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` is the script's own command line, untouched by argparse.
    rest: list[str] = []
    if "--" in argv:
        argv, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    try:
        args, extra = ap.parse_known_args(argv)
        from hpc_train.cli.flags import refuse_stray
        refuse_stray(_leaf(ap, args), ap.commands, args, extra, argv, rest)
        args.script_args = rest
        if not args.command:
            ap.print_help()
            return EXIT_USAGE
        return COMMANDS[args.command](args)
    except UsageError as e:
        msg = str(e)
        print(msg if msg.startswith("python -m hpc_train") else f"hpc_train: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        if isinstance(e, BrokenPipeError) and _stdout_gone():
            raise
        # A full, read-only or unwritable disk is the environment's problem, not a bug: one line.
        from hpc_train.errors import os_error_line
        print(f"hpc_train: error: {os_error_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
