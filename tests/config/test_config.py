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

DIGITS = str(Path(__file__).resolve().parents[2] / "jobs" / "digits.yaml")


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


@pytest.mark.procs
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
    # Issue 50: counts no cluster has never reach an #SBATCH line.
    ("job.nodes=9223372036854775807", "job.nodes"),
    ("job.spare_nodes=9223372036854775807", "job.spare_nodes"),
    ("job.min_nodes=65536", "job.min_nodes"),
    ("job.cpus_per_task=65536", "job.cpus_per_task"),
])
def test_wrong_type_or_range_names_the_field(item, field):
    with pytest.raises(UsageError) as e:
        config.load(None, [item])
    assert f"{field} " in str(e.value) or f"'{field}'" in str(e.value), str(e.value)


@pytest.mark.parametrize("spec", ["٣٠", "١:٠٠:٠٠", "3٠", "1" * 10, "1-" + "2" * 10])
def test_a_time_limit_in_other_digits_or_beyond_any_cluster_is_refused(spec):
    """\\d took Arabic-Indic digits, which reached #SBATCH --time for Slurm to refuse."""
    from hpc_train.config_rules import time_minutes
    with pytest.raises(UsageError, match="job.time"):
        time_minutes(spec)


def test_cross_field_rule():
    with pytest.raises(UsageError, match="train.epochs"):
        config.load(None, ["train.epochs=0", "train.max_steps=0"])
    assert config.load(None, ["train.epochs=0", "train.max_steps=5"]).train.max_steps == 5


# -- YAML 1.1 pitfalls: a plain scalar is text; the field's type decides what it means -------------
# (field, as written). PyYAML (YAML 1.1) read these as 1800, 5400, 83, 1000, 31, 8, 1.5, False, a
# date: what reached Slurm was not what the user wrote.
SLURM_STRINGS = [
    ("job.time", "30:00"), ("job.time", "1:30:00"), ("job.account", "0123"), ("job.partition", "1_000"),
    ("job.qos", "0x1F"), ("job.mem", "1_000"), ("job.constraint", "010"), ("job.name", "1.50"),
    ("log.progress", "off"), ("job.name", "2024-01-02"), ("run_dir", "yes"),
]


def _get(cfg, dotted):
    *section, key = dotted.split(".")
    return getattr(getattr(cfg, section[0]) if section else cfg, key)


def _as_file(dotted, text):
    section, _, key = dotted.rpartition(".")
    return f"{section}:\n  {key}: {text}\n" if section else f"{key}: {text}\n"


@pytest.mark.parametrize("field,text", SLURM_STRINGS, ids=[f"{f}={t}" for f, t in SLURM_STRINGS])
def test_string_fields_keep_the_text_as_written(job_file, field, text):
    assert _get(config.load(job_file(_as_file(field, text))), field) == text
    assert _get(config.load(None, [f"{field}={text}"]), field) == text
    # The printed/written config quotes it, so a plain YAML 1.1 reader sees the same string, and
    # reading the written file back (as workers and the requeue hook do) gives the same config.
    cfg = config.load(None, [f"{field}={text}"])
    assert _get(config.from_dict(yaml.safe_load(cfg.to_yaml())), field) == text
    assert config.load(job_file(cfg.to_yaml())) == cfg


def test_job_time_30_00_is_thirty_minutes(run_cli):
    from hpc_train.login.scheduler import time_minutes
    r = run_cli("config", "jobs/digits.yaml", "--set", "job.time=30:00")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["job"]["time"] == "30:00" and time_minutes("30:00") == 30


# An int field takes decimal digits only: each of these has a YAML 1.1 reading (1000, 16, 8 in
# octal, 90 in base 60) that differs from another reasonable one, so the user writes the number.
@pytest.mark.parametrize("text", ["1_000", "0x10", "010", "1:30", "1e3", "2.0", "١٢", "", "~"])
def test_int_fields_refuse_ambiguous_numbers(job_file, text):
    for source in (lambda: config.load(job_file(f"optim:\n  warmup_steps: {text}\n")),
                   lambda: config.load(None, [f"optim.warmup_steps={text}"])):
        with pytest.raises(UsageError, match=r"optim\.warmup_steps must be an integer \(decimal digits"):
            source()


@pytest.mark.parametrize("text", ["1_0.5", "١٢", "1:30", "0x10", "fast"])
def test_float_fields_refuse_non_numbers(text):
    with pytest.raises(UsageError, match=r"optim\.lr must be a number"):
        config.load(None, [f"optim.lr={text}"])


