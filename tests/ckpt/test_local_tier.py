"""The node-local checkpoint tier (issue 30, item 1): real processes, real gloo groups, real files.

* A user's loop under ``torchrun --max-restarts 1`` (tests/scripts/local_tier_loop.py): rank 1
  SIGKILLs itself at step 7, torchrun starts both ranks again in place, and they restore from
  their own local items of step 6 (the shared tier has step 4), ending bitwise equal to a run
  that was never killed. With a bit flipped in rank 1's item, every rank falls back to the shared
  tier's step 4 with one warning and still ends bitwise equal.
* The built-in trainer under ``run``: local items are saved and nothing is left in /dev/shm
  after the run; an unwritable or missing local directory turns the tier off in one line and the
  run completes.
* Bad values of its config: exit 2, one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import REPO, clean_env, hpc, show, write_config
from hpc_train import config_local

STEPS, KILL_AT = 12, 7
WRAPPER = f"""import sys
sys.path.insert(0, {str(REPO / "tests" / "scripts")!r})
import hpc_train
import os
# ON_FAILURE: the survivors' save at a failure (tests/ckpt/test_save_at_failure.py); off here,
# where the subject is what the tier's own saves serve.
hpc_train.init(overrides=["checkpoint.every_steps=" + os.environ.get("SHARED_EVERY", "4"), "checkpoint.every_seconds=0",
                          "checkpoint.local_every_steps=" + os.environ.get("LOCAL_EVERY", "3"),
                          "checkpoint.local_dir=" + sys.argv[3], "log.tensorboard=false",
                          "checkpoint.local_on_failure=" + os.environ.get("ON_FAILURE", "false"),
                          "dist.strategy=" + os.environ.get("STRATEGY", "ddp")])
if os.environ.get("LOCAL_TIER_WHERE_BUILT"):
    # Where each rank's tier is built: whether DDP's communication hook is on the stack then.
    import traceback
    from hpc_train.ckpt.local.tier import LocalTier
    _init = LocalTier.__init__
    def _where(self, *a, **kw):
        hooked = any(f.name == "_agreement_hook" for f in traceback.extract_stack())
        with open("built-" + os.environ['RANK'] + ".txt", "a") as f:
            f.write("in the hook " if hooked else "outside ")
        return _init(self, *a, **kw)
    LocalTier.__init__ = _where
if os.environ.get("LOCAL_TIER_SLOW_WRITE"):
    # A fake slow disk (a fault this machine's /dev/shm cannot show): each local item's write
    # starts this many seconds late, on the tier's writer thread.
    import time
    from hpc_train.ckpt.local.tier import LocalTier
    _write = LocalTier._write
    def _slow(self, *a, **kw):
        time.sleep(float(os.environ["LOCAL_TIER_SLOW_WRITE"]))
        return _write(self, *a, **kw)
    LocalTier._write = _slow
if os.environ.get("LOCAL_TIER_DIE_WRITING") and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    # A rank that crashes while its local item is still being written (a fault caused for
    # real, at a chosen moment): rank 1 is killed 1 s into its write of step 6. Rank 0 records
    # every step_end it completes, to compare with the step restored.
    import signal, time
    from hpc_train.ckpt.local.tier import LocalTier
    from hpc_train.run import Run
    _write, _step_end = LocalTier._write, Run.step_end
    def _dying(self, staged, small, path, step, *a, **kw):
        if self.rank == 1 and step == int(os.environ["LOCAL_TIER_DIE_WRITING"]):
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        return _write(self, staged, small, path, step, *a, **kw)
    def _recorded(self, state):
        stop = _step_end(self, state)
        if self.rank == 0:
            with open(self.run_dir / "done-0.txt", "a") as f:
                f.write(str(state['step']) + ' ')
        return stop
    LocalTier._write, Run.step_end = _dying, _recorded
import local_tier_loop
local_tier_loop.main(int(sys.argv[1]), int(sys.argv[2]))
"""


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def fake_nodes(cwd: Path, shm: Path, kill_at: int, nodes: tuple[str, ...] = ("fakeA", "fakeB"), restarts: str = "0",
               **env: str) -> list[subprocess.CompletedProcess]:
    """The loop on ``nodes`` in ``cwd``, its tier's base ``shm``: one torchrun agent and worker per
    fake node, each with its own ``SLURMD_NODENAME`` (their local tiers lie apart as on two
    machines), ``--max-restarts RESTARTS``, a c10d rendezvous on this machine. On a hang the agents
    are ended (they end their workers), then killed: nothing is left behind."""
    (cwd / "loop.py").write_text(WRAPPER)
    shm.mkdir(exist_ok=True)
    port, procs, done = _port(), [], []
    for i, node in enumerate(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(nodes)), "--nproc_per_node", "1",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "fake-nodes",
               "--rdzv_conf", f"is_host={'true' if i == 0 else 'false'}", "--max-restarts", restarts,
               "--monitor-interval", "0.2", "loop.py", str(STEPS), str(kill_at), str(shm)]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=clean_env(SLURMD_NODENAME=node, **env),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return done


def _torchrun(cwd: Path, kill_at: int, restarts: str = "1", **env: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 --max-restarts RESTARTS loop.py STEPS KILL_AT LOCAL_DIR`` in ``cwd``."""
    (cwd / "loop.py").write_text(WRAPPER)
    (cwd / "shm").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", restarts,
           "--monitor-interval", "0.2", "--master_port", _port(), "loop.py", str(STEPS), str(kill_at), str(cwd / "shm")]
    return subprocess.run(cmd, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=180)


