"""Small file work on the event loop, large in a thread.

A hop to a thread and back costs more than reading or writing a few dozen kilobytes, and in a Ray worker,
whose other threads want the GIL too, several milliseconds. A session makes a dozen such small steps
(configs, result files, a harness's output and the parse of its record, a request body's kept copy, a
prepared workspace's copy, the evidence's compression, the row's conversion), so they run inline; anything
larger goes to a thread, so that one big file, tree or record never stalls the worker's other sessions.
Work of many small steps that can wait on no disk (a tree copied from memory to memory) runs on the loop
in slices instead (``in_slices``): in a thread each of its system calls hands the GIL to the loop and
back, which cost more than the copy itself (a 200-file workspace: ~28 us a file in a thread under a
worker's load, against ~10 us alone).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Generator
from typing import TypeVar

INLINE_BYTES = 64 * 1024
INLINE_ENTRIES = 64  # a directory tree with fewer entries than this counts as small
SLICE_S = 0.002  # ``in_slices``: the loop's time at once, no longer than a small step's

T = TypeVar("T")


async def inline_if(small: bool, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``: here when ``small``, else in a thread."""
    if small:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def small_inline(size: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``, which handles about ``size`` bytes: here when that is little, else in a thread."""
    return await inline_if(size <= INLINE_BYTES, fn, *args)


def small_tree(root: str | os.PathLike[str]) -> bool:
    """Whether the tree under ``root`` holds fewer than ``INLINE_ENTRIES`` entries; stops counting there."""
    count, pending = 0, [os.fspath(root)]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                count += 1
                if count >= INLINE_ENTRIES:
                    return False
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
    return True


async def in_slices(steps: Generator[object, None, None], slice_s: float = SLICE_S) -> None:
    """Run ``steps`` (a generator whose every step is quick and waits on no disk) to the end on this
    event loop, giving the loop back every ``slice_s``. Closed if cancelled."""
    try:
        ends = time.perf_counter() + slice_s
        for _ in steps:
            if time.perf_counter() >= ends:
                await asyncio.sleep(0)
                ends = time.perf_counter() + slice_s
    finally:
        steps.close()