def test_numbers_and_bools_as_yaml_writes_them():
    cfg = config.load(None, ["seed=+5", "optim.lr=.5", "optim.gamma=5E-1", "train.eval=no",
                             "log.tensorboard=ON", "checkpoint.async_save=Yes"])
    assert (cfg.seed, cfg.optim.lr, cfg.optim.gamma) == (5, 0.5, 0.5)
    assert (cfg.train.eval, cfg.log.tensorboard, cfg.checkpoint.async_save) == (False, True, True)
    with pytest.raises(UsageError, match="data.batch_size must be >= 1, got '-0'"):
        config.load(None, ["data.batch_size=-0"])


def test_null_for_a_string_field_says_how_to_write_empty(job_file):
    with pytest.raises(UsageError, match=r"job\.mem must be a string, got an empty value \(null\); write ''"):
        config.load(job_file("job:\n  mem:\n"))
    assert config.load(job_file("job:\n  mem: ''\n")).job.mem == ""


# -- refused YAML -----------------------------------------------------------------------------------
def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 300, msg
    return msg


def test_duplicate_keys_name_the_key_and_both_lines(job_file):
    with pytest.raises(UsageError) as e:
        config.load(job_file("optim:\n  lr: 0.1\n  name: sgd\n  lr: 0.2\n"))
    msg = one_line(e)
    assert "job.yaml" in msg and "duplicate key 'lr'" in msg and "line 4" in msg and "first at line 2" in msg
    with pytest.raises(UsageError, match="duplicate key 'optim'"):
        config.load(job_file("optim: {lr: 0.1}\nseed: 1\noptim: {lr: 0.2}\n"))
    with pytest.raises(UsageError, match=r"--set job: duplicate key 'name'"):
        config.load(None, ["job={name: a, name: b}"])


BILLION_LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{x}: &{x} [{', '.join([f'*{p}'] * 9)}]\n" for p, x in zip("abcdefgh", "bcdefghi"))


@pytest.mark.timeout(60)    # a bound on a hang (expanding the aliases would never end), not a speed
def test_alias_bomb_fails_fast(job_file):
    # How fast it fails is measured by benchmarks/cli_latency.py, not asserted here (a shared machine).
    f = job_file(BILLION_LAUGHS)
    with pytest.raises(UsageError) as e:
        config.load(f)
    msg = one_line(e)
    assert "job.yaml" in msg and "alias *a" in msg and "line 2" in msg


def test_aliases_are_refused_but_anchors_alone_are_fine(job_file):
    assert config.load(job_file("optim: &o\n  lr: 0.5\n")).optim.lr == 0.5
    with pytest.raises(UsageError, match=r"--set job.name: found the alias \*x"):
        config.load(None, ["job.name=*x"])


def test_deep_nesting_is_refused_not_a_recursion_error(job_file):
    with pytest.raises(UsageError) as e:
        config.load(job_file("job:\n  setup: " + "[" * 3000 + "]" * 3000 + "\n"))
    assert "nested deeper than" in one_line(e)
    with pytest.raises(UsageError, match=r"--set job.setup: nested deeper than"):
        config.load(None, ["job.setup=" + "[" * 3000])


def test_file_that_is_not_utf8(job_file, tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"job:\n  name: caf\xe9\n")
    with pytest.raises(UsageError) as e:
        config.load(p)
    msg = one_line(e)
    assert str(p) in msg and "not UTF-8" in msg and "0xe9" in msg and "line 2" in msg
    p.write_bytes(b"\xef\xbb\xbfjob:\n  name: caf\xc3\xa9\n")   # UTF-8 with a BOM is fine
    assert config.load(p).job.name == "café"


def test_control_character_in_a_file_is_one_line(job_file):
    with pytest.raises(UsageError) as e:
        config.load(job_file("job:\n  name: a\x07b\n"))
    msg = one_line(e)
    assert "not valid YAML at line 2" in msg and "U+0007" in msg


def test_paths_that_are_not_readable_files(tmp_path):
    with pytest.raises(UsageError) as e:
        config.load(tmp_path)
    assert f"{tmp_path} is a directory" in one_line(e)
    with pytest.raises(UsageError, match="cannot read .*File name too long"):
        config.load(tmp_path / ("a" * 5000))
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200_000)
    with pytest.raises(UsageError, match=r"big\.yaml is 2000000 bytes; a job config is a few kilobytes"):
        config.load(big)


