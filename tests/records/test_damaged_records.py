"""Issue 19 (round 3), the login side and the run directory's records: batch scripts rendered in
one pass, no write through a symlinked record, damaged records set aside instead of crashing a
resume or `status`, and an explicit `--resume PATH` that is honoured.

Real processes and files throughout: the real CLI in a subprocess, the rendered script run by a
real bash (with `srun`/`scontrol` as shell functions, as TorchX's tests do), tiny real runs.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from damage import SPECIAL, make_special
from helpers import hpc, show, write_config

# -- 1. batch scripts: one pass, no value scanned again ---------------------------------------

# A job name holding other placeholders' names: filled one after another, the config's YAML
# (whose values would run if they reached bash unquoted) landed in the script's comment line.
HOSTILE_NAME = "a{{config_yaml}}b{{run_dir}}c{{setup}}$(touch {m}name)"


def _prelude(script: str) -> str:
    """The script up to the training step's loop (see hpc_train.login.batch.Loop):
    directives, config heredoc, setup, exports."""
    head, sep, _ = script.partition("\nwhile :; do\n")
    assert sep, script
    return head + "\n"


def _run_bash(text: str, cwd: Path) -> subprocess.CompletedProcess:
    # srun/scontrol as shell functions: nothing in the prelude may reach them anyway.
    stubs = "srun() { :; }\nscontrol() { echo node1; }\n"
    return subprocess.run(["bash", "-c", stubs + text], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1"})


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_sbatch_script_is_rendered_in_one_pass_and_runs_nothing_it_was_given(tmp_path, launcher):
    m = tmp_path / "pwned-"
    rd = tmp_path / "run dir"
    out = tmp_path / "job.sbatch"
    name = HOSTILE_NAME.replace("{m}", str(m))
    root = f"$(touch {m}root)`touch {m}tick`"
    p = hpc("sbatch", "jobs/digits.yaml", "--launcher", launcher, "--run-dir", rd, "-o", out,
            "--set", f"job.name={name}", "--set", f"data.root={root}", "--set", "job.partition={{eof}}")
    assert p.returncode == 0, show(p)
    script = out.read_text()
    ran = _run_bash(_prelude(script), tmp_path)
    assert not list(tmp_path.glob("pwned-*")), (sorted(tmp_path.glob("pwned-*")), script)
    assert ran.returncode == 0, ran.stderr
    # The job name is one quoted word on its line, with the placeholder text still in it.
    line = next(ln for ln in script.splitlines() if ln.startswith("#SBATCH --job-name="))
    assert shlex.split(line.split("=", 1)[1]) == [name]
    # The config travelled through the heredoc unchanged (rank 0 checks it and writes config.yaml).
    import yaml
    written = yaml.safe_load((rd / "logs" / ".job-config-7.yaml").read_text())
    assert written["job"]["name"] == name and written["data"]["root"] == root


def test_submit_dry_run_quotes_what_it_was_given(tmp_path):
    """submitit renders the submit script; hostile values stay data there too."""
    m = tmp_path / "pwned-"
    rd = tmp_path / f"run $(touch {m}rd)"
    p = hpc("submit", "jobs/digits.yaml", "--dry-run", "--run-dir", rd, "--set",
            f"job.name={HOSTILE_NAME.replace('{m}', str(m))}", "--set", f"job.partition=p$(touch {m}part)",
            "--set", f"data.root=$(touch {m}root)")
    assert p.returncode == 0, show(p)
    ran = _run_bash(_prelude(p.stdout), tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert not list(tmp_path.glob("pwned-*")), p.stdout


# -- a tiny real run, stopped at step 4 with a checkpoint at every step -----------------------

@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> tuple[Path, Path]:
    """(config, run directory): 2 ranks stopped by a real SIGTERM at step 4 of 8, checkpoints
    step-1..4 kept. Tests copy the run directory; this one stays as it is."""
    from helpers import run
    base = tmp_path_factory.mktemp("stopped")
    cfg = write_config(base / "job.yaml", {"train": {"max_steps": 8}, "checkpoint": {"every_steps": 1, "keep": 5}})
    rd = base / "run"
    p = run(cfg, rd, stop_at=4)
    assert p.returncode != 0 and (rd / "stopped.json").exists(), show(p)
    assert [int(s.name[5:]) for s in sorted((rd / "checkpoints").glob("step-*"))] == [1, 2, 3, 4]
    return cfg, rd


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst, symlinks=True)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


def _training_steps(rd: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (rd / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


# -- 2. never write through a symlink in a run directory ----------------------------------------

def _victim(tmp_path: Path) -> tuple[Path, tuple[bytes, int]]:
    v = tmp_path / "victim.txt"
    v.write_bytes(b"precious\n")
    return v, (v.read_bytes(), v.stat().st_mtime_ns)


@pytest.mark.procs
def test_status_writes_nothing_through_a_symlinked_lock(tmp_path, stopped_run):
    rd = _copy(stopped_run[1], tmp_path / "run")
    victim, before = _victim(tmp_path)
    (rd / ".lock").symlink_to(victim)
    p = hpc("status", rd)
    assert p.returncode == 0 and "Traceback" not in p.stderr, show(p)
    assert "stopped at step 4" in p.stdout, show(p)
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before
    assert (rd / ".lock").is_symlink()


@pytest.mark.procs
def test_run_refuses_a_symlinked_lock_in_one_line(tmp_path, stopped_run):
    from helpers import one_line_exit2
    cfg, src = stopped_run
    rd = _copy(src, tmp_path / "run")
    victim, before = _victim(tmp_path)
    (rd / ".lock").symlink_to(victim)
    one_line_exit2(hpc("run", cfg, "--nproc", "2", "--run-dir", rd), f"{rd / '.lock'}", "symbolic link")
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before


@pytest.mark.parametrize("name", ["logs/rank-1.log", "metrics.jsonl"])
@pytest.mark.procs
def test_a_resume_never_appends_through_a_symlinked_log(tmp_path, stopped_run, name):
    cfg, src = stopped_run
    rd = _copy(src, tmp_path / "run")
    victim, before = _victim(tmp_path)
    (rd / name).unlink()
    (rd / name).symlink_to(victim)
    p = hpc("run", cfg, "--nproc", "2", "--run-dir", rd, "--set", "train.max_steps=6")
    assert "Traceback" not in p.stderr, show(p)
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before
    if name.startswith("logs/"):      # refused, naming the link
        assert p.returncode != 0 and f"{rd / name} is a symbolic link" in p.stderr, show(p)


# -- 20. an explicit --resume PATH is loaded, or refused in one line ----------------------------

@pytest.mark.procs
def test_resume_from_an_older_checkpoint_of_the_same_run_loads_that_one(tmp_path, stopped_run):
    cfg, src = stopped_run
    rd = _copy(src, tmp_path / "run")
    p = hpc("run", cfg, "--nproc", "2", "--run-dir", rd, "--resume", rd / "checkpoints" / "step-2",
            "--set", "train.max_steps=6")
    assert p.returncode == 0, show(p)
    assert "resuming from step 2" in p.stderr and f"resumed from step 2 ({rd / 'checkpoints' / 'step-2'})" in p.stderr, \
        show(p)
    # Steps 3 and 4 were trained again (once each in the record), then 5 and 6.
    assert _training_steps(rd) == [1, 2, 3, 4, 5, 6]
    # The newer saves it went back past were moved aside, not deleted.
    assert len(list((rd / "checkpoints").glob("step-4.skipped-*"))) == 1


@pytest.mark.procs
def test_an_explicit_resume_path_that_cannot_load_is_refused_not_replaced(tmp_path, stopped_run):
    from helpers import one_line_exit2, snapshot
    cfg, src = stopped_run
    rd = _copy(src, tmp_path / "run")
    step2 = rd / "checkpoints" / "step-2"
    rank0 = step2 / "rank-0.pt"
    rank0.write_bytes(rank0.read_bytes()[:-1] + bytes([rank0.read_bytes()[-1] ^ 1]))   # one bit flipped
    before = snapshot(rd)
    one_line_exit2(hpc("run", cfg, "--nproc", "2", "--run-dir", rd, "--resume", step2), f"--resume {step2}",
                   "damaged")
    one_line_exit2(hpc("run", cfg, "--nproc", "2", "--run-dir", rd, "--resume", rd / "checkpoints" / "step-9"),
                   "step-9", "no such checkpoint")
    assert snapshot(rd) == before


@pytest.mark.procs
def test_a_requeued_job_resumes_from_its_own_newest_not_the_explicit_path(stopped_run):
    """Under Slurm the batch script still names PATH when the job is requeued: a restart (restart
    count > 0) goes on from the run directory's own newest save, never back to PATH."""
    from hpc_train.ckpt import store
    rd = stopped_run[1]
    step2 = rd / "checkpoints" / "step-2"
    assert store.plan(rd, str(step2)).source.step == 2
    assert store.plan(rd, str(step2), requeued=True).source.step == 4


