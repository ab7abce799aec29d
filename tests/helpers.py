"""The tests' shared helpers (fixtures are in tests/conftest.py): real `python -m hpc_train` processes
on real disk, checkpoints read and damaged as an attacker or a bad disk would, the no-torch probe.

Nothing here is a mock. Runs are started exactly as a user starts them (``run CONFIG --nproc N
--run-dir D --set ...``); the only test-only mechanism is ``HPC_TRAIN_TEST_STOP_AT_STEP`` (see
tests/plugins_for_tests.py: a model plug-in), which makes rank 0 send a real SIGTERM to the ``run`` launcher at a chosen
step, so the real signal path (launcher -> every rank -> agreed stop -> save) is exercised at a
deterministic step instead of racing a log line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]

# Small, fast and still meaningful: dropout > 0 so the RNG state matters, real shuffling.
BASE: dict[str, Any] = {
    "seed": 3,
    "data": {"name": "synthetic", "synthetic_size": 512, "batch_size": 16, "num_workers": 0},
    "model": {"name": "tests.plugins_for_tests:stoppable_mlp", "hidden": 32, "dropout": 0.25},
    "optim": {"name": "adam", "lr": 3e-3, "schedule": "cosine", "warmup_steps": 3, "grad_clip": 1.0},
    "train": {"max_steps": 12, "log_every": 1, "eval": False},
    "checkpoint": {"every_steps": 5, "keep": 2},
    "log": {"tensorboard": False, "progress": "lines"},
}


def merge(base: dict, over: dict) -> dict:
    out = json.loads(json.dumps(base))
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def write_config(path: Path, over: dict | None = None) -> Path:
    path.write_text(yaml.safe_dump(merge(BASE, over or {})))
    return path


_LAUNCH_VARS = ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without Slurm, torchrun or launcher variables (the tests may run inside a job)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "HPC_TRAIN_", "TORCHELASTIC_")) and k not in _LAUNCH_VARS}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def hpc(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m hpc_train ARGS`` in a fresh process; output captured. ``timeout`` only guards
    against a hang (a run here takes seconds); on expiry the workers, which live in their own
    sessions, are killed too, so nothing is left behind."""
    p = subprocess.Popen([sys.executable, "-m", "hpc_train", *map(str, args)], cwd=REPO, env=env or clean_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = _stacks_of_hung_run(p.pid, [str(a) for a in args])
        kill9_workers(p.pid)
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"hung: {' '.join(map(str, args))} still running after {timeout}s; killed.\n"
                             f"{err[-6000:]}\n{stacks}") from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _stacks_of_hung_run(launcher_pid: int, args: list[str]) -> str:
    """Before a hung run is killed: every worker and its data-loader processes (its process
    group) write their Python stacks to the rank log (hpc_train's stack-dump signal; a forked
    loader worker inherits its handler and file). Returns the logs' tails, for the failure
    message: a temporary directory may be gone before anyone reads it."""
    from hpc_train.node.watchdog import DUMP_SIGNAL
    for pid in children(launcher_pid):
        try:
            os.killpg(pid, DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    time.sleep(3)
    if "--run-dir" not in args:
        return ""
    logs = sorted((Path(args[args.index("--run-dir") + 1]) / "logs").glob("rank-*.log"))
    return "\n".join(f"--- {f.name}, its last lines:\n{f.read_text(errors='replace')[-5000:]}" for f in logs)


def run(config: Path, run_dir: Path, *, nproc: int = 2, stop_at: str | int | None = None, resume: str | None = None,
        sets: tuple[str, ...] = (), timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m hpc_train run CONFIG --nproc N --run-dir D``; ``stop_at`` delivers a real SIGTERM to it
    at that step ("K" or "K:M": after micro-batch M of step K)."""
    args = ["run", str(config), "--nproc", str(nproc), "--run-dir", str(run_dir)]
    if resume is not None:
        args += ["--resume", resume]
    for s in sets:
        args += ["--set", s]
    env = clean_env(**({"HPC_TRAIN_TEST_STOP_AT_STEP": str(stop_at)} if stop_at is not None else {}))
    return hpc(*args, env=env, timeout=timeout)


def show(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-6000:]}"


def steps(run_dir: Path) -> list[int]:
    """Step directories present, newest first (complete or not)."""
    root = Path(run_dir) / "checkpoints"
    return sorted((int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit()), reverse=True)


def metric_lines(run_dir: Path) -> list[str]:
    """The lines of ``metrics.jsonl`` that are whole: rank 0 flushes the file on a clock and a
    full buffer goes out whole, so a file read while its run trains (or after a kill) may end
    inside a line. Every line before the last newline must parse."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    return text[:text.rfind("\n") + 1].splitlines()


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl; fails if a training step appears more than once."""
    out: dict[int, float] = {}
    for line in metric_lines(run_dir):
        rec = json.loads(line)
        if "loss" in rec:
            assert rec["step"] not in out, f"step {rec['step']} appears twice in metrics.jsonl"
            out[rec["step"]] = rec["loss"]
    return out


def export(run_dir: Path, out: Path, step: int | None = None) -> dict:
    """``ckpt export`` in a fresh process, then plain ``torch.load(weights_only=True)``."""
    import torch
    p = hpc("ckpt", "export", run_dir, out, *(["--step", str(step)] if step is not None else []))
    assert p.returncode == 0, show(p)
    return torch.load(out, weights_only=True)


def assert_same_weights(a: dict, b: dict) -> None:
    import torch
    assert sorted(a) == sorted(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"tensors not bitwise equal: {differ}"


def crc32c(data: bytes) -> str:
    """CRC32C by google-crc32c, independent of hpc_train's own checksum code: a check against it
    still fails if hpc_train's checksums were all the same (e.g. all zero)."""
    import google_crc32c
    return f"{google_crc32c.value(data):08x}"


def intact(path: Path) -> bool:
    """Whether every file a step directory's commit record lists has the recorded size and the
    recorded CRC32C, judged by :func:`crc32c`, not by hpc_train's verify."""
    try:
        rec = json.loads((Path(path) / "commit.json").read_text())
        return all((Path(path) / n).stat().st_size == size and crc32c((Path(path) / n).read_bytes()) ==
                   rec["checksums"]["files"][n] for n, size in rec["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def rank_records(run_dir: Path) -> dict[str, bytes]:
    """Every rank's record of a run directory (``logs/.heartbeat/rank-R``), as bytes: what a
    process refused by its lock must leave as it was."""
    return {p.name: p.read_bytes() for p in (Path(run_dir) / "logs" / ".heartbeat").glob("rank-*")}


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime_ns) of every file under root, but the run directory's lock
    (`.lock`: every command that may touch the directory takes it first and writes its own pid
    there) and the heartbeats (`logs/.heartbeat/`), which are liveness, not data."""
    root = Path(root)
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock" and ".heartbeat" not in p.parts}


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid ...; comm may contain spaces, so split after the last ')'
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def kill9_workers(launcher_pid: int) -> list[int]:
    """SIGKILL every worker of a `run` launcher, each with its process group (its loader workers)."""
    pids = children(launcher_pid)
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)   # workers are session leaders (start_new_session=True)
        except ProcessLookupError:
            pass
    return pids


def load_full(path: Path) -> dict[str, Any]:
    """Load *everything* in a checkpoint (model, optimizer, schedule, progress) in this process,
    through hpc_train's safe reader, as resume does; returns the flat state."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hpc_train.ckpt.safe import SafePlanner, SafeReader
    unset = object()
    meta = SafeReader(str(path)).read_metadata()
    state: dict[str, Any] = {}
    for fqn, md in meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            state[fqn] = unset
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=True)
    missing = [k for k, v in state.items() if v is unset]
    assert not missing, f"{path}: items not loaded: {missing}"
    for r in range(int(json.loads((Path(path) / "commit.json").read_text())["world_size"])):
        torch.load(Path(path) / f"rank-{r}.pt", weights_only=True)
    # The replicated non-DCP entries (schedule, progress, step) under "app.<key>".
    for k, v in torch.load(Path(path) / "app.pt", weights_only=True).items():
        state[f"app.{k}"] = v
    return state


def tb_scalar_steps(run_dir: Path, tag: str = "train/loss") -> tuple[list[int], list[int]]:
    """Steps of ``tag`` as TensorBoard shows them (EventAccumulator, default purging), and as
    written, honouring only the writer's own purge markers (a SessionLog START at the purge step:
    what SummaryWriter(purge_step=...) writes). The second catches doubled segments that
    TensorBoard's out-of-order heuristics would otherwise hide."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog

    tb = Path(run_dir) / "tb"
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    shown = [e.step for e in acc.Scalars(tag)]
    written: list[int] = []
    for f in sorted(tb.glob("events.out.tfevents.*")):
        for ev in EventFileLoader(str(f)).Load():
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                written = [s for s in written if s < ev.step]
            for v in ev.summary.value:
                if v.tag == tag:
                    written.append(ev.step)
    return shown, written


def start(*args, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m hpc_train ARGS`` in the background, output captured."""
    return subprocess.Popen([sys.executable, "-m", "hpc_train", *map(str, args)], cwd=REPO, env=env or clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_when(p: subprocess.Popen, path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """SIGTERM to the launcher once ``path`` exists; then wait for it to exit."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert p.poll() is None, f"ended before {path} appeared:\n{p.communicate()[1][-4000:]}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def one_line_exit2(p: subprocess.CompletedProcess, *needles: str) -> str:
    """Bad input's contract: exit 2, no traceback, exactly one line on stderr, naming ``needles``."""
    assert p.returncode == 2, show(p)
    assert "Traceback" not in p.stderr, show(p)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, show(p)
    for n in needles:
        assert n in lines[0], show(p)
    return lines[0]


def plant(ck, name: str, payload: bytes) -> None:
    """Replace one file of a checkpoint and update its commit record to match (size and checksum),
    as an attacker would: the checksums guard against rot, safe loading against this."""
    from hpc_train.ckpt import store
    (ck / name).write_bytes(payload)
    rec = json.loads((ck / "commit.json").read_text())
    rec["files"][name] = len(payload)
    rec["checksums"]["files"][name] = store.file_checksum(ck / name)
    (ck / "commit.json").write_text(json.dumps(rec))


# Runs `python -m hpc_train ARGS` exactly as the command line does (runpy), then records what was
# imported, whatever the exit: --help exits through SystemExit, errors return 2.
PROBE = r"""
import json, runpy, sys
out, args, preload = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
if preload:
    __import__(preload)                  # the control case: proves the probe sees an import
sys.argv = ["python -m hpc_train", *args]
code = 0
try:
    runpy.run_module("hpc_train", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchvision", "torchdata", "tensorboard"))
open(out, "w").write(json.dumps({"code": code, "heavy": heavy}))
"""


def probe(py: str, env: dict, tmp_path: Path, args: list[str], preload: str = "") -> dict:
    """``python -m hpc_train ARGS`` in a fresh interpreter: its exit code and the torch-side modules it
    had loaded (``heavy``), with its output."""
    out = tmp_path / "probe.json"
    r = subprocess.run([py, "-c", PROBE, str(out), json.dumps(args), preload], env=env,
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.exists(), f"probe did not finish: {r.stderr}"
    return {**json.loads(out.read_text()), "stdout": r.stdout, "stderr": r.stderr}


# The columns of docs/faults.md's exit-code table, by what names each path in its header.
EXIT_COLUMNS = {"run": "`run`", "worker": "a worker process", "python": "`python train.py`",
                "torchrun": "`torchrun train.py`", "slurm": "a Slurm job"}


def documented_exit(outcome: str, path: str) -> int:
    """The exit code docs/faults.md documents for ``outcome`` (the first word of its row:
    finished, stopped, refused, failed) on ``path`` (a key of :data:`EXIT_COLUMNS`): the first
    number in that cell. The tests that measure exit codes read them here, so that the page and
    the code cannot drift apart."""
    import re
    text = (REPO / "docs" / "faults.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in section.splitlines()
            if ln.startswith("| ")]
    header, body = rows[0], rows[1:]
    column = next(i for i, h in enumerate(header) if h.startswith(EXIT_COLUMNS[path]))
    row = next(r for r in body if r[0].split()[0] == outcome)
    return int(re.search(r"\d+", row[column]).group())


def safetensors_bytes(nbytes: int = 4) -> bytes:
    """A .safetensors file as the format lays it out: the header's length, the header, the data
    (a Trainer checkpoint's weights, for the readers that judge one whole or cut off)."""
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    return len(header).to_bytes(8, "little") + header + bytes(nbytes)


def torch_archive_bytes() -> bytes:
    """A torch.save file's layout: a zip archive, its directory written last (a Trainer
    checkpoint's RNG states and optimizer)."""
    import io
    import zipfile
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    return buf.getvalue()
