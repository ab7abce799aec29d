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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpc_train.errors import UsageError, closest


def _f(default: Any, *, choices: tuple[str, ...] | None = None, min: float | None = None,
       max: float | None = None, importable: bool = False) -> Any:
    """A dataclass field carrying its validation rules.

    ``importable`` means the value may also be ``package.module:function`` (a user plug-in).
    """
    meta = {"choices": choices, "min": min, "max": max, "importable": importable}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class JobSection:
    """Scheduler resources. Used by ``submit`` and ``sbatch``; ``run`` ignores them."""
    name: str = _f("hpc_train")
    nodes: int = _f(1, min=1)
    tasks_per_node: int = _f(0, min=0)          # 0: one per GPU, else 1
    gpus_per_node: int = _f(0, min=0)
    cpus_per_task: int = _f(1, min=1)
    mem: str = _f("")                            # e.g. "16G"; "" = cluster default
    time: str = _f("01:00:00")                   # Slurm time: MM, HH:MM:SS, D-HH[:MM[:SS]]
    partition: str = _f("")
    account: str = _f("")
    qos: str = _f("")
    constraint: str = _f("")
    exclusive: bool = _f(False)
    signal: str = _f("USR2", choices=("USR1", "USR2", "TERM", "INT", "HUP"))  # NCCL may catch USR1
    signal_lead: int = _f(90, min=0)             # seconds before the time limit
    setup: list = _f([])                         # shell lines run before srun in the batch script
    # Requeue budgets per cause, counted across runs in RUN_DIR/requeue.json; -1 = unlimited.
    requeue_preemption: int = _f(-1, min=-1)
    requeue_timeout: int = _f(20, min=-1)
    requeue_failure: int = _f(1, min=-1)


@dataclass
class DistSection:
    backend: str = _f("auto", choices=("auto", "nccl", "gloo"))
    strategy: str = _f("ddp", choices=("ddp", "none"))
    init_timeout_s: float = _f(300.0, min=1)     # rendezvous and first collective
    timeout_s: float = _f(600.0, min=1)          # every later collective (a dead rank fails the job)
    threads_per_rank: int = _f(1, min=0)         # torch intra-op threads per rank; 0 = torch's default


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


@dataclass
class CheckpointSection:
    enabled: bool = _f(True)
    every_steps: int = _f(0, min=0)              # 0 = off
    every_seconds: float = _f(0.0, min=0)        # 0 = off
    keep: int = _f(2, min=2)                     # the newest may still be being written
    async_save: bool = _f(True)


@dataclass
class LogSection:
    tensorboard: bool = _f(True)
    progress: str = _f("auto", choices=("auto", "bar", "lines", "off"))
    level: str = _f("INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass
class Config:
    seed: int = _f(0, min=0)
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

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def digest(self) -> str:
        """A short hash of everything that changes what is trained (not where it runs)."""
        d = self.to_dict()
        for volatile in ("job", "run_dir", "log"):
            d.pop(volatile)
        d["data"].pop("num_workers")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


_SECTIONS = {f.name: f for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory)}
_IMPORT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _fields(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj) if f.name not in _SECTIONS}


def _coerce(path: str, f: dataclasses.Field, value: Any) -> Any:
    """Check ``value`` against the field's type and rules; return it in the field's type."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    m = f.metadata
    if kind == "bool":
        if not isinstance(value, bool):
            raise UsageError(f"config: {path} must be true or false, got {value!r}")
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"config: {path} must be an integer, got {value!r}")
    elif kind == "float":
        if isinstance(value, str):
            try:
                value = float(value)   # YAML 1.1 reads 1e-3 (no dot) as a string, not a float
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"config: {path} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise UsageError(f"config: {path} must be a finite number, got {value!r}")
    elif kind == "str":
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise UsageError(f"config: {path} must be a string, got {value!r}")
        value = str(value)
        if any(c in value for c in "\n\r\0"):
            # Values end up on #SBATCH lines, where a newline would start a shell command.
            raise UsageError(f"config: {path} must be a single line, got {value!r}")
    elif kind == "list":
        if not isinstance(value, list) or not all(isinstance(v, str) and "\n" not in v for v in value):
            raise UsageError(f"config: {path} must be a list of single-line strings, got {value!r}")
    if m.get("min") is not None and value < m["min"]:
        raise UsageError(f"config: {path} must be >= {m['min']:g}, got {value!r}")
    if m.get("max") is not None and value > m["max"]:
        raise UsageError(f"config: {path} must be <= {m['max']:g}, got {value!r}")
    if m.get("choices") and value not in m["choices"]:
        if not (m.get("importable") and _IMPORT_RE.match(value)):
            extra = " or an import path 'package.module:function'" if m.get("importable") else ""
            raise UsageError(f"config: {path} must be one of {', '.join(m['choices'])}{extra}; "
                             f"got {value!r}{closest(str(value), m['choices'])}")
    if m.get("importable") and not m.get("choices") and value and not _IMPORT_RE.match(value):
        raise UsageError(f"config: {path} must be an import path 'package.module:function', got {value!r}")
    return value


def _unknown(path: str, key: str, valid: list[str]) -> UsageError:
    where = f"section '{path}'" if path else "the top level"
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
            if not isinstance(value, dict):
                raise UsageError(f"config: section '{key}' must be a mapping, got {value!r}")
            section = getattr(cfg, key)
            fields = _fields(section)
            for sub, v in value.items():
                if sub not in fields:
                    raise _unknown(key, str(sub), list(fields))
                setattr(section, sub, _coerce(f"{key}.{sub}", fields[sub], v))
        elif key in top:
            setattr(cfg, key, _coerce(key, top[key], value))
        else:
            raise _unknown("", str(key), list(top) + list(_SECTIONS))


def parse_set(item: str) -> dict[str, Any]:
    """``section.key=value`` -> ``{section: {key: value}}``, the value parsed as YAML."""
    m = re.match(r"^([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?=(.*)$", item, re.S)
    if not m:
        raise UsageError(f"--set expects section.key=value (e.g. optim.lr=0.01), got {item!r}")
    section, key, raw = m.groups()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if key is None:
        return {section: value}
    if section not in _SECTIONS:
        raise _unknown("", section, list(_fields(Config())) + list(_SECTIONS))
    return {section: {key: value}}


def load(path: str | Path | None, overrides: list[str] = (), extra: dict[str, Any] | None = None) -> Config:
    """Build a :class:`Config` from defaults, a YAML file, ``--set`` items and flag values."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"config file not found: {p} (example configs are in jobs/, e.g. jobs/digits.yaml)")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise UsageError(f"config: {p} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
        _apply(cfg, data or {}, str(p))
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
    from hpc_train.scheduler import time_minutes
    time_minutes(cfg.job.time)   # a malformed job.time fails here, not at submission
    if cfg.train.fn and not _IMPORT_RE.match(cfg.train.fn):
        raise UsageError(f"config: train.fn must be an import path 'package.module:function', got {cfg.train.fn!r}")
    return cfg


def from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a config from :meth:`Config.to_dict` (e.g. after pickling to a Slurm node)."""
    cfg = Config()
    _apply(cfg, data, "config")
    return validate(cfg)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` in one rename, so a reader (or a kill) never sees half a file.
    Every small record in a run directory is written this way."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write(cfg: Config, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    write_atomic(out, cfg.to_yaml())
    return out
