"""Issue 23: README claims about training runs that had no test. Each test drives the claim
through the public path (``python -m hpc_train run``, real gloo processes, real signals) and fails
when the behaviour breaks.

The user's own loop is ``tests.plugins_for_tests:claims_loop`` (``run --fn``), steered by the
environment knobs documented there; the built-in trainer is used where the claim is about it.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (REPO, assert_same_weights, children, clean_env, export, hpc, show, start,
                          tb_scalar_steps, train_losses, write_config)

from hpc_train.ckpt import store
from hpc_train.errors import EXIT_STOPPED

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs

FN = "tests.plugins_for_tests:claims_loop"


def _wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    """Poll ``pred``; ``timeout`` bounds a hang, it is not a speed requirement."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc is None or proc.poll() is None, f"ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _fn_run(tmp_path: Path, rd: Path, steps: int, *sets: str, env: dict[str, str] | None = None,
            nproc: int = 2) -> subprocess.CompletedProcess:
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": steps}, "checkpoint": {"every_steps": 0}})
    args = ["run", "--fn", FN, str(cfg), "--nproc", str(nproc), "--run-dir", str(rd)]
    for s in sets:
        args += ["--set", s]
    return hpc(*args, env=clean_env(**(env or {})))


def _complete_steps(rd: Path) -> list[int]:
    return sorted(i.step for i in store.scan(rd) if i.complete)


# -- the stop agreement leaves DDP's arithmetic alone ------------------------------------------
def test_agreement_hook_leaves_weights_bitwise_those_of_plain_ddp(tmp_path):
    """README: "On 2 ranks the weights stay bitwise those of plain DDP". Two gloo processes train
    the same model under DDP with the agreement's comm hook and under DDP without it."""
    r = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "ddp_agreement_probe.py"), str(tmp_path)],
                       env=clean_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert len(reports) == 2
    for rank, rep in enumerate(reports):
        assert set(rep) == {"small", "big"}
        for kind, res in rep.items():
            assert res["hooked"] and res["init_equal"], (rank, kind, res)
            assert len(res["keys"]) == 4 and len(res["changed_by_training"]) == 4, (rank, kind, res)
            assert res["differ"] == [], f"rank {rank}, {kind} bucket 0: not bitwise plain DDP's: {res['differ']}"
            # The agreement really rode on the step: rank 1 + rank 2 staged 1 and 2 (sum 3) and the step.
            assert [s[2:] for s in res["sums"]] == [[3.0, 2.0 * i] for i in range(6)], res["sums"]
            # Both of the hook's paths ran: inside bucket 0's all-reduce, and beside a bucket 0 over 1 MiB.
            assert res["carried"] == [kind == "small"] * 6, (kind, res["carried"])
            # gloo's work thread, which runs the hook's callbacks, keeps one Python thread state
            # from its first callback on: no step drops a state, and one state is not of a Python
            # thread. One made per callback hangs a fork (a loader's workers) that lands on it.
            states = res["states"]
            assert all(set(a[0]) <= set(b[0]) for a, b in zip(states, states[1:])), states
            assert len(states[-1][0]) > states[-1][1], (rank, kind, states)


# -- run.request_stop() ---------------------------------------------------------------------
def test_request_stop_from_code_stops_every_rank_at_that_step_with_a_checkpoint(tmp_path):
    rd = tmp_path / "run"
    p = _fn_run(tmp_path, rd, 1000, env={"HPC_TEST_REQUEST_STOP_AT": "1:5"})
    assert p.returncode == EXIT_STOPPED, show(p)          # unfinished, non-zero
    assert "checkpoint saved at step 5; run the same command to resume" in p.stderr, show(p)
    rec = json.loads((rd / "stopped.json").read_text())
    assert rec["steps"] == 5 and rec["checkpoint"], rec
    assert _complete_steps(rd) == [5]
    assert sorted(train_losses(rd)) == [1, 2, 3, 4, 5]          # rank 0 stopped too, at the same step
    assert not (rd / "result.json").exists()


# -- run.watch(ddp) -------------------------------------------------------------------------
@pytest.mark.parametrize("own_ddp", [True, False], ids=["watch-own-ddp", "no-ddp-watched"])
def test_watched_ddp_carries_the_agreement_with_no_collective_of_its_own(tmp_path, own_ddp):
    """README: step_end costs "nothing extra under a watched DDP module (run.wrap, or
    run.watch(ddp) for a DDP you built)". With the user's own DDP handed to run.watch, step_end
    makes no all-reduce of its own; the control (a DDP that run.watch never saw: here, strategy
    none) needs one per step. A stop from code is still agreed at the same step."""
    rd = tmp_path / "run"
    env = {"HPC_TEST_COUNT_ALLREDUCE": "1", "HPC_TEST_REQUEST_STOP_AT": "0:6"}
    sets = []
    if own_ddp:
        env["HPC_TEST_OWN_DDP"] = "1"
    else:
        sets = ["dist.strategy=none"]
    p = _fn_run(tmp_path, rd, 1000, *sets, env=env)
    assert p.returncode == EXIT_STOPPED and "checkpoint saved at step 6" in p.stderr, show(p)
    for rank in (0, 1):
        counts = json.loads((rd / f"allreduce-rank{rank}.json").read_text())
        assert len(counts) == 6, counts
        # The stop's step saves, and the save checks the weights with one all-reduce: not counted.
        assert counts[:5] == ([0] * 5 if own_ddp else [1] * 5), (rank, counts)


