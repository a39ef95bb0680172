"""The fork server of supervisor servers (sandboxes/zygote.py): what it forks is a server as a new
interpreter would be, and its failures cost no sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from sandboxes import exec_server
from sandboxes.base import SandboxLostError
from sandboxes.environment import marker_entry
from sandboxes.local import MAX_ZYGOTE_STARTS, LocalSandbox, LocalSandboxProvider
from sandboxes.proctree import has_env_entry, read_proc
from tests.test_local_sandbox import REPO, Fifo, identify, running, spec, wait_exit


def _fds(pid: int) -> dict[int, str]:
    """What each descriptor of ``pid`` names (``pipe:[INODE]``, a path, ``anon_inode:[pidfd]``...)."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
    return found


def _environ(pid: int) -> list[bytes]:
    return [e for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e]


@pytest.fixture
async def provider(tmp_path: Path):
    provider = LocalSandboxProvider(tmp_path / "sandboxes", kill_grace_s=0.5, pids="isolated")
    yield provider
    await provider.aclose()


async def _started(provider: LocalSandboxProvider) -> LocalSandbox:
    sandbox = await provider.start(spec())
    assert (await sandbox.exec(["true"], timeout=30)).exit_code == 0
    return sandbox


async def test_a_forked_server_holds_its_own_pipes_its_marker_and_nothing_of_another_sandbox(
    provider: LocalSandboxProvider,
) -> None:
    first, second = await _started(provider), await _started(provider)
    try:
        zygote = provider._zygote
        assert zygote is not None
        for sandbox in (first, second):
            assert read_proc(sandbox._server.pid).ppid == zygote.pid  # forked, not a new interpreter
            # The environment a server started from here gets: its own marker and nothing else.
            assert _environ(sandbox._server.pid) == [sandbox._marker]
        assert _environ(zygote.pid)[0].startswith(b"ROLLOUT_SANDBOX=") and len(_environ(zygote.pid)) == 1
        theirs = {name for fd, name in _fds(second._server.pid).items() if fd in (0, 1)}
        mine = _fds(first._server.pid)
        assert theirs and not theirs & set(mine.values())
        # stdio, the worker's pidfd, then only what the server itself opened (its wake-up pipe, its
        # selector, its namespace's handles): neither the fork server's control socket nor a file.
        assert not [name for fd, name in mine.items() if fd != 2 and name.startswith(("socket:", "/"))], mine
        # The fork server keeps no pipe of a sandbox once it has forked its server.
        pipes = {name for box in (first, second) for fd, name in _fds(box._server.pid).items() if fd < 2}
        assert not pipes & set(_fds(zygote.pid).values())
    finally:
        await first.stop()
        await second.stop()


