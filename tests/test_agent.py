"""The in-sandbox agent as a real process, and the remote client the session code sees."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import time
import uuid

import httpx
import pytest

from sandboxes.base import SandboxError, SandboxLostError, SandboxSpec, WorkspaceSpec
from sandboxes.remote import AGENT_PATH, RemoteSandbox
from sandboxes.workspace import lay_out, workspace_diff
from tests.agent_process import AgentProcess, start_agent

TOKEN = "s3cret-token-for-tests"


@pytest.fixture
def agent(tmp_path):
    proc = start_agent(tmp_path / "sb", TOKEN, "--max-upload-bytes", "100000")
    yield proc
    proc.kill()


def _remote(agent: AgentProcess, *, token: str = TOKEN, ttl_s: float = 600) -> RemoteSandbox:
    async def teardown() -> None:
        agent.kill()

    async def probe() -> str | None:
        return None if agent.proc.poll() is None else f"agent exited {agent.proc.returncode}"

    return RemoteSandbox(
        sandbox_id="agent-test",
        provider_name="test",
        spec=SandboxSpec(run_id="r", session_id="s", ttl_s=ttl_s),
        base_url=agent.url,
        token=token,
        root=str(agent.root),
        teardown=teardown,
        probe=probe,
        marker_token=uuid.uuid4().hex,
    )


def _marked(marker: str) -> list[int]:
    entry = f"ROLLOUT_SANDBOX={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if entry in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                pass
    return found


def test_no_token_no_service(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("")
    for args in ([], ["--token-file", str(empty)], ["--token-env", "ROLLOUT_TEST_UNSET_VAR"]):
        proc = subprocess.run(
            [sys.executable, str(AGENT_PATH), "--root", str(tmp_path / "sb"), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 2, args
        assert "refusing to start" in proc.stderr


def test_missing_or_wrong_token_rejected(agent):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        resp = httpx.get(f"{agent.url}/health", headers=headers, timeout=10)
        assert resp.status_code == 401
        resp = httpx.post(f"{agent.url}/exec", headers=headers, json={"argv": ["true"]}, timeout=10)
        assert resp.status_code == 401
    ok = httpx.get(f"{agent.url}/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["ok"] is True


async def test_wrong_token_through_the_client(agent):
    sandbox = _remote(agent, token="not-it")
    with pytest.raises(SandboxError, match="401"):
        await sandbox.exec(["true"], timeout=5)


async def test_paths_escaping_the_root_are_refused(agent, tmp_path):
    sandbox = _remote(agent)
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    (agent.root / "work" / "link").symlink_to(tmp_path)
    for path in ("../../outside.txt", str(outside), "link/outside.txt", "/etc/passwd"):
        with pytest.raises(SandboxError, match="403"):
            await sandbox.read_file(path, 100)
        with pytest.raises(SandboxError, match="403"):
            await sandbox.write_file(path, b"x")
    assert outside.read_text() == "secret"
    with pytest.raises(SandboxError, match="403"):
        await sandbox.exec(["true"], timeout=5, cwd="/tmp")
    # A tar member climbing out, or a symlink pointing out, refuses the whole archive.
    for member in ("../escape.txt", "sym"):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:") as tar:
            info = tarfile.TarInfo(member)
            if member == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc"
                tar.addfile(info)
            else:
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
        resp = httpx.post(
            f"{agent.url}/untar",
            params={"dest": "."},
            content=buf.getvalue(),
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )
        assert resp.status_code == 403, resp.text
    assert not (agent.root / "escape.txt").exists() and not (agent.root / "work" / "sym").exists()


async def test_oversized_upload_is_refused(agent):
    sandbox = _remote(agent)
    with pytest.raises(SandboxError, match="413"):
        await sandbox.write_file("big.bin", b"x" * 100_001)
    assert not (agent.root / "work" / "big.bin").exists()
    await sandbox.write_file("ok.bin", b"x" * 100_000)  # the limit itself is allowed
    assert (await sandbox.health())["ok"]


async def test_exec_timeout_kills_the_group(agent):
    sandbox = _remote(agent)
    marker = sandbox.base_env["ROLLOUT_SANDBOX"]
    script = "sleep 300 & (setsid sleep 301 &) ; echo started; sleep 302"
    result = await sandbox.exec(["bash", "-c", script], timeout=1.0, name="slow")
    assert result.timed_out and result.exit_code is None
    assert "started" in result.stdout_tail
    assert _marked(marker) == []


async def test_exec_files_and_workspace_like_a_local_sandbox(agent, tmp_path):
    sandbox = _remote(agent)
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    await lay_out(sandbox, WorkspaceSpec(files={"a.txt": "one\n"}, copy_from=str(src)))
    result = await sandbox.exec(
        ["bash", "-c", 'cat; echo "$GREETING from $(pwd)"; echo err >&2; exit 3'],
        timeout=30,
        env={"GREETING": "hi"},
        stdin=b"from stdin\n",
    )
    assert result.exit_code == 3 and not result.timed_out
    assert result.stdout_tail == f"from stdin\nhi from {sandbox.workdir}\n"
    assert result.stderr_tail == "err\n" and result.stderr_bytes == 4
    assert await sandbox.read_file(result.stdout_path, 4) == b"from"
    with pytest.raises(FileNotFoundError):
        await sandbox.read_file("missing.txt", 10)
    await sandbox.write_file("a.txt", b"two\n", 0o600)
    assert (agent.root / "work" / "a.txt").stat().st_mode & 0o777 == 0o600
    diff = await workspace_diff(sandbox)
    assert diff is not None and "-one" in diff and "+two" in diff and "pkg/mod.py" not in diff


async def test_stop_ends_running_commands_and_the_agent(agent):
    sandbox = _remote(agent)
    marker = sandbox.base_env["ROLLOUT_SANDBOX"]
    import asyncio

    running = asyncio.ensure_future(sandbox.exec(["sleep", "300"], timeout=300))
    deadline = time.monotonic() + 20
    while not _marked(marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _marked(marker)
    await sandbox.stop()
    with pytest.raises(SandboxLostError):
        await running
    assert agent.proc.wait(15) == 0
    assert _marked(marker) == []
    await sandbox.stop()  # idempotent


async def test_a_dead_agent_reads_as_a_lost_sandbox(agent):
    sandbox = _remote(agent)
    agent.proc.kill()
    agent.proc.wait(10)
    with pytest.raises(SandboxLostError, match="agent exited"):
        await sandbox.exec(["true"], timeout=5)
