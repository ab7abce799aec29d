"""Job configuration: typed, sectioned dataclasses loaded from YAML.

Precedence, lowest to highest:

1. the defaults below;
2. the YAML file (``jobs/*.yaml``);
3. each ``--set section.key=value`` on the command line, in order;
4. dedicated command-line flags (``--nodes``, ``--run-dir``, ...), which are ``--set``s
   under another name.

Every value is checked on the way in: an unknown key names its section's valid keys and
the closest match, a value of the wrong type or out of range names the field. The resolved
config is written to ``RUN_DIR/config.yaml``; ``python -m hpc_train config CONFIG`` prints it
without running anything. This module must not import torch: the CLI's fast paths use it.

How YAML is read (plain scalars as text, no aliases or duplicate keys): :mod:`hpc_train.config_yaml`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpc_train import config_local, rundir
from hpc_train.config_rules import (OPT_LEVELS, STRATEGIES, check_launch, hang_timeout,  # noqa: F401 (re-exported)
                                    resolve_precision, stragglers, time_minutes)
from hpc_train.config_yaml import IMPORT_RE, coerce, parse_mapping, parse_value, read_file, section  # noqa: F401 (section re-exported)
from hpc_train.errors import UsageError, closest, show
from hpc_train.rundir import write_atomic


_COUNT_MAX = 65535    # more nodes than any Slurm cluster has; Slurm keeps CPUs and tasks per node in 16 bits


def _f(default: Any, *, choices: tuple[str, ...] | None = None, min: float | None = None,
       max: float | None = None, importable: bool = False, doc: str = "") -> Any:
    """A dataclass field carrying its validation rules.

    ``importable`` means the value may also be ``package.module:function`` (a user plug-in).
    ``doc`` is written beside the value wherever the config is shown (``config``, config.yaml).
    """
    meta = {"choices": choices, "min": min, "max": max, "importable": importable, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


_WEEK = 7 * 24 * 3600


@dataclass
class JobSection:
    """Scheduler resources. Used by ``submit`` and ``sbatch``; ``run`` ignores them."""
    name: str = _f("hpc_train")
    # Counts beyond what any Slurm cluster has are refused here, not written into #SBATCH lines.
    nodes: int = _f(1, min=1, max=_COUNT_MAX)
    tasks_per_node: int = _f(0, min=0, max=_COUNT_MAX)          # 0: one per GPU, else 1
    gpus_per_node: int = _f(0, min=0, max=_COUNT_MAX)
    cpus_per_task: int = _f(1, min=1, max=_COUNT_MAX)
    mem: str = _f("")                            # e.g. "16G"; "" = cluster default
    time: str = _f("01:00:00")                   # Slurm time: MM, HH:MM:SS, D-HH[:MM[:SS]]
    partition: str = _f("")
    account: str = _f("")
    qos: str = _f("")
    constraint: str = _f("")
    exclusive: bool = _f(False)
    signal: str = _f("USR2", choices=("USR1", "USR2", "TERM", "INT", "HUP"))  # NCCL may catch USR1
    signal_lead: int = _f(90, min=0, max=65535)  # seconds before the time limit (sbatch --signal's limit)
    setup: list = _f([])                         # shell lines run before srun in the batch script
    # Requeue budgets per cause, counted across runs in RUN_DIR/requeue.json; -1 = unlimited.
    requeue_preemption: int = _f(-1, min=-1)
    requeue_timeout: int = _f(20, min=-1)
    requeue_failure: int = _f(1, min=-1)
    # A failed step (a rank crashed, the watchdog ended a hung rank) is first restarted inside
    # the allocation, resuming from the newest complete checkpoint: at most this many times over
    # the run (a restart without a newer checkpoint counts twice), then the failure budget.
    restarts_in_place: int = _f(3, min=0)
    # A lost node (the batch script is submitted with --no-kill when either is set): spare_nodes
    # more are allocated and idle until one replaces a lost node; min_nodes (0: job.nodes) lets
    # the run go on with fewer nodes, resharded, when no spare is left.
    spare_nodes: int = _f(0, min=0, max=_COUNT_MAX)
    min_nodes: int = _f(0, min=0, max=_COUNT_MAX)
    # A rank named slow (dist.straggler_*) for dist.straggler_window_s: checkpoint, end the step and
    # restart it in place with its node swapped for a spare (needs spare_nodes >= 1).
    replace_stragglers: bool = _f(False)
    # A standby step (srun launcher): each step's tasks are started a second time beside it, with
    # torch imported, and the next in-place restart on the same nodes is handed to them (about
    # 2-3 s less from a failure to the first step again). Costs one idle process per rank.
    standby: bool = _f(False)


@dataclass
class DistSection:
    backend: str = _f("auto", choices=("auto", "nccl", "gloo"))
    # ddp, fsdp (sharded), dp (nn.DataParallel, 1 process/node), allreduce (no wrapper), split (stages on
    # successive devices), none: see hpc_train/node/strategies.py
    strategy: str = _f("ddp", choices=("ddp", "fsdp", "dp", "allreduce", "split", "none"))
    # At most a week: the value becomes a timedelta (overflows near 1e14 s) and a C++ timeout in ms.
    init_timeout_s: float = _f(300.0, min=1, max=_WEEK)   # rendezvous and first collective
    timeout_s: float = _f(600.0, min=1, max=_WEEK)        # every later collective (a dead rank fails the job)
    threads_per_rank: int = _f(1, min=0)         # OMP_NUM_THREADS per rank, unless set; 0 = torch's default
    # A loop stepping through Run is hung when no step ended for 10 x its recent p99 step time, at
    # least hang_floor_s ("auto"; 0: 20 s, or half of timeout_s if less), or for this many seconds
    # (a number); see hpc_train/node/hang.py.
    hang_timeout_s: str = _f("auto")
    hang_floor_s: float = _f(0.0, min=0, max=_WEEK)
    # Every N steps the ranks' own step times are gathered; a rank this many times slower than the
    # median is named (0: off); see hpc_train/node/straggler.py.
    straggler_every_steps: int = _f(50, min=0)
    straggler_ratio: float = _f(1.3, min=1, max=1000)
    straggler_window_s: float = _f(300.0, min=0, max=_WEEK)   # named this long: swapped (job.replace_stragglers)


@dataclass
class DataSection:
    name: str = _f("digits", choices=("digits", "mnist", "synthetic"), importable=True)
    root: str = _f("data")                       # MNIST: ROOT/MNIST/raw/*-ubyte
    batch_size: int = _f(32, min=1)              # per rank
    eval_batch_size: int = _f(256, min=1)
    num_workers: int = _f(0, min=0)
    test_fraction: float = _f(0.2, min=0.01, max=0.9)   # digits: held-out split
    synthetic_size: int = _f(4096, min=1)
    shuffle: bool = _f(True)


@dataclass
class ModelSection:
    name: str = _f("convnet", choices=("convnet", "mlp", "linear"), importable=True)
    hidden: int = _f(50, min=1)                  # mlp hidden width
    dropout: float = _f(0.0, min=0, max=1)


@dataclass
class OptimSection:
    name: str = _f("adam", choices=("sgd", "adam", "adamw"))
    lr: float = _f(1e-3, min=0)
    momentum: float = _f(0.9, min=0, max=1)
    weight_decay: float = _f(0.0, min=0)
    schedule: str = _f("cosine", choices=("constant", "step", "cosine"))
    warmup_steps: int = _f(0, min=0)
    step_size: int = _f(1000, min=1)             # step schedule: decay every N optimizer steps
    gamma: float = _f(0.1, min=0)
    grad_clip: float = _f(0.0, min=0)            # max grad norm; 0 = off
    grad_accum: int = _f(1, min=1)               # micro-batches per optimizer step


@dataclass
class TrainSection:
    epochs: int = _f(10, min=0)
    max_steps: int = _f(0, min=0)                # optimizer steps; 0 = run by epochs
    log_every: int = _f(10, min=1)
    eval: bool = _f(True)                        # evaluate on the held-out split every epoch
    fn: str = _f("")                             # "pkg.mod:fn" replaces the built-in trainer
    script: str = _f("")                         # a script run on every task instead (python SCRIPT ARGS)
    args: list = _f([])                          # the script's arguments
    # The job's signal (job.signal) reaches every process of a Slurm step: "term" starts the script
    # with it ignored (it gets SIGTERM, once, from hpc_train); "passthrough" leaves it to the script.
    script_signal: str = _f("term", choices=("term", "passthrough"))
    precision: str = _f("fp32", choices=("fp32", "bf16", "fp16"))   # autocast dtype; fp16 adds a GradScaler
    opt_level: str = _f("none", choices=("none", "O0", "O1", "O2"))   # Apex's names: O0=fp32, O1/O2=fp16 (precision.py)


@dataclass
class CheckpointSection:
    enabled: bool = _f(True)
    every_steps: int = _f(0, min=0, doc="0 = off; the timer below still applies")
    # On by default: a run killed without warning (a node lost, kill -9, an OOM) otherwise loses
    # everything since its start, and a rerun starts from step 0.
    every_seconds: float = _f(600.0, min=0, max=_WEEK,
                              doc="a checkpoint every 10 minutes of training by default; a stop always "
                                  "saves one; 0 = only at a stop")
    keep: int = _f(2, min=2)                     # the newest may still be being written
    keep_skipped: int = _f(3, min=0)             # moved-aside damaged/unfinished copies kept (never deleted sooner)
    async_save: bool = _f(True)
    # "always": an async save copies the state on a background thread while the next step's
    # forward and backward run; the next optimizer.step() waits for the copy. "auto": only with a
    # GPU (the copy is a device-to-host transfer off the compute stream). On CPU the copy competes
    # with the step for the same cores and memory bandwidth, which can make it slower (measure
    # with benchmarks/checkpoint.py). "never" for code that changes weights outside optimizer.step().
    overlap_staging: str = _f("auto", choices=("auto", "always", "never"))
    local_every_steps: int = _f(0, min=0, doc="node-local tier (docs/checkpoints.md); 0 = off")
    local_every_seconds: float = _f(30.0, min=0, max=_WEEK, doc="node-local tier; 0 and local_every_steps 0: off")
    local_dir: str = _f("", doc="'' = $SLURM_TMPDIR, else $TMPDIR, else /dev/shm")
    local_keep: int = _f(2, min=1)
    local_replicas: int = _f(1, min=0, doc="local tier: copies on the next node(s); 0 = none; < job.nodes")
    # When a peer fails, each survivor saves the step it holds to the node-local tier, and the
    # dead rank's item from its own state, which every rank sends to a peer at each step
    # (docs/checkpoints.md): a crash or a hang then redoes at most the step in flight. Off by
    # default: the per-step exchange costs a few percent of a short step (benchmarks/overhead.py).
    local_on_failure: bool = _f(False, doc="node-local tier: the survivors save the step they hold when a peer fails")


@dataclass
class LogSection:
    tensorboard: bool = _f(True)
    progress: str = _f("auto", choices=("auto", "bar", "lines", "off"))
    level: str = _f("INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass
class Config:
    seed: int = _f(0, min=0, max=2**32 - 1)      # numpy's legacy seeding takes [0, 2**32)
    run_dir: str = _f("")                        # "" = runs/<job.name>
    job: JobSection = field(default_factory=JobSection)
    dist: DistSection = field(default_factory=DistSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or f"runs/{self.job.name}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_written_dict(self) -> dict[str, Any]:
        """The sections that apply, as ``config.yaml`` and ``config`` show them. A script or a
        function (``train.script``, ``train.fn``) never reads the built-in trainer's sections
        (:data:`TRAINER_SECTIONS`) and keys (:data:`TRAINER_KEYS`), nor the other's ``train`` keys:
        of those only the keys set away from their defaults are kept.
        :func:`load` gives whatever is left out its default again."""
        d = self.to_dict()
        if self.train.script or self.train.fn:
            defaults = Config().to_dict()
            for name in TRAINER_SECTIONS:
                kept = {k: v for k, v in d[name].items() if v != defaults[name][k]}
                if kept:
                    d[name] = kept
                else:
                    del d[name]
            unread = TRAINER_KEYS + (("fn",) if self.train.script else ("script", "args", "script_signal"))
            d["train"] = {k: v for k, v in d["train"].items() if k not in unread or v != defaults["train"][k]}
        return d

    def to_yaml(self) -> str:
        return _with_docs(yaml.safe_dump(self.to_written_dict(), sort_keys=False))

    def digest(self) -> str:
        """A short hash of everything that changes what is trained (not where it runs)."""
        d = self.to_dict()
        for volatile in ("job", "run_dir", "log"):
            d.pop(volatile)
        d["data"].pop("num_workers")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


_SECTIONS = {f.name: f for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory)}
# Read only by the built-in trainer (hpc_train.trainer), never by a train.script or train.fn run.
TRAINER_SECTIONS = ("data", "model", "optim")
TRAINER_KEYS = ("epochs", "eval")   # the train section's keys that only the built-in trainer reads


def _with_docs(text: str) -> str:
    """A config's YAML with each documented field's ``doc`` as a comment at the end of its line.
    Only a section's own ``  key: value`` lines are touched (not list items or wrapped text)."""
    # A section's default_factory is its dataclass (_SECTIONS keeps only those); mypy cannot narrow a Field's.
    docs = {f"{name}.{f.name}": f.metadata["doc"] for name, sec in _SECTIONS.items()
            for f in dataclasses.fields(sec.default_factory) if f.metadata.get("doc")}  # type: ignore[arg-type]
    out, section = [], ""
    for line in text.splitlines():
        if line[:1] not in ("", " "):
            section = line.split(":", 1)[0]
        elif line.startswith("  ") and line[2:3] not in (" ", "-") and not line.endswith(":"):
            doc = docs.get(f"{section}.{line[2:].split(':', 1)[0]}")
            if doc:
                line = f"{line}  # {doc}"
        out.append(line)
    return "\n".join(out) + "\n"


