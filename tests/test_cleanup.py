"""Nothing of a session is left once its run is over, however long its sandboxes took to stop.

A stop is bounded for the session (``executor.grading.STOP_TIMEOUT_S``), not for the sandbox: on an
overloaded host a stop ran past the bound, was cut short, and left its directory (with its disk, uid
and caps) for a later `rollout gc`. Here the stops run past their bound for real (a bound of 0 s, which
no stop meets; a command that ignores SIGTERM while its sandbox stops), and the run's end (the
provider's close, which a worker's close awaits) must find everything of the session gone, its row
written and saying what happened.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from executor import grading
from executor.session import SessionRequest, run_session
from executor.tasks import Task
from harnesses.command import CommandHarness
from sandboxes import uidpool
from sandboxes.base import SandboxLostError, SandboxSpec
from sandboxes.environment import marker_entry
from sandboxes.local_config import LocalSandboxConfig
from tests.conftest import processes_under, session_context

pytestmark = pytest.mark.integration

# What the agent's commands run as and in, written into the workspace (so the diff carries it out).
RECORD = "id -u > whoami.txt; cat /proc/self/cgroup > cgroups.txt"
WAIT_S = 60.0  # bound on waiting for the harness to be running


def _left_behind(root: Path, rollout: str, record: str) -> list[str]:
    """What of the session is still on the host: its directories, processes, mounts, caps, uid lease.
    ``record``: the agent's whoami.txt and cgroups.txt, as its diff or its workspace showed them."""
    left = [str(p) for p in (root / "t").glob(f"{rollout}*")]
    left += processes_under(str(root))
    with open("/proc/self/mountinfo") as f:
        left += [line.split()[4] for line in f if line.split()[4].startswith(str(root))]
    for line in (line for line in record.splitlines() if line.count(":") >= 2):
        # cgroup v1 lines (N:controller:/path) and v2 (0::/path), of the sandbox's own caps only.
        _n, controller, path = line.lstrip("+").split(":", 2)
        if "rollout-executor" in path:
            group = Path("/sys/fs/cgroup", controller.removeprefix("name="), path.lstrip("/"))
            if not controller:
                group = Path("/sys/fs/cgroup", path.lstrip("/"))
            if group.exists():
                left.append(str(group))
    left += _marked(record)
    uids = [int(word) for word in record.split() if word.isdigit() and int(word) >= uidpool.POOL_BASE]
    for uid in uids:  # a lease is an flock this process holds on the uid's file (uidpool.py)
        if _holds_lock(Path(uidpool.LEASE_DIR, str(uid))):
            left.append(f"the lease of uid {uid}")
    return left


def _marked(record: str) -> list[str]:
    """Processes that carry the sandbox's marker (its caps' cgroups are named by it: local.py), as the
    sandbox's own stop finds them."""
    tokens = {line.rsplit("/", 1)[1] for line in record.splitlines() if "/rollout-executor/" in line}
    entries = {marker_entry(token) for token in tokens}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if entries.intersection(environ):
            found.append(f"process {pid}")
    return found


def _holds_lock(path: Path) -> bool:
    try:
        inode = os.stat(path).st_ino
    except FileNotFoundError:
        return False
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            # "1: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END" (a blocked waiter has "->" first)
            if fields[1] == "->":
                continue
            if int(fields[4]) == os.getpid() and int(fields[5].rsplit(":", 1)[1]) == inode:
                return True
    return False


def _added(diff: str, name: str) -> str:
    """The lines a diff adds to ``name``."""
    out, inside = [], False
    for line in diff.splitlines():
        if line.startswith("+++ "):
            inside = line.endswith("/" + name)
        elif inside and line.startswith("+"):
            out.append(line[1:])
    return "\n".join(out)


async def test_a_stop_past_its_bound_still_leaves_nothing_and_the_row_is_written(tmp_path, monkeypatch):
    # No stop is done in 0 s: each of the session's (its agent's sandbox, its grading sandbox) runs past
    # the bound, and the session returns without waiting for it.
    monkeypatch.setattr(grading, "STOP_TIMEOUT_S", 0.0)
    task = Task.model_validate({"id": "cmd", "prompt": "p", "verify": "test -s whoami.txt"})
    async with session_context(tmp_path) as ctx:
        ctx.harness = CommandHarness(command=f"{RECORD}; echo done")
        row = await run_session(SessionRequest("t", task, 0, 1), ctx)
        # The row is the rollout's as ever; only its cleanup was not seen to end in time.
        outcome = (row["status"], row["reward"], row["verified"])
        assert outcome == ("completed", 1.0, True), row["error_message"]
        assert row["cleanup_ok"] is False
    # The context's end is the worker's close: the provider has finished every stop it began.
    record = _added(row["workspace_diff"], "whoami.txt") + "\n" + _added(row["workspace_diff"], "cgroups.txt")
    assert "/rollout-executor/" in record  # the sandbox's caps, named by its marker
    assert _left_behind(tmp_path / "sandboxes", row["rollout_id"], record) == []


async def test_a_stop_of_processes_that_ignore_sigterm_past_its_bound_leaves_nothing(tmp_path, monkeypatch):
    # A stop while a command runs that ignores SIGTERM waits its supervisor's kill grace (1 s) before the
    # command is killed: longer than the stop's caller waits. As a worker's sandboxes are made.
    monkeypatch.setattr(grading, "STOP_TIMEOUT_S", 0.2)
    root = tmp_path / "sandboxes"
    config = LocalSandboxConfig()
    gateway = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # listening; the command never connects
    gateway.bind(str(tmp_path / "gw.sock"))
    gateway.listen()
    provider = config.build(root, (8, str(tmp_path / "gw.sock")) if config.needs_gateway_socket else None)
    sandbox = await provider.start(SandboxSpec(run_id="t", session_id="s1", ttl_s=600))
    command = f"trap '' TERM; {RECORD}; touch running; sleep 600"
    running = asyncio.ensure_future(sandbox.exec(["sh", "-c", command], timeout=600, name="stubborn"))
    try:
        work = Path(sandbox.workdir)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while not (work / "running").exists() and loop.time() < deadline and not running.done():
            await asyncio.sleep(0.05)  # a condition, looked at again; bounded
        assert (work / "running").exists(), "the command never ran"
        record = (work / "whoami.txt").read_text() + (work / "cgroups.txt").read_text()
        assert await grading.stop_sandbox(sandbox) is False  # not stopped within 0.2 s
        assert _marked(record), "the stop was over before its bound"
        with pytest.raises(SandboxLostError):  # the stop ended it
            await running
    finally:
        running.cancel()
        await provider.aclose()  # as a worker's close: every stop begun is finished
        gateway.close()
    assert _left_behind(root, "s1", record) == []
