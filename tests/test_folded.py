"""A command its sandbox's server supervises itself (sandboxes/folded.py): where the server is its PID
namespace's init and the command is alone in the sandbox at its start, no supervisor process runs beside
it, and at its end nothing it started is left, whatever it did to hide: a session of its own, a name of
the executor's, SIGTERM ignored. A command started beside it gets a supervisor, and the folded command's
end leaves that one's processes alone. Real sandboxes, as root; skipped where root's view cannot be made."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandboxes import folded, isolation
from sandboxes.base import ExecStep, SandboxLostError, SandboxSpec
from sandboxes.local_sandbox import LocalSandbox
from sandboxes.proctree import descendants, read_proc, snapshot
from tests.test_local_sandbox import Fifo
from tests.test_shared_view import _provider

pytestmark = pytest.mark.skipif(
    isolation.mounts_unavailable() is not None, reason=f"no root view: {isolation.mounts_unavailable()}"
)

# Starts what an agent's command leaves to outlive it: a daemon in a session of its own, named as the
# executor's supervisors are, that ignores SIGTERM and holds the command's stdout open. It says "hidden"
# there and makes `hid` in the workspace once it runs, which the command waits for.
HIDE = (
    'setsid sh -c \'printf rollout-sup > /proc/self/comm; trap "" TERM; echo hidden; touch hid; '
    "while :; do sleep 1; done' & until [ -e hid ]; do sleep 0.01; done;"
)


@contextlib.asynccontextmanager
async def _sandbox(tmp_path: Path, name: str, *fifos: str) -> AsyncIterator[tuple[LocalSandbox, list[Fifo]]]:
    """A sandbox of root's view, every layer on, with named pipes in its workspace its commands report to."""
    provider = _provider(tmp_path)
    sandbox = await provider.start(SandboxSpec(run_id="r", session_id=name, ttl_s=300))
    opened: list[Fifo] = []
    try:
        for fifo_name in fifos:
            opened.append(Fifo(Path(sandbox.workdir) / fifo_name))
            os.chmod(opened[-1].path, 0o666)
        yield sandbox, opened
    finally:
        for fifo in opened:
            fifo.close()
        await sandbox.stop()
        await provider.aclose()


def _under(server: int) -> set[int]:
    return descendants(snapshot(), server)


async def test_a_lone_command_runs_under_its_server_and_leaves_nothing_behind(tmp_path):
    async with _sandbox(tmp_path, "lone") as (sandbox, _):
        script = f"cat /proc/$PPID/comm; {HIDE} echo out; echo err >&2"
        res = await sandbox.exec(["sh", "-c", script], timeout=60)
        server = sandbox._server.pid
        left = _under(server)
        assert (res.exit_code, res.timed_out) == (0, False), res
        # Its parent is the server (the namespace's pid 1), not a supervisor of its own.
        assert res.stdout_tail.split() == ["rollout-server", "hidden", "out"], res.stdout_tail
        assert res.stderr_tail == "err\n"
        assert left == set(), [read_proc(pid) for pid in left]
        # The sandbox runs on: a later command is folded too.
        again = await sandbox.exec(["sh", "-c", "cat /proc/$PPID/comm"], timeout=60)
        assert again.stdout_tail == "rollout-server\n"


async def test_a_folded_commands_end_kills_its_leftovers_and_not_a_command_beside_it(tmp_path):
    async with _sandbox(tmp_path, "beside", "report", "go-a", "go-b") as (sandbox, (report, go_a, go_b)):
        server = sandbox._server.pid
        first = asyncio.ensure_future(
            sandbox.exec(["sh", "-c", f"{HIDE} echo a >> report; read x < go-a; echo a-done"], timeout=60)
        )
        second = None
        try:
            assert await report.lines(1) == ["a"]
            second = asyncio.ensure_future(
                sandbox.exec(["sh", "-c", "echo b >> report; read x < go-b; echo b-done"], timeout=60)
            )
            assert await report.lines(1) == ["b"]
            # The first command (its daemon below it while it runs) and the second's supervisor.
            assert len([pid for pid in _under(server) if read_proc(pid).ppid == server]) == 2
            os.write(go_a._w, b"go\n")
            res_a = await first
            assert (res_a.exit_code, res_a.stdout_tail) == (0, "hidden\na-done\n"), res_a
            # What the first left is gone; the second, and its supervisor, run on.
            (supervisor,) = [pid for pid in _under(server) if read_proc(pid).ppid == server]
            assert read_proc(supervisor).name == b"rollout-sup"
            assert _under(server) - {supervisor} == descendants(snapshot(), supervisor)
            assert descendants(snapshot(), supervisor)  # its shell, still waiting
            os.write(go_b._w, b"go\n")
            res_b = await second
            assert (res_b.exit_code, res_b.stdout_tail) == (0, "b-done\n"), res_b
            assert _under(server) == set()
        finally:
            for task in (first, second):
                if task is not None and not task.done():
                    task.cancel()