def _logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank-*.log")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The final weights of the same loop, never killed."""
    d = tmp_path_factory.mktemp("local-ref")
    p = _torchrun(d, 0)
    assert p.returncode == 0, show(p)
    return torch.load(d / "runs" / "loop" / "final.pt", weights_only=True)


def _assert_bitwise(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.procs
def test_a_rank_killed_in_place_restores_from_its_node_bitwise(tmp_path, reference):
    p = _torchrun(tmp_path, KILL_AT)
    assert p.returncode == 0, show(p)
    rd = tmp_path / "runs" / "loop"
    # Both ranks held local items of steps 3 and 6 when rank 1 died (local_keep 2); the shared tier had step 4.
    assert [json.loads((rd / f"local-steps-{r}.json").read_text()) for r in (0, 1)] == [[3, 6], [3, 6]]
    logs = _logs(rd)
    for r in (0, 1):
        assert re.search(rf"\[rank {r}\] .*resumed from step 6 \(\S+/rank-{r}/step-6\), saved at world size 2 \(local tier, [0-9.]+s\)", logs), logs
    assert "shared tier" not in logs and "skipping" not in logs, logs
    _assert_bitwise(torch.load(rd / "final.pt", weights_only=True), reference)
    # A finished run leaves nothing of its local tier.
    assert list((tmp_path / "shm").iterdir()) == []


def _python(cwd: Path, shm: Path, kill: bool, **env: str) -> subprocess.CompletedProcess:
    """A plain ``python loop.py STEPS KILL_AT LOCAL_DIR`` (one rank, run directory ``cwd/runs/loop``),
    started by this process: every such run has the same parent, as runs started from one shell do.
    ``kill``: its rank 0 is killed at KILL_AT (the arguments, part of the config, stay the same)."""
    cwd.mkdir(exist_ok=True)
    (cwd / "loop.py").write_text(WRAPPER)
    return subprocess.run([sys.executable, "loop.py", str(STEPS), str(KILL_AT), str(shm)], cwd=cwd,
                          env=clean_env(LOCAL_TIER_KILL_RANK="0" if kill else "1", **env), capture_output=True,
                          text=True, timeout=180)


@pytest.mark.procs
def test_a_rerun_with_another_config_says_which_local_items_it_does_not_load(tmp_path):
    """A crash leaves local items of steps 3 and 6 (shared: 4); the rerun changes a setting (part
    of the config's digest), so those items are not this config's: it resumes from the shared
    tier's step 4, and says once why the newer local step 6 is not loaded (it fell back in
    silence before)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    crashed = _python(tmp_path, shm, True)
    assert crashed.returncode == -signal.SIGKILL, show(crashed)
    again = _python(tmp_path, shm, False, SHARED_EVERY="2")
    assert again.returncode == 0, show(again)
    logs = _logs(tmp_path / "runs" / "loop")
    assert "resumed from step 4" in logs, logs
    said = [ln for ln in logs.splitlines() if "are not loaded" in ln]
    assert len(said) == 1 and "1 newer item(s) of this run (up to step 6)" in said[0], said
    assert "saved under another config" in said[0], said


@pytest.mark.procs
def test_two_runs_of_one_shell_keep_their_own_items_and_each_restores_from_its_own(tmp_path):
    """Issue 49.2: two runs from one shell share the node-local tier's job ID (their parent's pid).
    Run B crashes at step 7 (its items: steps 3 and 6; the shared tier: 4); run A then runs to its
    end, which removes its own items; B's are still there, and B's restart resumes from its own
    step 6, bitwise equal to A (the same loop, never killed). Both finished: nothing is left."""
    shm = tmp_path / "shm"
    shm.mkdir()
    from hpc_train.ckpt import tiers
    crashed = _python(tmp_path / "b", shm, True)
    assert crashed.returncode == -signal.SIGKILL, show(crashed)
    rd_a, rd_b = tmp_path / "a" / "runs" / "loop", tmp_path / "b" / "runs" / "loop"
    held = lambda: sorted(i.info.step for i in tiers.local_items(rd_b, str(shm), env={}))   # noqa: E731
    assert held() == [3, 6]
    a = _python(tmp_path / "a", shm, False)
    assert a.returncode == 0, show(a)
    assert held() == [3, 6], list(shm.rglob("*"))
    b = _python(tmp_path / "b", shm, False)
    assert b.returncode == 0, show(b)
    assert re.search(r"resumed from step 6 \(\S+/rank-0/step-6\), saved at world size 1 \(local tier", _logs(rd_b)), \
        _logs(rd_b)
    _assert_bitwise(torch.load(rd_b / "final.pt", weights_only=True), torch.load(rd_a / "final.pt", weights_only=True))
    assert list(shm.iterdir()) == []


@pytest.mark.procs
def test_a_failed_run_script_leaves_nothing_under_the_local_tier_s_base(tmp_path):
    """Issue 49.2: under ``run --script`` each rank's program is a child of its supervisor, and
    names its tier by the launcher's ID that it inherits; rank 1 is killed after its local saves,
    the run fails, and the launcher removes all of it: nothing is left in node memory."""
    shm = tmp_path / "shm"
    shm.mkdir()
    (tmp_path / "loop.py").write_text(WRAPPER)
    p = hpc("run", "--script", tmp_path / "loop.py", "--nproc", "2", "--run-dir", tmp_path / "run",
            "--set", f"checkpoint.local_dir={shm}", "--", str(STEPS), str(KILL_AT), str(shm))
    assert p.returncode == 1, show(p)
    logs = _logs(tmp_path / "run")
    assert len(re.findall(r"local checkpoint tier: step 3 to " + re.escape(str(shm)), logs)) == 2, logs
    assert "rank 1" in p.stderr and (tmp_path / "run" / "local-steps-1.json").exists(), show(p)
    assert list(shm.iterdir()) == []


@pytest.mark.procs
def test_a_failed_run_fn_leaves_nothing_under_the_local_tier_s_base(tmp_path):
    """The same under ``run --fn``: the function runs in the launcher's workers, which name
    their tier by the ID the launcher hands them; rank 1 is killed after its local saves, the
    run fails, and the launcher removes the tier: nothing is left in node memory."""
    shm = tmp_path / "shm"
    shm.mkdir()
    rd = tmp_path / "run"
    sets = [f"checkpoint.local_dir={shm}", "checkpoint.every_steps=4", "checkpoint.every_seconds=0",
            "checkpoint.local_every_steps=3", "log.tensorboard=false"]
    p = hpc("run", "--fn", "tests.scripts.local_tier_loop:fn", "--nproc", "2", "--run-dir", rd,
            *[a for s in sets for a in ("--set", s)],
            env=clean_env(LOCAL_TIER_STEPS=str(STEPS), LOCAL_TIER_KILL_AT=str(KILL_AT)))
    assert p.returncode == 1, show(p)
    logs = _logs(rd)
    assert len(re.findall(r"local checkpoint tier: step 3 to " + re.escape(str(shm)), logs)) == 2, logs
    assert "rank 1" in p.stderr and (rd / "local-steps-1.json").exists(), show(p)
    assert list(shm.iterdir()) == []


@pytest.mark.procs
def test_the_tier_is_never_built_inside_ddp_s_communication_hook(tmp_path):
    """A loop that never restores (the tier is not built by restore): the step's votes are read
    in DDP's hook during the first backward, and they only read timers; the tier is built before
    (by run.wrap), once per rank, and the run ends as usual."""
    p = _torchrun(tmp_path, 0, LOCAL_TIER_WHERE_BUILT="1", LOCAL_TIER_NO_RESTORE="1")
    assert p.returncode == 0, show(p)
    assert [(tmp_path / f"built-{r}.txt").read_text() for r in (0, 1)] == ["outside "] * 2


@pytest.mark.procs
def test_a_crash_redoes_at_most_one_local_interval_even_while_a_write_is_slow(tmp_path, reference):
    """Each local item is written 1.5 s late (a slow disk), steps take milliseconds. The save of
    step 6 is still being written when step 7 ends, so step 7's end waits for it: rank 1, killed
    right after, and rank 0 both hold step 6, and the restart redoes 1 step, not the 3 back to
    the shared tier's step 4 (or 4 to the local step 3)."""
    p = _torchrun(tmp_path, KILL_AT, LOCAL_TIER_SLOW_WRITE="1.5")
    assert p.returncode == 0, show(p)
    rd = tmp_path / "runs" / "loop"
    assert [json.loads((rd / f"local-steps-{r}.json").read_text()) for r in (0, 1)] == [[3, 6], [3, 6]]
    logs = _logs(rd)
    assert len(re.findall(r"resumed from step 6 \(\S+/step-6\), saved at world size 2 \(local tier", logs)) == 2, logs
    _assert_bitwise(torch.load(rd / "final.pt", weights_only=True), reference)


