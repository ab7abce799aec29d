"""``python -m hpc_train sbatch``: a standalone sbatch script for users who submit themselves.

The script is a plain dataclass rendered from ``slurm/templates/*.sbatch`` (TorchX's pattern:
``materialize()`` returns the text; a dry run is printing it). Every value from the config or
the command line goes through :func:`shlex.quote`; the resolved config is embedded in a quoted
heredoc, which the shell does not expand. No torch here.
"""

from __future__ import annotations

import argparse
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_train.login import scheduler
from hpc_train.config import Config


TEMPLATES = Path(__file__).parent / "templates"   # slurm/templates links here


def q(value: object) -> str:
    return shlex.quote(str(value))


@dataclass
class SbatchScript:
    cfg: Config
    run_dir: Path
    launcher: str = "srun"            # srun | torchrun
    command: str = ""
    resume: str = "latest"

    def materialize(self) -> str:
        from hpc_train.login import batch
        job = self.cfg.job
        loop = batch.Loop(job, self.launcher, q(sys.executable), config_expr='"$JOB_CONFIG"',
                          local_dir=batch.local_dir(self.cfg))
        config_yaml = self.cfg.to_yaml().rstrip("\n")
        eof = "END_OF_CONFIG_" + secrets.token_hex(4).upper()
        while eof in config_yaml:   # the heredoc must not end early
            eof = "END_OF_CONFIG_" + secrets.token_hex(4).upper()
        values = {
            "version": batch.version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": (self.command or "(Python API)").replace("\n", "\\n").replace("\r", "\\r"),
            "directives": "\n".join(batch.directives(batch.options(job, self.launcher))),
            "nproc_per_node": str(loop.ranks), "output": q(batch.filename_pattern(self.run_dir) + "/slurm-%j.out"),
            "run_dir": q(self.run_dir), "config_yaml": config_yaml, "eof": eof,
            "setup": "\n".join(job.setup), "python": q(sys.executable), "resume": q(self.resume),
            "loop": "\n".join([*loop.before(), *loop.start()]), "after": "\n".join(loop.after()), "srun": loop.srun(),
            "threads": batch.threads(self.cfg.dist.threads_per_rank),
        }
        return render((TEMPLATES / f"{self.launcher}.sbatch").read_text(), values)


_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def render(template: str, values: dict[str, str]) -> str:
    """Fill every ``{{name}}`` of ``template`` in one pass. A substituted value is never scanned
    again: filled one placeholder after another, a value containing ``{{config_yaml}}`` (a job
    name, say) would get a later value pasted into it, outside the quoting that value had."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def cmd_sbatch(args: argparse.Namespace) -> int:
    from hpc_train.login.args import load as _load
    cfg = _load(args)
    scheduler.time_minutes(cfg.job.time)
    run_dir = cfg.resolved_run_dir().absolute()
    from hpc_train.rundir import check_path
    check_path(run_dir, "the run directory")
    cfg.run_dir = str(run_dir)
    command = "python -m hpc_train sbatch " + " ".join(q(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["sbatch"] \
        else "python -m hpc_train sbatch"
    text = SbatchScript(cfg, run_dir, args.launcher, command).materialize()
    # Slurm opens --output before the script runs, and does not create its directory.
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.output:
        out = Path(args.output)
        out.write_text(text)
        out.chmod(0o755)
        print(f"wrote {out}; submit it with: sbatch {q(out)}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
