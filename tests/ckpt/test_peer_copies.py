"""Copies of the local tier on a peer node (issue 30, item 2), and the restore that fetches them.

Two real "nodes" without Slurm: two torchrun agents (``--nnodes 2``, one process each, a c10d
rendezvous on this machine), each with its own ``SLURMD_NODENAME`` (fakeA, fakeB), which is what
names a node's local directory (hpc_train.config_local.node_name): their local tiers are apart
as on two machines. Real gloo groups, real files, real SIGKILL.

* Every local save sends each rank's item to the other node, which commits it with its own
  record and checksums; they match the original's.
* Rank 1 deletes its node's whole local directory (a lost node's storage) and every rank
  SIGKILLs itself (as srun ends every task of a failed step): both agents restart their workers, the rank on the emptied node fetches its item of step 6
  from the other node's copy, and the run ends bitwise equal to a run never killed.
* With a bit flipped in that copy, the fetch refuses it on arrival: one warning, every rank
  resumes from the shared tier's step 4, still bitwise equal.
* The plan itself (which step, who sends to whom) and the ring, as pure functions.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import hpc, show
from test_local_tier import KILL_AT, _assert_bitwise, _logs, fake_nodes

from hpc_train.ckpt import store
from hpc_train.ckpt.local import peer


def _two_nodes(cwd: Path, kill_at: int, restarts: str = "1",
               **env: str) -> tuple[list[subprocess.CompletedProcess], Path]:
    """The loop on two fake nodes, ``--max-restarts RESTARTS``, in ``cwd``; and its run directory."""
    return fake_nodes(cwd, cwd / "shm", kill_at, restarts=restarts, **env), cwd / "runs" / "loop"


def _ok(done: list[subprocess.CompletedProcess]) -> None:
    assert [p.returncode for p in done] == [0, 0], "\n".join(show(p) for p in done)


@pytest.fixture(scope="module")
def two_node_reference(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("peer-ref")
    done, rd = _two_nodes(d, 0)
    _ok(done)
    return torch.load(rd / "final.pt", weights_only=True)


@pytest.mark.procs
def test_a_lost_nodes_rank_fetches_its_item_from_the_peers_copy_bitwise(tmp_path, two_node_reference):
    done, rd = _two_nodes(tmp_path, KILL_AT, LOCAL_TIER_LOSE_NODE="1")
    _ok(done)
    # Before the kill each node held copies of the other's items of steps 3 and 6 (local_keep 2).
    assert [json.loads((rd / f"copies-{r}.json").read_text()) for r in (0, 1)] == [[3, 6], [3, 6]]
    logs = _logs(rd)
    # The rendezvous may give the ranks out anew at the restart: the rank on the emptied node
    # fetches its item from the other node, a copy there (or that node's own item, if they moved).
    fetched = re.findall(r"\[rank (\d)\] .*fetched step 6 of rank (\d) from (fake[AB]) \(rank (\d), its (copy|own item)"
                         r"[^)]*\): [0-9.]+ MB in [0-9.]+s, checksums match", logs)
    assert len(fetched) == 1, logs
    me, of, _, sender, _ = fetched[0]
    assert me == of and sender != me, fetched
    assert len(re.findall(r"resumed from step 6 \(\S+/step-6\), saved at world size 2 \(local tier", logs)) == 2, logs
    assert "shared tier" not in logs and "skipping" not in logs, logs
    _assert_bitwise(torch.load(rd / "final.pt", weights_only=True), two_node_reference)
    assert list((tmp_path / "shm").iterdir()) == []   # both nodes' tiers, copies included, removed at the end


@pytest.mark.procs
def test_a_damaged_copy_is_refused_on_arrival_and_the_shared_tier_serves(tmp_path, two_node_reference):
    done, rd = _two_nodes(tmp_path, KILL_AT, LOCAL_TIER_LOSE_NODE="1", LOCAL_TIER_FLIP_COPY="1")
    _ok(done)
    logs = _logs(rd)
    warned = [ln for ln in logs.splitlines() if "skipping local checkpoint" in ln]
    assert len(warned) == 1 and "crc32c" in warned[0] and "restoring from the shared tier" in warned[0], logs
    assert len(re.findall(r"resumed from step 4 \(\S+/checkpoints/step-4\), saved at world size 2 \(shared tier",
                          logs)) == 2, logs
    _assert_bitwise(torch.load(rd / "final.pt", weights_only=True), two_node_reference)


@pytest.mark.procs
def test_copies_carry_their_own_commit_record_and_checksums_and_ckpt_list_shows_them(tmp_path):
    """Without a restart (``--max-restarts 0``), what a crash leaves: each node holds copies of
    the other's items of steps 3 and 6, complete items of their own (commit record, checksums
    that verify when read back), naming the node they came from."""
    done, rd = _two_nodes(tmp_path, KILL_AT, restarts="0")
    assert all(p.returncode != 0 for p in done), "\n".join(show(p) for p in done)
    logs = _logs(rd)
    sent = re.findall(r"local checkpoint tier: step 3 to \S+/(fake[AB])/rank-(\d) .*; copies to rank (\d)", logs)
    assert sorted((r, b) for _, r, b in sent) == [("0", "1"), ("1", "0")], logs
    assert {n for n, _, _ in sent} == {"fakeA", "fakeB"}, logs
    copies = sorted((tmp_path / "shm").glob("hpc_train-*/run-*/fake*/copies/rank-*/step-*"))
    assert sorted((c.parent.parent.parent.name, c.name) for c in copies) == \
        [(n, f"step-{s}") for n in ("fakeA", "fakeB") for s in (3, 6)], copies
    for c in copies:
        info = store.inspect(c)
        assert info.complete and store.verify_checksums(info) is None, (c, info.problem)
        assert info.record["held_by"] == c.parent.parent.parent.name != info.record["copy_of"], info.record
        assert info.record["rank"] == int(c.parent.name[5:]) and info.record["tier"] == "local"
    listing = hpc("ckpt", "list", rd)
    assert listing.returncode == 0, show(listing)
    shown = [ln for ln in listing.stdout.splitlines() if re.search(r" copy  fake[AB]/copies/rank-\d ", ln)]
    assert len(shown) == 4, listing.stdout


def _plan(table, world: int, floor: int) -> tuple[int, list[tuple[int, int]]]:
    """The restore's one chooser (hpc_train.ckpt.tiers.choose): the step and the transfers."""
    from hpc_train.ckpt import tiers
    chosen = tiers.choose(table, world, floor)
    return chosen.step, list(chosen.fetches)