# -- 14/15. damaged records: set aside or named, never a traceback ------------------------------

RECORDS = ("requeue.json", "stopped.json", "goodput.json", "job.json", "metrics.jsonl", "logs/rank-0.log")
WRONG_FIELDS = {
    "requeue.json": {"counts": {"preemption": "x"}, "events": 3},
    "stopped.json": {"steps": "x", "stop_signal": 5, "checkpoint": "yes"},
    "goodput.json": {"segments": [1, {"start": "x", "end": None}], "first_submit": "y"},
    "job.json": {"jobs": [{"job_id": 5}, "x"]},
}
# metrics.jsonl's kind of wrong fields: lines that parse but are not records, and values that
# are not numbers, after the real records.
BAD_METRIC_LINES = b'[]\n{"step": "x"}\n3\n{"loss": 1.5}\n{"step": 4, "loss": null}\n{"step": 4, "loss": "x"}\n'
DAMAGES = ("not-json", "wrong-type", "wrong-fields", "binary", "empty", "directory")
# Not a regular file: a rerun's restore sets it aside like any damage (issue 50).
SPECIAL_DAMAGES = ("fifo", "device", "dangling-symlink")


def _damage(rd: Path, record: str, damage: str) -> None:
    path = rd / record
    if path.is_dir():
        import shutil
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if damage in SPECIAL:
        make_special(path, damage, Path(str(rd) + ".src"))
        return
    data = {"not-json": b"{not json\n", "wrong-type": b"[1, 2]\n", "binary": b"\x00\xff\xfe\x80\x9c garbage\n",
            "empty": b""}.get(damage)
    if damage == "wrong-fields":
        if record == "metrics.jsonl":
            data = (Path(str(rd) + ".src") / record).read_bytes() + BAD_METRIC_LINES
        else:
            data = json.dumps(WRONG_FIELDS.get(record, [1])).encode()
    path.write_bytes(data)


