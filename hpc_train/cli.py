"""Command line. Commands that do not train must not import torch (a test checks it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpc_train.errors import EXIT_USAGE, UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code is 2 too; keep one line
        raise UsageError(f"{self.prog}: {message}")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a job config, e.g. jobs/digits.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable); e.g. --set optim.lr=0.01")
    p.add_argument("--run-dir", help="where logs, metrics and checkpoints go (default: runs/<job.name>)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m hpc_train",
                 description="Take a PyTorch training job from a laptop to a multi-node Slurm cluster.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("run", help="train on this machine with N local processes (no Slurm)")
    _add_config_args(p)
    p.add_argument("--nproc", type=int, default=1, help="worker processes (default 1)")

    p = sub.add_parser("config", help="print the resolved config without running anything")
    _add_config_args(p)

    p = sub.add_parser("env", help="print this process's derived rank/world/rendezvous (srun it to debug)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("worker", help="(internal) one task's entry point, started by run/srun")
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir")
    return ap


def _load(args: argparse.Namespace):
    from hpc_train import config
    extra = {"run_dir": args.run_dir} if getattr(args, "run_dir", None) else None
    return config.load(args.config, args.overrides, extra)


def cmd_config(args: argparse.Namespace) -> int:
    print(_load(args).to_yaml(), end="")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from hpc_train import environment
    env = environment.current()
    if args.json:
        print(env.to_json())
    else:
        for k, v in env.__dict__.items():
            print(f"{k:17s} {','.join(v) if isinstance(v, tuple) else v}")
    return 0


def check_plugins(cfg) -> None:
    """Resolve every import path now, before a worker starts or a job is queued."""
    from hpc_train.plugins import resolve
    for field, value in (("model.name", cfg.model.name), ("data.name", cfg.data.name), ("train.fn", cfg.train.fn)):
        if value and ":" in value:
            resolve(value, field)


def cmd_run(args: argparse.Namespace) -> int:
    from hpc_train import config as config_mod
    from hpc_train import launch
    if args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    cfg = _load(args)
    check_plugins(cfg)
    run_dir = cfg.resolved_run_dir().absolute()
    cfg.run_dir = str(run_dir)
    path = config_mod.write(cfg, run_dir)
    print(f"hpc_train: run directory {run_dir} ({args.nproc} process{'es' if args.nproc > 1 else ''})",
          file=sys.stderr)
    return launch.launch(args.nproc, path, run_dir)


def cmd_worker(args: argparse.Namespace) -> int:
    from hpc_train import worker
    return worker.main(["--config", args.config] + (["--run-dir", args.run_dir] if args.run_dir else []))


COMMANDS = {"run": cmd_run, "config": cmd_config, "env": cmd_env, "worker": cmd_worker}


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
        if not args.command:
            ap.print_help()
            return EXIT_USAGE
        return COMMANDS[args.command](args)
    except UsageError as e:
        msg = str(e)
        print(msg if msg.startswith("python -m hpc_train") else f"hpc_train: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
