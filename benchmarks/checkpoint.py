"""Checkpoint benchmark (issue 3): what a save costs, against what the disk can do.

One run, 2 gloo ranks (torch.multiprocessing), the real hpc_train Trainer's state holding an MLP whose
model + Adam state is >= 200 MB, saved through the real ``hpc_train.ckpt.shared.save.Checkpointer``:

* **sync save**: ``Checkpointer.save(blocking=True)``: rank files, DCP shards from both ranks
  (fsync'd by DCP), ``.metadata``, then rank 0's commit record (fsync'd, directory fsync'd).
* **async blocking**: how long ``Checkpointer.save()`` with ``dcp.async_save`` holds the training
  loop (until it returns); **async total**: until the background write is committed.
* **torch.save (rank 0)**: the same model + optimizer state, consolidated, written by rank 0 alone
  with ``torch.save`` and fsync'd.
* **disk write**: the same number of bytes as the DCP checkpoint, written sequentially in 16 MiB
  blocks into the same directory, then fsync'd: by 1, 2 and 4 concurrent writers (DCP here uses
  2 ranks x 2 writer threads).
* **load**: ``hpc_train.ckpt.load.load`` on both ranks (what a resume does), with the checkpoint's
  pages evicted from the page cache first (``posix_fadvise(DONTNEED)``, our files only) and warm;
  and the same load of the same files with a commit record that has no checksums (nothing checked).
* **checksums**: the same ``dcp.save`` through hpc_train's checksumming writer and DCP's own.
* **async, until committed**: a save, then training steps until every rank's write is committed;
  their time less as many plain steps is what the save cost the loop in all.

Each is repeated (``--repeats`` rounds) and the medians are printed, with the ratios the issues set
as targets (issue 22): sync save with checksums / without <= 1.05; sync save throughput / disk
bandwidth >= 0.85 (the bandwidth is the best of the 1, 2 and 4 writer figures, so the ratio is not
flattered); resume load with verification / without <= 1.05; async blocking / one in-memory copy
of the state <= 1.2 (and, from issue 3, async blocking / sync save <= 0.05). Baselines
with DCP's own defaults (``dcp.save`` / ``dcp.async_save`` with no writer or stager given) show
what the Checkpointer's settings buy. Other processes on the machine add noise: see all runs.

A round that crashes (a rank killed by a signal, or raising) takes its process group with it: it is
reported (which round, the rank's exit code or signal, the last lines of its stderr), the rounds
before it are kept, and a fresh set of ranks (with its own warm-up round) runs the rounds left.
The figures say how many rounds they rest on; the exit status is 1 if any round failed.

    python benchmarks/checkpoint.py [--hidden 24576] [--repeats 7] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reps import Reps, tail  # noqa: E402

BLOCK = 16 * 2**20
ROWS = [("sync_save", "sync DCP save (Checkpointer, blocking)", True),
        ("async_block", "async save: blocks training for", False),
        ("train_step", "one training step (fwd, bwd, Adam), no save", False),
        ("memcpy", "copy of the state's bytes in memory (each rank)", True),
        ("overlap_extra", "async save, copy overlapping the next step: step + save - step", False),
        ("nooverlap_extra", "async save, copy before save() returns: step + save - step", False),
        ("async_total", "async save: until committed", True),
        ("raw_sync", "  baseline: dcp.save, DCP defaults", True),
        ("raw_async_block", "  baseline: dcp.async_save blocks for", False),
        ("torch_save", "torch.save on rank 0 (+fsync)", True),
        ("disk_1", "disk write+fsync, 1 writer", True),
        ("disk_2", "disk write+fsync, 2 writers", True),
        ("disk_4", "disk write+fsync, 4 writers", True),
        ("load_cold", "load (resume), cold page cache", True),
        ("load_warm", "load (resume), warm page cache", True),
        ("load_cold_plain", "  the same load, no checksums in commit.json, cold", True),
        ("load_warm_plain", "  the same load, no checksums in commit.json, warm", True),
        ("dcp_crc", "dcp.save, hpc_train's checksumming writer (2 threads, fsync)", True),
        ("dcp_plain", "dcp.save, DCP's FileSystemWriter (2 threads, fsync)", True),
        ("async_steps_extra", "async save: until committed, steps' time less as many plain steps", False)]
KEYS = [r[0] for r in ROWS]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def _evict(path: Path) -> None:
    """Drop one checkpoint's pages from the page cache (clean pages: they were fsync'd)."""
    for f in Path(path).iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _write_fsync(path: Path, nbytes: int, block: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    # This rank's stderr (Python's and C++'s: an abort's message) into a file, whose tail is shown
    # if the rank dies.
    err = os.open(Path(args.dir) / f"rank-{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.close(err)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
                      HPC_TRAIN_LAUNCHER="local")
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        del os.environ[k]
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hpc_train import config
    from hpc_train.ckpt.shared import save
    from hpc_train.ckpt.common import dir_for
    from hpc_train.ckpt.shared.crc import ChecksummingWriter
    from hpc_train.ckpt import load, store
    from hpc_train.node import group as distributed
    from hpc_train.node import environment
    from hpc_train.run import Run
    from hpc_train.logs import setup_logging
    from hpc_train.node.stops import StopRequest
    from hpc_train.trainer.loop import Trainer

    root = Path(args.dir)
    run_dir = root / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(rank, None, "WARNING")
    cfg = config.load(None, ["model.name=mlp", f"model.hidden={args.hidden}", "data.name=synthetic",
                             "data.synthetic_size=64", "data.batch_size=8", "train.max_steps=1", "train.eval=false",
                             "log.tensorboard=false", "log.progress=lines", "checkpoint.keep=1000",
                             "checkpoint.async_save=true", f"run_dir={run_dir}"])
    env = environment.current()
    device = distributed.init(env, cfg.dist)
    trainer = Trainer(cfg, Run(cfg, env, run_dir, device, StopRequest()))
    trainer.fit()                                       # one real step: Adam's moments exist
    state = trainer.state                               # what the checkpointer sees: a mapping of state objects
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    tensors = [*model_sd.values(), *(v for per_param in optim_sd["state"].values() for v in per_param.values())]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
    ck = save.Checkpointer(cfg.checkpoint, run_dir, rank, world)
    # The timing barriers' own group: a barrier on the checkpointer's group while its async save
    # runs collectives there in the background would interleave with them (and hang).
    pg = dist.new_group(backend="gloo")
    # The copy overlapping the next step (checkpoint.overlap_staging=always), and made before
    # save() returns (never); `ck` keeps the config's default (auto: never on CPU).
    import copy
    overlapped, no_overlap = copy.deepcopy(cfg.checkpoint), copy.deepcopy(cfg.checkpoint)
    overlapped.overlap_staging, no_overlap.overlap_staging = "always", "never"
    ck_over = save.Checkpointer(overlapped, run_dir, rank, world)
    ck_plain = save.Checkpointer(no_overlap, run_dir, rank, world)
    model, optim = trainer.model, trainer.optimizer
    gen = torch.Generator().manual_seed(rank)
    xb, yb = torch.randn(8, 1, 28, 28, generator=gen), torch.randint(0, 10, (8,), generator=gen)

    def train_step() -> None:
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()      # an overlapping save's copy must be done first (the checkpointer's pre-hook)

    def save_then_step(c) -> float:
        """What a save costs the loop: save() and the next full step, less a step (below)."""
        nonlocal step
        step += 1
        state["step"] = step
        t = timed(lambda: (c.save(state, step, blocking=False), train_step()))
        c.wait()
        return t
    def save_then_steps_until_committed(c) -> tuple[float, int]:
        """The loop's time from save() until the save is committed on every rank, stepping all
        along (the background write, fsync and checksums compete with these steps), and the
        number of steps taken (at least one)."""
        nonlocal step
        step += 1
        state["step"] = step
        done = torch.zeros(1)
        n = 0
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        c.save(state, step, blocking=False)
        while True:
            train_step()
            n += 1
            done[0] = float(c.pending is None or c.pending[0].done())
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=pg)   # every rank's write is done
            if done[0] == 1.0:
                break
        c.wait()
        dist.barrier(group=pg)
        return time.perf_counter() - t0, n
    block = os.urandom(BLOCK)

    def timed(fn) -> float:
        """Wall time of fn on the slowest rank, from a common start."""
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        fn()
        dist.barrier(group=pg)
        return time.perf_counter() - t0

    res: dict[str, list[float]] = {k: [] for k in KEYS}
    ckpt_bytes = 0
    step = 1000
    for rep in range(args.repeats + 1):                 # round 0 warms up (allocations, first-call costs)
        keep = rep > 0
        step += 1
        state["step"] = step
        t = timed(lambda: ck.save(state, step, blocking=True))
        sync_dir = dir_for(run_dir, step)
        ckpt_bytes = _dir_bytes(sync_dir)
        record = json.loads((sync_dir / "commit.json").read_text())
        # What the checksums cost a save: the same DCP save through hpc_train's writer (CRC32C of
        # every buffer as it is written) and through DCP's own, with the same threads and fsync.
        raw = {"model": model_sd, "optim": optim_sd}
        # Alternating which goes first from round to round (the disk's writeback favours neither).
        for summed in ((True, False) if rep % 2 == 0 else (False, True)):
            if summed:
                t_dcp_crc = timed(lambda: dcp.save(raw, process_group=pg, storage_writer=ChecksummingWriter(
                    str(root / f"crc-{step}"), thread_count=save.IO_THREADS, sync_files=True)))
            else:
                t_dcp_plain = timed(lambda: dcp.save(raw, process_group=pg, storage_writer=dcp.FileSystemWriter(
                    str(root / f"plain-{step}"), thread_count=save.IO_THREADS, sync_files=True)))
        if rank == 0:
            shutil.rmtree(root / f"crc-{step}")
            shutil.rmtree(root / f"plain-{step}")

        step += 1
        state["step"] = step
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        ck.save(state, step, blocking=False)
        blocked = torch.tensor([time.perf_counter() - t0])
        ck.wait()
        dist.barrier(group=pg)
        total = time.perf_counter() - t0
        dist.all_reduce(blocked, op=dist.ReduceOp.MAX, group=pg)

        # Baselines: the same state with DCP's defaults (1 writer thread; a new stager per async save).
        t_raw = timed(lambda: dcp.save(raw, checkpoint_id=str(root / f"raw-{step}"), process_group=pg))
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        fut = dcp.async_save(raw, checkpoint_id=str(root / f"raw-async-{step}"), process_group=pg)
        raw_blocked = torch.tensor([time.perf_counter() - t0])
        fut.result()
        dist.barrier(group=pg)
        dist.all_reduce(raw_blocked, op=dist.ReduceOp.MAX, group=pg)
        if rank == 0:
            shutil.rmtree(root / f"raw-{step}")
            shutil.rmtree(root / f"raw-async-{step}")

        def torch_save() -> None:
            if rank == 0:
                f = root / "torch_save.pt"
                with open(f, "wb") as fh:
                    torch.save({"model": model_sd, "optim": optim_sd}, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                f.unlink()
        t_ts = timed(torch_save)

        def disk(writers: int):
            """``writers`` concurrent streams in all (threads, spread over the ranks), each writing
            its share of the checkpoint's bytes to its own file, then fsync."""
            mine = [w for w in range(writers) if w % world == rank]

            def one(w: int) -> None:
                f = root / f"bw-{w}.bin"
                _write_fsync(f, ckpt_bytes // writers, block)
                f.unlink()

            def go() -> None:
                threads = [threading.Thread(target=one, args=(w,)) for w in mine]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
            return go
        t_d1 = timed(disk(1))
        t_d2 = timed(disk(2))
        t_d4 = timed(disk(4))

        def loads() -> tuple[float, float]:
            if rank == 0:
                _evict(sync_dir)
            dist.barrier(group=pg)
            return (timed(lambda: load.load(state, sync_dir, rank, world)),
                    timed(lambda: load.load(state, sync_dir, rank, world)))
        # The load with the save's own record (every item checked as it is read), then the same
        # checkpoint with a record that has no checksums (nothing checked), alternating per round.
        plain_first = rep % 2 == 1
        for with_sums in ((False, True) if plain_first else (True, False)):
            if rank == 0:
                store.write_commit(sync_dir, record, sums=record["checksums"] if with_sums else None,
                                    checksums=with_sums)
            dist.barrier(group=pg)
            if with_sums:
                t_cold, t_warm = loads()
            else:
                t_cold_plain, t_warm_plain = loads()
        if rank == 0:                                   # keep the disk tidy between rounds
            shutil.rmtree(sync_dir)
            shutil.rmtree(dir_for(run_dir, step))
        # Interleaved: a plain step, a save overlapping the next step, a plain step, a save copied first.
        t_step = [timed(train_step) for _ in range(2)]
        t_ov = save_then_step(ck_over)
        t_step.append(timed(train_step))
        t_nov = save_then_step(ck_plain)
        t_step.append(timed(train_step))
        one = statistics.median(t_step)
        t_until, n_steps = save_then_steps_until_committed(ck)
        t_step.append(timed(train_step))
        src = torch.ones(state_bytes // 4)
        dst = torch.zeros_like(src)          # pages touched: a copy into warm memory, as the stager's
        dst.copy_(src)
        t_copy = timed(lambda: dst.copy_(src))
        src = dst = None                     # free them (the lambda above holds the names, not a copy)
        if rank == 0:
            for d in list(store.ckpt_root(run_dir).iterdir()):
                shutil.rmtree(d, ignore_errors=True)
        if keep:
            for k, v in zip(KEYS, (t, float(blocked), one, t_copy, t_ov - one, t_nov - one, total, t_raw, float(raw_blocked),
                                   t_ts, t_d1, t_d2, t_d4, t_cold, t_warm, t_cold_plain, t_warm_plain, t_dcp_crc,
                                   t_dcp_plain, t_until - n_steps * one)):
                res[k].append(v)
            if rank == 0:       # after every round: a later round's crash keeps this one's figures
                tmp = Path(out).with_suffix(".tmp")
                tmp.write_text(json.dumps({"results": res, "state_bytes": state_bytes, "ckpt_bytes": ckpt_bytes,
                                           "torch": torch.__version__}))
                os.replace(tmp, out)
    ck.close()
    ck_over.close()
    ck_plain.close()
    del trainer
    distributed.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=24576, help="MLP hidden width (24576: ~234 MB with Adam)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory under runs/)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch.multiprocessing as mp

    base = Path(args.dir) if args.dir else Path("runs")
    base.mkdir(parents=True, exist_ok=True)
    args.dir = tempfile.mkdtemp(prefix="bench-ckpt-", dir=base)
    reps = Reps()
    data: dict = {}
    attempt = 0
    try:
        while (ran := reps.n_ok("round") + reps.n_failed("round")) < args.repeats:
            attempt += 1
            sub = argparse.Namespace(**{**vars(args), "dir": str(Path(args.dir) / f"attempt-{attempt}"),
                                        "repeats": args.repeats - ran})
            Path(sub.dir).mkdir()
            out = Path(sub.dir) / "result.json"
            try:
                mp.spawn(_worker, args=(args.nproc, _free_port(), sub, str(out)), nprocs=args.nproc, join=True)
                crash = None
            except Exception as e:              # a rank died or raised: its process group is gone
                crash = e
            got = json.loads(out.read_text()) if out.exists() else None
            kept = len(got["results"]["sync_save"]) if got else 0
            for n in range(kept):
                reps.run("round", ran + n + 1, lambda n=n: {k: got["results"][k][n] for k in KEYS})
            data = got or data
            if crash is not None or kept < sub.repeats:
                reason, err = _crash_report(crash, Path(sub.dir), args.nproc)
                reps.fail("round", ran + kept + 1, reason, err)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    if not reps.n_ok("round"):
        print(f"checkpoint benchmark: {reps.basis('round')}")
        return reps.finish()
    med = {k: reps.median("round", lambda r, k=k: r[k]) for k in KEYS}
    nb = data["ckpt_bytes"]
    mb = 1e6
    bws = {n: nb / med[f"disk_{n}"] for n in (1, 2, 4)}
    bw = max(bws.values())
    sync_tp = nb / med["sync_save"]
    print(f"checkpoint benchmark: torch {data['torch']}, {args.nproc} gloo ranks, MLP hidden {args.hidden} + Adam: "
          f"state {data['state_bytes'] / mb:.0f} MB, DCP checkpoint on disk {nb / mb:.0f} MB; "
          f"{reps.basis('round')} rounds (after 1 warm-up per set of ranks), directory {base.resolve()}")
    print(f"{'measurement':64} {'median s':>9} {'MB/s':>8}   all runs (s)")
    for key, name, has_bytes in ROWS:
        sec = med[key]
        runs = " ".join(f"{x:.3f}" for x in reps.values("round", lambda r, k=key: r[k]))
        rate = f"{nb / sec / mb:8.0f}" if has_bytes else f"{'-':>8}"
        print(f"{name:64} {sec:9.3f} {rate}   {runs}")
    r1 = med["async_block"] / med["sync_save"]
    r2 = sync_tp / bw
    print(f"async blocking / sync save           = {r1:.3f}  (target <= 0.05: {'met' if r1 <= 0.05 else 'MISSED'})")
    r4 = max(med["overlap_extra"], 0.0) / med["sync_save"]
    r5 = max(med["nooverlap_extra"], 0.0) / med["sync_save"]
    print(f"async save's cost to the loop / sync save = {r4:.3f} with the copy overlapping the next step, "
          f"{r5:.3f} without (the step's own time taken out)")
    def target(r: float, ok: bool, want: str) -> str:
        return f"{r:.3f}  (target {want}: {'met' if ok else 'MISSED'})"
    r_block = med["async_block"] / med["memcpy"]
    r_steps = max(med["async_steps_extra"] - med["async_block"], 0.0) / med["memcpy"]
    print(f"async blocking / one in-memory copy of the state = {target(r_block, r_block <= 1.2, '<= 1.2')}")
    print(f"async save's extra cost to the next steps, until committed (less the blocking) / that copy = "
          f"{r_steps:.2f}")
    r3 = med["dcp_crc"] / med["dcp_plain"]
    print(f"sync save with checksums / without    = {target(r3, r3 <= 1.05, '<= 1.05')}  (the same dcp.save, "
          f"hpc_train's checksumming writer vs DCP's)")
    print(f"sync save throughput / disk bandwidth = {target(r2, r2 >= 0.85, '>= 0.85')}; "
          f"{sync_tp / mb:.0f} MB/s vs the best disk figure, {bw / mb:.0f} MB/s")
    for temp in ("cold", "warm"):
        r = med[f"load_{temp}"] / med[f"load_{temp}_plain"]
        print(f"resume load with verification / without, {temp} page cache = {target(r, r <= 1.05, '<= 1.05')}")
    return reps.finish()


def _crash_report(crash: BaseException | None, attempt_dir: Path, nproc: int) -> tuple[str, str]:
    """(one line: which rank and how it ended, the last lines of its stderr) of a crashed round."""
    import torch.multiprocessing as mp

    rank = getattr(crash, "error_index", None)
    if isinstance(crash, mp.ProcessExitedException):
        how = f"killed by {crash.signal_name}" if crash.signal_name else f"exit {crash.exit_code}"
        reason = f"rank {rank}: {how}"
    elif isinstance(crash, mp.ProcessRaisedException):
        return f"rank {rank} raised: {str(crash).strip().splitlines()[-1]}", tail(str(crash))
    elif crash is not None:
        reason = f"{type(crash).__name__}: {crash}".splitlines()[0]
    else:
        reason = "the ranks exited without writing every round's figures"
    files = [attempt_dir / f"rank-{r}.stderr" for r in ([rank] if rank is not None else range(nproc))]
    err = "\n".join(f"[rank {f.stem.split('-')[1]}]\n" + tail(f.read_text(errors="replace"))
                    for f in files if f.exists() and f.stat().st_size)
    return reason, err


if __name__ == "__main__":
    sys.exit(main())