@pytest.fixture
def damaged(tmp_path, stopped_run, request):
    record, damage = request.param
    rd = _copy(stopped_run[1], tmp_path / "run")
    os.symlink(stopped_run[1], str(rd) + ".src")
    _damage(rd, record, damage)
    return stopped_run[0], rd, record, damage


CASES = [(r, d) for r in RECORDS for d in DAMAGES]


@pytest.mark.parametrize("damaged", CASES, indirect=True, ids=[f"{r}-{d}" for r, d in CASES])
@pytest.mark.procs
def test_status_and_logs_show_what_they_can_and_name_what_they_cannot(damaged):
    _, rd, record, damage = damaged
    st = hpc("status", rd)
    assert st.returncode == 0 and "Traceback" not in st.stderr, show(st)
    assert str(rd) in st.stdout
    if record != "logs/rank-0.log" and not (record == "metrics.jsonl" and damage == "empty"):
        assert f"could not read: {record}" in st.stdout, show(st)
    if record != "metrics.jsonl":
        assert "last step 4" in st.stdout, show(st)     # what is intact is still shown
    lg = hpc("logs", rd)
    assert "Traceback" not in lg.stderr, show(lg)
    if record == "logs/rank-0.log" and damage == "directory":
        from helpers import one_line_exit2
        one_line_exit2(lg, str(rd / record), "directory")
    else:
        assert lg.returncode == 0, show(lg)


@pytest.mark.parametrize("damage", DAMAGES + SPECIAL_DAMAGES)
@pytest.mark.procs
def test_a_resume_sets_damaged_records_aside_and_trains_on(tmp_path, stopped_run, damage):
    """One real resume per kind of damage, with every record a resume reads damaged that way."""
    cfg, src = stopped_run
    rd = _copy(src, tmp_path / "run")
    os.symlink(src, str(rd) + ".src")
    records = ("goodput.json", "metrics.jsonl", "job.json", "stopped.json")
    for record in records:
        _damage(rd, record, damage)
    p = hpc("run", cfg, "--nproc", "2", "--run-dir", rd, "--set", "train.max_steps=6")
    assert p.returncode == 0 and "Traceback" not in p.stderr, show(p)
    assert "resuming from step 4" in p.stderr and (rd / "result.json").exists(), show(p)
    assert _training_steps(rd)[-2:] == [5, 6]
    for record in ("goodput.json", "metrics.jsonl"):
        if record == "metrics.jsonl" and damage == "empty":
            continue     # an empty metrics file is no damage
        # Set aside (kept, not deleted) with one warning naming it; a new one is written.
        assert len(list(rd.glob(f"{record}.damaged-*"))) == 1, sorted(os.listdir(rd))
        assert sum(f"{rd / record}" in line and "WARNING" in line for line in p.stderr.splitlines()) == 1, show(p)
    assert json.loads((rd / "goodput.json").read_text())["segments"]


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.procs
def test_sweep_summary_and_status_take_damaged_files(tmp_path, stopped_run, damage):
    """A task's damaged records are read as far as they go; a damaged sweep.json (the sweep's
    index: nothing can be listed without it) is one line, exit 2."""
    from helpers import one_line_exit2
    src = stopped_run[1]
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    rd = _copy(src, sweep / "task-0")
    os.symlink(src, str(rd) + ".src")
    for record in ("metrics.jsonl", "result.json", "job.json"):
        _damage(rd, record, damage)
    manifest = {"source": "x", "created": 0, "submissions": [{"jobs": ["7_0"], "time": 0}],
                "tasks": [{"index": 0, "overrides": {"optim.lr": "0.1"}, "run_dir": str(rd), "jobs": ["7_0"]}]}
    (sweep / "sweep.json").write_text(json.dumps(manifest))
    p = hpc("sweep", "summary", sweep)
    assert p.returncode == 0 and "Traceback" not in p.stderr, show(p)
    _damage(sweep, "sweep.json", damage)
    for argv in (("sweep", "summary", sweep), ("status", sweep)):
        one_line_exit2(hpc(*argv), str(sweep / "sweep.json"))
