"""Sweeps: a sweep file (or ``--sweep key=a,b``) -> points -> one Slurm array job.

A sweep file's top-level keys are all optional::

    grid:   {optim.lr: [0.01, 0.05], model.name: [mlp, convnet]}   # the cartesian product
    points: [{optim.lr: 0.1, train.max_steps: 50}]                   # explicit points, added to it
    seeds:  [0, 1, 2]                                                # crossed with all of the above

The file is read by the config's own YAML loader (plain scalars stay text, aliases and
duplicate keys are refused), and every point is validated as a whole :class:`Config` before
anything is written or submitted, so a typo in one point submits nothing.

Layout of a sweep directory::

    SWEEP_DIR/sweep.json                 the manifest: tasks, their overrides and run dirs, submissions
    SWEEP_DIR/submission-N.tasks         run dir of array index I on line I+1 (read by the batch shell)
    SWEEP_DIR/submitit/                  submitit's pickles and logs
    SWEEP_DIR/003-optim.lr=0.1,seed=2/   one full run directory per task

Each task is a full run: its own run dir, its own MASTER_PORT (derived from its own
``SLURM_JOB_ID``, which Slurm gives every array task; see :func:`environment.derive_port`), any
node count, and its own requeue naming ``ARRAYJOB_TASK`` (see :mod:`hpc_train.requeue`).
No torch here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shlex
import time
from collections.abc import Mapping
from pathlib import Path

from hpc_train import rundir
from hpc_train.login import scheduler
from hpc_train.config import Config
from hpc_train.login.sweep_report import MANIFEST, is_sweep, read_manifest
from hpc_train.rundir import write_atomic
from hpc_train.errors import UsageError, closest, show

FILE_KEYS = ("grid", "points", "seeds")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]")
Point = dict[str, object]    # one point of a sweep: {dotted config key: value as YAML gave it}


# -- points --------------------------------------------------------------------------------
def _flatten(d: Mapping[str, object], prefix: str = "") -> Point:
    """``{optim: {lr: x}}`` and ``{optim.lr: x}`` both become ``{"optim.lr": x}``."""
    out: Point = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def read_file(path: Path) -> dict[str, object]:
    """A sweep file's mapping, read with the config's safe loader."""
    from hpc_train import config_yaml
    if not path.is_file():
        raise UsageError(f"--sweep {path}: no such file (a sweep file is YAML with grid:, points:, seeds:)")
    data = config_yaml.read_file(path)   # same safety as a config file: text scalars, no aliases/duplicates
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"sweep {path}: must be a mapping with any of {', '.join(FILE_KEYS)}; got {show(data)}")
    for key in data:
        if key not in FILE_KEYS:
            raise UsageError(f"sweep {path}: unknown key {show(key)}{closest(str(key), FILE_KEYS)} "
                             f"(valid keys: {', '.join(FILE_KEYS)})")
    return data


def expand(spec: Mapping[str, object], source: str) -> list[Point]:
    """grid x (plus) points, then x seeds -> one ``{dotted key: value}`` per point, in order."""
    grid, points, seeds = spec.get("grid"), spec.get("points"), spec.get("seeds")
    base: list[Point] = []
    if grid is not None:
        if not isinstance(grid, dict) or not grid:
            raise UsageError(f"sweep {source}: grid is empty; give each key a list of values "
                             f"(e.g. grid: {{optim.lr: [0.01, 0.05]}})")
        axes: dict[str, list[object]] = {}
        for key, values in _flatten(grid).items():
            if not isinstance(values, list) or not values:
                raise UsageError(f"sweep {source}: grid {key} must be a non-empty list of values, got {show(values)}")
            axes[key] = values
        base += [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]
    if points is not None:
        if not isinstance(points, list) or not points or not all(isinstance(p, dict) and p for p in points):
            raise UsageError(f"sweep {source}: points must be a non-empty list of mappings of overrides "
                             f"(e.g. points: [{{optim.lr: 0.1}}]), got {show(points)}")
        base += [_flatten(p) for p in points]
    if seeds is not None:
        if not isinstance(seeds, list) or not seeds:
            raise UsageError(f"sweep {source}: seeds must be a non-empty list, got {show(seeds)}")
        base = [{**p, "seed": s} for p in (base or [{}]) for s in seeds]
    if not base:
        raise UsageError(f"sweep {source}: no points; give grid:, points: or seeds:")
    seen: dict[str, int] = {}
    for i, p in enumerate(base):
        label = describe(p)
        if label in seen:
            raise UsageError(f"sweep {source}: point {i} ({label}) repeats point {seen[label]}")
        seen[label] = i
    return base


def from_args(items: list[str]) -> tuple[str, list[Point]]:
    """``--sweep FILE.yaml`` or ``--sweep key=a,b`` (repeatable: the product) -> (source, points)."""
    files = [i for i in items if "=" not in i]
    if files:
        if len(items) != 1:
            raise UsageError(f"--sweep: give one sweep file, or key=v1,v2 items, not both ({' '.join(items)})")
        path = Path(files[0])
        return str(path), expand(read_file(path), str(path))
    grid: dict[str, list[str]] = {}
    for item in items:
        key, _, values = item.partition("=")
        if not key or not values:
            raise UsageError(f"--sweep expects section.key=v1,v2,... (e.g. optim.lr=0.1,0.01) or a sweep file, "
                             f"got {show(item)}")
        grid[key] = values.split(",")
    return "--sweep", expand({"grid": grid}, "--sweep")


def _text(v: object) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def describe(point: Mapping[str, object]) -> str:
    return " ".join(f"{k}={_text(v)}" for k, v in point.items())


def set_items(point: Mapping[str, object]) -> list[str]:
    """A point as ``--set`` items. Values go in as JSON, which the config's YAML reader takes
    as a quoted string (or a list): text such as ``a: b`` or ``#x`` cannot change meaning on the way."""
    return [f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in point.items()]


