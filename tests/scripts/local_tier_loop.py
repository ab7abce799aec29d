"""The README's loop for the local-tier tests (tests/ckpt/test_local_tier.py), under torchrun.

``python local_tier_loop.py STEPS [KILL_AT]``: STEPS optimizer steps of a tiny model with dropout
(so the RNG state matters) and a shuffled loader. With KILL_AT, rank 1 of the first attempt
(torchrun's ``TORCHELASTIC_RESTART_COUNT`` 0) SIGKILLs itself right after ``step_end`` of that
step, as a crashed rank would; torchrun's ``--max-restarts`` then starts every rank again in
place. With ``LOCAL_TIER_FLIP`` set, rank 1 first flips one bit of its newest local item; with
``LOCAL_TIER_UNFINISHED``, rank 0 leaves a shared step directory without a commit record; with
``LOCAL_TIER_LOSE_NODE``, rank 1 removes its node's whole local directory (a lost node's storage)
and every rank is killed; with ``LOCAL_TIER_NO_RESTORE``, the loop never calls ``run.restore``;
with ``LOCAL_TIER_FLIP_COPY``, rank 0 flips a bit in its copy of rank 1's newest item; with
``LOCAL_TIER_KILL_RANK``, those ranks (a comma-separated list) are the ones killed (default 1; a plain
``python`` run has rank 0 only); with
``LOCAL_TIER_SLOW_WRITE`` (see tests/ckpt/test_local_tier.py), the loop does not wait for the
local save in flight before the kill; with ``LOCAL_TIER_KILL_MID``, the rank is killed in the
middle of the next step instead (after its forward, before its backward, as a crash mid-step: its
peers wait in that step's gradient all-reduce), with nothing waited for. Before
the kill, each rank writes the steps its node's local tier holds to ``RUN_DIR/local-steps-R.json``
(and, with copies, the steps of the copies it holds to ``copies-R.json``); at the end, rank 0
writes the model's weights to ``RUN_DIR/final.pt``.
"""

import json
import os
import shutil
import signal
import sys
import time

import torch

import hpc_train


def main(steps: int, kill_at: int = 0) -> dict:
    run = hpc_train.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
    model = run.wrap(net)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, generator=g), torch.tensor(i % 2)) for i in range(256)]
    loader = run.loader(data, batch_size=4)
    state = {"model": model, "optim": optim, "loader": loader, "step": 0}
    if not os.environ.get("LOCAL_TIER_NO_RESTORE"):   # a loop that never resumes: the tier is built later
        run.restore(state)
    # LOCAL_TIER_AGAIN: a later start of the same command (the same config, so the same local
    # items serve it) that kills nothing.
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not os.environ.get("LOCAL_TIER_AGAIN")
    # LOCAL_TIER_KILL_AT: kill at this step instead, the command (and so the config) unchanged.
    kill_at = int(os.environ.get("LOCAL_TIER_KILL_AT", kill_at))
    loss = torch.zeros(())
    kill_ranks = {int(r) for r in os.environ.get("LOCAL_TIER_KILL_RANK", "1").split(",")}
    mid = bool(os.environ.get("LOCAL_TIER_KILL_MID"))
    while state["step"] < steps:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if mid and first and state["step"] == kill_at and run.rank in kill_ranks:
                time.sleep(0.3)   # the step's forward took a while: its state of step KILL_AT has left
                os.kill(os.getpid(), signal.SIGKILL)
            optim.zero_grad()
            loss.backward()
            optim.step()
            state["step"] += 1
            if run.step_end(state):
                sys.exit(run.exit_code)
            if first and state["step"] == kill_at and not mid:
                # Both tiers' saves in flight are on disk (what a crash a bit later finds): the
                # shared step 4 is complete even on a loaded machine, where its writer thread
                # (nice 10) may still be at work three steps later.
                if not os.environ.get("LOCAL_TIER_SLOW_WRITE"):   # there, step_end's own wait is the subject
                    run._local.wait()
                run._ckpt.wait()
                held = sorted(i.step for i in run._local.usable())
                (run.run_dir / f"local-steps-{run.rank}.json").write_text(json.dumps(held))
                if run.rank == 0 and os.environ.get("LOCAL_TIER_UNFINISHED"):   # a shared save cut short
                    (run.run_dir / "checkpoints" / "step-5").mkdir(parents=True)
                copies = run._local.peers   # hpc_train.ckpt.local.peer: this rank's copies of its source's items
                if copies is not None:
                    source = copies.copies_dir(copies.ring.source(1))
                    got = sorted(int(p.name[5:]) for p in source.glob("step-*") if p.name[5:].isdigit())
                    (run.run_dir / f"copies-{run.rank}.json").write_text(json.dumps(got))
                    if run.rank == 0 and os.environ.get("LOCAL_TIER_FLIP_COPY"):   # rank 1's newest, as held here
                        _flip(max((source / f"step-{got[-1]}").glob("flat-*.bin"), key=lambda f: f.stat().st_size))
                if run.rank == 1:
                    if os.environ.get("LOCAL_TIER_LOSE_NODE"):   # the node's storage is gone, as with a lost node
                        shutil.rmtree(run._local.node)
                    if os.environ.get("LOCAL_TIER_FLIP"):   # one bit of the newest item's tensor data
                        _flip(max((run._local.dir / f"step-{held[-1]}").glob("flat-*.bin"), key=lambda f: f.stat().st_size))
                if run.rank in kill_ranks or os.environ.get("LOCAL_TIER_LOSE_NODE"):
                    # With two torchrun agents (tests/ckpt/test_peer_copies.py) every rank ends here, as
                    # srun's --kill-on-bad-exit ends every task of a step: each agent counts one failure,
                    # so both restart with the same TORCHELASTIC_RESTART_COUNT (an agent that restarts for
                    # the other's rejoining counts none, and the attempts' store prefixes would differ).
                    os.kill(os.getpid(), signal.SIGKILL)
            if state["step"] >= steps:
                break
    # Whole tensors (an FSDP run's shards gathered, on every rank), before finish.
    final = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in net.state_dict().items()}
    out = run.finish({"loss": loss.item()})
    if run.rank == 0:
        torch.save(final, run.run_dir / "final.pt")
    return out


def _flip(shard) -> None:
    """One bit of a shard's tensor data."""
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def fn() -> dict:
    """``run --fn tests.scripts.local_tier_loop:fn``: the same loop as a callable, STEPS and KILL_AT
    from ``LOCAL_TIER_STEPS`` and ``LOCAL_TIER_KILL_AT`` (the tier's settings from ``--set``)."""
    return main(int(os.environ["LOCAL_TIER_STEPS"]))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
