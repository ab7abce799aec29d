"""The parts every batch script is made of, in one place: the ``#SBATCH`` options and the srun
loop with the requeue hook after it. No torch here.

Both kinds of script take them from here: the standalone ones ``sbatch`` renders from
``templates/*.sbatch`` (:mod:`hpc_train.login.sbatch`), and submitit's, for ``submit``,
``hpc_train.submit`` and sweeps (:mod:`hpc_train.login.submission`), which submitit writes
around its own srun line from our options, setup and teardown lines.

The loop: the batch shell runs ``srun`` once per job step; after each, the requeue hook
(:mod:`hpc_train.login.hook`) decides. It exits :data:`~hpc_train.login.decide.AGAIN` to have the
step started again in the allocation, and prints the next step's fields
(:data:`~hpc_train.login.decide.NEXT_FIELDS`), one per line, which the loop reads into shell
variables with ``read -r``: data, never shell text to evaluate. Any other exit code ends the job with it.
Each step is numbered (``HPC_TRAIN_ATTEMPT``), so every rank's record names the step it is from.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping

from hpc_train import config_local
from hpc_train import threads as omp
from hpc_train.config import Config, JobSection, time_minutes
from hpc_train.rundir import ATTEMPT_ENV, BATCH_START_ENV, LOCAL_STEP_ENV, RESUME_ENV, STANDBY_ENV
from hpc_train.login import nodes
from hpc_train.login.decide import AGAIN, NEXT_FIELDS
from hpc_train.login.scheduler import tasks_per_node

Option = str | int | bool    # an #SBATCH option's value (True: a flag without one)


def version() -> str:
    """hpc_train's version, for the comments of a batch script: the installed distribution's (what
    pip put on the nodes' path), "unknown" for a checkout run without an install."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    try:
        return installed("hpc_train")
    except PackageNotFoundError:
        return "unknown"


def options(job: JobSection, launcher: str = "srun") -> dict[str, Option]:
    """Every ``#SBATCH`` option of the job, by its long name (True: a flag without a value).
    Under torchrun, one srun task per node starts the node's ranks, and gets their CPUs."""
    ranks = tasks_per_node(job)
    per_node = launcher == "torchrun"
    # torchrun forwards SIGTERM to its workers but dies of USR1/USR2: it gets TERM.
    signal = "TERM" if per_node else job.signal
    opts: dict[str, Option] = {
        "job-name": job.name, "nodes": nodes.allocated_nodes(job), "ntasks-per-node": 1 if per_node else ranks,
        "cpus-per-task": job.cpus_per_task * (ranks if per_node else 1), "time": time_minutes(job.time),
        # No "B:": the signal goes to the srun steps (the ranks), job.signal_lead s before the limit.
        "signal": f"{signal}@{job.signal_lead}", "requeue": True, "open-mode": "append"}
    for key in ("gpus_per_node", "mem", "partition", "account", "qos", "constraint"):
        if getattr(job, key):
            opts[key.replace("_", "-")] = getattr(job, key)
    if job.exclusive:
        opts["exclusive"] = True
    if nodes.guards_nodes(job):     # the allocation outlives a lost node (login.nodes)
        opts["no-kill"] = True
    return opts


def threads(threads_per_rank: int) -> str:
    """A shell line that sets ``OMP_NUM_THREADS`` for every rank and says so once, unless it is
    set already or ``threads_per_rank`` is 0 (:mod:`hpc_train.threads`)."""
    if threads_per_rank <= 0:
        return "# dist.threads_per_rank=0: OMP_NUM_THREADS is left as it is (torch's default)"
    say = shlex.quote(f"hpc_train: {omp.line(threads_per_rank)}")
    return (f'if [ -z "${{{omp.VAR}:-}}" ]; then export {omp.VAR}={threads_per_rank}; echo {say} >&2; fi')


def filename_pattern(path: object) -> str:
    """A path for ``--output``, where Slurm reads ``%`` as the start of a replacement symbol (``%j``,
    ``%x``...): each ``%`` of the path itself is written ``%%``."""
    return str(path).replace("%", "%%")


def directives(opts: Mapping[str, Option]) -> list[str]:
    """``#SBATCH`` lines; sbatch honours shell-style quotes in them."""
    return [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={shlex.quote(str(v))}" for k, v in opts.items()]


def local_dir(cfg: Config) -> str | None:
    """``checkpoint.local_dir`` when the config asks for the local tier, else None (see Loop)."""
    return cfg.checkpoint.local_dir if config_local.enabled(cfg.checkpoint) else None


class Loop:
    """The srun loop of one batch script: :meth:`before` and :meth:`start` go before the srun
    line, :meth:`after` right after it (with ``status`` holding srun's exit code)."""

    def __init__(self, job: JobSection, launcher: str = "srun", python: str | None = None,
                 run_dir_expr: str = '"$RUN_DIR"', config_expr: str = "", local_dir: str | None = None) -> None:
        self.ranks = tasks_per_node(job)
        self.srun_tasks = 1 if launcher == "torchrun" else self.ranks
        self.job = job
        self.python = python or shlex.quote(sys.executable)
        self.run_dir_expr = run_dir_expr
        self.config_expr = config_expr     # the job's own config file, where it is not the run's yet
        self.local_dir = local_dir         # the local checkpoint tier's checkpoint.local_dir; None: tier off
        self.standby = job.standby and launcher == "srun"   # a torchrun agent is not a worker to hand over

    def before(self) -> list[str]:
        return [f"export SRUN_CPUS_PER_TASK={self.job.cpus_per_task * (self.ranks // self.srun_tasks)}",
                f'export {BATCH_START_ENV}="$(date +%s)"', "attempt=0",
                f"step_nodes={shlex.quote(nodes.first_step_args(self.job, self.srun_tasks))}",
                *(self._standby_lines() if self.standby else [])]

    def srun(self) -> str:
        """What the loop's srun line starts with: the step function with a standby, else srun
        on the step's nodes."""
        return "hpc_train_step" if self.standby else "srun $step_nodes"

    @staticmethod
    def _standby_lines() -> list[str]:
        """job.standby (hpc_train.launch.standby): each step's srun line runs a second time beside
        it, --overlap, its tasks waiting on a FIFO that this shell holds on fd 8; a restart on the
        same nodes writes them the go and waits for that srun instead of starting one. Every srun
        closes fd 8 (the shell's close is the standby's end-of-file: its dismissal)."""
        return [
            "# job.standby: the next step's tasks wait beside this one, torch imported (launch.standby).",
            'standby=""; standby_nodes=""',
            "hpc_train_standby() {",
            '  local fifo; fifo="$(mktemp -u "${TMPDIR:-/tmp}/hpc_train-standby.XXXXXXXX")" || return 0',
            '  mkfifo -m 600 "$fifo" || return 0',
            '  exec 8<>"$fifo" 7<"$fifo"; rm -f "$fifo"',
            f'  {STANDBY_ENV}=1 command srun --overlap --input=all --open-mode=append $step_nodes "$@" <&7 7<&- 8>&- &',
            '  standby=$!; standby_nodes="$step_nodes"; exec 7<&-',
            "}",
            "hpc_train_step() {",
            '  local took=""',
            f'  case "${{{RESUME_ENV}:-latest}}" in *[[:space:]]*) ;; *)',
            '    if [ -n "$standby" ] && [ "$standby_nodes" = "$step_nodes" ] && kill -0 "$standby" 2>/dev/null \\',
            f'      && printf \'go %s %s %s\\n\' "${ATTEMPT_ENV}" "${{{RESUME_ENV}:-latest}}" "${{{LOCAL_STEP_ENV}:--}}" >&8; '
            'then took="$standby"; fi;;',
            "  esac",
            '  exec 8>&-; standby=""',
            '  hpc_train_standby "$@"',
            '  if [ -n "$took" ]; then wait "$took"; else command srun $step_nodes "$@" 8>&-; fi',
            "}"]

    @staticmethod
    def start() -> list[str]:
        return ["while :; do", f"attempt=$((attempt + 1)); export {ATTEMPT_ENV}=$attempt"]

    def after(self) -> list[str]:
        call = (f'{self.python} -m hpc_train requeue-hook {self.run_dir_expr} "$status" '
                f"--tasks-per-node {self.srun_tasks} --ranks-per-node {self.ranks}"
                + (f" --config {self.config_expr}" if self.config_expr else ""))
        # "|| hooked=$?": a batch script under set -e would end at the hook's non-zero exit.
        return ["hooked=0", f"next=$({call}) || hooked=$?", 'status="$hooked"',
                f'if [ "$status" -ne {AGAIN} ]; then break; fi', *self.read_next(), "done",
                *(["exec 8>&-   # the standby's end-of-file: it leaves"] if self.standby else []), *self.cleanup()]

    @staticmethod
    def read_next() -> list[str]:
        """The hook's fields for the next step, one per line of ``$next``, read as data: the
        resume value exported, srun's node arguments kept unless the hook named new ones."""
        reads = "; ".join(f"IFS= read -r hpc_train_next_{f}" for f in NEXT_FIELDS)
        return [f'{{ {reads}; }} <<< "$next" || true',
                f'export {RESUME_ENV}="${{hpc_train_next_resume:-latest}}" {LOCAL_STEP_ENV}="${{hpc_train_next_local:-}}"',
                'if [ -n "${hpc_train_next_nodes:-}" ]; then step_nodes="$hpc_train_next_nodes"; fi']

    def cleanup(self) -> list[str]:
        """After the loop: remove the job's node-local checkpoint tier on every node (an in-place
        restart, inside the loop, still finds it). Only under Slurm (``SLURM_JOB_NUM_NODES``);
        ``command``: not through a shell function named srun (login.nodes)."""
        if self.local_dir is None:
            return []
        return ["# The job's node-local checkpoints (checkpoint.local_*) end with it, on every node.",
                'if [ -n "${SLURM_JOB_NUM_NODES:-}" ]; then',
                f"  {config_local.NODES_NOW}", f"  command {config_local.shell_cleanup(self.local_dir)}", "fi"]