# -- a torchdata StatefulDataLoader in state -------------------------------------------------
def _own_run(tmp_path: Path, rd: Path, steps: int, how: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The same loop as ``run --fn`` runs it, as a user's own file under plain ``python`` (one
    process) or ``torchrun`` (2), its config passed to ``hpc_train.init()``."""
    cfg = write_config(tmp_path / "own.yaml", {"train": {"max_steps": steps}, "checkpoint": {"every_steps": 0},
                                               "run_dir": str(rd)})
    main = tmp_path / "main.py"
    main.write_text("import sys\nimport hpc_train\nfrom tests.plugins_for_tests import claims_loop\n"
                    "hpc_train.init(sys.argv[1])\nclaims_loop()\n")
    if how == "python":
        cmd = [sys.executable, str(main), str(cfg)]
    else:
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(main), str(cfg)]
    return subprocess.run(cmd, cwd=tmp_path, env=clean_env(**env), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("loader, stops, how", [
    pytest.param(loader, stops, how, id=f"{loader}-{'-'.join(map(str, stops))}-{how}")
    for loader, stops, how in [("stateful", (4, 9), "run --fn"), ("stateful-workers", (9,), "run --fn"),
                               ("stateful-gen", (4,), "run --fn"), ("stateful", (9,), "python"),
                               ("stateful", (9,), "torchrun")]])
def test_stateful_dataloader_in_state_resumes_bitwise(tmp_path, loader, stops, how):
    """README: state may hold torchdata's StatefulDataLoader, and a stopped run resumes bitwise.
    Stopped mid-epoch (6 batches per epoch per rank: step 4 is mid-epoch 0, step 9 mid-epoch 1,
    after a set_epoch; the first case stops at both, resuming in between) and resumed in fresh
    processes, the run must end with the weights and losses of one that never stopped. Each
    iter() of a loader without a generator of its own draws its base seed from torch's global
    RNG, which the dropout masks come from: the run that never stopped drew it at the epoch's
    start, before the save, and the resumed loop's iter() must not draw it again.
    ``stateful-workers``: 2 loader workers (their seeds come from the base seed the loader's
    state holds); ``stateful-gen``: the loader given its own generator.
    The same under plain ``python`` (one process: one epoch is 12 steps, step 9 mid-epoch 0)
    and ``torchrun``, the loop in a file of the user's own."""
    env = {"HPC_TEST_LOADER": loader}

    def go(rd: Path, **more: str) -> subprocess.CompletedProcess:
        if how == "run --fn":
            return _fn_run(tmp_path, rd, 12, env={**env, **more})
        return _own_run(tmp_path, rd, 12, how, {**env, **more})
    ref = tmp_path / "ref"
    p = go(ref)
    assert p.returncode == 0, show(p)
    rd = tmp_path / "run"
    for stop_at in stops:
        p = go(rd, HPC_TEST_REQUEST_STOP_AT=f"0:{stop_at}")
        assert re.search(rf"checkpoint saved (by \w+ )?at step {stop_at}\b", p.stderr), show(p)
        assert p.returncode == (EXIT_STOPPED if how == "run --fn" else p.returncode), show(p)
    p = go(rd)
    assert p.returncode == 0, show(p)
    assert (rd / "logs" / "rank-0.log").read_text().count("resumed from") == len(stops)
    ref_losses, got = train_losses(ref), train_losses(rd)
    assert len(ref_losses) == 12 and got == ref_losses
    assert_same_weights(export(ref, tmp_path / "a.pt"), export(rd, tmp_path / "b.pt"))


# -- Ctrl-C twice ---------------------------------------------------------------------------
def test_second_ctrl_c_aborts_at_once(tmp_path):
    """README: "A second Ctrl-C aborts at once". The first step takes 16 samples x 2 s of loading
    per rank, so the first Ctrl-C alone would end the run only after that step and a save; the
    second must end it before: no checkpoint, no stop record, exit 130, no worker left."""
    cfg = write_config(tmp_path / "job.yaml", {"model": {"name": "mlp"},
                                               "data": {"name": "tests.plugins_for_tests:slow_data"},
                                               "train": {"max_steps": 3}})
    rd = tmp_path / "run"
    p = start("run", cfg, "--nproc", "2", "--run-dir", rd, env=clean_env(HPC_TEST_SLOW_S="2"))
    hb = rd / "logs" / ".heartbeat"
    _wait_for(lambda: (hb / "rank-0").exists() and (hb / "rank-1").exists(), 120, "both workers", p)
    workers = children(p.pid)
    assert len(workers) == 2, workers
    p.send_signal(signal.SIGINT)
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "aborted; workers killed" in err, err
    assert not (rd / "stopped.json").exists() and _complete_steps(rd) == []
    assert not (rd / "metrics.jsonl").exists() or train_losses(rd) == {}
    time.sleep(0.5)
    assert not [w for w in workers if Path(f"/proc/{w}").exists()], "workers left running"