@pytest.mark.procs
def test_a_rank_that_dies_writing_its_item_holds_the_other_ranks_within_one_interval(tmp_path, reference):
    """Rank 1 dies 1 s into writing its local item of step 6 (saves every 3 steps, no shared
    tier). Under DDP the step's agreement rides on the backward's last all-reduce, before
    step_end: the wait for the item sits there, so rank 0 cannot finish step 7 while rank 1's
    step 6 is unwritten. The restart loads step 3 for both, at most 3 steps behind the newest
    step any rank finished (with the wait at step_end, rank 0 finished step 7: 4 redone)."""
    p = _torchrun(tmp_path, 0, SHARED_EVERY="0", LOCAL_TIER_DIE_WRITING="6")
    assert p.returncode == 0, show(p)
    rd = tmp_path / "runs" / "loop"
    done = [int(s) for s in (rd / "done-0.txt").read_text().split()]
    logs = _logs(rd)
    restored = [int(s) for s in re.findall(r"resumed from step (\d+) \(\S+\), saved at world size 2 \(local tier", logs)]
    assert restored == [3, 3], logs
    assert max(done) - restored[0] <= 3, (done, restored)
    _assert_bitwise(torch.load(rd / "final.pt", weights_only=True), reference)


@pytest.mark.procs
def test_with_no_complete_shared_checkpoint_the_local_tier_still_serves(tmp_path, reference):
    """The shared tier holds only a save that never finished (as when a rank dies while the first
    one is written): alone, that is refused ("none is complete"); the local tier resumes instead."""
    p = _torchrun(tmp_path, KILL_AT, SHARED_EVERY="0", LOCAL_TIER_UNFINISHED="1")
    assert p.returncode == 0, show(p)
    rd = tmp_path / "runs" / "loop"
    logs = _logs(rd)
    assert len([ln for ln in logs.splitlines() if "the shared tier has no checkpoint to resume from" in ln]) == 1, logs
    assert len(re.findall(r"resumed from step 6 \(\S+/step-6\), saved at world size 2 \(local tier", logs)) == 2, logs
    _assert_bitwise(torch.load(rd / "final.pt", weights_only=True), reference)