async def test_a_killed_fork_server_is_started_again_and_then_given_up_and_no_sandbox_is_lost(
    provider: LocalSandboxProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sandboxes.local")
    first = await _started(provider)
    survivors = [first]
    try:
        for _ in range(MAX_ZYGOTE_STARTS):
            zygote = provider._zygote
            assert zygote is not None
            os.kill(zygote.pid, signal.SIGKILL)
            assert await zygote.ended(60)
            # The next sandbox starts (on a new fork server while they last, then as a new interpreter);
            # the sandboxes of the dead one still run commands.
            survivors.append(await _started(provider))
            for sandbox in survivors:
                assert (await sandbox.exec(["true"], timeout=30)).exit_code == 0
        # The last fork server's spare went to the last sandbox; the next one is a new interpreter's.
        survivors.append(await _started(provider))
        assert provider._zygote is None and provider._zygote_starts == MAX_ZYGOTE_STARTS
        assert read_proc(survivors[-1]._server.pid).ppid == os.getpid()
        said = [r.getMessage() for r in caplog.records if "fork server" in r.getMessage()]
        assert len(said) == 2, said  # its first death, and the giving up: once each
    finally:
        for sandbox in survivors:
            await sandbox.stop()


async def test_a_burst_of_starts_beyond_the_fork_servers_queue_all_start_on_it(
    provider: LocalSandboxProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The control socket's send buffer holds ~150 requests by default (a burst of 400 starts in one worker
    # overflowed it); made as small as it gets, it holds a few. The others wait for room, and each must
    # be woken when there is some, however many wait: none may sit out a timeout (shortened here, so
    # that a lost wake-up fails fast), and none may take the fork server for gone.
    zygote = provider._live_zygote()
    assert zygote is not None and zygote._sock is not None
    zygote._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
    burst = 30
    monkeypatch.setattr(exec_server, "SPAWN_TIMEOUT_S", 20.0)
    started = await asyncio.gather(*(provider.start(spec()) for _ in range(burst)), return_exceptions=True)
    sandboxes = [s for s in started if isinstance(s, LocalSandbox)]
    try:
        assert len(sandboxes) == burst, [repr(s) for s in started if not isinstance(s, LocalSandbox)][:3]
        assert provider._zygote is zygote and provider._zygote_starts == 1
        assert {read_proc(s._server.pid).ppid for s in sandboxes} == {zygote.pid}
        assert (await sandboxes[-1].exec(["true"], timeout=30)).exit_code == 0
    finally:
        await asyncio.gather(*(s.stop() for s in sandboxes))


async def test_servers_forked_from_one_batch_of_requests_hold_only_their_own_pipes(tmp_path: Path) -> None:
    """Requests that wait together are read together and their servers forked one after another (the
    fork server writes as little as it can between two forks): each server still holds its own pipes
    and none of another's, and answers on its own."""
    zygote = exec_server.Zygote(tmp_path / "zygote.log")
    os.kill(zygote.pid, signal.SIGSTOP)  # the requests wait together on its socket
    pipes = [(os.pipe(), os.pipe()) for _ in range(8)]
    try:
        for (stdin_r, _stdin_w), (_out_r, out_w) in pipes:
            await zygote.fork({"marker": "a" * 32, "pid_namespace": True, "views": True}, (stdin_r, out_w))
        os.kill(zygote.pid, signal.SIGCONT)
        servers = []
        for (stdin_r, _stdin_w), (out_r, out_w) in pipes:
            os.close(stdin_r)  # the server's ends are the server's alone now
            os.close(out_w)
            with os.fdopen(os.dup(out_r), "rb") as answers:
                servers.append(json.loads(answers.readline())["ready"])
        names = {pid: _fds(pid) for pid in servers}
        for pid, ((_stdin_r, stdin_w), (out_r, _out_w)) in zip(servers, pipes, strict=True):
            own = {names[pid][0], names[pid][1]}
            assert own == {_fds(os.getpid())[stdin_w], _fds(os.getpid())[out_r]}, (pid, names[pid])
            others = {name for other, held in names.items() if other != pid for name in held.values()}
            assert not own & others
            assert read_proc(pid).ppid == zygote.pid
    finally:
        os.kill(zygote.pid, signal.SIGCONT)
        for (_stdin_r, stdin_w), (out_r, _out_w) in pipes:
            for fd in (stdin_w, out_r):  # the servers' stdin ends: each exits
                with contextlib.suppress(OSError):
                    os.close(fd)
        await zygote.close()
        assert await zygote.ended(60)


async def test_a_request_waiting_for_room_is_told_at_once_when_the_fork_server_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exec_server, "SPAWN_TIMEOUT_S", 60.0)
    zygote = exec_server.Zygote(tmp_path / "zygote.log")
    os.kill(zygote.pid, signal.SIGSTOP)  # it reads nothing: its socket fills
    assert zygote._sock is not None
    zygote._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
    read_end, write_end = os.pipe()
    waiting = None
    try:
        for _ in range(64):
            task = asyncio.ensure_future(zygote.fork({"marker": "x"}, (read_end, write_end)))
            await asyncio.sleep(0)  # it runs up to its first wait: sent, or waiting for room
            if not task.done():
                waiting = task
                break
            task.result()
        assert waiting is not None and zygote._room_wait is not None
        await zygote.close()
        # Woken by the close, not by the timeout: the request says the fork server is closed.
        with pytest.raises(exec_server.ZygoteGone, match="closed"):
            await waiting
    finally:
        os.close(read_end)
        os.close(write_end)
        os.kill(zygote.pid, signal.SIGKILL)
        os.kill(zygote.pid, signal.SIGCONT)
        assert await zygote.ended(60)


async def test_a_forked_server_that_dies_loses_its_sandbox(provider: LocalSandboxProvider, tmp_path: Path):
    sandbox = await _started(provider)
    fifo = Fifo(tmp_path / "fifo")
    running = None
    try:
        command = ["sh", "-c", f"echo up > {fifo.path}; exec sleep 300"]
        running = asyncio.ensure_future(sandbox.exec(command, timeout=120))
        await fifo.lines(1)
        server = sandbox._server.pid
        os.kill(server, signal.SIGKILL)
        await wait_exit(server)
        with pytest.raises(SandboxLostError):
            await running
        with pytest.raises(SandboxLostError):
            await sandbox.exec(["true"], timeout=30)
    finally:
        fifo.close()
        await sandbox.stop()


async def test_a_request_the_fork_server_took_with_it_is_served_by_the_next_one(
    provider: LocalSandboxProvider,
) -> None:
    """Killed with a sandbox's request still unread: that sandbox's server comes from the next one."""
    first = await _started(provider)
    zygote = provider._zygote
    assert zygote is not None
    os.kill(zygote.pid, signal.SIGSTOP)
    try:
        starting = asyncio.ensure_future(provider._new_server())
        await asyncio.sleep(0)  # the task runs to its first wait: its request is in the socket by then
        os.kill(zygote.pid, signal.SIGKILL)
        server = await starting
    finally:
        with contextlib.suppress(ProcessLookupError):  # not left stopped if the test failed before
            os.kill(zygote.pid, signal.SIGCONT)
    try:
        assert provider._zygote is not None and provider._zygote.pid != zygote.pid
        assert read_proc(server.pid).ppid == provider._zygote.pid and server.alive
    finally:
        await server.close(5)
        await first.stop()


WORKER = """
import asyncio, sys
# The command reports its pid from its own image: one that reported and then exec'd could be read in
# the middle of its exec, when /proc/PID/environ reads empty.
REPORT_THEN_WAIT = "import os, sys, time; print(os.getpid(), file=open(sys.argv[1], 'w')); time.sleep(300)"
from pathlib import Path
from sandboxes.base import SandboxSpec
from sandboxes.local import LocalSandboxProvider

async def main() -> None:
    provider = LocalSandboxProvider(Path(sys.argv[1]), pids="isolated")
    sandbox = await provider.start(SandboxSpec(run_id="run", session_id="s", ttl_s=600))
    await sandbox.exec([sys.executable, "-c", REPORT_THEN_WAIT, sys.argv[2]], timeout=300)

asyncio.run(main())
"""


async def test_the_workers_death_ends_its_forked_servers_and_everything_in_their_namespaces(
    tmp_path: Path,
) -> None:
    fifo = Fifo(tmp_path / "fifo")
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WORKER, str(tmp_path / "sb"), str(fifo.path),
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await fifo.lines(1)  # the command runs
        descriptor = json.loads((tmp_path / "sb" / "run" / "s" / "sandbox.json").read_text())
        marker = marker_entry(descriptor["marker"])
        ours = {p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if has_env_entry(p, marker)}
        # The server, the namespace's init, the supervisor and the command.
        assert descriptor["server_pid"] in ours and len(ours) == 4, ours
        procs = [identify(p) for p in ours]
        worker.kill()
        await worker.wait()
        await wait_exit(descriptor["server_pid"])  # it saw the worker's pidfd, and its namespace ended
        assert not [p for p in procs if running(p)]
    finally:
        fifo.close()
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
