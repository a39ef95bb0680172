"""Shared fixtures: real parts only (scripted model over HTTP, gateway, local sandboxes, real Codex)."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Runs under test never attach to a warm executor (`rollout up`) a developer left running.
_WARM_DIR = os.environ["ROLLOUT_WARM_DIR"] = tempfile.mkdtemp(prefix="rollout-warm-test-")
from sandboxes.testing.leaks import ended, processes_under, stopped_by  # noqa: F401  (their home; tests import them from here)


def _remove_warm_dir(owner: int = os.getpid()) -> None:
    if os.getpid() == owner:  # not in a child forked from this process that exits through Python
        shutil.rmtree(_WARM_DIR, ignore_errors=True)


atexit.register(_remove_warm_dir)

REPO = Path(__file__).parents[1]


def rollout_run(config: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`rollout run CONFIG` in a fresh process of the real CLI, from the repository, with ``env`` as its
    whole environment."""
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", "run", str(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


@pytest.fixture(scope="session")
def test_images() -> Any:
    """The container tests' images (sandboxes/testing/images.py), built once per machine and recipe."""
    from sandboxes.testing.images import ensure_test_images

    return ensure_test_images()


def sandbox_yaml(root: Path, gate: Path | None = None) -> str:
    """A run config's ``sandbox`` section (flow YAML) with its root; with ``gate``, its directory bound
    into the sandboxes' view, read-only: the view shows the host by allow-list only."""
    mounts = f", mounts: [{{path: {gate.parent}}}]" if gate is not None else ""
    return f"{{root: {root}{mounts}}}"


@pytest.fixture
def gate_dir() -> Iterator[Path]:
    """A directory of this test's own that a sandboxed command can see (read-only), for the gate files a
    test opens to let its sessions go on: the default sandbox hides /tmp (so ``tmp_path``), homes, /root,
    /srv and /mnt. As root under /var/lib; otherwise beside this file, in the repository."""
    base = Path("/var/lib/rollout-executor-tests") if os.geteuid() == 0 else REPO / "tests" / ".gates"
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=base))
    for traversed in (base, path):  # the sandbox's own user reads the gates
        traversed.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def codex_installed() -> Path:
    from harnesses.codex import CodexHarness
    from harnesses.install import default_cache_root

    return CodexHarness().ensure_installed(default_cache_root())


@pytest.fixture(scope="session")
def opencode_installed() -> Path:
    from harnesses.install import default_cache_root
    from harnesses.opencode import OpenCodeHarness

    return OpenCodeHarness().ensure_installed(default_cache_root())


@pytest.fixture(scope="session")
def pi_installed() -> Path:
    from harnesses.install import default_cache_root
    from harnesses.pi import PiHarness

    return PiHarness().ensure_installed(default_cache_root())


@pytest.fixture(scope="session")
def hermes_installed() -> Path:
    from harnesses.hermes import HermesHarness
    from harnesses.install import default_cache_root

    return HermesHarness().ensure_installed(default_cache_root())


@asynccontextmanager
async def session_context(
    tmp_path: Path,
    config: dict[str, Any] | None = None,
    *,
    upstream: str | None = None,
    api_key: str | None = None,
    harness: Any = None,
) -> AsyncIterator[Any]:
    """A SessionContext like a worker builds, with the scripted model as the endpoint unless given one,
    and the provider a worker builds from the config's sandbox section (isolated as it says).

    ``harness`` is an adapter instance; Codex when not given.
    """
    from executor.config import RunConfig
    from executor.session import SessionContext
    from executor.storage import locate
    from executor.worker import build_provider, gateway_socket
    from harnesses.codex import CodexHarness
    from harnesses.gateway import Gateway
    from harnesses.install import default_cache_root
    from harnesses.testing.scripted_model import ScriptedModel
    from sandboxes.prepared import PreparedWorkspaces

    cfg = RunConfig.model_validate({"run_id": "t", "tasks": str(tmp_path / "none.jsonl"), **(config or {})})
    scripted = ScriptedModel(model_names=(cfg.model.name,))
    await scripted.start()
    gateway = Gateway(upstream or scripted.base_url, api_key, cfg.gateway, **cfg.model.pins())
    await gateway.start(unix_path=gateway_socket(cfg))
    provider: Any = build_provider(cfg, tmp_path / "sandboxes", gateway, locate(str(tmp_path / "evidence")))
    try:
        yield SessionContext(
            config=cfg,
            provider=provider,
            harness=harness if harness is not None else CodexHarness(),
            gateway=gateway,
            scripted=scripted,
            evidence_root=tmp_path / "evidence",
            cache_root=default_cache_root(),
            workspaces=PreparedWorkspaces(tmp_path / "sandboxes", cfg.run_id or ""),
        )
    finally:
        close = getattr(getattr(provider, "inner", provider), "aclose", None)
        if close is not None:  # a remote provider holds nothing past its sandboxes
            await close()
        await gateway.stop()
        await scripted.stop()


