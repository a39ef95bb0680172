# Two commands on a fresh machine: `make demo` runs a real batch of rollouts, `make test` passes the tests.
# Both install what is missing first: the venv from PyPI, then (on first use) the pinned Codex from npm.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint install clean-runs conformance

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
	.ci/system-deps
	$(VENV)/bin/ruff check .
	@# pytest exits 5 when it collected no tests: a failure here, not a pass.
	$(VENV)/bin/pytest -ra --durations=40; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests ran" >&2; exit 1; fi; exit $$rc

# Every scenario against every registered harness; the matrix goes to runs/conformance/conformance.md.
conformance: $(STAMP)
	$(VENV)/bin/rollout conformance --harness all --out runs/conformance

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean-runs:
	rm -rf runs