def _fields(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj) if f.name not in _SECTIONS}


def _unknown(path: str, key: str, valid: list[str]) -> UsageError:
    where = f"section '{path}'" if path else "the top level"
    key = key if len(key) <= 60 else key[:40] + f"... ({len(key)} characters)"
    return UsageError(f"config: unknown key '{path + '.' if path else ''}{key}' in {where}"
                      f"{closest(key, valid)} (valid keys: {', '.join(valid)})")


def _apply(cfg: Config, data: dict[str, Any], source: str) -> None:
    if not isinstance(data, dict):
        raise UsageError(f"config: {source} must be a mapping of sections, got {type(data).__name__}")
    top = _fields(cfg)
    for key, value in data.items():
        if key in _SECTIONS:
            if value is None:
                continue
            section = getattr(cfg, key)
            fields = _fields(section)
            if not isinstance(value, dict):
                raise UsageError(f"config: section '{key}' must be a mapping of its keys "
                                 f"(e.g. {key}.{next(iter(fields))}), got {show(value)}; on the command line "
                                 f"set one key: --set {key}.KEY=VALUE")
            for sub, v in value.items():
                if sub not in fields:
                    raise _unknown(key, str(sub), list(fields))
                setattr(section, sub, coerce(f"{key}.{sub}", fields[sub], v))
        elif key in top:
            setattr(cfg, key, coerce(key, top[key], value))
        else:
            raise _unknown("", str(key), list(top) + list(_SECTIONS))


