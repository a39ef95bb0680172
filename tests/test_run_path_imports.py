"""The product imports none of its test machinery: every module of executor/, harnesses/, sandboxes/ and
policy/ outside a ``testing`` subpackage loads without one ``*.testing`` module coming along. Only the
commands and settings that need them (``rollout conformance``, ``rollout bench``, ``rollout model
serve``, the ``scripted`` provider, injected start failures) load them, inside the function that does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A fresh interpreter: this test process has long since imported the test machinery itself.
_IMPORT_ALL = """
import importlib, json, pkgutil, sys

def product_modules(package):
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if info.name.rsplit(".", 1)[1] == "testing":
            continue
        module = importlib.import_module(info.name)
        yield info.name
        if info.ispkg:
            yield from product_modules(module)

imported = []
for top in ("executor", "harnesses", "sandboxes", "policy"):
    imported.append(top)
    imported.extend(product_modules(importlib.import_module(top)))
testing = sorted(name for name in sys.modules if ".testing" in name or name.startswith("tests"))
print(json.dumps({"imported": imported, "testing": testing}))
"""


def test_no_product_module_imports_test_machinery() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    found = json.loads(out.stdout.splitlines()[-1])
    # The run path is among what was imported: the CLI, the driver, the worker and what a session loads.
    for module in (
        "executor.cli",
        "executor.driver",
        "executor.worker",
        "executor.session",
        "harnesses.gateway",
        "harnesses.registry",
        "sandboxes.local",
        "sandboxes.slurm",
    ):
        assert module in found["imported"]
    assert found["testing"] == []


# What a `rollout run` driver loads before its first session, and what its first rows make pyarrow load.
_DRIVER = """
import json, sys
sys.argv = ["rollout"]
import executor.cli
import executor.driver
from executor.schema import refuse_pandas, rows_to_batch, warm_up
refuse_pandas()
warm_up()
rows_to_batch([{}]).to_pylist()
unwanted = ("aiohttp", "httpx", "pandas", "harnesses.gateway.server")
print(json.dumps(sorted(m for m in unwanted if m in sys.modules)))
"""


def test_a_driver_imports_neither_the_gateway_server_nor_pandas_nor_httpx() -> None:
    """The gateway's server (aiohttp) is its workers', pandas nobody's, and httpx the remote sandboxes'
    and the endpoint check's (which imports it itself): ~0.7 s of a driver's CPU."""
    out = subprocess.run(
        [sys.executable, "-c", _DRIVER], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.splitlines()[-1]) == []


# A worker actor's process, as Ray's worker entry point leaves it before the actor is constructed: Ray
# and the actor's module imported; then the actor's constructor and its warm-up (the first session's).
_WORKER = """
import json, sys
import executor.worker
from executor.config import RunConfig
from executor.schema import warm_up
executor.worker.SandboxWorker(RunConfig(tasks="t.jsonl").model_dump_json(), "/nonexistent/run", 0)
warm_up()
print(json.dumps("pandas" in sys.modules))
"""


def test_a_worker_does_not_import_pandas() -> None:
    """pyarrow's first conversion in a worker imported pandas, 0.2 s before its first session's row."""
    out = subprocess.run(
        [sys.executable, "-c", _WORKER], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.splitlines()[-1]) is False
