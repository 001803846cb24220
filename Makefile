# make demo: set up and train the digits recipe with DDP on 2 local CPU processes.
# make lint: ruff (lint rules and formatting) and mypy (strict on the public API, every built-in
#   strategy checked against the contract in tests/typecheck_contract.py).
# make test: set up, lint, and run the test suite.
# make bench: every strategy family against the hand-written torch it wraps, training loop and whole
#   process, one table (benchmarks/families.py, 8 interleaved pairs a family; about an hour on 2 cores).
# make mutants: check that the tests catch a list of deliberate bugs.
PYTHON ?= python3
VENV ?= .venv
OUT ?= runs/demo
# Test files run in 3 worker processes, one file per worker (module-scoped launches stay whole):
# most multi-process tests wait on process start and messages, so three files at once keep both
# cores busy (2 workers: 24.8 min on 2 cores; 3: 21-24.5 min in four clean CI runs, 18.5-19 min since
# launch forks its ranks from a zygote that imported torch once, launcher/zygote.py; 20:46 with issue 36's
# 1172 tests, quiet machine). tests/conftest.py hands the files out longest first (an estimate), each
# README block on its own (test_readme.py and test_readme_shell.py were ~10 and ~12 minutes as one
# unit each), and the three tests that start Ray last, together, on cores the others have left
# (2:10 so; 7-11 minutes of worker time when they ran beside other work). No test asserts
# a wall-clock time, so the load does not change what passes. TEST_WORKERS=0 runs them one at a time.
TEST_WORKERS ?= 3

.PHONY: setup setup-dev demo lint test bench mutants clean

# the README's examples draw PNGs, write TensorBoard events and search hyperparameters (Optuna):
# make setup installs those three extras
setup:
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup-env.sh "[plot,tensorboard,tune]"

setup-dev:
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup-env.sh "[dev]"

# a second make demo moves the first run aside (OUT/replaced-<time>/; nothing is deleted)
demo: setup
	$(VENV)/bin/shardwise train --recipe digits --strategy ddp --nproc 2 --out $(OUT) --overwrite

lint: setup-dev
	$(VENV)/bin/ruff check shardwise tests
	$(VENV)/bin/ruff format --check shardwise tests
	$(VENV)/bin/mypy shardwise tests/typecheck_contract.py

test: setup-dev lint
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=15

bench: setup-dev
	$(VENV)/bin/python benchmarks/families.py --whole

# make mutants: apply each deliberate bug of scripts/mutants.py to a temporary copy and run the
# tests that should catch it (a few minutes; not part of make test).
mutants: setup-dev
	$(VENV)/bin/python scripts/mutants.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