def test_a_file_of_one_scalar_or_list_is_not_a_mapping(job_file):
    for text in ("[]\n", "0\n", "false\n"):
        with pytest.raises(UsageError, match="must be a mapping of sections"):
            config.load(job_file(text))
    assert config.load(job_file("# nothing\n")) == config.Config()


# -- ranges: what would break later (timedelta, numpy's seed, sbatch --signal) fails here -----------
@pytest.mark.parametrize("item,needle", [
    ("dist.timeout_s=1e15", "dist.timeout_s must be >= 1 and <= 604800, got '1e15'"),
    ("dist.init_timeout_s=1e9", "dist.init_timeout_s must be >= 1 and <= 604800"),
    ("checkpoint.every_seconds=1e9", "checkpoint.every_seconds must be >= 0 and <= 604800"),
    ("seed=1e23", "seed must be an integer"),
    ("seed=4294967296", "seed must be >= 0 and <= 4294967295"),
    ("seed=100000000000000000000000", "seed must be >= 0 and <= 4294967295"),
    ("job.signal_lead=70000", "job.signal_lead must be >= 0 and <= 65535"),
    ("data.batch_size=" + "9" * 5000, "data.batch_size must be <= 9223372036854775807"),
    ("optim.lr=1e999", "optim.lr must be a finite number, got '1e999'"),
])
def test_out_of_range_numbers_name_the_field_and_the_range(item, needle):
    with pytest.raises(UsageError) as e:
        config.load(None, [item])
    assert needle in one_line(e)


def test_range_limits_themselves_are_accepted():
    cfg = config.load(None, ["seed=4294967295", "dist.timeout_s=604800", "dist.init_timeout_s=604800",
                             "job.signal_lead=65535"])
    assert (cfg.seed, cfg.dist.timeout_s, cfg.job.signal_lead) == (2**32 - 1, 604800.0, 65535)


FLOAT_FIELDS = [f"{s}.{f.name}" for s, sec in config._SECTIONS.items()
                for f in dataclasses.fields(sec.default_factory) if f.type in ("float", float)]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_every_float_field_refuses_nan_and_inf(field, job_file):
    for text in (".nan", ".inf", "-.Inf", "nan", "inf"):
        with pytest.raises(UsageError, match=f"{field} must be a finite number"):
            config.load(None, [f"{field}={text}"])
    with pytest.raises(UsageError, match=f"{field} must be a finite number"):
        config.load(job_file(_as_file(field, ".NaN")))


def test_from_dict_checks_typed_values_alike():
    """Workers rebuild the config with from_dict: the same limits hold for typed values."""
    good = config.Config().to_dict()
    for section, key, bad in (("dist", "timeout_s", 1e15), (None, "seed", 1e23), (None, "seed", 2**70),
                              ("optim", "lr", float("nan")), ("optim", "lr", 10**400)):
        d = config.Config().to_dict()
        (d[section] if section else d)[key] = bad
        with pytest.raises(UsageError, match=f"{key} must be"):
            config.from_dict(d)
    assert config.from_dict(good) == config.Config()


# -- adversarial --set ------------------------------------------------------------------------------
@pytest.mark.parametrize("item,needle", [
    ("", "--set expects section.key=value"),
    ("=1", "--set expects section.key=value"),
    ("a.b.c=1", "--set expects section.key=value"),
    ("seed.x=1", "'seed' is a top-level key, not a section; use --set seed=VALUE"),
    ("job=3", "section 'job' must be a mapping of its keys (e.g. job.name), got '3'; on the command line"),
    ("data.batch_size=" + "x" * 100_000, "(100002 characters)"),
    ("data.name=" + "y" * 100_000, "data.name must be one of"),
    ("x" * 100_000 + ".y=1", "unknown key 'xxxx"),
    ("job.name=a\udcffb", "job.name must be a single line of printable text"),
    ("job.setup=[ok, \"a\\0b\"]", "job.setup must be a list of single-line strings"),
    ("job.name=!!binary aGk=", "job.name must be a string, got b'hi'"),
])
def test_adversarial_set_items_give_one_line(item, needle):
    with pytest.raises(UsageError) as e:
        config.load(None, [item])
    assert needle in one_line(e)


def test_unicode_and_long_strings_that_are_fine():
    cfg = config.load(None, ["job.name=日本語-ü", "job.mem=" + "a" * 100_000, "job.name=x: y: z"])
    assert cfg.job.name == "x: y: z" and len(cfg.job.mem) == 100_000
    assert config.load(None, ["job.name=日本語-ü"]).job.name == "日本語-ü"