@pytest.mark.procs
def test_a_restore_told_the_local_step_by_the_hook_does_not_plan_the_shared_tier(tmp_path, reference):
    """Issue 49.4: the step the requeue hook chose (HPC_TRAIN_LOCAL_STEP, as the batch script
    exports it for an in-place restart) is checked against what the ranks hold and loaded; the
    shared tier is not planned: its only save, cut short, which the test above sees refused,
    goes unread. The first attempt, told a step no rank holds, says so once and plans as usual."""
    p = _torchrun(tmp_path, KILL_AT, SHARED_EVERY="0", LOCAL_TIER_UNFINISHED="1", HPC_TRAIN_LOCAL_STEP="6")
    assert p.returncode == 0, show(p)
    rd = tmp_path / "runs" / "loop"
    logs = _logs(rd)
    assert "the shared tier has no checkpoint to resume from" not in logs, logs
    told = re.findall(r"resumed from step 6 \(\S+/step-6\), saved at world size 2 \(local tier, as the requeue hook "
                      r"chose", logs)
    assert len(told) == 2, logs
    missing = [ln for ln in logs.splitlines() if "the requeue hook's choice, is not held for every rank" in ln]
    assert len(missing) == 1 and missing[0].startswith("[rank 0]"), logs
    _assert_bitwise(torch.load(rd / "final.pt", weights_only=True), reference)


@pytest.mark.procs
@pytest.mark.parametrize("told", ["", "6"])   # "6": the requeue hook chose that step (issue 49.4)
def test_a_flipped_bit_in_a_local_item_falls_back_to_the_shared_tier(tmp_path, reference, told):
    p = _torchrun(tmp_path, KILL_AT, LOCAL_TIER_FLIP="1", HPC_TRAIN_LOCAL_STEP=told)
    assert p.returncode == 0, show(p)
    rd = tmp_path / "runs" / "loop"
    logs = _logs(rd)
    warned = [ln for ln in logs.splitlines() if "skipping local checkpoint" in ln]
    assert len(warned) == 1 and warned[0].startswith("[rank 1]") and "crc32c" in warned[0], logs
    assert "step 6" in warned[0] and "restoring from the shared tier" in warned[0], warned
    assert len(re.findall(r"resumed from step 4 \(\S+/checkpoints/step-4\), saved at world size 2 \(shared tier", logs)) == 2, logs
    _assert_bitwise(torch.load(rd / "final.pt", weights_only=True), reference)
    assert list((tmp_path / "shm").iterdir()) == []


