# make demo: set up and train the digits recipe with DDP on 2 local CPU processes.
# make test: set up and run the test suite.
PYTHON ?= python3
VENV ?= .venv
OUT ?= runs/demo

.PHONY: setup setup-dev demo test bench clean

setup:
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup-env.sh

setup-dev:
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup-env.sh "[dev]"

demo: setup
	$(VENV)/bin/shardwise train --recipe digits --strategy ddp --nproc 2 --out $(OUT)

test: setup-dev
	$(VENV)/bin/python -m pytest

bench: setup-dev
	$(VENV)/bin/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