def parse_set(item: str) -> dict[str, Any]:
    """``section.key=value`` -> ``{section: {key: value}}``, the value parsed as YAML."""
    m = re.match(r"^([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?=(.*)$", item, re.S)
    if not m:
        raise UsageError(f"--set expects section.key=value (e.g. optim.lr=0.01), got {show(item)}")
    section, key, raw = m.groups()
    value = parse_value(raw, f"--set {section}{'.' + key if key else ''}")
    if key is None:
        return {section: value}
    if section not in _SECTIONS:
        top = list(_fields(Config()))
        if section in top:
            raise UsageError(f"--set {section}.{key}: '{section}' is a top-level key, not a section; "
                             f"use --set {section}=VALUE")
        raise _unknown("", section, top + list(_SECTIONS))
    return {section: {key: value}}


def load(path: str | os.PathLike[str] | None, overrides: Sequence[str] = (),
         extra: dict[str, Any] | None = None) -> Config:
    """Build a :class:`Config` from defaults, a YAML file, ``--set`` items and flag values."""
    cfg = Config()
    if path is not None:
        data = read_file(path)
        _apply(cfg, {} if data is None else data, str(path))
    for item in overrides:
        _apply(cfg, parse_set(item), f"--set {item}")
    if extra:
        _apply(cfg, extra, "command line")
    return validate(cfg)