def _trainer(tmp_path: Path, *sets: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    cfg = write_config(tmp_path / "job.yaml", {"checkpoint": {"every_steps": 0, "every_seconds": 0,
                                                              "local_every_steps": 2}})
    rd = tmp_path / "run"
    args = ["run", str(cfg), "--nproc", "2", "--run-dir", str(rd)] + [x for s in sets for x in ("--set", s)]
    return hpc(*args, env=env or clean_env()), rd


@pytest.mark.procs
def test_the_trainer_saves_local_items_in_dev_shm_and_leaves_none(tmp_path):
    env = {k: v for k, v in clean_env().items() if k != "TMPDIR"}   # the default base: /dev/shm
    p, rd = _trainer(tmp_path, env=env)
    assert p.returncode == 0, show(p)
    assert (rd / "result.json").exists()
    logs = _logs(rd)
    saved = re.findall(r"local checkpoint tier: step 2 to (/dev/shm/hpc_train-p\d+/run-[0-9a-f]+/[^/]+/rank-(\d))", logs)
    assert sorted(r for _, r in saved) == ["0", "1"], logs
    # One node: no peer node for checkpoint.local_replicas' copies (default 1), said once.
    off = [ln for ln in logs.splitlines() if "copies on a peer node are off: the run has one node" in ln]
    assert len(off) == 1 and off[0].startswith("[rank 0]"), logs
    # This run's own area (named by its launcher's pid): other runs may be using /dev/shm meanwhile.
    job_dir = Path(saved[0][0]).parent.parent.parent
    assert job_dir.parent == Path("/dev/shm") and not job_dir.exists(), job_dir


@pytest.mark.parametrize("local_dir, why", [("/proc", "is not writable"),
                                            ("/nonexistent-hpc-train/x", "does not exist")])
@pytest.mark.procs
def test_an_unusable_local_dir_turns_the_tier_off_in_one_line(tmp_path, local_dir, why):
    p, rd = _trainer(tmp_path, f"checkpoint.local_dir={local_dir}")
    assert p.returncode == 0, show(p)
    assert (rd / "result.json").exists()
    logs = _logs(rd)
    off = [ln for ln in logs.splitlines() if "local checkpoint tier off" in ln]
    assert sorted(ln[:8] for ln in off) == ["[rank 0]", "[rank 1]"], logs     # one line per rank
    assert all(why in ln and "the shared tier go on" in ln for ln in off), off
    assert "local checkpoint tier: step" not in logs


@pytest.mark.parametrize("setting, names", [
    ("checkpoint.local_every_steps=-1", ("checkpoint.local_every_steps",)),
    ("checkpoint.local_every_seconds=abc", ("checkpoint.local_every_seconds",)),
    ("checkpoint.local_every_seconds=-5", ("checkpoint.local_every_seconds",)),
    ("checkpoint.local_keep=0", ("checkpoint.local_keep",)),
    ("checkpoint.local_dir=relative/dir", ("checkpoint.local_dir", "absolute")),
])
def test_bad_local_tier_values_exit_2_in_one_line(setting, names):
    p = hpc("config", "jobs/digits.yaml", "--set", setting)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, show(p)
    assert all(n in p.stderr for n in names), p.stderr
    assert "Traceback" not in p.stderr


def test_the_config_shows_the_local_tier_defaults():
    p = hpc("config", "jobs/digits.yaml")
    assert p.returncode == 0, show(p)
    for line in ("local_every_steps: 0", "local_every_seconds: 30.0", "local_dir: ''", "local_keep: 2"):
        assert line in p.stdout, p.stdout


@pytest.mark.procs
def test_the_batch_script_removes_the_jobs_local_tier_after_its_loop(tmp_path):
    """The rendered script in a real bash: its steps (a shell function named srun) finish the run;
    the cleanup's ``command srun`` (a program on PATH here, running its command on "the node",
    this machine) removes ``$TMPDIR/hpc_train-<job id>``, the directory every rank of the job used."""
    out = tmp_path / "job.sbatch"
    rd = tmp_path / "run"
    p = hpc("sbatch", "jobs/digits.yaml", "--run-dir", rd, "-o", out, "--set", "checkpoint.local_every_steps=5")
    assert p.returncode == 0, show(p)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/cleanup.calls\n'
                                  'while [ "$1" != bash ]; do shift; done\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    (bin_dir / "scontrol").chmod(0o755)
    tmp = tmp_path / "tmp"
    (tmp / "hpc_train-7" / "node1" / "rank-0" / "step-5").mkdir(parents=True)
    (tmp / "hpc_train-8").mkdir()   # another job's
    steps = 'srun() { echo "{}" > "$RUN_DIR/result.json"; }\n'
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1", "SLURM_RESTART_COUNT": "0",
           "SLURM_JOB_START_TIME": "1", "TMPDIR": str(tmp)}
    job = subprocess.run(["bash", "-c", steps + out.read_text()], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=env)
    assert job.returncode == 0, job.stderr
    assert sorted(p.name for p in tmp.iterdir()) == ["hpc_train-8"], job.stderr
    assert "--nodes=1 --ntasks-per-node=1" in (tmp_path / "cleanup.calls").read_text()


@pytest.mark.procs
def test_ckpt_list_shows_the_local_items_a_crash_left(tmp_path, monkeypatch):
    """Without a restart, a crashed rank's run leaves its local items (an in-place restart would
    have used them); ``ckpt list`` on the same machine shows them, marked local."""
    p = _torchrun(tmp_path, KILL_AT, restarts="0")
    assert p.returncode != 0, show(p)
    listing = hpc("ckpt", "list", tmp_path / "runs" / "loop")
    assert listing.returncode == 0, show(listing)
    local = [ln.split() for ln in listing.stdout.splitlines() if " local " in ln]
    host = socket.gethostname()
    assert sorted((int(f[0]), f[-2]) for f in local) == [(s, f"{host}/rank-{r}") for s in (3, 6) for r in (0, 1)], \
        listing.stdout
    # What status says an in-place restart would load (a torchrun restart's too): the local step 6,
    # newer than the shared tier's 4.
    from hpc_train.ckpt import store
    from hpc_train.login.jobs import restart_point
    run_dir = tmp_path / "runs" / "loop"
    assert restart_point(run_dir, store.newest_complete(run_dir)) == ("restarted in place: step 6 from the node-local tier "
                                                         "(every rank of 2 held); a requeue: the shared tier's step 4")
    # The requeue hook, on a node that sees them, counts them as progress (a failure judged by
    # the shared tier's step alone looked like no progress since the last one).
    from hpc_train.login.gather import gather
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))   # squeue: "unknown"
    # The hook judges items as the restore does, its job's only: here the tier's ID is torchrun's
    # agent's (p<pid>), which stands in for the job id.
    job = next((tmp_path / "shm").glob("hpc_train-*")).name.removeprefix("hpc_train-")
    inputs, _ = gather(run_dir, 1, {"SLURM_JOB_ID": job}, srun_tasks_per_node=2, ranks_per_node=2)
    assert (inputs.newest_step, inputs.local_step) == (4, 6), inputs
    other, _ = gather(run_dir, 1, {"SLURM_JOB_ID": "7"}, srun_tasks_per_node=2, ranks_per_node=2)
    assert other.local_step is None, other   # another job's items buy no restart


