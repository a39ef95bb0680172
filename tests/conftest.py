"""Shared fixtures: real parts only (scripted model over HTTP, gateway, local sandboxes, real Codex)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def processes_under(marker: str) -> list[str]:
    """Live processes whose command line or working directory mentions ``marker``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = (
                Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            )
            cwd = os.readlink(f"/proc/{pid}/cwd")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if state != "Z" and (marker in cmdline or cwd.startswith(marker)):
            found.append(f"{pid}: {cmdline[:200]}")
    return found


@pytest.fixture(scope="session")
def codex_installed() -> Path:
    from harnesses.codex import CodexHarness
    from harnesses.install import default_cache_root

    return CodexHarness().ensure_installed(default_cache_root())


@asynccontextmanager
async def session_context(
    tmp_path: Path,
    config: dict[str, Any] | None = None,
    *,
    upstream: str | None = None,
    api_key: str | None = None,
) -> AsyncIterator[Any]:
    """A SessionContext like a worker builds, with the scripted model as the endpoint unless given one."""
    from executor.config import RunConfig
    from executor.session import SessionContext
    from harnesses.codex import CodexHarness
    from harnesses.gateway import Gateway
    from harnesses.install import default_cache_root
    from harnesses.scripted_model import ScriptedModel
    from sandboxes.local import LocalSandboxProvider

    cfg = RunConfig.model_validate({"run_id": "t", "tasks": str(tmp_path / "none.jsonl"), **(config or {})})
    scripted = ScriptedModel(model_names=(cfg.model.name,))
    await scripted.start()
    gateway = Gateway(upstream or scripted.base_url, api_key, cfg.gateway)
    await gateway.start()
    try:
        yield SessionContext(
            config=cfg,
            provider=LocalSandboxProvider(tmp_path / "sandboxes"),
            harness=CodexHarness(),
            gateway=gateway,
            scripted=scripted,
            evidence_root=tmp_path / "evidence",
            cache_root=default_cache_root(),
        )
    finally:
        await gateway.stop()
        await scripted.stop()
