"""Each rank's record, ``logs/.heartbeat/rank-R``: who runs it, in which job step, and how its
work ended. No torch here.

A rank writes its record when it starts (:func:`begin`), touches it while it lives (the
heartbeat, :func:`touch`), and adds one word before it exits: ``ended`` (its work is done:
finished, stopped, returned) or ``left`` (it left code a stop ended). A rank that exits without
either word failed, and so did a rank of the step that left no record at all (it died before
writing one). That is what the batch shell's hook, the local launcher and the watchdogs read
here, the same way: :func:`read_step` gives every rank of one step, ``None`` for a missing one.

A record names its step (:class:`StepId`: the Slurm job, the incarnation ``SLURM_RESTART_COUNT``
and the batch script's attempt ``HPC_TRAIN_ATTEMPT``; a local launch by its start), so a record
an earlier step left is never taken for this one's. Its node is named as Slurm names it
(``SLURMD_NODENAME``), which is what ``sinfo`` and ``squeue`` answer with.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_train import config_local, rundir
from hpc_train.records import io
from hpc_train.records import fields
from hpc_train.records.fields import Bad

DIR = ".heartbeat"          # under logs/
ATTEMPT_ENV = rundir.ATTEMPT_ENV
ENDINGS = ("finished", "stopped", "returned")


@dataclass(frozen=True)
class StepId:
    """One job step: ``job`` and ``restart`` name the incarnation, ``attempt`` the step within it
    (the batch script counts them). A local launch has no job and is told apart by ``launch``."""

    job: str
    restart: int
    attempt: int
    launch: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StepId:
        env = os.environ if env is None else env
        keys = (rundir.LAUNCHED_AT_ENV, "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", ATTEMPT_ENV,
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
        return cls(env.get("SLURM_JOB_ID", ""), _int(env.get("SLURM_RESTART_COUNT")), _int(env.get(ATTEMPT_ENV)),
                   "/".join(env.get(k, "") for k in keys))

    def holds(self, rec: RankRecord) -> bool:
        """Whether ``rec`` was written in this step: by job, incarnation and attempt under a
        batch script, by the launch otherwise."""
        if self.job and self.attempt:
            return (rec.job, rec.restart, rec.attempt) == (self.job, self.restart, self.attempt)
        return rec.launch == self.launch


def _int(raw: str | None) -> int:
    return rundir.decimal(raw or "", 9) or 0


@dataclass(frozen=True)
class RankRecord:
    rank: int
    node: str                 # as Slurm names it (SLURMD_NODENAME), else the host name
    host: str
    pid: int | None
    job: str
    restart: int
    attempt: int
    launch: str
    world_size: int | None
    started: float | None
    ended: str | None = None  # finished | stopped | returned
    left: str | None = None   # "stop": left code a stop ended
    addr: str = ""            # the host's address, as a peer's transport names it in an error
    tier_id: str = ""         # the node-local tier's ID of this rank's items (hpc_train.config_local.run_id)

    @property
    def said_its_end(self) -> bool:
        """It ended its work as it should, or left for a stop: not a failure."""
        return self.ended is not None or self.left == "stop"


def path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / rundir.LOGS / DIR / f"rank-{rank}"


def _parse(raw: Mapping[str, object], rank: int) -> RankRecord:
    ended = raw.get("ended")
    if not (ended is None or ended in ENDINGS):
        raise Bad(f"ended is {ended!r}, not one of {', '.join(ENDINGS)}")
    left = raw.get("left")
    if not (left is None or left == "stop"):
        raise Bad(f"left is {left!r}, not 'stop'")
    host = fields.text(raw, "host", "unknown host")
    return RankRecord(rank, fields.text(raw, "node", host), host, fields.opt_count(raw, "pid"), fields.text(raw, "job", ""),
                      fields.count(raw, "restart", 0), fields.count(raw, "attempt", 0), fields.text(raw, "launch", ""),
                      fields.opt_count(raw, "world_size", lo=1), fields.opt_time(raw, "started"), ended, left,
                      fields.text(raw, "addr", ""), fields.text(raw, "tier_id", ""))


def read(run_dir: Path, rank: int) -> tuple[RankRecord | None, str | None]:
    """Rank ``rank``'s record: (record, None), (None, None) when it has none, (None, what is
    wrong) when it is damaged."""
    return _read_at(path(run_dir, rank), rank)


def _read_at(p: Path, rank: int) -> tuple[RankRecord | None, str | None]:
    raw, problem = io.read_json(p)
    if raw is None:
        return None, problem
    try:
        return _parse(raw, rank), None
    except Bad as e:
        return None, str(e)


def read_step(run_dir: Path, step: StepId, world_size: int) -> dict[int, RankRecord | None]:
    """Every rank of the step ``0..world_size-1``: its record of that step, or None (it left none,
    or an earlier step's, or a damaged one: each means it never said its work ended)."""
    out: dict[int, RankRecord | None] = {}
    d = path(run_dir, 0).parent    # joined once: three joins per rank were a fifth of the read
    for r in range(world_size):
        rec, _ = _read_at(d / f"rank-{r}", r)
        out[r] = rec if rec is not None and step.holds(rec) else None
    return out


def node_name(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def host_address() -> str:
    """This host's address as its peers see it ("" when it does not resolve)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""


def begin(run_dir: Path, rank: int, world_size: int | None) -> Path:
    """This rank starts: its record for this step (any earlier one is replaced), and its error
    file, if an earlier step left one, removed: whatever reads this step's errors (the requeue
    hook, ``status``) must not take an earlier step's for this one's. A standby step begins
    within a second of the step it replaces having failed, closer than any clock's slack."""
    step = StepId.from_env()
    p = path(run_dir, rank)
    p.parent.mkdir(parents=True, exist_ok=True)
    rundir.remove_record(rundir.rank_error(run_dir, rank))
    io.write_json(p, {"rank": rank, "host": socket.gethostname(), "node": node_name(), "pid": os.getpid(),
                          "job": step.job, "restart": step.restart, "attempt": step.attempt, "launch": step.launch,
                          "world_size": world_size, "started": time.time(), "addr": host_address(),
                          "tier_id": config_local.this_id(os.environ.get(rundir.LOCAL_ID_ENV))})
    return p


def say(run_dir: Path, rank: int, *, ended: str | None = None, left: str | None = None) -> None:
    """Add this rank's word to its record (a later word keeps the earlier ones)."""
    raw, _ = io.read_json(path(run_dir, rank))
    rec = dict(raw or {})
    if not rec:      # never begun (a rank saying its end before any start): name it all the same
        step = StepId.from_env()
        rec = {"rank": rank, "host": socket.gethostname(), "node": node_name(), "pid": os.getpid(), "job": step.job,
               "restart": step.restart, "attempt": step.attempt, "launch": step.launch}
    rec.update({k: v for k, v in (("ended", ended), ("left", left)) if v is not None})
    io.write_json(path(run_dir, rank), rec)


def touch(p: Path) -> None:
    """The heartbeat: the record's mtime says the rank is alive."""
    os.utime(p)


def age(run_dir: Path, rank: int, now: float | None = None) -> float | None:
    """Seconds since rank ``rank`` last beat; None when it has no record."""
    try:
        return (time.time() if now is None else now) - path(run_dir, rank).stat().st_mtime
    except OSError:
        return None


def error_line(run_dir: Path, rank: int, since: float) -> str | None:
    """The first line of rank ``rank``'s error file (``logs/rank-R.error``, which says why it
    failed), if it was written at or after ``since``; None otherwise."""
    p = rundir.rank_error(run_dir, rank)
    try:
        if p.stat().st_mtime < since:
            return None
    except OSError:
        return None
    text, _ = rundir.read_text(p)
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), None)
    return line[:300] if line else None