def _item(step: int, rank: int, world: int = 2, complete: bool = True, copy: bool = False, node: str = "n",
          job: str = "7", run: str = "/r", config: str = "c"):
    from hpc_train.ckpt import store, tiers
    info = store.CkptInfo(step, Path(f"/x/{node}/rank-{rank}/step-{step}"), complete, None,
                          {"rank": rank, "world_size": world, "tier": "local", "run_dir": run, "config_hash": config})
    return tiers.LocalItem(info, node, copy, job)


def _restart(items, **ident) -> tuple[int, int] | None:
    """The one chooser's answer (hpc_train.ckpt.tiers.restart) as (step, world size), or None."""
    from hpc_train.ckpt import tiers
    chosen = tiers.restart(items, tiers.Identity("/r", **ident))
    return (chosen.step, chosen.world_size) if chosen.local else None


@pytest.mark.parametrize("items, expected", [
    ([], None),
    ([_item(6, 0), _item(6, 1), _item(3, 0), _item(3, 1)], (6, 2)),
    ([_item(6, 0), _item(3, 0), _item(3, 1)], (3, 2)),                      # rank 1's newest is lost
    ([_item(6, 0), _item(6, 1, copy=True), _item(3, 0)], (6, 2)),           # a peer's copy counts
    ([_item(6, 0), _item(6, 1, complete=False), _item(3, 0), _item(3, 1)], (3, 2)),   # incomplete does not
    ([_item(9, 0, world=1), _item(6, 0), _item(6, 1)], (9, 1)),             # per world size, the newest
    ([_item(6, 0), _item(6, 2)], None),                                     # rank 2 of 2: not a rank
])
def test_the_restart_step_is_the_newest_held_for_every_rank(items, expected):
    assert _restart(items) == expected


# Issue 49.2: what is not this run's serves nothing, whatever lies in its directories.
@pytest.mark.parametrize("items, ident, expected", [
    ([_item(9, 0, run="/other"), _item(9, 1, run="/other"), _item(6, 0), _item(6, 1)], {}, (6, 2)),   # another run's
    ([_item(9, 0, job="5"), _item(9, 1, job="5"), _item(6, 0), _item(6, 1)], {"job": "7"}, (6, 2)),  # another job's
    ([_item(9, 0, job="5"), _item(9, 1, job="7")], {}, None),               # two jobs' halves never make one
    ([_item(9, 0, world=1), _item(6, 0), _item(6, 1)], {"world_size": 2}, (6, 2)),   # after a shrink: this size
    ([_item(9, 0, config="d"), _item(9, 1, config="d"), _item(6, 0), _item(6, 1)], {"config_hash": "c"}, (6, 2)),
    ([_item(6, 0, node="a"), _item(6, 1, node="b")], {"job": "7", "world_size": 2, "config_hash": "c"}, (6, 2)),
])
def test_the_restart_takes_only_this_run_s_items(items, ident, expected):
    assert _restart(items, **ident) == expected


@pytest.mark.parametrize("items, expected", [
    ([], None),
    ([_item(6, 0), _item(3, 0), _item(3, 1)], 3),                           # rank 1 holds 3 only: 3 is what loads
    ([_item(9, 1, copy=True), _item(9, 0), _item(6, 0)], 9),                # a copy counts
    ([_item(9, 0, complete=False), _item(9, 1), _item(6, 0), _item(6, 1)], 6),   # incomplete does not
    ([_item(9, 0, job="5"), _item(9, 1, job="5")], None),                   # another job's buy no restart
])
def test_the_hook_s_local_progress_is_the_step_a_restart_loads(tmp_path, items, expected):
    """The requeue hook's progress (login/gather) asks the same chooser as the restore: before,
    any rank's newest item counted, and a leftover of another job bought a restart."""
    from hpc_train import config
    from hpc_train.login import gather
    from hpc_train.ckpt import tiers
    run_dir = tmp_path / "run"
    cfg = config.Config()
    mine = {"run_dir": str(run_dir), "config_hash": cfg.digest()}   # the items' "c" is this config
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tiers, "local_items", lambda *_a, **_k: [
            dataclasses.replace(i, info=dataclasses.replace(i.info, record={
                **i.info.record, **(mine if i.info.record["config_hash"] == "c" else {"run_dir": str(run_dir)})}))
            for i in items])
        assert gather._local_step(run_dir, cfg, {"SLURM_JOB_ID": "7"}) == expected


@settings(max_examples=300, deadline=None)
@given(table=st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9)), max_size=8), min_size=1, max_size=4),
       world=st.integers(1, 4), floor=st.integers(-1, 9))
def test_the_chooser_s_invariants(table, world, floor):
    """Whatever each holder holds: the step chosen is held for every rank and not below the
    floor, none newer is, each transfer comes from a holder of that rank's item, and the order
    in which a holder lists its items changes nothing."""
    from hpc_train.ckpt import tiers
    chosen = tiers.choose(table, world, floor)
    held = {(r, s): {q for q, pairs in enumerate(table) if (r, s) in pairs} for pairs in table for r, s in pairs}
    full = [s for s in range(10) if s >= floor and all((r, s) in held for r in range(world))]
    assert chosen.step == max(full, default=-1)
    for r, q in chosen.fetches:
        assert q in held[(r, chosen.step)] and r not in held[(r, chosen.step)]
    assert tiers.choose([list(reversed(p)) for p in table], world, floor) == chosen


