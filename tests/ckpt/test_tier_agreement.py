"""One answer to "which step would a restart load, from which tier" (issue 49): real items of six
kinds, and all that ask agree on each.

Real runs build the items: the loop of tests/ckpt/test_peer_copies.py on two fake nodes (two
torchrun agents, one worker each, each with its own ``SLURMD_NODENAME``: their local tiers lie
apart as on two machines; real gloo, real SIGKILL), under one tier ID (``HPC_TRAIN_LOCAL_ID``,
what a ``run`` launcher hands its workers). A crash at step 7 leaves the shared tier's step 4 and,
on each node, its rank's local items of steps 3 and 6 and copies of the other node's. Another
run on the same nodes, under the same ID, crashes later (its items are newer). Each case starts
from a copy of what they left, in the same directory (the run's identity is its real path),
changed as the case says, and then asks

* ``status`` (:func:`hpc_train.login.jobs.restart_point`, the line it prints),
* ``ckpt list`` and ``ckpt verify`` (their "a restart in place loads" line; ``verify`` reads
  this run's items back and exits 1 when one is damaged),
* the requeue hook's progress check (:func:`hpc_train.login.gather.gather`: the local step it
  would tell the next job step, else the shared tier's newest),
* ``Run.restore`` itself (the same loop started again on the same nodes: the step it resumed
  from, and from which tier)

and all must give the same (step, tier).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import hpc, show
from test_local_tier import KILL_AT, fake_nodes

# The tier ID the run's processes are handed, as a `run` launcher hands its own: a live process's
# (this one's), as a launcher's is while its run lasts; a dead pid's directory is a leftover that
# the next process to use the base removes (config_local.sweep).
ID = f"p{os.getpid()}"


def _loop(cwd: Path, shm: Path, kill_at: int, nodes: tuple[str, ...] = ("fakeA", "fakeB"),
          **env: str) -> list[subprocess.CompletedProcess]:
    """The loop on ``nodes`` (no restarts) in ``cwd``, under this test's tier ID."""
    return fake_nodes(cwd, shm, kill_at, nodes, HPC_TRAIN_LOCAL_ID=ID, **env)


def _crashed(done: list[subprocess.CompletedProcess]) -> None:
    assert done and all(p.returncode != 0 for p in done), "\n".join(show(p) for p in done)


@pytest.fixture(scope="module")
def left(tmp_path_factory) -> Path:
    """What the crashes leave (``work/``: this run in ``runs/loop``, the other in ``other/``, the
    tier's base in ``shm/``), kept aside as it was."""
    root = tmp_path_factory.mktemp("agree")
    work = root / "work"
    (work / "shm").mkdir(parents=True)
    _crashed(_loop(work, work / "shm", KILL_AT))
    (work / "other").mkdir()
    _crashed(_loop(work / "other", work / "shm", 10))
    shutil.copytree(work, root / "pristine", symlinks=True)
    return root


def _fresh(left: Path) -> Path:
    work = left / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(left / "pristine", work, symlinks=True)
    return work


def _tier(work: Path, tier_id: str = ID) -> Path:
    """This run's directory of the tier under ``tier_id`` (hpc_train.config_local's layout)."""
    from hpc_train import config_local
    return work / "shm" / f"hpc_train-{tier_id}" / config_local.run_key(work / "runs" / "loop")


def _node(work: Path, node: str) -> Path:
    return _tier(work) / node


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _biggest(step_dir: Path) -> Path:
    return max(step_dir.glob("flat-*.bin"), key=lambda f: f.stat().st_size)


# --- the cases: how each changes what the crashes left ---------------------------------------------

def _as_left(work: Path) -> None:
    """A crash: local items (step 6) newer than the shared tier's step 4, on both nodes."""


def _lost_node(work: Path) -> None:
    """fakeB's storage is gone: rank 1's step 6 lives only as fakeA's copy."""
    shutil.rmtree(_node(work, "fakeB"))


def _damaged(work: Path) -> None:
    """Rank 1's step 6 fails its checksums, in its own node's item and in the copy (whichever node
    rank 1 lands on at the restart, the item it loads is damaged)."""
    _flip(_biggest(_node(work, "fakeB") / "rank-1" / "step-6"))
    _flip(_biggest(_node(work, "fakeA") / "copies" / "rank-1" / "step-6"))


def _other_job(work: Path) -> None:
    """This run's items lie under another tier ID (another job's), and its own holds none."""
    other = _tier(work, f"p{os.getppid()}")   # a live process's: not a leftover
    other.parent.mkdir()
    _tier(work).rename(other)


