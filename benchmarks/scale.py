"""What a 4096-rank job costs the parts of hpc_train that read per-rank records, by simulation
(issue 32, item 3), and what a run costs its run directory per second, extrapolated.

A synthetic run directory of a Slurm job (``--ranks`` ranks on ``--nodes`` nodes, default 4096 on
512) is written through the records' own writers: ``config.yaml``, ``job.json``, every rank's
record (``logs/.heartbeat/rank-R``, begun and ended as a preemption stop leaves it) and log,
``stopped.json`` with rank 0's request, a ``requeue.json`` of earlier preemptions, a goodput ledger
over those runs, a ``metrics.jsonl`` of ``--steps`` lines, and two complete checkpoints whose
``commit.json`` is written by ``hpc_train.ckpt.store.write_commit`` (sizes and CRC32C of every
file) over small files of random bytes in DCP's layout (``.metadata``, ``__R_0.distcp`` and
``rank-R.pt`` per rank, ``app.pt``): the readers check sizes and checksums, never tensors. Then,
in this process, medians of ``--reps`` repetitions, every part once per round:

* the requeue hook's ``gather`` + ``decide`` after a preemption stop; it must decide a requeue;
* ``status RUN_DIR`` and ``status RUN_DIR --goodput`` (``cmd_status``, output to a buffer), and
  the same as a command (``python -m hpc_train status``), whose interpreter start-up is shown
  apart (``python -m hpc_train --help``);
* the restore plan: ``store.plan(latest)`` as rank 0 of every restart makes it (sizes only), and
  as the pre-launch check makes it (checksums read: here small files, so per-file cost only);
* the watchdog's scan of ranks 1..N-1 (rank 0 of a Slurm job's, and a stalled rank's hang watch):
  a Run's, one read of N-1 keys from a real ``TCPStore`` served by this process, after every rank's
  beat was set in it (:mod:`hpc_train.node.beats`); a ``--script``'s supervisors', a ``stat`` of
  every rank's record;

and, where ``strace`` is installed, the run directory's operations per second of a real 2-rank
local run in steady state (:mod:`benchmarks.rundir_ops`), extrapolated to N ranks on M nodes from
its per-rank rates.

No Slurm is asked: PATH holds only ``squeue``, ``sinfo`` and ``sacct`` stand-ins that fail at
once (a controller that does not answer), so Slurm's view is "unknown", as the readers take a
failed query. A real cluster's ``squeue`` and ``sacct`` round trips come on top of ``status``.

Usage: .venv/bin/python benchmarks/scale.py [--ranks 4096 --nodes 512 --reps 5 --no-strace]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from reps import Reps  # noqa: E402

from hpc_train import config as config_mod, goodput, rundir  # noqa: E402
from hpc_train.ckpt import store  # noqa: E402
from hpc_train.errors import EXIT_STOPPED  # noqa: E402
from hpc_train.node.liveness import BEAT_S  # noqa: E402
from hpc_train.records import jobs, ranks, stop  # noqa: E402
from hpc_train.records import requeue as requeue_rec  # noqa: E402

JOB = "7001"
RESTART = 3            # this is the job's fourth incarnation: three preemptions before it
ATTEMPT = 1
SIGNAL = "USR2"


def _env(nodes: int, node: int = 0) -> dict[str, str]:
    return {"SLURM_JOB_ID": JOB, "SLURM_RESTART_COUNT": str(RESTART), ranks.ATTEMPT_ENV: str(ATTEMPT),
            "SLURM_JOB_NODELIST": f"node[000-{nodes - 1:03d}]", "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURMD_NODENAME": f"node{node:03d}", rundir.BATCH_START_ENV: str(int(time.time()) - 3600)}


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _checkpoint(run_dir: Path, step: int, world: int, when: float) -> None:
    d = store.ckpt_root(run_dir) / f"step-{step}"
    d.mkdir(parents=True)
    (d / store.METADATA).write_bytes(os.urandom(2048))
    (d / "app.pt").write_bytes(os.urandom(512))
    for r in range(world):
        (d / f"__{r}_0.distcp").write_bytes(os.urandom(256))
        (d / f"rank-{r}.pt").write_bytes(os.urandom(128))
    store.write_commit(d, {"config_hash": "0" * 16, "model": {"name": "convnet", "hidden": 50}, "step": step,
                           "time": when, "world_size": world, "torch": "synthetic",
                           "state": {"model": "module", "optim": "optimizer", "loader": "per_rank", "step": "plain"},
                           "save_seconds": 1.0})


def build(run_dir: Path, world: int, nodes: int, steps: int) -> None:
    """The synthetic run directory (see the module's doc), as a preemption stop leaves it."""
    per_node = world // nodes
    run_dir.mkdir(parents=True)
    cfg = config_mod.load(ROOT / "jobs" / "digits.yaml", [f"job.nodes={nodes}", f"job.tasks_per_node={per_node}"])
    config_mod.write(cfg, run_dir)
    jobs.append(run_dir, JOB, "submit", print)
    now = time.time()
    # Three earlier incarnations, each preempted and requeued, each with its ledger segment.
    history = requeue_rec.RequeueState()
    for inc in range(RESTART):
        history = history.requeued(requeue_rec.Incarnation(JOB, inc), "preemption", (inc + 1) * steps // 4,
                                   now - 3600 * (RESTART - inc))
    requeue_rec.write(run_dir, history, print)
    for seg in range(RESTART + 1):   # the ledger's real writer; its times are this build's (timing only)
        led = goodput.Ledger(run_dir)
        led.restored(seg * steps // 4, 0.4)
        led.step(seg * steps // 4 + 1)
        led.saved(0.3)
        led.close()
    with (run_dir / rundir.METRICS).open("w") as f:
        for s in range(1, steps + 1):
            f.write(f'{{"step": {s}, "epoch": {s // 1000}, "time": {now - steps + s}, "loss": 0.5, "acc": 0.9, '
                    f'"lr": 0.001}}\n')
    for n in range(nodes):
        with _environ(_env(nodes, n)):
            for r in range(n * per_node, (n + 1) * per_node):
                ranks.begin(run_dir, r, world)
                rundir.rank_log(run_dir, r).write_text(f"[rank {r}] started\n[rank {r}] stopped\n")
                ranks.say(run_dir, r, ended="stopped")
    _checkpoint(run_dir, steps - 500, world, now - 600)
    _checkpoint(run_dir, steps, world, now - 10)
    stop.write(run_dir, stop.StopRecord(steps, SIGNAL, now - 30, True, now - 10,
                                        request=stop.Request(JOB, JOB, RESTART, ATTEMPT)))


def hook_gather_decide(run_dir: Path, world: int, nodes: int):
    from hpc_train.login.decide import decide
    from hpc_train.login.gather import gather
    inputs, _ = gather(run_dir, EXIT_STOPPED, _env(nodes), world // nodes, world // nodes)
    d = decide(inputs)
    if d.action != "requeue" or d.cause != "preemption":
        raise RuntimeError(f"the hook decided {d.action} ({d.cause}): {d.message}")
    return d


def status(run_dir: Path, with_goodput: bool) -> str:
    import argparse as ap

    from hpc_train.login.jobs import cmd_status
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cmd_status(ap.Namespace(target=str(run_dir), goodput=with_goodput))
    return out.getvalue()


def restore_plan(run_dir: Path, verify: bool, step: int) -> None:
    plan = store.plan(run_dir, "latest", None, warn=None, verify=verify)
    if plan.source is None or plan.source.step != step:
        raise RuntimeError(f"the plan chose {plan.source}")


def watchdog_scan(run_dir: Path, world: int) -> None:
    from hpc_train.node import beats, liveness
    found = beats.stale(beats.FileBeats(run_dir, -1), list(range(1, world)), liveness.heartbeat_limit(600.0), time.time() - 60)
    if found is not None:
        raise RuntimeError(f"the scan named rank {found[0]}")


def store_beats(world: int):
    """A ``TCPStore`` served here, every rank's beat set in it (as each rank's heartbeat sets its
    own), and a reader's connection: (the reader, the server, seconds per beat set)."""
    from datetime import timedelta

    import torch.distributed as dist

    from hpc_train.node import beats
    from hpc_train.launch.local import free_port
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    writer = dist.PrefixStore("hpc_train/beats/", dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30)))
    t = time.perf_counter()
    for r in range(world):
        writer.set(str(r), repr(time.time()))
    per_set = (time.perf_counter() - t) / world
    reader = beats.StoreBeats("127.0.0.1", port, 0, "hpc_train/beats/", 0)
    return reader, server, per_set


def store_scan(reader, world: int) -> None:
    from hpc_train.node import beats, liveness
    found = beats.stale(reader, list(range(1, world)), liveness.heartbeat_limit(600.0), time.time() - 60)
    if found is not None:
        raise RuntimeError(f"the scan named rank {found[0]}")


def _timed(fn):
    def one() -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return one


def _cli(args: list[str], env: dict[str, str]) -> None:
    r = subprocess.run([sys.executable, "-m", "hpc_train", *args], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])}: exit {r.returncode}: {r.stderr[-500:]}")