# -- a stop during start-up -----------------------------------------------------------------
def test_a_stop_during_start_up_is_kept_and_saved_at_the_first_step(tmp_path):
    """README: "a signal during start-up is kept and acted on at the first step boundary". The
    SIGTERM reaches the workers while they build the model (the plug-in sleeps there and records
    that the stop had arrived by the time it returned); the run trains exactly one step, saves
    it and stops."""
    marks = tmp_path / "marks"
    marks.mkdir()
    cfg = write_config(tmp_path / "job.yaml", {"model": {"name": "tests.plugins_for_tests:slow_build_mlp"},
                                               "train": {"max_steps": 50}})
    rd = tmp_path / "run"
    p = start("run", cfg, "--nproc", "2", "--run-dir", rd,
              env=clean_env(HPC_TEST_MARK_DIR=str(marks), HPC_TEST_BUILD_SLEEP_S="4"))
    _wait_for(lambda: (marks / "building-rank0").exists() and (marks / "building-rank1").exists(), 120,
              "both ranks building the model", p)
    assert not (marks / "built-rank0").exists() and not (marks / "built-rank1").exists()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    built = [json.loads((marks / f"built-rank{r}").read_text()) for r in (0, 1)]
    assert len(built) == 2 and all(b["stop_requested"] for b in built), built   # it came during start-up
    assert p.returncode == EXIT_STOPPED, err
    assert "checkpoint saved at step 1; run the same command to resume" in err, err
    assert json.loads((rd / "stopped.json").read_text())["steps"] == 1
    assert _complete_steps(rd) == [1]
    assert sorted(train_losses(rd)) == [1]


# -- timed saves ----------------------------------------------------------------------------
@pytest.mark.parametrize("every_seconds", [0.5, 0.0])
def test_timed_saves_follow_checkpoint_every_seconds(tmp_path, every_seconds):
    """checkpoint.every_seconds saves on time alone (every_steps off); the control, with it
    off, saves only the final step. Steps take >= 16 x 10 ms of loading, 40 of them >= 6 s."""
    cfg = write_config(tmp_path / "job.yaml", {"model": {"name": "mlp"},
                                               "data": {"name": "tests.plugins_for_tests:slow_data"},
                                               "train": {"max_steps": 40},
                                               "checkpoint": {"every_steps": 0, "every_seconds": every_seconds,
                                                              "keep": 100}})
    rd = tmp_path / "run"
    p = hpc("run", cfg, "--nproc", "2", "--run-dir", rd, env=clean_env(HPC_TEST_SLOW_S="0.01"))
    assert p.returncode == 0, show(p)
    steps = _complete_steps(rd)
    assert steps and steps[-1] == 40, steps
    if every_seconds:
        assert len(steps[:-1]) >= 2, f"no timed saves before the final one: {steps}"
    else:
        assert steps == [40], steps


# -- one async save in flight ---------------------------------------------------------------
def test_async_saves_one_in_flight(tmp_path):
    """checkpoint.async_save: a save starts only once the one before it is committed. The
    state's SaveProbe runs inside every save on rank 0 and records the older step directories
    still without commit.json at that moment: there must never be one."""
    rd = tmp_path / "run"
    p = _fn_run(tmp_path, rd, 12, "checkpoint.every_steps=1", "checkpoint.async_save=true", "checkpoint.keep=100",
                env={"HPC_TEST_SAVE_PROBE": "1"})
    assert p.returncode == 0, show(p)
    seen = json.loads((rd / "save-probe.json").read_text())
    assert [s["step"] for s in seen] == list(range(1, 13)), seen
    assert all(len(s["older"]) == s["step"] - 1 for s in seen), seen      # nothing pruned, all seen
    assert [s for s in seen if s["uncommitted"]] == [], "a save started while another was in flight"
    assert _complete_steps(rd) == list(range(1, 13))


# -- TensorBoard ------------------------------------------------------------------------------
def test_tensorboard_gets_goodput_and_eval_loss(tmp_path):
    """README: tb/ holds eval/loss and goodput/training (at every save)."""
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 6, "eval": True},
                                               "checkpoint": {"every_steps": 2, "async_save": False},
                                               "log": {"tensorboard": True}})
    rd = tmp_path / "run"
    p = hpc("run", cfg, "--nproc", "2", "--run-dir", rd)
    assert p.returncode == 0, show(p)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(rd / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "goodput/training" in tags and "eval/loss" in tags, tags
    good = acc.Scalars("goodput/training")
    assert [e.step for e in good] == [2, 4, 6], [e.step for e in good]      # one per save
    assert all(0 < e.value <= 1 for e in good), [e.value for e in good]
    ev = acc.Scalars("eval/loss")
    assert len(ev) >= 1 and all(math.isfinite(e.value) for e in ev), ev
    assert ev[-1].step == 6
    shown, written = tb_scalar_steps(rd, "eval/loss")
    assert shown == written == [e.step for e in ev]
