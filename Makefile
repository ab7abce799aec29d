# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The install's inputs: the project's dependencies and the install line below (a changed one reinstalls).
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
RUN_DIR ?= runs/digits-$(shell date +%Y%m%d-%H%M%S)
# pytest-xdist workers for `make test`: 2 take about half the time of one process (the tests
# wait more than they compute; a test marked `quiet` still runs alone). TEST_WORKERS=0: one
# process, as plain `pytest` runs (docs/development.md).
TEST_WORKERS ?= 2
# Bytecode of the project's own modules. Where PYTHONDONTWRITEBYTECODE is set (this project's
# machines set it) Python writes none, and a clone has none: every process of a run or of the
# tests (each rank, each CLI call) compiled hpc_train from source again, about 0.1 s of CPU each
# (tests/cli: 53 -> 44 s). compileall writes it whatever that variable says, only for files changed.
COMPILE := $(BIN)/python -m compileall -q hpc_train tests benchmarks

.PHONY: run test test-fast venv bench clean

# The first install downloads torch and the rest (about 2 minutes): pip's own progress is shown,
# so a newcomer sees it working instead of a silent terminal. editable_mode=compat puts the clone
# on sys.path (a .pth line) instead of a finder that runs after the path's own: with that finder, a
# script beside the clone (whose folder is named hpc_train, as `git clone` names it) imported the
# folder as an empty namespace package ("module 'hpc_train' has no attribute 'init'").
$(STAMP): pyproject.toml Makefile
	@echo "make: setting up $(VENV): installing hpc_train with torch, submitit and the test tools (about 2 minutes the first time)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -e '.[test]' --config-settings editable_mode=compat
	rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

# The main job: the MNIST ConvNet on real handwritten digits, 2 local processes, gloo.
run: $(STAMP)
	$(COMPILE)
	$(BIN)/python -m hpc_train run jobs/digits.yaml --nproc 2 --run-dir $(RUN_DIR)

# Every test. Slurm tests start the project's own local cluster (slurm/devcluster.sh, root
# needed) and stop it when done; with CI=true they must run, not skip. With TEST_WORKERS=2, two
# test files run at a time (tests/conftest.py: a file stays on one worker, the Slurm tests all on one).
test: $(STAMP)
	$(COMPILE)
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -ra --durations=20 $(PYTEST_ARGS)

# The edit loop's tier (about 2 minutes): every test that starts no Slurm cluster and no training
# processes (pure functions, records, decide, config, the CLI, renderers, stand-in Slurm commands),
# plus the layers and the types. Left out: tests/slurm/ (marked slurm) and tests marked procs.
test-fast: $(STAMP)
	$(COMPILE)
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slurm and not procs" -q --durations=10 $(PYTEST_ARGS)

bench: $(STAMP)
	$(COMPILE)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
