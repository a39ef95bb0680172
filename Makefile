# Two commands on a fresh machine: `make demo` runs a real batch of rollouts, `make test` passes the tests.
# Both install what is missing first: the venv from PyPI, then (on first use) the pinned Codex from npm.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint install clean-runs

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rollout run examples/demo.yaml
	$(VENV)/bin/rollout status runs/demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -ra

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean-runs:
	rm -rf runs