def test_the_cleanup_asks_for_the_allocation_s_node_count_now(tmp_path):
    """After a lost node (``--no-kill``) the allocation has fewer nodes than the batch shell's
    ``$SLURM_JOB_NUM_NODES`` says, and an ``srun`` asking for that many waits forever: the
    cleanup takes ``scontrol``'s count now, and the old one only when ``scontrol`` says nothing."""
    from hpc_train import config_local
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # As in the batch script: set -euo pipefail. A failed scontrol is the old count, not the job's end.
    line = 'set -euo pipefail; ' + config_local.NODES_NOW + '; echo "${hpc_train_nodes:-$SLURM_JOB_NUM_NODES}"'
    for says, want in (("JobId=7 JobName=x\n   NumNodes=2 NumCPUs=2 NumTasks=2\n", "2"), ("", "3"),
                       ("' >&2; exit 1; echo '", "3")):
        (bin_dir / "scontrol").write_text(f"#!/bin/sh\nprintf '%s' '{says}'\n")
        (bin_dir / "scontrol").chmod(0o755)
        got = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30,
                             env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
                                  "SLURM_JOB_NUM_NODES": "3"})
        assert got.stdout.strip() == want, (says, got.stdout, got.stderr)


def test_a_symlink_among_the_local_items_is_neither_listed_nor_removed_through(tmp_path):
    """Someone else's directory (a copy of a real item), linked in as ``step-9`` beside it: the tier never lists
    it (a restore would read it), and a restore to an older step, which removes the newer items,
    leaves the link's target untouched."""
    from hpc_train import config as config_mod
    from hpc_train.ckpt.local.tier import LocalTier
    base, run_dir = tmp_path / "shm", tmp_path / "run"
    base.mkdir()
    run_dir.mkdir()
    cfg = config_mod.load(None, [f"checkpoint.local_dir={base}", "checkpoint.local_every_steps=1"])
    tier = LocalTier(cfg.checkpoint, cfg.dist, run_dir, 0, 1, node=config_local.node_dir(base / "hpc_train-1", run_dir, {}, "node0"))
    assert tier.off is None
    model = torch.nn.Linear(2, 2)
    state = {"model": model, "step": 3}
    tier.save(state, 3, {"model": "module", "step": "plain"})
    tier.wait()
    elsewhere = tmp_path / "elsewhere"   # a complete item, as an attacker would plant one
    shutil.copytree(tier.dir / "step-3", elsewhere)
    record = json.loads((elsewhere / "commit.json").read_text())
    (elsewhere / "commit.json").write_text(json.dumps({**record, "step": 9}))
    (elsewhere / "keep.txt").write_text("not the tier's")
    (tier.dir / "step-9").symlink_to(elsewhere, target_is_directory=True)
    assert [i.step for i in tier.usable()] == [3]
    tier.restored(3)
    assert (elsewhere / "keep.txt").read_text() == "not the tier's"
    tier.close(remove=True)
    assert (elsewhere / "keep.txt").exists()


def test_the_newest_items_are_kept_across_saves_and_a_restore(tmp_path):
    """local_keep 2: what the directory holds is read at the first save (a leftover of a save
    cut short goes), then each save adds its own step; a restore to an older step removes the
    newer items, and the next save reads the directory again (a restore can fetch an item from
    a peer into it: here one of step 2)."""
    from hpc_train import config as config_mod
    from hpc_train.ckpt.local.tier import LocalTier
    base, run_dir = tmp_path / "shm", tmp_path / "run"
    base.mkdir()
    run_dir.mkdir()
    cfg = config_mod.load(None, [f"checkpoint.local_dir={base}", "checkpoint.local_every_steps=1"])
    tier = LocalTier(cfg.checkpoint, cfg.dist, run_dir, 0, 1, node=config_local.node_dir(base / "hpc_train-1", run_dir, {}, "node0"))
    model = torch.nn.Linear(2, 2)
    state, kinds = {"model": model, "step": 0}, {"model": "module", "step": "plain"}

    def held() -> list[int]:
        return sorted(int(p.name.removeprefix("step-")) for p in tier.dir.iterdir() if p.name.startswith("step-"))

    def save(step: int) -> None:
        with torch.no_grad():
            model.weight.add_(1.0)
        state["step"] = step
        tier.save(state, step, kinds)
        tier.wait()

    tier.dir.mkdir(parents=True)
    (tier.dir / "step-0").mkdir()          # a save cut short by a crash: no commit record
    for step in range(1, 6):
        save(step)
        assert held() == list(range(max(1, step - 1), step + 1)), step
    tier.restored(4)
    assert held() == [4]
    shutil.copytree(tier.dir / "step-4", tier.dir / "step-2")
    record = json.loads((tier.dir / "step-2" / "commit.json").read_text())
    (tier.dir / "step-2" / "commit.json").write_text(json.dumps({**record, "step": 2}))
    assert [i.step for i in tier.usable()] == [4, 2]
    save(5)
    save(6)
    assert held() == [5, 6]
    assert [i.step for i in tier.usable()] == [6, 5]
    tier.close(remove=True)