async def test_the_workers_word_ends_a_folded_command(tmp_path):
    """The expire signal ends it as timed out, the sandbox's stop as terminated; SIGTERM ignored or not,
    nothing of it is left."""
    async with _sandbox(tmp_path, "word", "report") as (sandbox, (report,)):
        server = sandbox._server.pid
        expire = asyncio.Event()
        stubborn = ["sh", "-c", f"{HIDE} trap '' TERM; echo up >> report; while :; do sleep 1; done"]
        running = asyncio.ensure_future(sandbox.exec(stubborn, timeout=120, expire=expire))
        assert await report.lines(1) == ["up"]
        expire.set()
        res = await running
        assert res.timed_out and res.signal == 9, res
        assert _under(server) == set()
        running = asyncio.ensure_future(sandbox.exec(stubborn, timeout=120))
        assert await report.lines(1) == ["up"]
        await sandbox.stop()
        with pytest.raises(SandboxLostError, match="stopped"):
            await running


async def test_a_step_and_its_command_are_both_the_servers_and_the_step_leaves_the_command_nothing(
    tmp_path,
):
    """One exec of two commands (a diff before the verifier): the step's daemon is gone before the
    command starts, each has its own output and exit code; a stop during the step runs no command."""
    async with _sandbox(tmp_path, "steps", "report") as (sandbox, (report,)):
        step = ExecStep(argv=["sh", "-c", f"{HIDE} echo step; exit 4"], timeout=30, name="step")
        listing = "cat /proc/$PPID/comm; cd /proc && set -- [0-9]* && echo $#"
        res = await sandbox.exec(["sh", "-c", listing], timeout=30, name="main", before=step)
        assert res.before is not None
        assert (res.before.exit_code, res.before.stdout_tail) == (4, "hidden\nstep\n"), res.before
        # The server (pid 1) and the command's shell: nothing of the step's.
        assert (res.exit_code, res.stdout_tail) == (0, "rollout-server\n2\n"), res
        stuck = ExecStep(argv=["sh", "-c", "echo up >> report; sleep 300"], timeout=300, name="stuck")
        running = asyncio.ensure_future(
            sandbox.exec(["sh", "-c", "echo ran > ran"], timeout=300, name="never", before=stuck)
        )
        assert await report.lines(1) == ["up"]
        await sandbox.stop()
        with pytest.raises(SandboxLostError):
            await running
        assert not (Path(sandbox.workdir) / "ran").exists()


def test_a_command_whose_output_cannot_be_kept_is_not_started(tmp_path):
    """Its files are opened before its init is forked: a command the server could not own never runs,
    and its result says it could not start, as a supervisor's would."""
    params = {
        "argv": ["touch", str(tmp_path / "ran")],
        "cwd": str(tmp_path),
        "stdout_path": str(tmp_path / "gone" / "out"),  # its directory was removed
        "stderr_path": str(tmp_path / "err"),
        "result_path": str(tmp_path / "result.json"),
        "timeout_s": 30.0,
        "deadline_epoch": time.time() + 60,
        "output_cap_bytes": 1024,
        "tail_bytes": 64,
        "kill_grace_s": 0.5,
        "nofile_limit": 1024,
        "user": [os.getuid(), os.getgid()],  # an init of its own (spawn.needs_init)
    }
    job = folded.FoldedExec(params, None, "/proc", set, lambda: None)
    ours = {pid for pid, info in snapshot().items() if info.ppid == os.getpid()}
    assert job.start() is True
    assert job.current is None and job.pid == 0
    # No init was forked (one would be our child, alive or not yet reaped).
    assert {pid for pid, info in snapshot().items() if info.ppid == os.getpid()} <= ours
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["reason"], result["exit_code"]) == ("spawn_failed", 127), result
    assert not (tmp_path / "ran").exists()