def validate(cfg: Config) -> Config:
    """Rules that span fields."""
    if cfg.train.epochs == 0 and cfg.train.max_steps == 0:
        raise UsageError("config: train.epochs and train.max_steps are both 0, so there is nothing to train; "
                         "set train.epochs >= 1 or train.max_steps >= 1")
    time_minutes(cfg.job.time)   # a malformed job.time fails here, not at submission
    if cfg.job.min_nodes > cfg.job.nodes:
        raise UsageError(f"config: job.min_nodes={cfg.job.min_nodes} is above job.nodes={cfg.job.nodes}; valid: "
                         f"1..{cfg.job.nodes} (0 keeps job.nodes: the run never goes on with fewer nodes)")
    cfg.train.precision = resolve_precision(cfg.train.precision, cfg.train.opt_level)
    # Slurm's processes per node (job.tasks_per_node 0: one per GPU); `run` checks its --nproc.
    check_launch(cfg.dist.strategy, cfg.job.tasks_per_node or max(1, cfg.job.gpus_per_node))
    if cfg.dist.strategy == "fsdp" and cfg.train.precision == "fp16":
        # GradScaler's inf/NaN check looks at local gradients: with sharded gradients one rank
        # could skip a step the others take. bf16 needs no scaler.
        raise UsageError("config: dist.strategy=fsdp with train.precision=fp16 is refused: the GradScaler's "
                         "overflow check sees only this rank's gradient shards, so ranks could disagree on "
                         "skipping a step; use train.precision=bf16 with fsdp")
    hang_timeout(cfg.dist.hang_timeout_s, cfg.dist.timeout_s, cfg.dist.hang_floor_s)
    stragglers(cfg.job, cfg.dist)
    if cfg.train.fn and not IMPORT_RE.match(cfg.train.fn):
        raise UsageError(f"config: train.fn must be an import path 'package.module:function', got {cfg.train.fn!r}")
    config_local.check(cfg.checkpoint, cfg.job.nodes)
    return cfg


def from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a config from :meth:`Config.to_dict` (e.g. after pickling to a Slurm node)."""
    cfg = Config()
    _apply(cfg, data, "config")
    return validate(cfg)


def write(cfg: Config, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / rundir.CONFIG
    write_atomic(out, cfg.to_yaml())
    return out


def read_saved(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The run directory's ``config.yaml`` (:func:`write` wrote it; anyone may have changed it
    since) as a mapping, taking whatever bytes are there: (mapping, None); (None, None) when it does
    not exist; (None, what is wrong) otherwise. Read bounded and never blocking
    (:func:`hpc_train.rundir.read_text`: a FIFO, a device or a directory in its place is a problem,
    not a hang). For readers that only look a value up (use :func:`section`); a run loads its
    config through :func:`load`, which names each bad field."""
    text, problem = rundir.read_text(Path(run_dir) / rundir.CONFIG)
    if text is None:
        return None, problem
    return parse_mapping(text)


def runs_own_code(run_dir: Path) -> bool:
    """Whether the run's saved config runs code of its own (``train.script`` or ``train.fn``),
    whose checkpoints, if it keeps any, are its own business; False when it cannot be read."""
    train = section(read_saved(run_dir)[0], "train")
    return bool(train.get("script") or train.get("fn"))
