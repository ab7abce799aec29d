"""Config: precedence, the resolved config (printed and written), and errors that name the field.

Precedence, lowest to highest: defaults < YAML file < each ``--set`` in order < dedicated flags.
Most cases call :func:`hpc_train.config.load` directly (fast); the command-line paths run the
real CLI.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from hpc_train import config
from hpc_train.errors import UsageError

DIGITS = str(Path(__file__).resolve().parents[1] / "jobs" / "digits.yaml")


@pytest.fixture
def job_file(tmp_path):
    def write(text: str):
        p = tmp_path / "job.yaml"
        p.write_text(text)
        return p
    return write


# -- precedence -------------------------------------------------------------------------------------
def test_defaults_then_yaml_then_set_then_flags(job_file):
    assert config.load(None).optim.lr == 1e-3                                       # default
    f = job_file("optim: {lr: 0.003, name: sgd}\ndata: {batch_size: 16}\nrun_dir: from-yaml\n")
    assert config.load(f).optim.lr == 0.003                                          # YAML over default
    cfg = config.load(f, ["optim.lr=0.01"])
    assert (cfg.optim.lr, cfg.optim.name, cfg.data.batch_size) == (0.01, "sgd", 16)  # --set over YAML only
    assert config.load(f, ["optim.lr=0.01", "optim.lr=0.02"]).optim.lr == 0.02     # later --set wins
    assert config.load(f, ["optim.lr=0.02", "optim.lr=0.01"]).optim.lr == 0.01
    cfg = config.load(f, ["run_dir=from-set"], {"run_dir": "from-flag"})
    assert cfg.run_dir == "from-flag"                                                # flag over --set
    assert config.load(f, ["run_dir=from-set"]).run_dir == "from-set"
    assert config.load(f).run_dir == "from-yaml"


def test_precedence_through_the_command(run_cli):
    r = run_cli("config", "jobs/digits.yaml", "--set", "optim.lr=0.5", "--set", "run_dir=/from/set",
                "--set", "optim.lr=0.25", "--run-dir", "/from/flag")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["optim"]["lr"] == 0.25 and cfg["run_dir"] == "/from/flag"
    assert cfg["optim"]["warmup_steps"] == 20            # from jobs/digits.yaml
    assert cfg["optim"]["momentum"] == 0.9               # a default the file does not set


def test_set_of_a_top_level_key():
    assert config.load(DIGITS, ["seed=3"]).seed == 3
    with pytest.raises(UsageError, match="seed"):
        config.load(DIGITS, ["seed=-1"])


def test_set_values_are_parsed_as_yaml_and_coerced():
    cfg = config.load(None, ["optim.lr=1", "train.eval=false", "job.name=123", "optim.lr=1e-3",
                             "job.setup=[module load cuda, echo hi]"])
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)   # '1e-3' is a string to YAML 1.1
    assert cfg.train.eval is False and cfg.job.name == "123"
    assert cfg.job.setup == ["module load cuda", "echo hi"]
    assert config.load(None, ["optim.lr=2"]).optim.lr == 2.0


def test_exponent_floats_in_yaml_files(job_file):
    assert config.load(job_file("optim:\n  lr: 1e-3\n  weight_decay: 5E-4\n")).optim.weight_decay == 5e-4


def test_import_paths_are_accepted_for_plugin_fields():
    cfg = config.load(None, ["model.name=mypkg.models:build", "data.name=mypkg.data:build",
                             "train.fn=mypkg.train:main"])
    assert (cfg.model.name, cfg.data.name, cfg.train.fn) == ("mypkg.models:build", "mypkg.data:build",
                                                             "mypkg.train:main")


# -- the resolved config ----------------------------------------------------------------------------
def test_config_command_prints_yaml_that_round_trips(run_cli, tmp_path):
    r = run_cli("config", "jobs/digits.yaml", "--set", "optim.lr=0.01", "--set", "seed=7")
    assert r.returncode == 0, r.stderr
    printed = yaml.safe_load(r.stdout)
    assert printed == config.load(DIGITS, ["optim.lr=0.01", "seed=7"]).to_dict()
    # Feeding the printed config back in changes nothing.
    again = tmp_path / "resolved.yaml"
    again.write_text(r.stdout)
    r2 = run_cli("config", again)
    assert r2.returncode == 0 and r2.stdout == r.stdout
    assert config.from_dict(printed) == config.load(again)


def test_every_field_is_printed(run_cli):
    printed = yaml.safe_load(run_cli("config", "jobs/digits.yaml").stdout)
    want = config.Config().to_dict()
    assert printed.keys() == want.keys()
    for section, body in want.items():
        if isinstance(body, dict):
            assert printed[section].keys() == body.keys(), section


def test_run_writes_the_resolved_config(run_cli, run_dir, smoke):
    sets = (*smoke, "--set", "train.max_steps=2", "--set", "log.tensorboard=false", "--set", "optim.lr=0.02")
    r = run_cli("run", "jobs/digits.yaml", "--nproc", "1", "--run-dir", run_dir, *sets)
    assert r.returncode == 0, r.stderr
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    expected = yaml.safe_load(run_cli("config", "jobs/digits.yaml", *sets).stdout)
    assert written["run_dir"] == str(run_dir.absolute())
    written.pop("run_dir"), expected.pop("run_dir")
    assert written == expected and written["optim"]["lr"] == 0.02 and written["model"]["name"] == "linear"


def test_digest_ignores_where_and_how_it_runs():
    a = config.load(DIGITS)
    b = config.load(DIGITS, ["run_dir=elsewhere", "job.nodes=4", "log.level=DEBUG",
                                         "data.num_workers=2"])
    assert a.digest() == b.digest()
    assert a.digest() != config.load(DIGITS, ["optim.lr=0.5"]).digest()


# -- errors -----------------------------------------------------------------------------------------
def test_unknown_key_lists_valid_keys_and_closest_match():
    with pytest.raises(UsageError) as e:
        config.load(None, ["optim.lrr=0.1"])
    msg = str(e.value)
    assert "optim.lrr" in msg and "did you mean 'lr'" in msg
    for f in dataclasses.fields(config.OptimSection):
        assert f.name in msg


def test_unknown_key_in_a_file_and_unknown_section(job_file):
    with pytest.raises(UsageError, match=r"data\.batchsize.*did you mean 'batch_size'"):
        config.load(job_file("data:\n  batchsize: 8\n"))
    with pytest.raises(UsageError, match=r"optimizer.*did you mean 'optim'"):
        config.load(None, ["optimizer.lr=0.1"])
    with pytest.raises(UsageError, match=r"'sede'.*did you mean 'seed'"):
        config.load(job_file("sede: 1\n"))


@pytest.mark.parametrize("item,field", [
    ("data.batch_size=abc", "data.batch_size"),
    ("data.batch_size=2.5", "data.batch_size"),
    ("data.batch_size=0", "data.batch_size"),
    ("optim.lr=fast", "optim.lr"),
    ("optim.lr=-0.1", "optim.lr"),
    ("optim.lr=.nan", "optim.lr"),
    ("data.test_fraction=0.95", "data.test_fraction"),
    ("train.eval=maybe", "train.eval"),
    ("model.dropout=1.5", "model.dropout"),
    ("checkpoint.keep=1", "checkpoint.keep"),
    ("log.level=VERBOSE", "log.level"),
    ("dist.backend=mpi", "dist.backend"),
    ("job.setup=echo hi", "job.setup"),
    ("model.name=resnet", "model.name"),
    ("data=3", "data"),
])
def test_wrong_type_or_range_names_the_field(item, field):
    with pytest.raises(UsageError) as e:
        config.load(None, [item])
    assert f"{field} " in str(e.value) or f"'{field}'" in str(e.value), str(e.value)


def test_cross_field_rule():
    with pytest.raises(UsageError, match="train.epochs"):
        config.load(None, ["train.epochs=0", "train.max_steps=0"])
    assert config.load(None, ["train.epochs=0", "train.max_steps=5"]).train.max_steps == 5
