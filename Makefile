# Two commands on a fresh machine: `make demo` runs a real batch of rollouts, `make test` passes the tests.
# Both install what is missing first: the venv from PyPI, then (on first use) the pinned Codex from npm.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp

# The oldest Ray of pyproject.toml's range, in a venv of its own beside the main one (which has the
# newest): `make test` runs the Ray-facing tests on it too, a selection of a few minutes.
RAY_OLDEST := 2.49.2
VENV_OLDEST := .venv-ray-oldest
STAMP_OLDEST := $(VENV_OLDEST)/.installed-stamp
# A run's own local cluster, a run through Ray, `rollout up` / an attached run / `down`, `ray job submit`,
# and the table of Ray's private names (a killed warm executor's test passes on it too, but takes ~2.5 min).
RAY_FACING := tests/test_ray_private.py tests/test_local_cluster.py \
	tests/test_run.py::test_demo_tasks_through_ray \
	tests/test_warm.py::test_runs_attach_to_the_warm_workers_and_down_leaves_nothing \
	tests/test_ray_job.py::test_ray_job_submit_refuses_a_relative_out_and_writes_an_absolute_one

.PHONY: demo test test-ray-oldest lint install clean-runs conformance

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

$(STAMP_OLDEST): pyproject.toml
	test -x $(VENV_OLDEST)/bin/python || $(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/pip install --quiet --upgrade pip
	$(VENV_OLDEST)/bin/pip install --quiet -e '.[test]' 'ray[default]==$(RAY_OLDEST)'
	touch $(STAMP_OLDEST)

install: $(STAMP)

# The package's bytecode, written once here rather than compiled in every process that imports it (each
# worker actor, the driver, every test's subprocess: ~0.1 s of CPU each) where the environment says
# PYTHONDONTWRITEBYTECODE, or the checkout is not writable by them. pip does the same for a regular
# install; an editable one leaves it to the first import. Quick when nothing changed.
BYTECODE := $(VENV)/bin/python -m compileall -q -j 0 executor harnesses policy sandboxes

demo: $(STAMP)
	$(BYTECODE)
	$(VENV)/bin/python -m sandboxes.native_init
	$(VENV)/bin/rollout run examples/demo.yaml
	$(VENV)/bin/rollout status runs/demo

test: $(STAMP)
	.ci/system-deps
	$(BYTECODE)
	$(VENV)/bin/python -m sandboxes.native_init
	$(VENV)/bin/ruff check .
	@# The oldest Ray's venv (about a minute of wheel installs) is made while the suite runs, not after
	@# it; its output goes to a log shown if it fails. pytest exits 5 when it collected no tests: a
	@# failure here, not a pass.
	$(MAKE) --no-print-directory $(STAMP_OLDEST) >$(VENV_OLDEST).log 2>&1 & oldest=$$!; \
	$(VENV)/bin/pytest -ra --durations=40; rc=$$?; \
	if ! wait $$oldest; then cat $(VENV_OLDEST).log >&2; echo "$(VENV_OLDEST): install failed" >&2; exit 1; fi; \
	if [ $$rc -eq 5 ]; then echo "no tests ran" >&2; exit 1; fi; exit $$rc
	$(MAKE) test-ray-oldest

# The Ray-facing tests on the oldest supported Ray (after the whole suite on the newest, in `make test`).
test-ray-oldest: $(STAMP_OLDEST)
	$(VENV_OLDEST)/bin/python -c 'import ray; assert ray.__version__ == "$(RAY_OLDEST)", ray.__version__'
	$(VENV_OLDEST)/bin/pytest -ra --durations=5 $(RAY_FACING); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests ran" >&2; exit 1; fi; exit $$rc

# Every scenario against every registered harness; the matrix goes to runs/conformance/conformance.md.
conformance: $(STAMP)
	$(VENV)/bin/rollout conformance --harness all --out runs/conformance

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean-runs:
	rm -rf runs