def test_a_pruned_item_s_files_are_overwritten_by_the_next_save_never_through_a_link(tmp_path):
    """local_keep 2: the item pruned after a save loses its commit record and becomes the spare;
    the next save writes its buffer file in place (the same inode: tmpfs pages reused), drops
    whatever else the spare holds, replaces a symlink planted there instead of writing through
    it, and commits an item whose checksums verify and whose weights load bitwise."""
    from hpc_train import config as config_mod
    from hpc_train.ckpt import load, store
    from hpc_train.ckpt.local.tier import SPARE, LocalTier
    base, run_dir = tmp_path / "shm", tmp_path / "run"
    base.mkdir()
    run_dir.mkdir()
    cfg = config_mod.load(None, [f"checkpoint.local_dir={base}", "checkpoint.local_every_steps=1"])
    tier = LocalTier(cfg.checkpoint, cfg.dist, run_dir, 0, 1, node=config_local.node_dir(base / "hpc_train-1", run_dir, {}, "node0"))
    model = torch.nn.Linear(64, 64)
    state, kinds = {"model": model, "step": 0}, {"model": "module", "step": "plain"}

    def save(step: int) -> Path:
        with torch.no_grad():
            model.weight.add_(1.0)
        state["step"] = step
        tier.save(state, step, kinds)
        tier.wait()
        return tier.dir / f"step-{step}"

    for step in (1, 2):
        save(step)
    assert not (tier.dir / SPARE).exists()
    save(3)
    spare = tier.dir / SPARE
    assert spare.is_dir() and not (spare / "commit.json").exists() and not (tier.dir / "step-1").exists()
    inode = (spare / "flat-float32.bin").stat().st_ino
    item = save(4)
    assert (item / "flat-float32.bin").stat().st_ino == inode
    assert sorted(p.name for p in tier.dir.iterdir()) == [SPARE, "step-3", "step-4"]
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"keep me")
    (spare / "stray").write_bytes(b"x")
    (spare / "flat-float32.bin").unlink()
    (spare / "flat-float32.bin").symlink_to(elsewhere)
    item = save(5)
    assert elsewhere.read_bytes() == b"keep me"
    assert not (item / "flat-float32.bin").is_symlink()
    assert sorted(p.name for p in item.iterdir()) == ["app.pt", "commit.json", "flat-float32.bin", "rank-0.pt"]
    info = store.inspect(item)
    assert info.complete and store.verify_checksums(info) is None, info.problem
    weights = model.weight.detach().clone()
    fresh = {"model": torch.nn.Linear(64, 64), "step": 0}
    load.load(fresh, item, 0, 1, kinds, single=True)
    assert torch.equal(fresh["model"].weight, weights) and fresh["step"] == 5
    tier.close(remove=True)
    assert not tier.dir.exists()


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_a_parameter_that_is_not_finite_is_found_and_a_large_finite_one_is_not(bad):
    """The local tier's check before a save: a sum that is not finite is checked element by
    element, so an overflow of finite values is not taken for a divergence."""
    from hpc_train.ckpt.local.flat import finite as _finite
    big = [torch.full((1000,), 3e38), torch.ones(3, dtype=torch.bfloat16), torch.ones(2, dtype=torch.complex64)]
    assert _finite(big)
    assert _finite([])
    for i in range(3):
        params = [p.clone() for p in big]
        params[i].view(-1)[-1] = float(bad) if not params[i].is_complex() else complex(float(bad), 0)
        assert not _finite(params), (bad, i)


@pytest.mark.parametrize("linked", ["copies", "copies/rank-1"])
def test_a_linked_copies_directory_is_never_listed_nor_removed_through(tmp_path, linked):
    """The copies' directory, or one rank's in it, is a link to someone else's directory holding
    what looks like a newer copy: a restore to an older step (which removes newer copies) and the
    run's end (which removes the copies) leave the link's target whole, with or without peers."""
    from hpc_train.ckpt.local.peer import Peers, Ring
    for peers in (False, True):
        node = tmp_path / f"peers-{peers}" / "node0"
        elsewhere = tmp_path / f"elsewhere-{peers}"
        target = elsewhere / "rank-1" if linked == "copies" else elsewhere
        (target / "step-9").mkdir(parents=True)
        (target / "step-9" / "keep.txt").write_text("not the tier's")
        (node / linked).parent.mkdir(parents=True, exist_ok=True)
        (node / linked).symlink_to(elsewhere, target_is_directory=True)
        if peers:
            p = Peers(Ring(0, 0, 1, 0, 2, 1), node, 10.0)
            assert p.ring.source(1) == 1
            p.restored(3)
            p.remove()
        else:
            from hpc_train import config as config_mod
            from hpc_train.ckpt.local.tier import LocalTier
            base, run_dir = tmp_path / "shm", tmp_path / "run"
            base.mkdir(exist_ok=True)
            run_dir.mkdir(exist_ok=True)
            cfg = config_mod.load(None, [f"checkpoint.local_dir={base}", "checkpoint.local_every_steps=1"])
            tier = LocalTier(cfg.checkpoint, cfg.dist, run_dir, 0, 2, node=node)
            assert tier._kept_copies() is None      # rank 1 is the one it keeps: a link stands there
            tier.restored(3)
            tier.close(remove=True)
        assert (target / "step-9" / "keep.txt").read_text() == "not the tier's", (linked, peers)
