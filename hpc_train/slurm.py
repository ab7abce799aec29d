"""The one Slurm client: every ``squeue``, ``sinfo``, ``sacct``, ``scontrol`` and ``scancel`` that
hpc_train runs goes through here (submitit runs ``sbatch`` itself; the batch templates' shell
lines run ``srun``). Torch-free, used from the login side and, for a stack dump, from a node.

One timeout and one failure convention. A :class:`Reply`'s ``out`` is the command's standard
output, or None: *unknown*, with one line in ``why`` (not on PATH, no answer within the timeout,
a non-zero exit with the last line it said, or nothing said where the question needs an answer).
A caller never reads an unknown answer as an empty one: "no nodes listed" would read as "every
node gone", "no job listed" as "the job ended".

Where listing nothing *is* the answer (``squeue -j`` of jobs that may have left the queue,
``sacct`` of jobs not yet in the accounting), the query says so with ``empty_ok``; ``squeue``'s
"Invalid job id specified" for one job that has left the queue is such an empty answer, not a
failure.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

# Slurm's own clients retry an unresponsive controller for about MessageTimeout x a few tries;
# one minute covers a busy slurmctld without leaving a status or a hook hanging for long.
TIMEOUT_S = 60.0

# squeue's answer when asked about one job that has left the queue (slurm_load_job).
_NOT_QUEUED = "Invalid job id specified"


@dataclass(frozen=True)
class Reply:
    """What one command answered: ``out`` (its standard output) or None and ``why`` (one line)."""

    out: str | None
    why: str = ""
    said: tuple[str, ...] = ()     # the lines it said, stderr first (for a refusal that names the cause)

    @property
    def known(self) -> bool:
        return self.out is not None

    @property
    def last(self) -> str:
        """The last line it said, cut to one reasonable line (an action's report)."""
        return self.said[-1][:300] if self.said else ""


def installed() -> bool:
    """Whether this machine can talk to Slurm at all (``sbatch`` on PATH: submitit needs it)."""
    return shutil.which("sbatch") is not None


def can_query() -> bool:
    """Whether ``squeue`` is on PATH (a laptop holding a copy of a run directory has none)."""
    return shutil.which("squeue") is not None


def _said(out: subprocess.CompletedProcess) -> tuple[str, ...]:
    return tuple(ln.strip() for ln in ((out.stderr or "") + "\n" + (out.stdout or "")).splitlines() if ln.strip())


def _call(cmd: list[str], empty_ok: bool, timeout: float = TIMEOUT_S) -> Reply:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return Reply(None, f"{cmd[0]} is not on PATH")
    except subprocess.TimeoutExpired:
        return Reply(None, f"{cmd[0]} did not answer in {timeout:g} s")
    except OSError as e:
        return Reply(None, f"{cmd[0]} could not start ({type(e).__name__}: {e})")
    said = _said(out)
    if out.returncode != 0:
        return Reply(None, f"{cmd[0]} failed: {said[-1][:300] if said else f'exit status {out.returncode}'}", said)
    if not empty_ok and not out.stdout.strip():
        return Reply(None, f"{cmd[0]} answered nothing", said)
    return Reply(out.stdout, "", said)


def squeue(*args: str, empty_ok: bool = False) -> Reply:
    reply = _call(["squeue", *args], empty_ok)
    if reply.out is None and any(_NOT_QUEUED in line for line in reply.said):
        return Reply("", "", reply.said)      # one job asked about has left the queue: not listed
    return reply


def sacct(*args: str, empty_ok: bool = False) -> Reply:
    return _call(["sacct", *args], empty_ok)


def sinfo(*args: str) -> Reply:
    return _call(["sinfo", *args], empty_ok=False)


def scontrol(*args: str) -> Reply:
    """``scontrol show ...`` answers something; ``scontrol requeue`` answers nothing on success."""
    return _call(["scontrol", *args], empty_ok=args[:1] != ("show",))


def scancel(*args: str) -> Reply:
    return _call(["scancel", *args], empty_ok=True)
