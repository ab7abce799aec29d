"""Bad input: exit code 2, exactly one line on stderr that names the field or flag, no traceback,
and nothing written.

Each case runs the real command in a subprocess. "Nothing written" is checked on the whole
temporary directory the case works in (its run directory must not appear) and, for a run
directory that already exists, on every file in it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

FILES = {
    "malformed.yaml": "optim:\n  lr: [0.1, 0.2\n",
    "list.yaml": "- optim\n- data\n",
    "unknown.yaml": "data:\n  batchsize: 8\n",
    "wrongtype.yaml": "data:\n  batch_size: big\n",
    # Nine levels of nine aliases: 9**9 strings once expanded ("billion laughs").
    "bomb.yaml": 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
        f"{x}: &{x} [{', '.join([f'*{p}'] * 9)}]\n" for p, x in zip("abcdefgh", "bcdefghi")),
    "dup.yaml": "optim:\n  lr: 0.1\n  lr: 0.2\n",
    "latin1.yaml": b"job:\n  name: caf\xe9\n",
    "ctrl.yaml": "job:\n  name: a\x07b\n",
    "deep.yaml": "job:\n  setup: " + "[" * 3000 + "]" * 3000 + "\n",
    "sexagesimal.yaml": "job:\n  signal_lead: 1:30\n",
}

# (id, argv, extra environment, substrings the one line must contain). {tmp} and {run} are
# filled in per test: the case's temporary directory and a run directory inside it.
RUN = ("run", "jobs/digits.yaml", "--run-dir", "{run}")
CASES = [
    ("missing-config-file", ("run", "{tmp}/nope.yaml", "--run-dir", "{run}"), {}, ("config file not found", "nope.yaml")),
    ("config-is-a-directory", ("run", "{tmp}", "--run-dir", "{run}"), {}, ("is a directory", "YAML file")),
    ("config-is-a-directory-config", ("config", "{tmp}"), {}, ("is a directory",)),
    ("config-path-too-long", ("config", "{tmp}/" + "a" * 5000), {}, ("cannot read", "File name too long")),
    ("config-not-utf8", ("run", "{tmp}/latin1.yaml", "--run-dir", "{run}"), {},
     ("latin1.yaml", "not UTF-8", "0xe9", "line 2")),
    ("control-character-in-file", ("config", "{tmp}/ctrl.yaml"), {}, ("ctrl.yaml", "line 2", "U+0007")),
    ("alias-bomb", ("run", "{tmp}/bomb.yaml", "--run-dir", "{run}"), {}, ("bomb.yaml", "alias *a", "not allowed")),
    ("alias-bomb-config", ("config", "{tmp}/bomb.yaml"), {}, ("bomb.yaml", "alias *a")),
    ("duplicate-key", ("run", "{tmp}/dup.yaml", "--run-dir", "{run}"), {},
     ("dup.yaml", "duplicate key 'lr'", "line 3", "first at line 2")),
    ("deeply-nested-yaml", ("run", "{tmp}/deep.yaml", "--run-dir", "{run}"), {}, ("deep.yaml", "nested deeper")),
    ("int-field-sexagesimal-in-file", ("run", "{tmp}/sexagesimal.yaml", "--run-dir", "{run}"), {},
     ("job.signal_lead", "'1:30'", "decimal digits")),
    ("int-field-underscore", (*RUN, "--set", "optim.warmup_steps=1_000"), {},
     ("optim.warmup_steps", "'1_000'", "decimal digits")),
    ("malformed-yaml", ("run", "{tmp}/malformed.yaml", "--run-dir", "{run}"), {}, ("not valid YAML", "line")),
    ("yaml-not-a-mapping", ("run", "{tmp}/list.yaml", "--run-dir", "{run}"), {}, ("mapping",)),
    ("unknown-key", (*RUN, "--set", "optim.lrr=0.1"), {}, ("optim.lrr", "did you mean 'lr'", "valid keys")),
    ("unknown-key-in-file", ("run", "{tmp}/unknown.yaml", "--run-dir", "{run}"), {},
     ("data.batchsize", "did you mean 'batch_size'")),
    ("unknown-section", (*RUN, "--set", "optimizer.lr=0.1"), {}, ("optimizer", "did you mean 'optim'")),
    ("wrong-type", (*RUN, "--set", "data.batch_size=abc"), {}, ("data.batch_size", "integer")),
    ("wrong-type-in-file", ("run", "{tmp}/wrongtype.yaml", "--run-dir", "{run}"), {}, ("data.batch_size",)),
    ("out-of-range", (*RUN, "--set", "data.test_fraction=0.95"), {}, ("data.test_fraction", "<= 0.9")),
    ("bad-set-syntax-no-equals", (*RUN, "--set", "optim.lr"), {}, ("--set", "section.key=value")),
    ("bad-set-syntax-no-key", (*RUN, "--set", "=0.1"), {}, ("--set",)),
    ("set-empty", (*RUN, "--set", ""), {}, ("--set", "section.key=value")),
    ("set-three-parts", (*RUN, "--set", "a.b.c=1"), {}, ("--set", "section.key=value", "'a.b.c=1'")),
    ("set-top-level-as-section", (*RUN, "--set", "seed.x=1"), {}, ("'seed' is a top-level key", "--set seed=VALUE")),
    ("set-section-to-a-scalar", (*RUN, "--set", "optim=1"), {}, ("section 'optim'", "--set optim.KEY=VALUE")),
    ("set-huge-value", (*RUN, "--set", "data.batch_size=" + "x" * 100_000), {}, ("data.batch_size", "characters)")),
    ("set-unicode-digits", (*RUN, "--set", "seed=١٢"), {}, ("seed", "'١٢'", "decimal digits")),
    ("set-alias", (*RUN, "--set", "job.setup=[*a]"), {}, ("--set job.setup", "alias *a")),
    ("unknown-model", (*RUN, "--set", "model.name=resnet"), {}, ("model.name", "convnet")),
    ("unknown-dataset", (*RUN, "--set", "data.name=imagenet"), {}, ("data.name", "digits")),
    ("import-path-module-missing", (*RUN, "--set", "model.name=no_such_pkg_hpc.models:build"), {},
     ("model.name", "no_such_pkg_hpc")),
    ("import-path-attribute-missing", (*RUN, "--set", "data.name=tests.plugins_for_tests:no_such_builder"), {},
     ("data.name", "no_such_builder")),
    ("train-fn-does-not-resolve", (*RUN, "--set", "train.fn=json:no_such_fn"), {}, ("train.fn", "no_such_fn")),
    ("import-path-malformed", (*RUN, "--set", "train.fn=not a path"), {}, ("train.fn", "import path")),
    ("nproc-0", (*RUN, "--nproc", "0"), {}, ("--nproc",)),
    ("nproc-not-a-number", (*RUN, "--nproc", "two"), {}, ("--nproc",)),
    ("negative-batch-size", (*RUN, "--set", "data.batch_size=-4"), {}, ("data.batch_size", ">= 1")),
    ("nothing-to-train", (*RUN, "--set", "train.epochs=0", "--set", "train.max_steps=0"), {},
     ("train.epochs", "train.max_steps")),
    ("nccl-without-gpus", (*RUN, "--set", "dist.backend=nccl"), {}, ("dist.backend=nccl", "gloo")),
    ("bad-log-level", (*RUN, "--set", "log.level=VERBOSE"), {}, ("log.level", "INFO")),
    ("resume-path-missing", (*RUN, "--resume", "/does/not/exist"), {}, ("--resume", "/does/not/exist")),
    ("run-bad-master-port", RUN, {"MASTER_PORT": "abc"}, ("MASTER_PORT",)),
    ("unknown-flag", (*RUN, "--nprocs", "2"), {}, ("--nprocs",)),
    ("unknown-command", ("train", "jobs/digits.yaml"), {}, ("invalid choice", "train")),
    ("ckpt-list-nonexistent", ("ckpt", "list", "/nonexistent/run"), {}, ("ckpt", "/nonexistent/run")),
    ("env-master-port-not-a-number", ("env",), {"MASTER_PORT": "abc"}, ("MASTER_PORT", "abc")),
    ("env-master-port-privileged", ("env", "--json"), {"MASTER_PORT": "80"}, ("MASTER_PORT", "1024")),
]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in root.rglob("*")}


@pytest.mark.parametrize("argv,extra_env,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(run_cli, clean_env, tmp_path, argv, extra_env, needles):
    if "dist.backend=nccl" in argv:
        torch = pytest.importorskip("torch")
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA devices: nccl is valid here")
    for name, text in FILES.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    run_dir = tmp_path / "run"
    before = snapshot(tmp_path)
    r = run_cli(*(a.format(tmp=tmp_path, run=run_dir) for a in argv), env=clean_env(**extra_env), timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and len(lines[0]) < 400, r.stderr[:1000]
    missing = [n for n in needles if n not in lines[0]]
    assert not missing, f"{lines[0]!r} lacks {missing}"
    assert r.stdout == ""
    assert not run_dir.exists()
    assert snapshot(tmp_path) == before


def test_an_existing_run_directory_is_left_unchanged(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("seed: 1\n")
    (run_dir / "logs" / "rank-0.log").write_text("an earlier run\n")
    before = snapshot(tmp_path)
    for bad in (("--set", "optim.lr=oops"), ("--nproc", "0"), ("--set", "model.name=nope.mod:fn")):
        r = run_cli("run", "jobs/digits.yaml", "--run-dir", run_dir, *bad)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert snapshot(tmp_path) == before


# Values that `config` accepted although they break a run later (a timedelta overflow, numpy's
# seed range, sbatch --signal's limit, NaN through the optimizer): both commands refuse them the
# same way, because both go through config.load.
SAME_FOR_BOTH = ["dist.timeout_s=1e15", "dist.init_timeout_s=1e9", "seed=1e23", "seed=4294967296",
                 "optim.lr=.nan", "optim.momentum=.inf", "checkpoint.every_seconds=1e9", "job.signal_lead=70000"]


@pytest.mark.parametrize("item", SAME_FOR_BOTH)
def test_config_and_run_refuse_alike(run_cli, tmp_path, item):
    run_dir = tmp_path / "run"
    field = item.partition("=")[0]
    stderr = {}
    for argv in (("config", "jobs/digits.yaml"), ("run", "jobs/digits.yaml", "--run-dir", run_dir)):
        r = run_cli(*argv, "--set", item)
        assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.splitlines()) == 1 and f"{field} must be" in r.stderr, r.stderr
        stderr[argv[0]] = r.stderr
    assert stderr["config"] == stderr["run"]
    assert not run_dir.exists()


@pytest.mark.parametrize("pending", ['{"target":', "[]", '{"cause": "preemption"}'])
def test_requeue_hook_survives_a_damaged_request(run_cli, clean_env, tmp_path, pending):
    """The batch shell's hook with a damaged requeue.pending (written atomically, so only outside
    hands do this): one line, no traceback, and it tries to requeue its own job, not nothing.
    No scontrol on PATH here (no cluster in this test), so the requeue itself fails, cleanly."""
    (tmp_path / "requeue.pending").write_text(pending)
    env = clean_env(SLURM_JOB_ID="4242", PATH="/usr/bin:/bin")
    r = run_cli("requeue-hook", tmp_path, "0", env=env, timeout=60)
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "NOT requeued" in lines[0] and "scontrol" in lines[0], r.stderr
    assert r.returncode == 3, r.stderr          # requeue.UNFINISHED: stopped and not requeued
    assert not (tmp_path / "requeue.pending").exists()