def test_the_plan_picks_the_newest_step_held_for_every_rank():
    # rank 0's node holds its own 3, 6 and rank 1's copies 3, 6; rank 1's node (a spare) holds nothing
    table = [[(0, 6), (0, 3), (1, 6), (1, 3)], []]
    assert _plan(table, 2, -1) == (6, [(1, 0)])
    assert _plan(table, 2, 7) == (-1, [])            # the shared tier is newer
    # three nodes: rank 2's own item of step 6 is gone, its copy is on rank 0's node
    table = [[(0, 6), (2, 6)], [(1, 6), (0, 6)], [(2, 3), (1, 6)]]
    assert _plan(table, 3, 4) == (6, [(2, 0)])
    assert _plan([[(0, 6)], [(0, 6)]], 2, -1) == (-1, [])   # nobody holds rank 1's


def _env(rank: int, local_rank: int, per_node: int, node: int, nodes: int) -> SimpleNamespace:
    """The fields of a NodeEnv that the ring reads."""
    return SimpleNamespace(rank=rank, local_rank=local_rank, local_world_size=per_node, node_rank=node, num_nodes=nodes)


def test_the_ring_sends_to_the_same_local_rank_on_the_next_node():
    r, why = peer.ring(_env(5, 1, 2, 2, 3), 6, 1)   # node 2 of 3, local rank 1
    assert why is None and (r.buddy(1), r.source(1)) == (1, 3)
    assert peer.ring(_env(1, 1, 2, 0, 1), 2, 1) == (None, "copies on a peer node are off: the run has one node "
                                                         "(checkpoint.local_replicas needs two or more)")
    assert peer.ring(_env(1, 1, 2, 0, 1), 2, 0) == (None, None)
    r, _ = peer.ring(_env(0, 0, 1, 0, 3), 3, 5)   # capped at nodes - 1
    assert r.replicas == 2 and [r.buddy(d) for d in (1, 2)] == [1, 2]


@pytest.mark.parametrize("setting, names", [
    (["checkpoint.local_replicas=-1"], ("checkpoint.local_replicas",)),
    (["checkpoint.local_replicas=abc"], ("checkpoint.local_replicas",)),
    (["job.nodes=2", "checkpoint.local_replicas=2"], ("checkpoint.local_replicas=2", "job.nodes=2", "0..1")),
])
def test_bad_local_replicas_exit_2_in_one_line(setting, names):
    p = hpc("config", "jobs/digits.yaml", *[x for s in setting for x in ("--set", s)])
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, show(p)
    assert all(n in p.stderr for n in names), p.stderr
    assert "Traceback" not in p.stderr