def measure_ops(world: int, nodes: int) -> list[tuple[str, str, str]]:
    """Rows (what, measured on 2 ranks, extrapolated to ``world`` ranks on ``nodes`` nodes) from a
    traced 2-rank local run. TensorBoard and metrics are rank 0's alone and stay as measured; a
    heartbeat touch is every rank's; the scan of every rank's heartbeat is measured at the local
    launcher's cadence (each rank once a second) and extrapolated at a Slurm job's (rank 0's
    watchdog: each rank every max(BEAT_S, heartbeat_limit(dist.timeout_s) / 10) s, 30 s at the default
    600 s); anything else grows with the ranks."""
    import rundir_ops
    tmp = Path(tempfile.mkdtemp(prefix="scale-ops-"))
    try:
        trace, run_dir = rundir_ops.trace_run(tmp)
        ops = rundir_ops.parse(trace, run_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rundir_ops.report(ops)
    return ops_rows(ops, world, nodes)


def ops_rows(ops, world: int, nodes: int) -> list[tuple[str, str, str]]:
    """:func:`measure_ops`'s rows from a parsed trace (:class:`benchmarks.rundir_ops.Ops`) of 2 ranks."""
    import rundir_ops

    from hpc_train.node import watchdog
    n, w = 2, ops.window_s
    touches = sum(v for (k, c), v in ops.path_calls.items() if k == "heartbeat" and c.startswith("utime")) / w
    scans = sum(v for (k, c), v in ops.path_calls.items() if k == "heartbeat" and "stat" in c) / w
    other_beat = ops.per_s("path", "heartbeat") - touches - scans
    rows = [("TensorBoard events (rank 0)", ops.per_s("path", "tensorboard"), ops.per_s("path", "tensorboard")),
            ("metrics.jsonl (rank 0)", ops.per_s("path", "metrics"), ops.per_s("path", "metrics")),
            ("heartbeat touches (a Run's beats go to the store)", touches, touches / n * world),
            ("heartbeat scans (the launcher's: /proc; Slurm rank 0's: the store)", scans, scans / n * world),
            ("rank records, other", other_beat, other_beat / n * world)]
    rows += [("rank 0's log", ops.per_s("path", "rank 0 log"), ops.per_s("path", "rank 0 log")),
             ("other ranks' logs", ops.per_s("path", "rank logs"),
              ops.per_s("path", "rank logs") / (n - 1) * (world - 1))]
    rows += [(k, ops.per_s("path", k), ops.per_s("path", k) / n * world) for k in ("checkpoints", "other")]
    total_m, total_x = sum(r[1] for r in rows), sum(r[2] for r in rows)
    out = [(what, f"{m:.2f}", f"{x:.1f}") for what, m, x in rows]
    out.append(("path ops/s on the run directory, all", f"{total_m:.2f}", f"{total_x:.1f}"))
    out.append(("  per node (target <= 1)", f"{total_m:.2f}", f"{total_x / nodes:.2f}"))
    out.append(("  of which heartbeats, per node", f"{touches + scans + other_beat:.2f}",
                f"{(touches + scans + other_beat) / n * world / nodes:.2f}"))
    fd = sum(ops.per_s("fd", k) if k in ("tensorboard", "metrics", "rank 0 log") else
             ops.per_s("fd", k) / (n - 1) * (world - 1) if k == "rank logs" else ops.per_s("fd", k) / n * world
             for k in rundir_ops.KINDS)
    out.append(("fd ops/s (write, fstat, close on open files)", f"{ops.per_s('fd'):.2f}", f"{fd:.1f}"))
    out.append(("steady-state window of the traced run", f"{w:.1f} s", ""))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--nodes", type=int, default=512)
    p.add_argument("--steps", type=int, default=20000, help="lines of metrics.jsonl")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-strace", action="store_true", help="skip the traced 2-rank run")
    p.add_argument("--no-cli", action="store_true", help="skip the status command's subprocess timings")
    a = p.parse_args()
    if a.ranks % a.nodes:
        p.error("--ranks must be a multiple of --nodes")
    reps = Reps()
    print(f"load average at the start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    tmp = Path(tempfile.mkdtemp(prefix="scale-"))
    run_dir = tmp / "run"
    empty_path = tmp / "bin"   # stand-ins that fail at once: Slurm's view is "unknown"
    empty_path.mkdir()
    for name in ("squeue", "sinfo", "sacct"):
        (empty_path / name).write_text("#!/bin/sh\n"
                                       "echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2\nexit 1\n")
        (empty_path / name).chmod(0o755)
    try:
        t = time.perf_counter()
        build(run_dir, a.ranks, a.nodes, a.steps)
        print(f"built {run_dir}: {a.ranks} ranks on {a.nodes} nodes in {time.perf_counter() - t:.1f} s")
        cli_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        cli_env.update(PYTHONPATH=str(ROOT), PATH=str(empty_path))
        parts = {
            "hook gather + decide (preemption stop)": lambda: hook_gather_decide(run_dir, a.ranks, a.nodes),
            "status (in-process)": lambda: status(run_dir, False),
            "status --goodput (in-process)": lambda: status(run_dir, True),
            "restore plan, sizes (rank 0 at a restart)": lambda: restore_plan(run_dir, False, a.steps),
            "restore plan, checksums (pre-launch)": lambda: restore_plan(run_dir, True, a.steps),
            "watchdog scan, store (a Run's ranks)": lambda: store_scan(reader, a.ranks),
            "watchdog scan, files (a --script's)": lambda: watchdog_scan(run_dir, a.ranks),
        }
        reader, server, per_set = store_beats(a.ranks)
        print(f"one beat (a set in the store over loopback): {per_set * 1e6:.0f} us; {a.ranks} ranks every "
              f"{BEAT_S:g} s send the store {a.ranks / BEAT_S:.0f} sets a second")
        if not a.no_cli:
            parts["python -m hpc_train status RUN_DIR"] = lambda: _cli(["status", str(run_dir)], cli_env)
            parts["python -m hpc_train --help (start-up alone)"] = lambda: _cli(["--help"], cli_env)
        with _environ({"PATH": str(empty_path)}):
            for rep in range(1, a.reps + 1):
                for name, fn in parts.items():
                    reps.run(name, rep, _timed(fn))
        targets = {"hook gather + decide (preemption stop)": 1.0, "status (in-process)": 1.0,
                   "status --goodput (in-process)": 1.0, "python -m hpc_train status RUN_DIR": 1.0}
        print(f"\n{a.ranks} ranks on {a.nodes} nodes, medians of {a.reps} (seconds):\n")
        print(f"| {'what':<48} | {'seconds':>22} | target |")
        print(f"|{'-' * 50}|{'-' * 24}|--------|")
        for name in parts:
            tgt = targets.get(name)
            med = reps.median(name)
            mark = "" if tgt is None else (f"<= {tgt:g} s" + ("" if med is None or med <= tgt else " MISSED"))
            print(f"| {name:<48} | {reps.figure(name, fmt='{:.3f}'):>22} | {mark} |")
        if a.no_strace or shutil.which("strace") is None:
            print("\nrun-directory operations: not measured (" +
                  ("--no-strace" if a.no_strace else "strace is not installed") + ")")
        else:
            print("\nrun-directory operations per second, steady state (a traced 2-rank local run):")
            rows = measure_ops(a.ranks, a.nodes)
            print(f"\n| {'what':<58} | {'2 ranks, 1 node':>16} | {f'{a.ranks} ranks, {a.nodes} nodes':>21} |")
            print(f"|{'-' * 60}|{'-' * 18}|{'-' * 23}|")
            for what, measured, scaled in rows:
                if "target <= 1" in what:
                    scaled += " MISSED" if float(scaled) > 1 else ""
                print(f"| {what:<58} | {measured:>16} | {scaled:>21} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    del server
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return reps.finish()


if __name__ == "__main__":
    sys.exit(main())