def rank_of(name: str, suffix: str = "") -> int | None:
    """R of a rank's file name ``rank-R`` + ``suffix``, when R is a rank number (below 2^31)."""
    r = rundir.name_number(name, "rank-", suffix)
    return r if r is not None and r < 1 << 31 else None


def error_times(run_dir: Path) -> dict[int, float]:
    """Every rank's error file (``logs/rank-R.error``) and when it was written: rank -> mtime."""
    logs = Path(run_dir) / rundir.LOGS
    out: dict[int, float] = {}
    for p in (logs.glob("rank-*.error") if logs.is_dir() else ()):
        r = rank_of(p.name, ".error")
        try:
            if r is not None:
                out[r] = p.stat().st_mtime
        except OSError:
            continue     # removed under us (a new launch clears them)
    return out


def last_step(run_dir: Path) -> list[RankRecord]:
    """The records of the newest job step present (the step of the record that began last), by
    rank; a damaged record is left out. Under the local launcher every record is its launch's
    (it clears them); under Slurm an earlier step's records can remain beside them."""
    recs = [r for r in (read(run_dir, i)[0] for i in present(run_dir)) if r is not None]
    if not recs:
        return []
    newest = max(recs, key=lambda r: r.started or 0.0)
    step = StepId(newest.job, newest.restart, newest.attempt, newest.launch)
    return [r for r in recs if step.holds(r)]


def launch_start(records: list[RankRecord]) -> float | None:
    """When the launch that wrote ``records`` (one step's, see :func:`last_step`) began: the local
    launcher's own start where it recorded one (the first part of ``launch``), else the first
    rank's start; None when nothing says. Anything written earlier was written by an earlier
    launch: the launcher starts only once the run directory's previous holder has let go."""
    for rec in records:
        first = rec.launch.split("/", 1)[0]
        try:
            return float(first)
        except ValueError:
            continue
    began = [r.started for r in records if r.started is not None]
    return min(began) if began else None


def clear(run_dir: Path) -> None:
    """Before a local launch: every rank's record is the new launch's, none an earlier one's."""
    for r in present(run_dir):
        rundir.remove_record(path(run_dir, r))


def present(run_dir: Path) -> list[int]:
    """The ranks that have a record, whatever step it is from."""
    d = Path(run_dir) / rundir.LOGS / DIR
    return sorted(r for p in d.glob("rank-*") if (r := rank_of(p.name)) is not None) if d.is_dir() else []
