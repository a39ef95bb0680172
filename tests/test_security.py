"""No credential reaches a sandbox: not its environment, files, command lines, nor the model evidence
the gateway records and hands back. Checked from outside, while the session runs, with the real Codex."""

from __future__ import annotations

import asyncio
import gzip
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from executor.session import SessionRequest, run_session
from executor.tasks import Task
from sandboxes import isolation
from tests.conftest import processes_under, session_context

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("codex_installed")]

API_KEY = "sk-rollout-sec-APIKEY-5b4a39"
# Credentials a user's shell typically holds; a sandbox must inherit none of them.
HOST_SECRETS = {
    "OPENAI_API_KEY": "sk-host-OPENAI-1c2d3e",
    "AWS_SECRET_ACCESS_KEY": "aws-host-SECRET-7f6e5d",
    "GITHUB_TOKEN": "ghp-host-TOKEN-0a9b8c",
    "RAY_ADDRESS": "ray-host-ADDRESS-424242",
}
SECRETS = [API_KEY, *HOST_SECRETS.values()]


def _contains_secret(data: bytes) -> list[str]:
    if data[:2] == b"\x1f\x8b":  # evidence is gzip: a leak inside it is still a leak
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            pass
    return [s for s in SECRETS if s.encode() in data]


def _scan_processes(marker: str, seen: dict[str, list[str]]) -> int:
    """Read the environment and command line of every sandbox process; returns how many were read."""
    read = 0
    for line in processes_under(marker):
        pid = line.split(":", 1)[0]
        for what in ("environ", "cmdline"):
            try:
                data = Path(f"/proc/{pid}/{what}").read_bytes()
            except OSError:
                continue
            read += what == "environ"
            for secret in _contains_secret(data):
                seen.setdefault(f"/proc/{pid}/{what}", []).append(secret)
    return read


async def test_no_credential_reaches_the_sandbox_environment_files_cmdlines_or_evidence(
    tmp_path, monkeypatch
):
    for name, value in HOST_SECRETS.items():
        monkeypatch.setenv(name, value)
    dump = (
        "env > env.txt; cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' ' > cmdlines.txt; "
        "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' > environs.txt; "
        "ls -laR ~ > home.txt 2>&1; cat ~/.codex/* > codex_home.txt 2>/dev/null; true"
    )
    task = Task.model_validate(
        {
            "id": "sec",
            "prompt": "dump what you can see",
            "model_script": [{"type": "shell", "command": dump}, {"type": "hang", "max_s": 600}],
            "deadline_s": 8,
        }
    )
    config = {
        "gateway": {"max_attempts_per_request": 2, "backoff_base_s": 0.05},
        "sandbox": {"keep": True},
    }
    marker = str(tmp_path / "sandboxes")
    seen: dict[str, list[str]] = {}
    async with session_context(tmp_path, config, api_key=API_KEY) as ctx:
        session = asyncio.create_task(run_session(SessionRequest("sec", task, 0, 1), ctx))
        scanned = 0
        for _ in range(600):  # bounded: the session's own deadline ends it well before
            if session.done():
                break
            # In a thread: a process in its exec or exit is watched until it settles, which must not
            # hold up the event loop the gateway and the session run on.
            scanned += await asyncio.to_thread(_scan_processes, marker, seen)
            await asyncio.sleep(0.05)  # polling the live processes while the session runs
        row = await asyncio.wait_for(session, 60)
    assert scanned > 0, "no sandbox process was seen while the session ran"
    files = 0
    for root in (tmp_path / "sandboxes", tmp_path / "evidence"):
        for path in root.rglob("*"):
            if path.is_file():
                files += 1
                for secret in _contains_secret(path.read_bytes()):
                    seen.setdefault(str(path), []).append(secret)
    assert not seen, seen
    assert files > 5
    outcome = {
        k: row.get(k)
        for k in (
            "status",
            "failure_kind",
            "error_message",
            "exit_code",
            "t_setup_s",
            "t_agent_s",
            "t_cleanup_s",
            "stderr_tail",
        )
    }
    assert list((tmp_path / "sandboxes").rglob("environs.txt")), f"the in-sandbox dump never ran: {outcome}"
    assert list((tmp_path / "evidence").rglob("req-*.json.gz")), "the gateway recorded no request body"
    assert not any(s in repr(row) for s in SECRETS)
    assert row["failure_kind"] == "model_timeout", outcome  # the script's last step stalls until the deadline
    shutil.rmtree(tmp_path / "sandboxes", ignore_errors=True)


@pytest.mark.skipif(
    isolation.pid_namespace_unavailable() is not None,
    reason=f"the sandbox shares the host's PID namespace here: {isolation.pid_namespace_unavailable()}",
)
async def test_a_host_process_environment_is_not_readable_from_the_sandbox(tmp_path):
    """Same uid as the worker, so only a PID namespace of its own (sandbox.pids, 'auto' by default) keeps
    /proc/<pid>/environ of the worker, which holds the key, out of the sandbox's sight."""
    secret = "sk-rollout-sec-HOLDER-6d5c4b"
    # Stands in for the worker process: it holds the key in its environment, as a Ray worker does.
    holder = subprocess.Popen(["sleep", "300"], env={"PATH": os.environ["PATH"], "OPENAI_API_KEY": secret})
    try:
        probe = "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' > environs.txt; true"
        task = Task.model_validate(
            {
                "id": "holder",
                "prompt": "look around",
                "model_script": [{"type": "shell", "command": probe}, {"type": "text", "text": "ok"}],
            }
        )
        async with session_context(tmp_path, {"sandbox": {"keep": True}}) as ctx:
            row = await run_session(SessionRequest("holder", task, 0, 1), ctx)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert row["status"] == "completed", row["error_message"]
    dumps = list((tmp_path / "sandboxes").rglob("environs.txt"))
    assert dumps, "the probe never ran"
    assert all(secret not in p.read_text(errors="replace") for p in dumps)
    shutil.rmtree(tmp_path / "sandboxes", ignore_errors=True)