def task_name(index: int, point: Mapping[str, object], width: int) -> str:
    """``003-optim.lr=0.1,seed=2``: sortable, unique by its index, readable by its overrides."""
    label = _NAME_UNSAFE.sub("_", ",".join(f"{k}={_text(v)}" for k, v in point.items()))
    return f"{index:0{width}d}-{label[:100]}"


def configs(args: argparse.Namespace, points: list[Point], source: str, sweep_dir: Path) -> list[Config]:
    """One validated Config per point: the command's config and ``--set``s, then the point, then flags."""
    from hpc_train.login.args import check_plugins_light, load as _load
    width = len(str(len(points) - 1))
    out = []
    for i, point in enumerate(points):
        ns = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, *set_items(point)],
                                   "run_dir": None})
        try:
            cfg = _load(ns)
            check_plugins_light(cfg)
        except UsageError as e:
            raise UsageError(f"sweep {source}: point {i} ({describe(point)}): {e}") from None
        cfg.run_dir = str(sweep_dir / task_name(i, point, width))
        out.append(cfg)
    return out


# -- the manifest --------------------------------------------------------------------------
# -- submission ----------------------------------------------------------------------------
def _executor(cfg: Config, sweep_dir: Path, map_file: Path, parallelism: int, dry_run: bool = False):
    from hpc_train.login.submission import make_executor
    # The batch shell's requeue hook must look at this task's run dir: line INDEX+1 of the map.
    # A one-task submission is a plain job (submitit submits no array of one): index 0.
    ex = make_executor(cfg, sweep_dir, dry_run=dry_run, run_dir_lines=[
        f'RUN_DIR=$(sed -n "$((${{SLURM_ARRAY_TASK_ID:-0}} + 1))p" {shlex.quote(str(map_file))})'])
    ex.update_parameters(array_parallelism=parallelism)
    return ex


def _submit_array(cfgs: list[Config], sweep_dir: Path, parallelism: int, number: int) -> list[str]:
    """One array job (submitit's batch) for these configs; returns the job ids, in order."""
    from hpc_train import config as config_mod
    from hpc_train.login.submission import SlurmEntry
    map_file = sweep_dir / f"submission-{number}.tasks"
    write_atomic(map_file, "".join(f"{c.run_dir}\n" for c in cfgs))
    ex = _executor(cfgs[0], sweep_dir, map_file, parallelism)
    with ex.batch():
        jobs = []
        for c in cfgs:
            Path(c.run_dir).mkdir(parents=True, exist_ok=True)
            config_mod.write(c, Path(c.run_dir))
            # "latest": a resubmitted task resumes from its newest complete checkpoint on disk,
            # never from state baked into the pickle (fairchem PR #1055).
            jobs.append(ex.submit(SlurmEntry(c.to_dict(), c.run_dir, resume="latest")))
    return [str(j.job_id) for j in jobs]


def _check_cluster(cfg: Config, n: int) -> None:
    scheduler.require_slurm()
    limit = scheduler.max_array_size()
    if limit is not None and n > limit:
        raise UsageError(f"the sweep has {n} points but this cluster's MaxArraySize is {limit} "
                         f"(scontrol show config); split the sweep or ask the admins")
    scheduler.check_resources(cfg.job)


