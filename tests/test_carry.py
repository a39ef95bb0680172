"""The agent's final workspace carried into the grading sandbox (sandboxes/carry.py) between two real local
sandboxes with disks of their own: on the worker's event loop, in slices (``in_slices``), as the agent
left it and as hostile as it likes. Skipped where a sandbox cannot have a disk of its own (not root)."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from executor.grading import carry_workspace
from sandboxes import diskfs, isolation, uidpool
from sandboxes.base import SandboxSpec
from sandboxes.carry import Carried, copy_steps
from sandboxes.inline import in_slices
from sandboxes.local import LocalSandbox, LocalSandboxProvider

pytestmark = pytest.mark.skipif(
    diskfs.unavailable() is not None or isolation.mounts_unavailable() is not None,
    reason=f"no disk of a sandbox's own: {diskfs.unavailable() or isolation.mounts_unavailable()}",
)

# What the agent leaves: a tree, a link out of the workspace, a FIFO, a sparse file of more than one of
# the copy's chunks with data past its hole, a file of no permissions for anyone, and many small files.
HOSTILE = """set -e
mkdir -p deep/er/est && echo fixed > deep/er/est/calc.py
ln -s /etc/shadow secrets && mkfifo pipe
dd if=/dev/zero of=sparse bs=1 count=0 seek=20M 2>/dev/null && echo tail >> sparse
echo closed > closed && chmod 000 closed
mkdir many && i=0; while [ $i -lt 300 ]; do echo $i > many/f$i; i=$((i + 1)); done
"""


async def _pair(tmp_path: Path) -> tuple[LocalSandboxProvider, LocalSandbox, LocalSandbox]:
    provider = LocalSandboxProvider(
        tmp_path / "sandboxes",
        keep=False,
        pids="isolated",
        filesystem="readonly",
        user=uidpool.pool_unavailable() is None,
        max_disk_mb=64,
    )
    agent = await provider.start(SandboxSpec(run_id="r", session_id="agent", ttl_s=300))
    checker = await provider.start(SandboxSpec(run_id="r", session_id="checker", ttl_s=300))
    return provider, agent, checker


async def test_a_hostile_workspace_is_carried_as_left_on_the_loop_and_in_slices(tmp_path: Path) -> None:
    provider, agent, checker = await _pair(tmp_path)
    try:
        assert agent.files_in_memory and checker.files_in_memory
        made = await agent.exec(["sh", "-c", HOSTILE], timeout=60)
        assert made.exit_code == 0, made.stderr_tail
        await agent.end_commands()

        # The loop goes on while the carry runs: a coroutine beside it is run between its slices.
        beside = 0

        async def count() -> None:
            nonlocal beside
            while True:
                await asyncio.sleep(0)
                beside += 1

        counting = asyncio.ensure_future(count())
        try:
            carried = await carry_workspace(agent, checker)
        finally:
            counting.cancel()
        assert beside > 0

        assert carried.skipped == 1 and "pipe" in (carried.gap() or "")
        work = Path(checker.workdir)
        assert sorted(os.listdir(work)) == ["closed", "deep", "many", "secrets", "sparse"]
        assert (work / "deep/er/est/calc.py").read_text() == "fixed\n"
        assert os.readlink(work / "secrets") == "/etc/shadow"  # a link, never followed
        assert len(os.listdir(work / "many")) == 300 and (work / "many/f299").read_text() == "299\n"
        sparse = (work / "sparse").stat()
        assert sparse.st_size == 20 * 1024 * 1024 + 5 and sparse.st_blocks * 512 < 1024 * 1024
        with open(work / "sparse", "rb") as f:
            f.seek(-5, os.SEEK_END)
            assert f.read() == b"tail\n"
        assert stat.S_IMODE((work / "closed").stat().st_mode) == 0
        owner = checker.owner_ids
        if owner is not None:  # what is made is the grading sandbox's user's, down to the deepest file
            assert {(p.lstat().st_uid, p.lstat().st_gid) for p in work.rglob("*")} == {owner}
        looked = await checker.exec(["sh", "-c", "cat deep/er/est/calc.py; ls many | wc -l"], timeout=30)
        assert looked.stdout_tail.split() == ["fixed", "300"], looked
    finally:
        await agent.stop()
        await checker.stop()
        await provider.aclose()


async def test_a_carry_given_up_half_way_holds_no_descriptor(tmp_path: Path) -> None:
    provider, agent, checker = await _pair(tmp_path)
    try:
        made = await agent.exec(["sh", "-c", HOSTILE], timeout=60)
        assert made.exit_code == 0, made.stderr_tail
        fds = len(os.listdir("/proc/self/fd"))
        done = Carried()
        steps = copy_steps(agent.workdir, checker.workdir, checker.owner_ids, done)
        # Deep in the tree (the descent holds a descriptor a level, and a file's two), then given up.
        for _ in range(4):
            next(steps)
        assert len(os.listdir("/proc/self/fd")) > fds
        slices = asyncio.ensure_future(in_slices(steps, slice_s=0))
        await asyncio.sleep(0)
        slices.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slices
        assert len(os.listdir("/proc/self/fd")) == fds
        assert 0 < done.files < 300
    finally:
        await agent.stop()
        await checker.stop()
        await provider.aclose()
