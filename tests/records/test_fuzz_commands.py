"""Issue 50.2: the commands that read a run directory, over a fuzzed one. A real run (2 ranks,
stopped by a real SIGTERM at step 4, a checkpoint at every step, a job.json naming a Slurm job)
is copied, hypothesis puts damaged bytes or a special file in the place of one to three of its
records, and every reading command runs over it in this process: ``status`` (and
``--goodput``), ``logs`` (rank 0, rank 1), ``ckpt list``, ``ckpt verify``, ``ckpt export``,
``cancel``, ``sweep summary`` (the run as a sweep's task) and the batch shell's requeue hook.

The promise checked: each returns an exit status (0, 1 or 2), never an exception, within 20 s;
what it says on stderr is lines, each short, never a traceback; nothing is written through a
link (a file outside the run directory linked in a record's place keeps its bytes).

Slurm is the one thing not real here: ``hpc_train.slurm``'s one call site answers with text drawn
by hypothesis or a failure, as a flaky cluster would (the real commands are tested in
tests/slurm). A rerun's restore over damaged records is tested with real runs in
test_damaged_records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
from damage import CONTENT, SPECIAL, make_special, within
from helpers import run, safetensors_bytes, show, torch_archive_bytes, write_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_train import slurm
from hpc_train.cli.main import main
from hpc_train.login import hook
from hpc_train.records import jobs, keeper, ranks

pytestmark = pytest.mark.procs    # the run that is damaged is a real one


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("fuzzed")
    cfg = write_config(base / "job.yaml", {"train": {"max_steps": 8}, "checkpoint": {"every_steps": 1, "keep": 5}})
    rd = base / "sweep" / "task-0"
    p = run(cfg, rd, stop_at=4)
    assert p.returncode != 0 and (rd / "stopped.json").exists(), show(p)
    (rd / ".lock").unlink(missing_ok=True)
    jobs.append(rd, "7", "submit", print)
    manifest = {"source": "x", "created": 0, "submissions": [{"jobs": ["7_0"], "time": 0}],
                "tasks": [{"index": 0, "overrides": {"optim.lr": "0.1"}, "run_dir": str(rd), "jobs": ["7_0"]}]}
    (rd.parent / "sweep.json").write_text(json.dumps(manifest))
    _trainer_checkpoint(rd)
    return rd.parent


def _trainer_checkpoint(rd: Path) -> None:
    """A Trainer's complete checkpoint-4 in rd/out, and keeper.json naming that directory (as
    hpc_train.huggingface writes it), for status's and ckpt's readers of them."""
    ck = rd / "out" / "checkpoint-4"
    ck.mkdir(parents=True)
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    (ck / "model.safetensors").write_bytes(safetensors_bytes())
    for name in ("rng_state_0.pth", "rng_state_1.pth"):
        (ck / name).write_bytes(torch_archive_bytes())
    keeper.write(rd, keeper.Keeper(keeper.TRAINER, rd / "out", 2))


def _places(rd: Path) -> list[str]:
    """The run directory's records, its checkpoints' records and files, and its sweep's index,
    relative to it."""
    step = sorted((rd / "checkpoints").glob("step-*"))[-1]
    data = sorted(p for p in step.iterdir() if p.name != "commit.json")[0]
    return ["config.yaml", "job.json", "requeue.json", "requeue.pending", "stopped.json", "result.json",
            "goodput.json", "metrics.jsonl", "logs/rank-0.log", "logs/rank-1.error",
            str(ranks.path(rd, 0).relative_to(rd)), str(ranks.path(rd, 1).relative_to(rd)),
            str((step / "commit.json").relative_to(rd)), str(data.relative_to(rd)),
            str(step.relative_to(rd)), str(step.parent.relative_to(rd) / "step-3" / "commit.json"),
            "../sweep.json", "keeper.json", "out/checkpoint-4/trainer_state.json", "out/checkpoint-4"]


DAMAGE = st.one_of(CONTENT, st.sampled_from(SPECIAL + ("victim-link",)))
# What Slurm answers each call: nothing known (a failed or silent command), or any text.
REPLY = st.one_of(st.just(slurm.Reply(None, "squeue failed: timeout")), st.text(max_size=80).map(slurm.Reply))


def _damage(rd: Path, place: str, damage: bytes | str, outside: Path) -> None:
    f = rd / place
    above = [rd / up for up in Path(place).parents if up != Path(".")]
    if any(a.is_symlink() or (a.exists() and not a.is_dir()) for a in above):
        return   # an earlier draw made a place above this one a file, a link or a FIFO: nothing below it
    if f.is_symlink() or f.is_file():
        f.unlink()
    elif f.is_dir():
        shutil.rmtree(f)
    f.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(damage, bytes):
        f.write_bytes(damage)
    elif damage == "victim-link":
        f.symlink_to(outside / "victim")
    else:
        make_special(f, damage, outside)


def _commands(sweep: Path, rd: Path, out: Path) -> list[list[str]]:
    return [["status", str(rd)], ["status", str(rd), "--goodput"], ["logs", str(rd)], ["logs", str(rd), "--rank", "1"],
            ["ckpt", "list", str(rd)], ["ckpt", "verify", str(rd)], ["ckpt", "export", str(rd), str(out), "--force"],
            ["cancel", str(rd)], ["sweep", "summary", str(sweep)], ["status", str(sweep)]]


def _check_said(err: str, argv: list[str]) -> None:
    assert "Traceback" not in err, (argv, err)
    assert all(len(line) < 2000 for line in err.splitlines()), (argv, err)


# ckpt export loads in this one process: DCP says so once per call (the CLI's own process too).
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data(), reply=REPLY)
def test_every_reading_command_takes_a_fuzzed_run_directory(real_run, tmp_path_factory, capsys, data, reply):
    work = tmp_path_factory.mktemp("case")
    sweep = work / "sweep"
    shutil.copytree(real_run, sweep, symlinks=True)
    rd = sweep / "task-0"
    (sweep / "sweep.json").write_text((real_run / "sweep.json").read_text().replace(str(real_run), str(sweep)))
    keeper.write(rd, keeper.Keeper(keeper.TRAINER, rd / "out", 2))
    outside = work / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious\n")
    places = data.draw(st.lists(st.sampled_from(_places(rd)), min_size=1, max_size=3, unique=True))
    for place in places:
        _damage(rd, place, data.draw(DAMAGE, label=place), outside)
    with mock.patch.object(slurm, "_call", return_value=reply):
        for argv in _commands(sweep, rd, work / "model.pt"):
            with within(20):
                code = main(argv)
            assert code in (0, 1, 2), (argv, code)
            _check_said(capsys.readouterr().err, argv)
        with within(20):
            msg, code, lines = hook.hook(rd, 1, env={"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0",
                                                     "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1"})
        assert isinstance(code, int) and "\n" not in msg and all(isinstance(x, str) for x in lines), (msg, lines)
    assert (outside / "victim").read_bytes() == b"precious\n"