@pytest.fixture
async def harness() -> AsyncIterator[Any]:
    """An HTTP client that plays the harness inside the sandbox (the gateway's tests)."""
    import httpx

    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        yield client


@pytest.fixture
async def model() -> AsyncIterator[Any]:
    """The scripted model, serving in this test's event loop."""
    from harnesses.testing.scripted_model import ScriptedModel

    scripted = ScriptedModel()
    await scripted.start()
    try:
        yield scripted
    finally:
        await scripted.stop()


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[Any]:
    """One local sandbox under this test's tmp_path, stopped afterwards."""
    from sandboxes.base import SandboxSpec
    from sandboxes.local import LocalSandboxProvider

    provider = LocalSandboxProvider(tmp_path / "sandboxes")
    box = await provider.start(SandboxSpec(run_id="test", session_id="s1", ttl_s=300))
    try:
        yield box
    finally:
        await box.stop()
        await provider.aclose()


DEMO_RUN_CONFIG = """\
tasks: {tasks}
out: {out}
run_id: demo
sandbox: {{root: {sandboxes}}}
gateway: {{max_attempts_per_request: 3, backoff_base_s: 0.1}}
policy:
  rules:
    rate_limit_exceeded: {{retry: true, max_attempts: 2, backoff_base_s: 0.2, backoff_cap_s: 0.5}}
    model_timeout: {{retry: true, max_attempts: 2, backoff_base_s: 0.2, backoff_cap_s: 0.5}}
limits: {{deadline_s: 60, grace_s: 3}}
concurrency: {{workers: 1, sessions_per_worker: 4}}
"""


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory, codex_installed: Path) -> Path:
    """One real `rollout run` of examples/tasks.jsonl per test session; the operator commands read it."""
    import subprocess
    import sys

    repo = Path(__file__).parents[1]
    root = tmp_path_factory.mktemp("demo-run")
    config = root / "demo.yaml"
    config.write_text(
        DEMO_RUN_CONFIG.format(
            tasks=repo / "examples" / "tasks.jsonl", out=root / "out", sandboxes=root / "sandboxes"
        )
    )
    for _ in range(2):  # a second try only when Ray itself could not start (an overloaded machine)
        proc = subprocess.run(
            [sys.executable, "-m", "executor.cli", "run", str(config)],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "RAY_TMPDIR": "/tmp/rollout-ray-tests"},
            cwd=repo,
        )
        if "timed out during startup" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "out" / "demo"


@pytest.fixture
def partial_run(tmp_path: Path, demo_run: Path) -> Path:
    """A run caught mid-way: its config and tasks, one part file with three rows, no summary, and a
    driver marker naming a live process (this one)."""
    import json
    import shutil
    import socket

    import pyarrow.parquet as pq

    from executor.store import read_table

    run = tmp_path / "out" / "partial"
    (run / "rows").mkdir(parents=True)
    for name in ("config.yaml", "tasks.jsonl"):
        shutil.copy(demo_run / name, run / name)
    first = read_table(demo_run).slice(0, 3)
    pq.write_table(first, run / "rows" / "part-000000.parquet")
    (run / "driver.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    return run