def submit(args: argparse.Namespace, cfg: Config, sweep_dir: Path) -> int:
    """``submit --sweep``: validate every point, then one array job; ``--dry-run`` prints it."""
    from hpc_train.login.submission import check_folder
    from hpc_train.rundir import check_path
    check_path(sweep_dir, "the sweep directory")
    check_folder(sweep_dir)
    source, points = from_args(args.sweep)
    cfgs = configs(args, points, source, sweep_dir)
    if args.array_parallelism < 1:
        raise UsageError(f"--array-parallelism must be >= 1, got {args.array_parallelism}")
    if args.dry_run:
        for i, (p, c) in enumerate(zip(points, cfgs)):
            print(f"# task {i}: {describe(p)} -> {c.run_dir}")
        ex = _executor(cfg, sweep_dir, sweep_dir / "submission-1.tasks", args.array_parallelism, dry_run=True)
        ex.parameters["map_count"] = len(cfgs)   # the array line, as submitit writes it for a batch
        from hpc_train.login.submission import dry_run_text
        print(dry_run_text(ex), end="")
        return 0
    if is_sweep(sweep_dir):
        raise UsageError(f"{sweep_dir} already holds a sweep; watch it with `python -m hpc_train status "
                         f"{sweep_dir}`, resubmit its failed tasks with `submit --resubmit-failed {sweep_dir}`, "
                         f"or use another --run-dir")
    _check_cluster(cfg, len(cfgs))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    ids = _submit_array(cfgs, sweep_dir, args.array_parallelism, 1)
    manifest = {"source": source, "created": time.time(), "submissions": [{"jobs": ids, "time": time.time()}],
                "tasks": [{"index": i, "overrides": {k: _text(v) for k, v in p.items()}, "run_dir": c.run_dir,
                           "jobs": [j]} for i, (p, c, j) in enumerate(zip(points, cfgs, ids))]}
    write_atomic(sweep_dir / MANIFEST, json.dumps(manifest, indent=2))
    for c, p, j in zip(cfgs, points, ids):
        scheduler.record_job(Path(c.run_dir), j, "submitit-array", sweep=describe(p))
        print(f"submitted array task {j}: {describe(p)} -> {c.run_dir}")
    print(f"sweep of {len(ids)} tasks in {sweep_dir}\n  watch: python -m hpc_train status {sweep_dir}")
    return _wait(ids) if args.wait else 0


def resubmit_failed(args: argparse.Namespace) -> int:
    """``submit --resubmit-failed SWEEP_DIR``: one new array of the tasks that ended unfinished."""
    from hpc_train import config as config_mod
    from hpc_train.login.sweep_report import NO_ANSWER, task_rows
    sweep_dir = Path(args.resubmit_failed).absolute()
    manifest = read_manifest(sweep_dir)
    rows, failed = task_rows(manifest)
    unknown = [r.index for r in rows if r.state == NO_ANSWER]
    if unknown:   # a task that may still run must not get a second job in its run directory
        raise UsageError(f"cannot tell whether task(s) {', '.join(map(str, unknown))} of {sweep_dir} are still "
                         f"live: {failed}; nothing resubmitted")
    redo = [r for r in rows if r.resubmittable]
    if not redo:
        print(f"nothing to resubmit in {sweep_dir}: no task failed, was cancelled or timed out unfinished")
        return 0
    # Each task's config.yaml is the whole resolved config it ran with: the resubmission is the same run.
    cfgs = [config_mod.load(Path(r.run_dir) / rundir.CONFIG) for r in redo]
    for c, r in zip(cfgs, redo):
        c.run_dir = r.run_dir
    if args.array_parallelism < 1:
        raise UsageError(f"--array-parallelism must be >= 1, got {args.array_parallelism}")
    _check_cluster(cfgs[0], len(cfgs))
    number = len(manifest["submissions"]) + 1
    ids = _submit_array(cfgs, sweep_dir, args.array_parallelism, number)
    manifest["submissions"].append({"jobs": ids, "time": time.time(), "resubmitted": [r.index for r in redo]})
    for r, j in zip(redo, ids):
        manifest["tasks"][r.index]["jobs"].append(j)
        scheduler.record_job(Path(r.run_dir), j, "submitit-array", resubmitted=True)
        print(f"resubmitted task {r.index} ({r.state}) as {j}: {r.overrides} -> {r.run_dir}")
    write_atomic(sweep_dir / MANIFEST, json.dumps(manifest, indent=2))
    return _wait(ids) if args.wait else 0


def _wait(ids: list[str]) -> int:
    states = scheduler.wait(ids)     # polls on while a query fails: a task it cannot see is not ended
    bad = [k for k, v in states.items() if v.state != "COMPLETED"]
    print(f"array ended: {len(ids) - len(bad)} of {len(ids)} tasks COMPLETED")
    return 1 if bad else 0