def _other_world(work: Path) -> None:
    """The run went on at world size 1 (fakeA alone) from the shared tier's step 4 and crashed at
    step 5 (the same command: the same config), before its first local save there: the items of
    world size 2 are left over, newer than what the run saved since."""
    _crashed(_loop(work, work / "shm", KILL_AT, nodes=("fakeA",), LOCAL_TIER_KILL_RANK="0", LOCAL_TIER_KILL_AT="5"))


BOTH = ("fakeA", "fakeB")
CASES = {   # case: (what it does, the nodes the restart runs on, the (step, tier) every asker must give)
    "crash": (_as_left, BOTH, (6, "local")),
    "lost node, the buddy's copy only": (_lost_node, BOTH, (6, "local")),
    "damaged item": (_damaged, BOTH, (4, "shared")),
    "another world size": (_other_world, ("fakeA",), (4, "shared")),
    "another job id": (_other_job, BOTH, (4, "shared")),
}


# --- the four that ask ------------------------------------------------------------------------

def _said(text: str) -> tuple[int, str]:
    m = re.search(r"step (\d+) from the node-local tier", text) or re.search(r"the shared tier's step (\d+)", text)
    assert m, text
    return int(m.group(1)), "local" if "node-local tier" in m.group(0) else "shared"


def _status(run_dir: Path) -> tuple[int, str]:
    from hpc_train.ckpt import store
    from hpc_train.login.jobs import restart_point
    line = restart_point(run_dir, store.newest_complete(run_dir))
    assert line is not None
    return _said(line.split(";")[0])


def _ckpt_list(run_dir: Path) -> tuple[int, str]:
    listing = hpc("ckpt", "list", run_dir)
    assert listing.returncode == 0, show(listing)
    from hpc_train import config_local
    other = config_local.run_key(run_dir.parent.parent / "other" / "runs" / "loop")
    assert other not in listing.stdout, listing.stdout   # the other run's items are not this run's to show
    (line,) = [ln for ln in listing.stdout.splitlines() if ln.startswith("a restart in place loads")]
    return _said(line)


def _ckpt_verify(run_dir: Path, damaged: bool) -> tuple[int, str]:
    """``ckpt verify`` reads this run's items back (exit 1 when one is damaged) and says the same."""
    checked = hpc("ckpt", "verify", run_dir)
    assert checked.returncode == (1 if damaged else 0), show(checked)
    assert ("BAD: " in checked.stdout) == damaged, checked.stdout
    return _said(checked.stdout.splitlines()[-1])


def _hook(run_dir: Path) -> tuple[int, str]:
    from hpc_train.login import decide
    from hpc_train.login.gather import gather
    with pytest.MonkeyPatch.context() as m:
        m.setenv("PATH", str(run_dir / "no-slurm-here"))   # squeue: "unknown"
        inputs, _ = gather(run_dir, 1, {"SLURM_JOB_ID": ID}, srun_tasks_per_node=1, ranks_per_node=1)
    told = decide.local_choice(inputs)
    return (told, "local") if told is not None else (inputs.newest_step, "shared")


def _restore(work: Path, run_dir: Path, nodes: tuple[str, ...]) -> tuple[int, str]:
    """The run started again with the same command (so the same config: a changed one would
    refuse the local items), killing nothing this time."""
    before = (run_dir / "logs" / "rank-0.log").read_text()
    done = _loop(work, work / "shm", KILL_AT, nodes=nodes, LOCAL_TIER_AGAIN="1")
    assert [p.returncode for p in done] == [0] * len(nodes), "\n".join(show(p) for p in done)
    new = (run_dir / "logs" / "rank-0.log").read_text()[len(before):]
    m = re.search(r"resumed from step (\d+) \(\S+\), saved at world size \d+(?:, now \d+: resharded)? "
                  r"\((local|shared) tier", new)
    assert m, new
    return int(m.group(1)), m.group(2)


@pytest.mark.procs
@pytest.mark.parametrize("case", CASES)
def test_the_restore_status_ckpt_list_and_the_hook_agree(left, case):
    change, nodes, expected = CASES[case]
    work = _fresh(left)
    run_dir = work / "runs" / "loop"
    change(work)
    asked = {"status": _status(run_dir), "ckpt list": _ckpt_list(run_dir),
             "ckpt verify": _ckpt_verify(run_dir, damaged=change is _damaged), "hook": _hook(run_dir)}
    asked["Run.restore"] = _restore(work, run_dir, nodes)
    assert asked == dict.fromkeys(asked, expected), asked
