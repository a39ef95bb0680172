"""A bound on the disk one local sandbox's files take in total, however many files they are.

``RLIMIT_FSIZE`` stops any one file at ``max_file_mb``; a command writing many files stops at nothing.
What is counted is every entry under the session's writable directories (work, home, tmp, the baseline's
git directory): its allocated blocks, and at least one block even when empty, so that a million empty
files (inodes) count too. A watcher walks them while a command runs, and once they pass the bound it
ends the command as its timeout would (the supervisor's expire signal): the command's result says it
timed out, with ``limit`` saying why, and a harness so stopped is ``agent_timeout``: stopped by a limit,
the agent's doing, its partial work kept and graded, never an infrastructure failure.

The watcher is what a sandbox gets where it cannot have a filesystem of its own: without root, or
without root's filesystem view (sandboxes/diskfs.py is the bound as root, enforced as writes happen).
Its bound is not exact: between two walks a command may write past it, by at most what it writes in one
interval, which shrinks as the files near the bound (``next_delay``) and is never more than
``MAX_DELAY_S`` (a ``fallocate`` writes gigabytes in that time). A walk stops counting once past the
bound, so one costs at most the bound's entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import Sequence

BLOCK = 4096  # what an entry counts at least
MIN_DELAY_S = 0.2
MAX_DELAY_S = 5.0
# The rate assumed when spacing the walks: the overshoot is about what is written past this in a delay.
ASSUMED_WRITE_BYTES_PER_S = 512 * 1024 * 1024
WALK_SHARE = 0.05  # a walk takes at most this share of the time between walks
# A walk of fewer entries than this runs on the event loop: a hop to a thread and back costs more than
# a few dozen scandir entries, and a 30 s command is walked seven times (inline.py says why it matters).
INLINE_WALK_ENTRIES = 128


def usage(paths: Sequence[str], stop_above: int, max_entries: int | None = None) -> int | None:
    """Bytes the trees under ``paths`` take, counted as above; stops early once past ``stop_above``.
    Symlinks are counted as entries, never followed. None once more than ``max_entries`` entries were
    seen (if given): the walk is too long for the caller's thread."""
    total = 0
    seen = 0
    pending = [p for p in paths if os.path.isdir(p)]
    while pending:
        try:
            entries = os.scandir(pending.pop())
        except OSError:  # removed, or made unreadable, under our feet: what is gone takes nothing
            continue
        with entries:
            for entry in entries:
                seen += 1
                if max_entries is not None and seen > max_entries:
                    return None
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += max(st.st_blocks * 512, BLOCK)
                if stat.S_ISDIR(st.st_mode):
                    pending.append(entry.path)
                if total > stop_above:
                    return total
    return total


def next_delay(used: int, limit: int, walk_s: float) -> float:
    """Seconds to the next walk: sooner as the files near the bound, never so often that walking takes
    more than ``WALK_SHARE`` of the time."""
    delay = (limit - used) / ASSUMED_WRITE_BYTES_PER_S
    return max(MIN_DELAY_S, min(MAX_DELAY_S, delay), walk_s / WALK_SHARE)


class DiskWatch:
    """Watches ``paths`` while one command runs; ``expired`` is set once they pass ``limit`` bytes (with
    ``why`` saying so) or once ``also`` (the caller's own expiry) is set. ``stop`` ends the watch."""

    def __init__(self, paths: Sequence[str], limit: int, also: asyncio.Event | None = None) -> None:
        self.paths, self.limit = list(paths), limit
        self.expired = asyncio.Event()
        self.why: str | None = None
        self._tasks = [asyncio.ensure_future(self._watch())]
        if also is not None:
            self._tasks.append(asyncio.ensure_future(self._follow(also)))

    async def _follow(self, also: asyncio.Event) -> None:
        await also.wait()
        self.expired.set()

    async def _watch(self) -> None:
        delay = MIN_DELAY_S
        big = False
        while True:
            await asyncio.sleep(delay)
            started = time.monotonic()
            # Once a walk was too long for here, the next ones go to a thread straight away.
            used = None if big else usage(self.paths, self.limit, INLINE_WALK_ENTRIES)
            if used is None:
                big = True
                used = await asyncio.to_thread(usage, self.paths, self.limit)
                assert used is not None  # counted to the end
            if used > self.limit:
                self.why = (
                    f"the sandbox's files took over {used // 2**20} MiB, past its bound of "
                    f"{self.limit // 2**20} MiB (sandbox.max_disk_mb)"
                )
                self.expired.set()
                return
            delay = next_delay(used, self.limit, time.monotonic() - started)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
